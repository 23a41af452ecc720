"""Gantt chart of a runtime trace: one row per device, one colour per task (needs the `plot` extra).

    trace = runtime.trace()                            # or hydra_tune.runtime.trace.Trace.load("trace.json")
    hydra_tune.plot_timeline(trace, "timeline.png")    # units per device; copies as a thin row under each
    hydra_tune.plot_timeline(trace, "t.svg", title="sweep 3", copies=False)

matplotlib is imported only when ``plot_timeline`` runs, through ``Figure`` + ``FigureCanvasAgg`` directly: no pyplot,
no global backend switch, no figure left open. The output format follows the file suffix (png, svg, pdf, ...).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
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
    rows = _rows(trace, copies, colormaps)
    fig, ax = _figure(Figure, FigureCanvasAgg, rows)
    _bars(ax, rows, rows.units, rows.unit_row, copy_lane=False)
    if rows.draw_copies:
        _bars(ax, rows, rows.copy_events, _COPY_ROW, copy_lane=True)
    _axes_labels(ax, rows)
    _titles(fig, ax, trace, rows.devices, title)
    _legend(ax, Patch, rows)
    _unit_labels(fig, ax, rows)
    fig.savefig(os.fspath(path))


@dataclass(frozen=True)
class _Rows:
    """What the chart shows, decided before anything is drawn: devices, events per lane, task colours."""

    devices: list[str]
    units: list[Event]
    copy_events: list[Event]    # empty when copies are not drawn
    tasks: list[str]
    colour: dict[str, tuple[float, ...]]
    unit_row: tuple[float, float]

    @property
    def n_dev(self) -> int:
        return len(self.devices)

    @property
    def draw_copies(self) -> bool:
        return bool(self.copy_events)

    @property
    def shown(self) -> list[str]:
        """The tasks the legend names."""
        return self.tasks[:MAX_LEGEND_TASKS]


def _rows(trace: Trace, copies: bool, colormaps: Any) -> _Rows:
    """Check every event's device is one of the trace's, then pick the lanes and colours."""
    devices = list(trace.devices)
    n_dev = len(devices)
    for e in trace.events:
        if not 0 <= e.device < n_dev:
            raise ValueError(f"plot_timeline: an event names device {e.device}, but got {n_dev} device(s) "
                             f"{devices}. Fix: build the Trace with every device the events use.")
    copy_events = trace.copies() if copies else []
    tasks = trace.tasks()
    return _Rows(devices, trace.units(), copy_events, tasks, dict(zip(tasks, _task_colours(colormaps, len(tasks)))),
                 _UNIT_ROW if copy_events else _UNIT_ONLY)


def _figure(Figure: Any, FigureCanvasAgg: Any, rows: _Rows) -> tuple[Any, Any]:
    """A figure tall enough for the device rows and the legend, its x axis spanning every drawn event."""
    n_entries = len(rows.shown) + (len(rows.tasks) > len(rows.shown)) + rows.draw_copies
    height = max(2.4 + 0.75 * max(rows.n_dev, 1), 1.6 + 0.21 * n_entries)
    fig = Figure(figsize=(12.0, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    drawn = rows.units + rows.copy_events
    if drawn:
        lo = min(0.0, min(e.start for e in drawn))
        hi = max(e.end for e in drawn)
    else:
        lo, hi = 0.0, 1.0
    span = hi - lo if hi > lo else 1.0
    ax.set_xlim(lo - 0.01 * span, hi + 0.01 * span)
    ax.set_ylim(rows.n_dev - 0.5, -0.5)          # device 0 on top
    return fig, ax


def _bars(ax: Any, rows: _Rows, events: list[Event], row: tuple[float, float], copy_lane: bool) -> None:
    """One lane of bars per device: ``row`` is (offset from the device's row centre, height)."""
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in events:
        groups.setdefault((e.device, e.task), []).append((e.start, max(e.end - e.start, 0.0)))
    per_row = max((sum(1 for e in events if e.device == d) for d in range(rows.n_dev)), default=0)
    # White separators show unit boundaries when there are few; with hundreds they would wash the colour out.
    edge = 0.6 if per_row <= 200 else 0.0
    for (d, task), ranges in groups.items():
        colour = rows.colour[task]
        ax.broken_barh(ranges, (d + row[0], row[1]), facecolors=[colour],
                       edgecolor="white" if not copy_lane else colour, linewidth=edge,
                       alpha=0.55 if copy_lane else 1.0, hatch="////" if copy_lane else None)


def _axes_labels(ax: Any, rows: _Rows) -> None:
    """Device names (and "copy" under each with a copy lane), the time axis and its grid."""
    n_dev = rows.n_dev
    ax.set_yticks([d + rows.unit_row[0] + rows.unit_row[1] / 2 for d in range(n_dev)], rows.devices)
    if rows.draw_copies:
        ax.set_yticks([d + _COPY_ROW[0] + _COPY_ROW[1] / 2 for d in range(n_dev)], ["copy"] * n_dev, minor=True)
        ax.tick_params(axis="y", which="minor", labelsize=7, labelcolor="0.4", length=0)
    ax.set_xlabel("seconds since the runtime started")
    ax.grid(axis="x", color="0.88", linewidth=0.6)
    ax.set_axisbelow(True)
    if not rows.units and not rows.copy_events:
        ax.text(0.5, 0.5, "no events", transform=ax.transAxes, ha="center", va="center", color="0.5")


def _titles(fig: Any, ax: Any, trace: Trace, devices: list[str], title: str | None) -> None:
    """The title, and a subtitle with the makespan and each device's compute-busy share."""
    makespan = trace.makespan()
    shares = ", ".join(f"{name} {100 * b / makespan:.0f}%" if makespan > 0 else f"{name} 0%"
                       for name, b in zip(devices, trace.busy()))
    fig.suptitle(title if title is not None else "hydra_tune timeline", fontsize=12)
    ax.set_title(f"makespan {_seconds(makespan)}  |  busy: {shares}", fontsize=9, loc="left", wrap=True)


def _legend(ax: Any, Patch: Any, rows: _Rows) -> None:
    """Tasks beside the plot (long names cut, "+N more" past ``MAX_LEGEND_TASKS``), and the copies' hatch."""
    handles = [Patch(facecolor=rows.colour[t], label=(t if len(t) <= 28 else t[:27] + "\u2026"))
               for t in rows.shown]
    if len(rows.tasks) > len(rows.shown):
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"+{len(rows.tasks) - len(rows.shown)} more"))
    if rows.draw_copies:
        handles.append(Patch(facecolor="0.75", edgecolor="0.4", hatch="////", label="copies (H2D/D2H)"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8,
                  title="tasks", title_fontsize=8, frameon=False)


def _unit_labels(fig: Any, ax: Any, rows: _Rows) -> None:
    """Kind+shard inside each unit bar wide enough for it."""
    # Labels go where they fit: measure the axes once the layout is settled.
    fig.draw_without_rendering()
    x0, x1 = ax.get_xlim()
    px_per_s = ax.get_window_extent().width / (x1 - x0)
    fontsize = 7
    char_px = 0.62 * fontsize * fig.dpi / 72
    for e in rows.units:
        label = f"{e.kind}{e.shard}"
        if (e.end - e.start) * px_per_s >= len(label) * char_px + 4:
            ax.text((e.start + e.end) / 2, e.device + rows.unit_row[0] + rows.unit_row[1] / 2, label, ha="center",
                    va="center", fontsize=fontsize, color=_ink(rows.colour[e.task]), clip_on=True)
