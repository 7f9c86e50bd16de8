"""Per-rank, per-phase timings and their aggregation into a report."""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager


class PhaseTimer:
    """Accumulates seconds per phase and bytes on one rank. Thread-safe enough for our use:
    each phase is timed by one thread at a time."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.bytes: dict[str, int] = {}
        # When each phase ran, for timelines (`omnickpt report --png/--trace`): [phase, start, seconds]
        # with start in seconds since t0, this rank's wall-clock start (ranks on several hosts align
        # on it as well as their clocks agree).
        self.t0 = time.time()
        self._origin = time.perf_counter()
        self.events: list[list] = []

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0, start=t0)

    def add(self, name: str, seconds: float, *, start: float | None = None) -> None:
        """Count `seconds` in phase `name`; `start` (a perf_counter value) defaults to now - seconds."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        begin = (time.perf_counter() - seconds if start is None else start) - self._origin
        self.events.append([name, begin, seconds])

    def count(self, name: str, nbytes: int) -> None:
        self.bytes[name] = self.bytes.get(name, 0) + int(nbytes)

    def as_dict(self) -> dict:
        return {"seconds": dict(self.seconds), "bytes": dict(self.bytes), "t0": self.t0,
                "events": [list(e) for e in self.events]}


def summarize(kind: str, per_rank: list[dict], *, total_seconds: float | None = None) -> dict:
    """Aggregate per-rank timings: per phase min/median/max and the slowest rank; bytes per rank
    and throughput."""
    phases = sorted({p for r in per_rank for p in r["seconds"]})
    out_phases = {}
    for p in phases:
        vals = [(r["seconds"].get(p, 0.0), i) for i, r in enumerate(per_rank)]
        secs = [v for v, _ in vals]
        slow = max(vals)
        out_phases[p] = {"min": min(secs), "median": statistics.median(secs), "max": slow[0], "slowest_rank": slow[1]}
    data_key = "written" if kind in ("save", "persist", "convert") else "read"
    bytes_per_rank = [r["bytes"].get(data_key, 0) for r in per_rank]
    report = {
        "kind": kind,
        "world_size": len(per_rank),
        "phases": out_phases,
        "bytes_per_rank": bytes_per_rank,
        "total_bytes": sum(bytes_per_rank),
        "per_rank": per_rank,
    }
    if total_seconds is not None:
        report["seconds"] = total_seconds
        report["throughput_bytes_per_s"] = sum(bytes_per_rank) / total_seconds if total_seconds > 0 else None
    return report


def format_report(report: dict) -> str:
    """A short human-readable table of a report."""
    lines = [f"{report['kind']}: {report['total_bytes'] / 1e6:.1f} MB on {report['world_size']} rank(s)"
             + (f" in {report['seconds']:.3f} s" if "seconds" in report else "")]
    for p, v in report["phases"].items():
        lines.append(f"  {p:<10} min {v['min']:.4f}  median {v['median']:.4f}  max {v['max']:.4f}  "
                     f"(rank {v['slowest_rank']})")
    return "\n".join(lines)
