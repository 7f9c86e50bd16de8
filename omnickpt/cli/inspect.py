"""`omnickpt inspect`: the text output of what a checkpoint holds.

The document itself (`describe`, `describe_manifest`, `name_tree`, `short_repr`) lives in
omnickpt/contents.py and is importable as `omnickpt.describe`; it is re-exported here for the
code that imported it from this module.
"""
from __future__ import annotations

import datetime

from omnickpt.cli.text import human_bytes, table
from omnickpt.contents import (  # noqa: F401  (re-exported: their home was this module)
    MAX_TREE_DEPTH, REPR_LIMIT, TEXT_REPR_LIMIT, clip, describe, describe_manifest, name_tree, short_repr)

# Layout keys shown on their own lines; the others are listed as "layout KEY: value".
_SHOWN_LAYOUT = ("world_size", "frameworks", "format")
_FORMAT_NAMES = {"omnickpt": "omnickpt", "hf": "Hugging Face safetensors", "dcp": "PyTorch DCP"}


def format_tree(tree: dict) -> list[str]:
    """Text lines of `name_tree`: groups with their tensor count and size, leaves with shape,
    dtype and size."""
    lines: list[str] = []

    def walk(node: dict, prefix: str, last: bool, top: bool) -> None:
        branch = "" if top else ("└── " if last else "├── ")
        if "children" in node:
            count = f"{node['tensors']} tensor" + ("s" if node["tensors"] != 1 else "")
            lines.append(f"{prefix}{branch}{node['name']}  ({count}, {human_bytes(node['bytes'])})")
        else:
            lines.append(f"{prefix}{branch}{node['name']}  {node['shape']} {node['dtype']}  "
                         f"{human_bytes(node['bytes'])}")
            return
        inner = prefix + ("" if top else ("    " if last else "│   "))
        for i, child in enumerate(node["children"]):
            walk(child, inner, i == len(node["children"]) - 1, False)

    for i, child in enumerate(tree["children"]):
        walk(child, "  ", i == len(tree["children"]) - 1, True)
    return lines


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> '0-3,5': readable for thousands of ranks."""
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def _layout_lines(doc: dict) -> list[str]:
    layout = doc["layout"]
    frameworks = layout.get("frameworks") or {}
    fmt = doc.get("format", "omnickpt")
    if fmt == "omnickpt":
        created = _utc(doc["created"])
        lines = [f"  save id {doc['save_id']}, format version {doc['format_version']}, written by omnickpt "
                 f"{doc['tool_version'] or '?'} at {created}"]
        if doc.get("compression") and doc["compression"] != "none":
            lines.append(f"  compressed with {doc['compression']}: {doc['totals']['tensor_bytes']:,} tensor bytes in "
                         f"{doc['totals']['file_bytes']:,} file bytes")
        inc = doc.get("incremental")
        if inc:
            base = inc["base"] or "the checkpoint it replaced"
            lines.append(f"  incremental (chain {inc['chain']}, compared with {base}"
                         f"): {len(inc['referenced_files'])} data file(s) of earlier checkpoints referenced"
                         + (": " + ", ".join(inc["referenced_files"][:3]) if inc["referenced_files"] else ""))
        if doc.get("quantized"):
            q = doc["quantized"]
            schemes = sorted({v["scheme"] for v in q.values()})
            lines.append(f"  {len(q)} tensor(s) quantized ({', '.join(schemes)}, lossy): largest error "
                         f"{max(v['max_error'] for v in q.values()):.3g}")
    else:
        lines = [f"  format: {_FORMAT_NAMES.get(fmt, fmt)} (read without conversion)"]
    lines.append(f"  saved by {doc['world_size']} rank(s); frameworks: "
                 + (", ".join(f"{k}={v}" for k, v in frameworks.items()) or "none recorded"))
    for key, value in layout.items():
        if key in _SHOWN_LAYOUT:
            continue
        if isinstance(value, dict) and len(short_repr(value, 1000)) > 100:
            lines.append(f"  layout {key}: {len(value)} key(s): {short_repr(list(value), 100)}")
        else:
            lines.append(f"  layout {key}: {short_repr(value, 100)}")
    return lines


def _utc(created: float) -> str:
    """A manifest's "created" as a UTC date; 0 (not recorded) or a time no calendar holds (a damaged
    or hostile field, year 10^9) is an unknown time."""
    try:
        if created:
            return datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, ValueError, OSError, TypeError):
        pass
    return "an unknown time"


def format_text(doc: dict) -> str:
    """The human-readable `inspect` output."""
    tot = doc["totals"]
    lines = [f"checkpoint {doc['path']}"] + _layout_lines(doc)
    if "filters" in doc:
        lines.append(f"tensors ({tot['matched']} of {tot['tensors']} match {' or '.join(doc['filters'])}, "
                     f"{human_bytes(tot['matched_bytes'])}):")
    else:
        lines.append(f"tensors ({tot['tensors']}, {human_bytes(tot['tensor_bytes'])}):")
    if "tree" in doc:
        lines += format_tree(doc["tree"])
    else:
        lines += table(("NAME", "SHAPE", "DTYPE", "SIZE", "BOXES"),
                       [(t["name"], t["shape"], t["dtype"], human_bytes(t["bytes"]), t["boxes"])
                        for t in doc["tensors"]], right={3, 4})
    lines.append(f"objects ({tot['objects']}, {human_bytes(tot['object_bytes'])}):")
    rows = []
    for o in doc["objects"]:
        reprs = o.get("reprs") or []
        value = (clip(reprs[0]["repr"], TEXT_REPR_LIMIT) + (f"  (+{len(reprs) - 1} other values)" if len(reprs) > 1
                                                              else "")) if reprs else ""
        rows.append((o["key"], _ranks(o["ranks"]), o["values"], human_bytes(o["bytes"]), value))
    lines += table(("KEY", "RANKS", "VALUES", "SIZE", "VALUE"), rows, right={2, 3})
    lines.append(f"files ({tot['files']}, {human_bytes(tot['file_bytes'])}):")
    lines += table(("PATH", "RANK", "SIZE"), [(f["path"], f["rank"], human_bytes(f["bytes"])) for f in doc["files"]],
                   right={1, 2})
    lines.append(f"total: {tot['tensors']} tensors in {tot['boxes']} boxes ({human_bytes(tot['tensor_bytes'])}), "
                 f"{tot['objects']} objects ({human_bytes(tot['object_bytes'])}), "
                 f"{tot['files']} data files ({human_bytes(tot['file_bytes'])})")
    return "\n".join(lines)


__all__ = ["describe", "describe_manifest", "format_text", "format_tree", "human_bytes", "name_tree", "short_repr",
           "table"]
