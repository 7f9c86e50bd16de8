"""`omnickpt inspect`: what a checkpoint holds. Tensors come from the manifest alone (no tensor byte
is read); object values are read and decoded safely (never unpickled) to show them."""
from __future__ import annotations

import datetime
import fnmatch
import math
import re
import reprlib
from typing import Any, Sequence

from omnickpt.errors import CheckpointError, UnsafeCheckpointError
from omnickpt.format import Manifest, dtype_from_name
from omnickpt.reader import CheckpointReader

# Layout keys shown on their own lines; the others are listed as "layout KEY: value".
_SHOWN_LAYOUT = ("world_size", "frameworks", "format")
# Characters of an object value's repr kept in the document (the text table shows fewer).
REPR_LIMIT = 500
TEXT_REPR_LIMIT = 120
_FORMAT_NAMES = {"omnickpt": "omnickpt", "hf": "Hugging Face safetensors", "dcp": "PyTorch DCP"}
# A name is split into at most this many levels of the tree (the rest stays in its leaf): names come
# from an untrusted manifest, and every level costs a copy of the name so far and a level of recursion.
MAX_TREE_DEPTH = 32


def describe(path: str, *, boxes: bool = False, filters: Sequence[str] = (), tree: bool = False,
             values: bool = True) -> dict:
    """The checkpoint at `path` (any format omnickpt reads) as plain JSON-ready data: the
    `inspect --json` document. `filters` (fnmatch globs, any may match) select the tensors
    listed; `tree` adds "tree", the tensors grouped by the "/" and "." parts of their names;
    `values` adds each object value's short repr (decoded safely: a pickled value is shown as
    such, never unpickled).

    Raises NotCommittedError when `path` holds no committed checkpoint.
    """
    with CheckpointReader(path) as reader:
        doc = describe_manifest(reader.manifest, reader.location, boxes=boxes, filters=filters)
        doc["format"] = reader.format
        if values:
            for obj, entries in zip(doc["objects"], reader.manifest.objects.values()):
                obj["reprs"] = [{"ranks": sorted(e.ranks), "repr": _value_repr(reader, obj["key"], e)}
                                for e in entries]
    if tree:
        doc["tree"] = name_tree(doc["tensors"])
    return doc


def _value_repr(reader: CheckpointReader, key: str, entry) -> str:
    try:
        return short_repr(reader.decode(key, reader.object_bytes(key, entry)), REPR_LIMIT)
    except UnsafeCheckpointError:
        return "<pickled value: not decoded (load it with allow_pickle=True if you trust the checkpoint)>"
    except CheckpointError as e:
        return f"<unreadable: {str(e)[:100]}>"


def describe_manifest(m: Manifest, path: str, *, boxes: bool = False, filters: Sequence[str] = ()) -> dict:
    """`describe` from a manifest alone (no object values, no tree)."""
    tensors = []
    for name, t in m.tensors.items():
        if filters and not any(fnmatch.fnmatchcase(name, f) for f in filters):
            continue
        entry = {"name": name, "shape": list(t.shape), "dtype": t.dtype,
                 "bytes": math.prod(t.shape) * dtype_from_name(t.dtype).itemsize,
                 "stored_bytes": t.nbytes, "boxes": t.box_count}
        if boxes:
            entry["box_list"] = [{"offsets": list(b.offsets), "lengths": list(b.lengths),
                                  "file": m.files[b.file].path if b.file >= 0 else None, "offset": b.offset,
                                  "nbytes": b.nbytes, "checksums": list(b.sums.crcs) if b.sums else []}
                                 for b in t.boxes]
        tensors.append(entry)
    objects = []
    for key, entries in m.objects.items():
        objects.append({"key": key, "ranks": sorted(r for e in entries for r in e.ranks),
                        "values": len(entries),
                        "bytes": sum(len(e.inline) if e.inline is not None else e.nbytes for e in entries)})
    files = [{"path": f.path, "rank": f.rank, "bytes": f.bytes} for f in m.files]
    all_tensors = m.tensors.values()
    doc = {
        "path": path,
        "format": m.layout.get("format", "omnickpt"),
        "format_version": m.version,
        "chunk_bytes": m.chunk_bytes if m.version >= 2 else None,
        "compression": getattr(m, "compression", None),
        "incremental": ({"block_bytes": m.block_bytes, "base": m.base, "chain": m.chain,
                         "referenced_files": [f.path for f in m.files if f.path.startswith("../")]}
                        if getattr(m, "block_bytes", None) else None),
        "quantized": dict(getattr(m, "quantized", {}) or {}),
        "tool_version": m.tool_version,
        "save_id": m.save_id,
        "created": m.created,
        "world_size": m.world_size,
        "layout": m.layout,
        "tensors": tensors,
        "objects": objects,
        "files": files,
        "totals": {
            "tensors": len(m.tensors), "boxes": sum(t.box_count for t in all_tensors),
            "tensor_bytes": sum(t.nbytes for t in all_tensors),
            "objects": len(objects), "object_bytes": sum(o["bytes"] for o in objects),
            "files": len(files), "file_bytes": sum(f["bytes"] for f in files),
        },
    }
    if filters:
        doc["filters"] = list(filters)
        doc["totals"]["matched"] = len(tensors)
        doc["totals"]["matched_bytes"] = sum(t["bytes"] for t in tensors)
    return doc


