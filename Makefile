# `make test` and `make demo` set everything up on a fresh machine: a .venv with the pinned CPU torch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.13.0 (CPU build) lies on this workplace's disk; elsewhere pip fetches it from the index.
WHEELS := $(wildcard /opt/wheels)
PIP_FLAGS := $(if $(WHEELS),--find-links $(WHEELS),)

.PHONY: test demo demo-optuna venv clean compat wheel

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(PIP_FLAGS) "torch==2.13.0"
	$(BIN)/python -m pip install -q $(PIP_FLAGS) -e ".[test,hf]"
	touch $@

venv: $(BIN)/.installed

# Two pytest calls: the suite on TEST_WORKERS workers (pytest-xdist; the Ray tests together on one worker, xdist group
# "ray", see tests/conftest.py), then the tests marked `serial` (a measured makespan, thread counts) alone; the
# second call collects only the files that mark some (collecting the whole suite again costs ~10 s).
# TEST_WORKERS=0 runs the first call in this process, as plain pytest does. pytest exits 5 when it collected no
# tests: that is a failure here, not a pass (both calls always select some).
TEST_WORKERS ?= 2
test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not serial"; rc=$$?; \
	$(BIN)/python -m pytest -q -m serial $$(grep -l "mark.serial" tests/test_*.py); rc2=$$?; \
	if [ $$rc -eq 5 ] || [ $$rc2 -eq 5 ]; then echo "make test: pytest collected nothing, failing" >&2; exit 1; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $$rc2

# The Ray Tune ASHA search (examples/tune_gpt2.py); `$(BIN)/python examples/demo_gpt2.py` is the single-runtime demo.
demo: venv
	$(BIN)/python examples/tune_gpt2.py

# The Optuna TPE + MedianPruner search (examples/optuna_gpt2.py) on one shared runtime.
demo-optuna: venv
	$(BIN)/python examples/optuna_gpt2.py

# The version matrix (benchmarks/compat.sh): one fresh venv per combination at the ends of the supported ranges,
# the version-dependent integration and family tests in each (torch's ends in cells torch-top and torch-low), the
# wheel checked in cell high, a markdown table at the end. Niced: it is meant to run beside other work. Not in `test`.
compat:
	nice -n 15 bash benchmarks/compat.sh

# The wheel, in dist/ (tests/test_wheel.py checks its file list; `make compat` installs it with [all] in cell high).
wheel: venv
	$(BIN)/python -m pip wheel --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) build dist *.egg-info
