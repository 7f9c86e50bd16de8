"""What a checkpoint holds, as plain JSON-ready data: `describe(path)` (the document `omnickpt inspect
--json` prints), its tree of names and short reprs of object values.

Tensors come from the manifest alone (no tensor byte is read); object values are read and decoded
safely (never unpickled) to show them. Text output is the command line's (omnickpt/cli/inspect.py).
"""
from __future__ import annotations

import fnmatch
import math
import re
import reprlib
from typing import Any, Sequence

from omnickpt.errors import CheckpointError, UnsafeCheckpointError
from omnickpt.format import Manifest, dtype_from_name
from omnickpt.reader import CheckpointReader

# Characters of an object value's repr kept in the document (the text table shows fewer).
REPR_LIMIT = 500
TEXT_REPR_LIMIT = 120
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
    tensors = [_tensor_entry(m, name, t, boxes) for name, t in m.tensors.items()
               if not filters or any(fnmatch.fnmatchcase(name, f) for f in filters)]
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
        "incremental": _incremental(m),
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


def _tensor_entry(m: Manifest, name: str, t, boxes: bool) -> dict:
    entry = {"name": name, "shape": list(t.shape), "dtype": t.dtype,
             "bytes": math.prod(t.shape) * dtype_from_name(t.dtype).itemsize,
             "stored_bytes": t.nbytes, "boxes": t.box_count}
    if boxes:
        entry["box_list"] = [{"offsets": list(b.offsets), "lengths": list(b.lengths),
                              "file": m.files[b.file].path if b.file >= 0 else None, "offset": b.offset,
                              "nbytes": b.nbytes, "checksums": list(b.sums.crcs) if b.sums else []}
                             for b in t.boxes]
    return entry


def _incremental(m: Manifest) -> dict | None:
    """An incremental checkpoint's chain and the files of earlier checkpoints it references."""
    if not getattr(m, "block_bytes", None):
        return None
    return {"block_bytes": m.block_bytes, "base": m.base, "chain": m.chain,
            "referenced_files": [f.path for f in m.files if f.path.startswith("../")]}


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
    return clip(" ".join(_SHORT.repr(value).split()), limit)


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, ending in "..." when cut."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


__all__ = ["describe", "describe_manifest", "name_tree", "short_repr", "clip"]