# ---------------------------------------------------------------------- the tree of names
def name_tree(tensors: list[dict]) -> dict:
    """The tensors (rows of `describe`) as a tree of their name parts split at "/" and ".":
    {"name", "path", "tensors", "bytes", "children"}; a leaf is {"name", "path", "shape", "dtype",
    "bytes"}. A group with a single sub-group is merged with it ("model/layers"), so chains of
    one-child levels take one line, and a group holding a single tensor becomes that tensor
    ("lm_head.weight"). Children keep the manifest's order. A name is split at its first
    MAX_TREE_DEPTH separators only."""
    root: dict = {"name": "", "path": "", "tensors": 0, "bytes": 0, "children": {}}
    for t in tensors:
        parts = re.split(r"([/.])", t["name"], maxsplit=MAX_TREE_DEPTH)   # ["model", "/", "layers", ".", "0", ...]
        node = root
        for i in range(0, len(parts) - 1, 2):
            node["tensors"] += 1
            node["bytes"] += t["bytes"]
            path = "".join(parts[:i + 1])
            node = node["children"].setdefault(parts[i] + parts[i + 1],
                                               {"name": parts[i] + parts[i + 1], "path": path, "tensors": 0,
                                                "bytes": 0, "children": {}})
        node["tensors"] += 1
        node["bytes"] += t["bytes"]
        leaf = {"name": parts[-1], "path": t["name"], "shape": t["shape"], "dtype": t["dtype"], "bytes": t["bytes"]}
        node["children"][parts[-1] + "\0leaf"] = leaf   # a leaf never merges with a group of the same name
    return _finish(root)


def _finish(node: dict) -> dict:
    if "children" not in node:
        return node
    kids = [_finish(c) for c in node["children"].values()]
    # merge a group whose only child is a group: "model/" + "layers." -> "model/layers."
    while node["name"] and len(kids) == 1 and "children" in kids[0]:
        only = kids[0]
        node = {**node, "name": node["name"] + only["name"], "path": only["path"]}
        kids = only["children"]
    if node["name"] and len(kids) == 1:   # one tensor in a group: "lm_head.weight" on one line
        return {**kids[0], "name": node["name"] + kids[0]["name"]}
    out = {k: v for k, v in node.items() if k != "children"}
    out["name"] = out["name"].rstrip("/.") if out["name"] else out["name"]
    out["children"] = kids
    return out


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


# ---------------------------------------------------------------------- short reprs of values
class _ShortRepr(reprlib.Repr):
    """reprlib with tensors and arrays shown by dtype and shape unless they are tiny."""

    def __init__(self):
        super().__init__()
        self.maxstring = self.maxother = 60
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdict = 8
        self.maxlevel = 4

    def repr_Tensor(self, x, level):
        dtype = str(x.dtype).removeprefix("torch.")
        if x.numel() <= 6:
            return f"tensor({x.tolist()}, {dtype})"
        return f"tensor({dtype}, shape={list(x.shape)})"

    def repr_ndarray(self, x, level):
        if x.size <= 6:
            return f"array({x.tolist()}, {x.dtype})"
        return f"array({x.dtype}, shape={list(x.shape)})"


_SHORT = _ShortRepr()


def short_repr(value: Any, limit: int = TEXT_REPR_LIMIT) -> str:
    """A one-line repr of `value`, at most `limit` characters (containers and strings elided
    with "...")."""
    return _clip(" ".join(_SHORT.repr(value).split()), limit)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ---------------------------------------------------------------------- text output
def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


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


def table(header: tuple[str, ...], rows: list[tuple], right: set[int]) -> list[str]:
    """Aligned text columns (those in `right` right-aligned), two spaces of indent."""
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in cells]


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
            lines.append(f"  incremental (chain {inc['chain']}, compared with {inc['base'] or 'the checkpoint it replaced'}"
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
        value = (_clip(reprs[0]["repr"], TEXT_REPR_LIMIT) + (f"  (+{len(reprs) - 1} other values)" if len(reprs) > 1
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
