"""`omnickpt verify`: the text output of a verification.

The check itself (`verify`, `VerifyReport`, `Problem`, `spans_of`) lives in omnickpt/integrity.py and is
importable as `omnickpt.verify`; it is re-exported here for the code that imported it from this module.
"""
from __future__ import annotations

from omnickpt.integrity import (  # noqa: F401  (re-exported: their home was this module)
    CHUNK_BYTES, MAX_GAP, TASK_BYTES, Problem, Span, VerifyReport, spans_of, verify)


def format_text(report: VerifyReport) -> str:
    """The human-readable `verify` output for standard output: one line per problem, the notes, and
    the OK line when there is no problem (the FAILED line goes to standard error)."""
    lines = [str(p) for p in report.problems] + [f"note: {note}" for note in report.notes]
    if report.ok:
        lines.append(f"OK {report.path}: {report.tensors} tensors in {report.boxes} boxes, {report.objects} object "
                     f"values, {report.files} data files; {report.bytes_checked} bytes read and checksummed in "
                     f"{report.seconds:.2f} s")
    return "\n".join(lines)


__all__ = ["Problem", "Span", "VerifyReport", "format_text", "spans_of", "verify"]
