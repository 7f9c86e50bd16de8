"""A save's or load's report (report.json): its per-rank phases as a timeline, a summary, a Chrome /
Perfetto trace and a picture. `omnickpt report PATH` prints these (omnickpt/cli/report.py);
`omnickpt.read_report(path)` reads a checkpoint's report or a report saved to a file.

A report is monitor.summarize's document (per phase min/median/max/slowest rank, and
`per_rank[r]["seconds"][phase]`), or the memory tier's persist report; `timeline` turns either
shape into one per-rank form first, so nothing after it asks which shape it read.

The report holds each rank's seconds per phase, summed, not when each phase started. Unless a
rank's record carries "events" ([phase, start, seconds], start in seconds since that rank's "t0",
the wall-clock time its save began), the timeline lays each rank's phases end to end in the
order a save runs them, which is the real order but not the real waiting between them, and says
so ("approximate"). The phase "stall" (what training waited for) spans plan..snapshot, so it is
drawn beside them, not after; so is "held", the time an optimizer step waited for a lazy snapshot's
copy (after the stall, beside the background copy).

A report is a file anyone may hand us: every number in it is checked before use, and anything
malformed is a CorruptCheckpointError naming the file and the field. Everything here is linear in
ranks x phases: a report at scale has thousands of ranks, and the picture draws one collection of
bars per phase (past its pixel rows, one row per group of ranks: the slowest of the group).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field

import numpy as np

from omnickpt.errors import CorruptCheckpointError, StorageError, UnsupportedError

REPORT_NAME = "report.json"
# The order the phases of a save and of a load run in (api.Checkpointer.save / load).
PHASE_ORDER = ("plan", "serialize", "exchange", "snapshot", "objects", "read", "verify", "checksum", "write",
               "fsync", "install", "forward", "persist", "commit")
# Training's waits, drawn beside the phases they overlap rather than after them (and not summed
# into a rank's total): the save() call, and an optimizer step held by a lazy snapshot's fence.
ENVELOPES = ("stall", "held")
# Phase colours (no grey: the stall is drawn in black).
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
            "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5")


@dataclass
class Timeline:
    """Per rank, (phase, start, seconds) spans; `exact` when the starts were recorded."""
    kind: str
    phases: list[str]                                   # every phase, in run order (envelopes last)
    seconds: list[dict[str, float]]                     # per rank: phase -> total seconds
    bytes: list[int]
    spans: list[list[tuple[str, float, float]]] = field(default_factory=list)
    exact: bool = False


def parse_report(raw: bytes, where: str, path: str) -> dict:
    """The report document in `raw` (read from `where`); "path" defaults to `path`.
    CorruptCheckpointError when it is not a JSON object."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({type(e).__name__}: {e}); not a timing "
                                     "report") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: not a timing report (a JSON {type(doc).__name__})")
    doc.setdefault("path", path)
    return doc


# ---------------------------------------------------------------------- report shapes
# report.json is written in three shapes: a save's or a load's (monitor.summarize's document), a
# convert's (the same document, kind "convert", its bytes written), and the memory tier's persist
# report (tiers.py: one total per rank). `_rank_records` turns each into summarize's per-rank records
# ({"seconds": {phase: s}, "bytes": {...}, and "t0" / "events" when recorded}) and `_DATA_KEY` names
# each kind's byte count, so that nothing after them asks which shape it read.
def _summarized_records(report: dict):
    """A save's, load's or convert's report (monitor.summarize's document): its records as they are."""
    return report.get("per_rank")


def _persist_records(report: dict) -> list[dict]:
    """The memory tier's persist report (tiers.py): one total per rank, {"seconds_per_rank": [s, ...]}."""
    return [{"seconds": {"persist": s}, "bytes": {}} for s in report["seconds_per_rank"]]


def _rank_records(report: dict):
    """The per-rank records of `report`, whatever shape it has (not yet checked)."""
    if report.get("per_rank") is None and isinstance(report.get("seconds_per_rank"), list):
        return _persist_records(report)
    return _summarized_records(report)


# The byte count of a rank's record that a report's kind moved; the other kinds ("load") read.
_DATA_KEY = {"save": "written", "convert": "written", "persist": "written"}


def timeline(report: dict) -> Timeline:
    """The per-rank phases of `report` (a save or load report, or the memory tier's persist
    report), with spans from recorded events or laid end to end. CorruptCheckpointError naming the
    report and the field when it does not have that shape or holds a time that is not a finite
    number of seconds."""
    where = _where(report)
    per_rank = _checked_records(_rank_records(report), where)
    kind = str(report.get("kind", "save"))
    seconds = [_phase_seconds(rec, r, where) for r, rec in enumerate(per_rank)]
    nbytes = [_data_bytes(rec, r, _DATA_KEY.get(kind, "read"), where) for r, rec in enumerate(per_rank)]
    phases = _run_order({p for s in seconds for p in s})
    spans = _recorded_spans(per_rank)
    if spans is not None:
        return Timeline(kind, phases, seconds, nbytes, spans, exact=True)
    return Timeline(kind, phases, seconds, nbytes, _laid_end_to_end(phases, seconds))


