"""The lazy per-shard optimizer step: step t's update of each shard applied just before the shard's next use,
bit-identical to the plain loop's whole ``optimizer.step()`` (with global clipping and an fp16 GradScaler).

    verdict = check_lazy(optimizer, scaler, model)          # allow.py: exact-type torch.optim per-parameter optimizers
    pending = PendingStep(optimizer, shards, list(model.parameters()), scaler=scaler, max_norm=1.0)
    pending.begin(); scheduler.step()                       # pending.py: the lifecycle
    pending.apply(i) / pending.flush()

Pieces: allow.py (which optimizers, and why not), snapshot.py (StepSnapshot, step_shard: the restricted step),
clip.py (clip_grad_norm_ cut into shards), scaler.py (GradScaler cut into shards), pending.py (PendingStep).
"""
from .allow import ALLOWED, LazyVerdict, check_lazy
from .clip import clip_coefficient, clip_shard, shard_norms, total_norm
from .pending import PendingStep
from .scaler import ScalerStep
from .snapshot import StepSnapshot, step_shard

__all__ = ["ALLOWED", "LazyVerdict", "PendingStep", "ScalerStep", "StepSnapshot", "check_lazy", "clip_coefficient",
           "clip_shard", "shard_norms", "step_shard", "total_norm"]
