"""Gantt chart of a runtime trace: one row per device, one colour per task (needs the `plot` extra).

    trace = runtime.trace()                            # or hydra_tune.runtime.trace.Trace.load("trace.json")
    hydra_tune.plot_timeline(trace, "timeline.png")    # units per device; copies as a thin row under each
    hydra_tune.plot_timeline(trace, "t.svg", title="sweep 3", copies=False)

matplotlib is imported only when ``plot_timeline`` runs, through ``Figure`` + ``FigureCanvasAgg`` directly: no pyplot,
no global backend switch, no figure left open. The output format follows the file suffix (png, svg, pdf, ...).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime.trace import Event, Trace

__all__ = ["plot_timeline"]

MAX_LEGEND_TASKS = 20
_UNIT_ROW = (-0.40, 0.50)      # (offset from the device's row centre, height) with a copy row below
_COPY_ROW = (0.14, 0.22)
_UNIT_ONLY = (-0.32, 0.64)     # without a copy row


def _import_matplotlib() -> tuple[Any, Any, Any, Any]:
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError("plot_timeline needs matplotlib, but got (matplotlib=missing). "
                          "Fix: pip install 'hydra_tune[plot]' or pip install matplotlib.") from exc
    return colormaps, FigureCanvasAgg, Figure, Patch


def _task_colours(colormaps: Any, n: int) -> list[tuple[float, ...]]:
    """Colour i for the i-th task of ``trace.tasks()``: tab10, then tab20 (darks first), then evenly spaced hues."""
    if n <= 10:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in range(n)]
    if n <= 20:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in list(range(0, 20, 2)) + list(range(1, 20, 2))][:n]
    cmap = colormaps["turbo"]
    return [cmap(0.05 + 0.9 * i / (n - 1)) for i in range(n)]


def _ink(rgba: tuple[float, ...]) -> str:
    """Black or white text, whichever reads better on ``rgba``."""
    r, g, b = rgba[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _seconds(x: float) -> str:
    return f"{x:.3f} s" if x < 10 else f"{x:.1f} s"


def plot_timeline(trace: Trace, path: str | os.PathLike[str], *, title: str | None = None,
                  copies: bool = True) -> None:
    """Draw ``trace`` as a Gantt chart and write it to ``path``.

    One row per device (``trace.devices``), one colour per task (in ``trace.tasks()`` order, legend beside the plot,
    at most 20 tasks named there), units as bars labelled kind+shard where they are wide enough. With ``copies`` and
    copy-lane events in the trace, each device gets a thin hatched row under its units for its copies. The x axis is
    seconds since the runtime started; the subtitle gives the makespan and each device's compute-busy share.
    """
    colormaps, FigureCanvasAgg, Figure, Patch = _import_matplotlib()

    devices = list(trace.devices)
    n_dev = len(devices)
    for e in trace.events:
        if not 0 <= e.device < n_dev:
            raise ValueError(f"plot_timeline: an event names device {e.device}, but got {n_dev} device(s) "
                             f"{devices}. Fix: build the Trace with every device the events use.")
    units = trace.units()
    copy_events = trace.copies() if copies else []
    draw_copies = bool(copy_events)
    tasks = trace.tasks()
    colour = dict(zip(tasks, _task_colours(colormaps, len(tasks))))

    shown = tasks[:MAX_LEGEND_TASKS]
    n_entries = len(shown) + (len(tasks) > len(shown)) + draw_copies
    width = 12.0
    height = max(2.4 + 0.75 * max(n_dev, 1), 1.6 + 0.21 * n_entries)
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    drawn = units + copy_events
    if drawn:
        lo = min(0.0, min(e.start for e in drawn))
        hi = max(e.end for e in drawn)
    else:
        lo, hi = 0.0, 1.0
    span = hi - lo if hi > lo else 1.0
    ax.set_xlim(lo - 0.01 * span, hi + 0.01 * span)
    ax.set_ylim(n_dev - 0.5, -0.5)          # device 0 on top
    unit_row = _UNIT_ROW if draw_copies else _UNIT_ONLY

    def bars(events: list[Event], row: tuple[float, float], copy_lane: bool) -> None:
        groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for e in events:
            groups.setdefault((e.device, e.task), []).append((e.start, max(e.end - e.start, 0.0)))
        per_row = max((sum(1 for e in events if e.device == d) for d in range(n_dev)), default=0)
        # White separators show unit boundaries when there are few; with hundreds they would wash the colour out.
        edge = 0.6 if per_row <= 200 else 0.0
        for (d, task), ranges in groups.items():
            ax.broken_barh(ranges, (d + row[0], row[1]), facecolors=[colour[task]],
                           edgecolor="white" if not copy_lane else colour[task], linewidth=edge,
                           alpha=0.55 if copy_lane else 1.0, hatch="////" if copy_lane else None)

    bars(units, unit_row, copy_lane=False)
    if draw_copies:
        bars(copy_events, _COPY_ROW, copy_lane=True)

    centres = [d + unit_row[0] + unit_row[1] / 2 for d in range(n_dev)]
    ax.set_yticks(centres, devices)
    if draw_copies:
        ax.set_yticks([d + _COPY_ROW[0] + _COPY_ROW[1] / 2 for d in range(n_dev)], ["copy"] * n_dev, minor=True)
        ax.tick_params(axis="y", which="minor", labelsize=7, labelcolor="0.4", length=0)
    ax.set_xlabel("seconds since the runtime started")
    ax.grid(axis="x", color="0.88", linewidth=0.6)
    ax.set_axisbelow(True)
    if not drawn:
        ax.text(0.5, 0.5, "no events", transform=ax.transAxes, ha="center", va="center", color="0.5")

    busy = trace.busy()
    makespan = trace.makespan()
    shares = ", ".join(f"{name} {100 * b / makespan:.0f}%" if makespan > 0 else f"{name} 0%"
                       for name, b in zip(devices, busy))
    fig.suptitle(title if title is not None else "hydra_tune timeline", fontsize=12)
    ax.set_title(f"makespan {_seconds(makespan)}  |  busy: {shares}", fontsize=9, loc="left", wrap=True)

    handles = [Patch(facecolor=colour[t], label=(t if len(t) <= 28 else t[:27] + "\u2026")) for t in shown]
    if len(tasks) > len(shown):
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"+{len(tasks) - len(shown)} more"))
    if draw_copies:
        handles.append(Patch(facecolor="0.75", edgecolor="0.4", hatch="////", label="copies (H2D/D2H)"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8,
                  title="tasks", title_fontsize=8, frameon=False)

    # Labels go where they fit: measure the axes once the layout is settled.
    fig.draw_without_rendering()
    ax_px = ax.get_window_extent().width
    x0, x1 = ax.get_xlim()
    px_per_s = ax_px / (x1 - x0)
    fontsize = 7
    char_px = 0.62 * fontsize * fig.dpi / 72
    for e in units:
        label = f"{e.kind}{e.shard}"
        if (e.end - e.start) * px_per_s >= len(label) * char_px + 4:
            ax.text((e.start + e.end) / 2, e.device + unit_row[0] + unit_row[1] / 2, label, ha="center",
                    va="center", fontsize=fontsize, color=_ink(colour[e.task]), clip_on=True)

    fig.savefig(os.fspath(path))
