"""`omnickpt diff A B`: the text output of a comparison of two checkpoints.

The comparison itself (`diff`, `DiffReport`) lives in omnickpt/compare.py and is importable as
`omnickpt.diff`; it is re-exported here for the code that imported it from this module.
"""
from __future__ import annotations

from omnickpt.cli.text import table
from omnickpt.compare import DIFFERENT, SLAB_BYTES, DiffReport, diff  # noqa: F401  (re-exported: their home was here)


def format_text(report: DiffReport, *, show_all: bool = False) -> str:
    """The human-readable `diff` output: counts, then a table of the tensors and objects that
    are not identical (all of them with `show_all`), then the verdict."""
    lines = [f"A {report.a}", f"B {report.b}"]
    if report.include or report.exclude:
        lines.append("compared: " + "; ".join(f"{what} {', '.join(pats)}" for what, pats in
                                              (("include", report.include), ("exclude", report.exclude)) if pats))

    def counts(rows: list[dict]) -> str:
        c = report.counts(rows)
        return ", ".join(f"{n} {s}" for s, n in sorted(c.items(), key=lambda kv: -kv[1])) or "none"

    lines.append(f"tensors ({len(report.tensors)}): {counts(report.tensors)}")
    lines += [_lossy_line(report, side) for side in ("a", "b") if report.lossy(side)]
    # an equal row with a lossy side is listed too: "equal" alone would read as "exact"
    lines += _tensor_table([t for t in report.tensors if show_all or t["status"] != "equal" or _lossy_sides(t)])
    lines.append(f"objects ({len(report.objects)}): {counts(report.objects)}")
    shown = [o for o in report.objects if show_all or o["status"] != "equal"]
    if shown:
        lines += table(("KEY", "STATUS", "DETAIL"), [(o["key"], o["status"], o.get("detail", "")) for o in shown],
                       right=set())
    tol = f"atol={report.atol:g}, rtol={report.rtol:g}"
    lossy = {t["name"] for t in report.lossy("a") + report.lossy("b")}
    note = f"; {len(lossy)} tensor(s) lossy (quantized) on a side, see above" if lossy else ""
    lines.append(f"DIFFERENT ({tol}){note}" if report.differs else f"SAME ({tol}){note}")
    return "\n".join(lines)


def _lossy_line(report: DiffReport, side: str) -> str:
    rows = report.lossy(side)
    schemes = ", ".join(sorted({t[f"lossy_{side}"]["scheme"] for t in rows}))
    worst = max(t[f"lossy_{side}"]["max_error"] for t in rows)
    return (f"lossy in {side.upper()}: {len(rows)} tensor(s) stored quantized ({schemes}, largest "
            f"recorded error {worst:.3g}): their values are a lossy copy of what was saved")


def _tensor_table(shown: list[dict]) -> list[str]:
    if not shown:
        return []
    return table(("NAME", "STATUS", "SHAPE A", "SHAPE B", "DTYPE A", "DTYPE B", "MAX ABS", "MAX REL", "BEYOND"),
                 [(t["name"], _status_text(t), _dims(t["shape_a"]), _dims(t["shape_b"]), t["dtype_a"] or "-",
                   t["dtype_b"] or "-", _num(t.get("max_abs")), _relative(t),
                   t.get("mismatched", "-")) for t in shown], right={6, 7, 8})


def _lossy_sides(row: dict) -> str:
    return "+".join(s.upper() for s in ("a", "b") if row.get(f"lossy_{s}"))


def _status_text(row: dict) -> str:
    sides = _lossy_sides(row)
    if not sides:
        return row["status"]
    within = ", within recorded error" if row.get("within_lossy_error") and row["status"] == "differs" else ""
    return f"{row['status']} (lossy {sides}{within})"


def _dims(shape: list | None) -> str:
    return "-" if shape is None else "[" + ",".join(map(str, shape)) + "]"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _relative(row: dict) -> str:
    """The MAX REL cell: inf from differences against zeros of B says how many, and what the rest need."""
    if not row.get("zero_b"):
        return _num(row.get("max_rel"))
    return f"{_num(row['max_rel'])} ({row['zero_b']} at B=0, else {_num(row['max_rel_nonzero_b'])})"


__all__ = ["DiffReport", "diff", "format_text"]
