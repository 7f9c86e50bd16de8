"""`omnickpt report PATH`: the text output of where the time of a save (or load) went, per rank and phase.

Reading a report, its timeline, summary, trace and picture live in omnickpt/monitor/report.py
(`omnickpt.read_report` reads one); they are re-exported here for the code that imported them from
this module.
"""
from __future__ import annotations

import statistics

from omnickpt.cli.text import human_bytes, table
from omnickpt.monitor.report import (  # noqa: F401  (re-exported: their home was this module)
    ENVELOPES, PHASE_ORDER, REPORT_NAME, Timeline, draw_png, rank_total, summary, timeline, trace, write_trace)
from omnickpt.reader import read_report  # noqa: F401  (re-exported)

# Past this many ranks the text table shows per-phase statistics and the slowest ranks instead.
MAX_TABLE_RANKS = 64


def format_text(doc: dict) -> str:
    """The human-readable `report` output (from `summary`)."""
    secs = doc.get("seconds")
    head = f"{doc['kind']} report for {doc['path']}" + (f" (save id {doc['save_id']})" if doc.get("save_id") else "")
    lines = [head, f"  {doc['world_size']} rank(s), {human_bytes(doc['total_bytes'])}"
             + (f" in {secs:.3f} s ({human_bytes(int(doc['total_bytes'] / secs))}/s)" if secs else "")]
    phases = doc["phases"]
    rows = doc["table"]
    if len(rows) <= MAX_TABLE_RANKS:
        lines.append("seconds per rank and phase (stall: what training waited for; it spans plan..snapshot"
                     + ("; held: an optimizer step waiting for the lazy copy" if "held" in phases else "") + "):")
        lines += table(("RANK",) + tuple(p.upper() for p in phases) + ("TOTAL", "BYTES"),
                       [(r["rank"],) + tuple(_secs(r["seconds"].get(p)) for p in phases)
                        + (_secs(r["total"]), human_bytes(r["bytes"])) for r in rows],
                       right=set(range(len(phases) + 3)))
    else:
        lines.append(f"seconds per phase over {len(rows)} ranks:")
        stats = []
        for p in phases:
            vals = [r["seconds"].get(p, 0.0) for r in rows]
            worst = max(range(len(vals)), key=vals.__getitem__)
            stats.append((p, _secs(min(vals)), _secs(statistics.median(vals)), _secs(vals[worst]), worst))
        lines += table(("PHASE", "MIN", "MEDIAN", "MAX", "SLOWEST RANK"), stats, right={1, 2, 3, 4})
        slowest = sorted(rows, key=lambda r: -r["total"])[:8]
        lines.append("slowest ranks: " + ", ".join(f"{r['rank']} ({r['total']:.4f} s)" for r in slowest))
    sp, sr = doc["slowest_phase"], doc["slowest_rank"]
    lines.append(f"slowest phase: {sp['phase']} on rank {sp['rank']} ({sp['seconds']:.4f} s; median over ranks "
                 f"{sp['median']:.4f} s)")
    lines.append(f"slowest rank: {sr['rank']} ({sr['seconds']:.4f} s in its phases)")
    return "\n".join(lines)


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


__all__ = ["Timeline", "draw_png", "format_text", "rank_total", "read_report", "summary", "timeline", "trace",
           "write_trace"]
