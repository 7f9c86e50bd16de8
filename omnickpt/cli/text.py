"""Text helpers shared by the commands' human-readable output: sizes and aligned tables."""
from __future__ import annotations


def human_bytes(n: int) -> str:
    """`n` bytes as "512 B", "1.5 KiB", "3.0 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def table(header: tuple[str, ...], rows: list[tuple], right: set[int]) -> list[str]:
    """Aligned text columns (those in `right` right-aligned), two spaces of indent."""
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in cells]


__all__ = ["human_bytes", "table"]