def _checked_records(per_rank, where: str) -> list[dict]:
    """`per_rank` when it is a non-empty list of records with numeric phase seconds."""
    if not isinstance(per_rank, list) or not per_rank or not all(map(_is_record, per_rank)):
        raise CorruptCheckpointError(f"{where}: no per-rank phase seconds in this report "
                                     "(expected per_rank[r]['seconds'][phase])")
    return per_rank


def _is_record(rec) -> bool:
    seconds = rec.get("seconds") if isinstance(rec, dict) else None
    return isinstance(seconds, dict) and all(_is_real(v) for v in seconds.values())


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _phase_seconds(rec: dict, r: int, where: str) -> dict[str, float]:
    return {str(p): _number(v, where, f"per_rank[{r}]['seconds'][{p!r}]") for p, v in rec["seconds"].items()}


def _data_bytes(rec: dict, r: int, data_key: str, where: str) -> int:
    counts = rec.get("bytes") or {}
    if not isinstance(counts, dict):
        raise CorruptCheckpointError(f"{where}: per_rank[{r}]['bytes'] is {counts!r:.40}, not an object of byte "
                                     "counts; the report is damaged")
    return int(_number(counts.get(data_key, 0), where, f"per_rank[{r}]['bytes'][{data_key!r}]"))


def _run_order(found: set[str]) -> list[str]:
    """The phases in the order a save or load runs them, unknown ones after, envelopes last."""
    return ([p for p in PHASE_ORDER if p in found] + sorted(found - set(PHASE_ORDER) - set(ENVELOPES))
            + [p for p in ENVELOPES if p in found])


def _laid_end_to_end(phases: list[str], seconds: list[dict[str, float]]) -> list[list[tuple[str, float, float]]]:
    """Spans from per-phase totals alone: each rank's phases one after the other in run order; the
    commit after every rank's last phase (the coordinator commits once all have written);
    envelopes from 0."""
    spans = [_one_after_another(phases, s) for s in seconds]
    last = max((rank[-1][1] + rank[-1][2] for rank in spans if rank), default=0.0)
    for rank, s in zip(spans, seconds):
        if "commit" in s:
            rank.append(("commit", last, s["commit"]))
        rank.extend((p, 0.0, s[p]) for p in ENVELOPES if p in s)
    return spans


def _one_after_another(phases: list[str], s: dict[str, float]) -> list[tuple[str, float, float]]:
    spans, t = [], 0.0
    for p in phases:
        if p in s and p not in ENVELOPES and p != "commit":
            spans.append((p, t, s[p]))
            t += s[p]
    return spans


def _where(report: dict) -> str:
    path = report.get("path")
    return path if isinstance(path, str) and path else "report"


def _number(v, where: str, what: str) -> float:
    """A report's time or byte count as a float: finite and not negative, else the report is damaged."""
    try:
        x = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    except OverflowError:   # an integer past float's range
        x = math.nan
    if not 0 <= x < math.inf:
        raise CorruptCheckpointError(f"{where}: {what} is {v!r:.40}, not a finite number >= 0; the report is "
                                     "damaged (or not written by omnickpt)")
    return x


def _recorded_spans(per_rank: list[dict]) -> list[list[tuple[str, float, float]]] | None:
    """Each rank's recorded (phase, start, seconds), aligned on the ranks' wall-clock starts "t0";
    None when a rank recorded none or they are malformed (the timeline then lays totals end to end)."""
    spans = []
    try:
        # Each rank's events count from its own start, "t0" (wall clock): align the ranks on it
        # (the earliest start, taken once: per event it made the timeline quadratic in ranks).
        starts = [float(r.get("t0", 0.0)) for r in per_rank]
        origin = min(starts)
        for s0, rec in zip(starts, per_rank):
            events = rec.get("events")
            if not isinstance(events, list):
                return None
            spans.append([(str(p), s0 - origin + float(t), float(dt)) for p, t, dt in events])
    except (TypeError, ValueError, OverflowError):
        return None
    if not all(math.isfinite(t) and 0 <= dt < math.inf for e in spans for _, t, dt in e):
        return None
    # A phase timed from before the timer existed (the stall starts at the save call) would start
    # before 0: time begins at the earliest start instead.
    first = min(0.0, min((t for e in spans for _, t, _ in e), default=0.0))
    return [[(p, t - first, dt) for p, t, dt in e] for e in spans]


def rank_total(seconds: dict[str, float]) -> float:
    """Seconds a rank spent in its phases (envelopes, which contain others, not counted)."""
    return sum(v for p, v in seconds.items() if p not in ENVELOPES)


def summary(report: dict) -> dict:
    """The `report --json` document: the report's own fields, plus "table" (per rank: seconds per
    phase, total, bytes), "slowest_phase" {phase, rank, seconds, median} and "slowest_rank" {rank,
    seconds}, and "timeline_exact"."""
    tl = timeline(report)
    total = report.get("seconds")
    if total is not None:
        total = _number(total, _where(report), "'seconds'")
    table = [{"rank": r, "seconds": s, "total": rank_total(s), "bytes": tl.bytes[r]} for r, s in enumerate(tl.seconds)]
    timed = [p for p in tl.phases if p not in ENVELOPES] or tl.phases
    slow_phase = max(((p, r, s.get(p, 0.0)) for p in timed for r, s in enumerate(tl.seconds)), key=lambda x: x[2])
    slow_rank = max(table, key=lambda row: row["total"])
    return {
        "path": report.get("path"), "kind": tl.kind, "save_id": report.get("save_id"),
        "world_size": len(tl.seconds), "seconds": total, "total_bytes": sum(tl.bytes),
        "phases": tl.phases, "table": table,
        "slowest_phase": {"phase": slow_phase[0], "rank": slow_phase[1], "seconds": slow_phase[2],
                          "median": statistics.median(s.get(slow_phase[0], 0.0) for s in tl.seconds)},
        "slowest_rank": {"rank": slow_rank["rank"], "seconds": slow_rank["total"]},
        "timeline_exact": tl.exact,
    }


# ---------------------------------------------------------------------- the trace
def trace(report: dict) -> dict:
    """A Chrome / Perfetto trace of the report: one process per rank ("rank N"), one complete
    event (ph "X", microseconds) per rank and phase (envelopes on a second thread lane)."""
    tl = timeline(report)
    events: list[dict] = []
    for r, spans in enumerate(tl.spans):
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "phases"}})
        if any(p in ENVELOPES for p, _, _ in spans):
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "training waits"}})
        for phase, start, secs in spans:
            events.append({"name": phase, "cat": tl.kind, "ph": "X", "pid": r, "tid": 1 if phase in ENVELOPES else 0,
                           "ts": round(start * 1e6, 3), "dur": round(secs * 1e6, 3),
                           "args": {"seconds": secs, "approximate_start": not tl.exact}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"path": report.get("path"), "kind": tl.kind, "save_id": report.get("save_id"),
                          "timeline": "recorded" if tl.exact else "phases laid end to end (report.json holds "
                                                                  "per-phase totals, not start times)"}}


def write_trace(report: dict, out: str) -> None:
    """Write `trace(report)` as JSON to the file `out`; StorageError when it cannot be written."""
    doc = trace(report)
    try:
        with open(out, "w") as f:
            json.dump(doc, f)
    except OSError as e:
        raise StorageError(f"cannot write the trace to {out} ({e.strerror or e}): give the path of a file in an "
                           "existing, writable folder") from None


# ---------------------------------------------------------------------- the picture
# The picture's size: 12 x at most 40 inches at 110 dpi.
_DPI, _WIDTH, _MAX_HEIGHT = 110, 12.0, 40.0
# Fewest pixels per row drawn: more ranks than that allows are grouped, one row per group.
_ROW_PIXELS = 3
# Most rank labels on the y axis; past this, evenly spaced ones.
_MAX_LABELS = 40


def draw_png(report: dict, out: str) -> None:
    """A per-rank timeline of the report's phases as a PNG at `out` (matplotlib, Agg backend;
    `pip install 'omnickpt[plot]'`). One row per rank; past the rows the picture has pixels for,
    one row per group of consecutive ranks, showing the group's slowest rank (most seconds in its
    phases), so that a straggler stays visible. UnsupportedError without matplotlib, StorageError
    when `out` cannot be written, CorruptCheckpointError for a malformed report."""
    if os.path.isdir(out):   # before minutes of drawing, not after
        raise StorageError(f"cannot write the timeline picture to {out}: it is a folder; give the path of a file "
                           "(e.g. timeline.png)")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.collections import PolyCollection
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise UnsupportedError(f"--png needs matplotlib ({e}); pip install 'omnickpt[plot]'") from None
    tl = timeline(report)
    doc = summary(report)
    height = min(_MAX_HEIGHT, 2.2 + 0.45 * len(tl.spans))
    shown, group = _shown_ranks(tl, max(1, int(height * _DPI * 0.8) // _ROW_PIXELS))
    colors = {p: _PALETTE[i % len(_PALETTE)] for i, p in enumerate(p for p in tl.phases if p not in ENVELOPES)}
    fig = Figure(figsize=(_WIDTH, height), dpi=_DPI)
    FigureCanvasAgg(fig)   # a canvas of our own: no pyplot, no global backend switch
    ax = fig.add_subplot(1, 1, 1)
    _draw_bars(ax, PolyCollection, tl, shown, colors)
    _label_axes(ax, tl, doc, shown, group)
    handles = [Patch(color=c, label=p) for p, c in colors.items()]
    if any(p in ENVELOPES for p in tl.phases):
        handles.append(Patch(color="black", alpha=0.55, label="training waits (stall, held step)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(out, format="png")
    except OSError as e:
        raise StorageError(f"cannot write the timeline picture to {out} ({e.strerror or e}): give the path of a file "
                           "in an existing, writable folder") from None


def _draw_bars(ax, PolyCollection, tl: Timeline, shown: list[int], colors: dict[str, str]) -> None:
    """The rows of `shown` ranks as one collection per phase (and one for the envelopes): the cost
    of drawing is then one artist per phase, not per rank and phase."""
    bars: dict[str, list[tuple[float, float, float, float]]] = {p: [] for p in colors}
    envelopes = []
    for row, r in enumerate(shown):
        for phase, start, secs in tl.spans[r]:
            if phase in ENVELOPES:   # a thin bar under the lane: it contains the phases above it
                envelopes.append((start, secs, row + 0.28, 0.12))
            else:
                bars[phase].append((start, secs, row - 0.35, 0.6))
    thin = len(shown) > 200   # white edges would cover bars a few pixels high
    for phase, rects in bars.items():
        if rects:
            ax.add_collection(PolyCollection(_quads(rects), facecolors=colors[phase],
                                             edgecolors="none" if thin else "white", linewidths=0 if thin else 0.4))
    if envelopes:
        ax.add_collection(PolyCollection(_quads(envelopes), facecolors="black", edgecolors="none", alpha=0.55))


def _label_axes(ax, tl: Timeline, doc: dict, shown: list[int], group: int) -> None:
    """Rank labels (at most _MAX_LABELS), the time axis, and a title naming the slowest phase and rank."""
    ticks = range(len(shown)) if len(shown) <= _MAX_LABELS else np.linspace(0, len(shown) - 1, _MAX_LABELS).astype(int)
    ax.set_yticks(list(ticks))
    ax.set_yticklabels([f"rank {shown[t]}" for t in ticks], fontsize=8 if len(shown) > 20 else None)
    ax.set_ylim(len(shown) - 0.5, -0.6)
    end = max((s + d for spans in tl.spans for _, s, d in spans), default=1.0)
    ax.set_xlim(0, end * 1.02 if end > 0 else 1.0)
    ax.set_xlabel("seconds since the save began" if tl.exact
                  else "seconds (each rank's phases laid end to end; report.json holds totals, not start times)")
    if group > 1:
        ax.set_ylabel(f"{len(tl.spans)} ranks: each row the slowest of {group} consecutive ranks")
    sp, sr = doc["slowest_phase"], doc["slowest_rank"]
    total = f" in {doc['seconds']:.3f} s" if doc.get("seconds") else ""
    ax.set_title(f"{tl.kind} {doc['path']}{total}: slowest phase {sp['phase']} (rank {sp['rank']}, "
                 f"{sp['seconds']:.4f} s), slowest rank {sr['rank']}", fontsize=9)


def _shown_ranks(tl: Timeline, rows: int) -> tuple[list[int], int]:
    """(the ranks drawn, one per row; how many consecutive ranks each row stands for): every rank
    when they fit in `rows`, else the slowest of each group."""
    ranks = len(tl.spans)
    if ranks <= rows:
        return list(range(ranks)), 1
    group = -(-ranks // rows)
    totals = [rank_total(s) for s in tl.seconds]
    return [max(range(a, min(a + group, ranks)), key=totals.__getitem__) for a in range(0, ranks, group)], group


def _quads(rects: list[tuple[float, float, float, float]]) -> np.ndarray:
    """(x, width, y, height) rectangles as the [n, 4, 2] corners a PolyCollection takes."""
    x, w, y, h = np.asarray(rects, dtype=float).T
    return np.stack([np.stack([x, y], 1), np.stack([x + w, y], 1), np.stack([x + w, y + h], 1),
                     np.stack([x, y + h], 1)], 1)


__all__ = ["ENVELOPES", "PHASE_ORDER", "REPORT_NAME", "Timeline", "draw_png", "parse_report", "rank_total", "summary",
           "timeline", "trace", "write_trace"]
