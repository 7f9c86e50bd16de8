"""The manifest: the one global metadata record of a checkpoint, written last and atomically.

Encoded as JSON (readable by any tool, no code execution). Boxes are stored as compact lists
because large checkpoints hold millions of them. `Manifest.decode` validates everything it reads:
a manifest is untrusted input.
"""
from __future__ import annotations

import json
import math
import posixpath
from dataclasses import dataclass, field
from typing import Any

import torch

from omnickpt.errors import CorruptCheckpointError, UnsafeCheckpointError

FORMAT_NAME = "omnickpt"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

# Only these dtypes are accepted from a manifest: a name is never resolved with getattr on
# arbitrary input.
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CorruptCheckpointError(f"dtype {dtype} is not supported by the omnickpt format")
    return name


def dtype_from_name(name: str, where: str = "manifest") -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"{where} names an unknown dtype {name!r}") from None


@dataclass
class SavedBox:
    """One stored box of a tensor: where its row-major bytes lie and their checksum."""
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: int          # index into Manifest.files
    offset: int        # byte offset in that file
    nbytes: int
    checksum: int | None   # crc32c of the nbytes bytes (None: a derived view, see transforms)

    def encode(self) -> list:
        return [list(self.offsets), list(self.lengths), self.file, self.offset, self.nbytes, self.checksum]


@dataclass
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    boxes: list[SavedBox] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.boxes)


@dataclass
class ObjectEntry:
    """A safely encoded non-tensor value; `ranks` lists every saving rank whose value it is."""
    ranks: list[int]
    file: int
    offset: int
    nbytes: int
    checksum: int

    def encode(self) -> dict:
        return {"ranks": self.ranks, "file": self.file, "offset": self.offset,
                "nbytes": self.nbytes, "checksum": self.checksum}


@dataclass
class FileEntry:
    path: str   # relative to the checkpoint directory, '/'-separated
    rank: int   # the rank that wrote it
    bytes: int


@dataclass
class Manifest:
    save_id: str
    world_size: int
    files: list[FileEntry]
    tensors: dict[str, TensorEntry]
    objects: dict[str, list[ObjectEntry]]
    layout: dict[str, Any] = field(default_factory=dict)
    tool_version: str = ""
    created: float = 0.0
    version: int = FORMAT_VERSION
    # True once a transform has rewritten it (omnickpt/transforms.py); never stored.
    derived: bool = False

    def object_for_rank(self, key: str, rank: int) -> ObjectEntry:
        """The value saved by `rank`, or else by the lowest saving rank (scale-up)."""
        entries = self.objects[key]
        for e in entries:
            if rank in e.ranks:
                return e
        return min(entries, key=lambda e: min(e.ranks))

    # -- encoding ---------------------------------------------------------------------------
    def encode(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "tool_version": self.tool_version,
            "save_id": self.save_id,
            "created": self.created,
            "world_size": self.world_size,
            "layout": self.layout,
            "checksum": "crc32c",
            "files": [{"path": f.path, "rank": f.rank, "bytes": f.bytes} for f in self.files],
            "tensors": {
                name: {"shape": list(t.shape), "dtype": t.dtype, "boxes": [b.encode() for b in t.boxes]}
                for name, t in self.tensors.items()
            },
            "objects": {k: [e.encode() for e in v] for k, v in self.objects.items()},
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes, where: str = "manifest") -> "Manifest":
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: not valid JSON ({e}); the manifest is damaged") from None
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(f"{where}: not an omnickpt manifest (a JSON {type(doc).__name__}, "
                                         "not an object); the manifest is damaged")
        try:
            return _decode(doc, where)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None


def safe_relative_path(path: str, where: str) -> str:
    """Reject any stored path that could point outside the checkpoint directory."""
    if not isinstance(path, str) or not path or "\\" in path or "\x00" in path:
        raise UnsafeCheckpointError(f"{where}: invalid data file path {path!r}")
    norm = posixpath.normpath(path)
    # ".." as a whole component only: "..data/x" is a legal name inside the checkpoint.
    if path.startswith("/") or norm == ".." or norm.startswith("../") or norm != path or ":" in path.split("/")[0]:
        raise UnsafeCheckpointError(
            f"{where}: data file path {path!r} escapes the checkpoint directory; refusing to load "
            "(a manifest may only name files inside its own checkpoint)")
    return path


def _decode(doc: dict, where: str) -> Manifest:
    if doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not an omnickpt manifest (format={doc.get('format')!r})")
    version = int(doc["version"])
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {version} is newer than this omnickpt reads ({FORMAT_VERSION}); "
            "upgrade omnickpt")
    files = [FileEntry(safe_relative_path(f["path"], where), int(f["rank"]), int(f["bytes"])) for f in doc["files"]]
    for f in files:
        if f.rank < 0 or f.bytes < 0:
            raise CorruptCheckpointError(f"{where}: data file {f.path!r} has an inconsistent record "
                                         f"(rank {f.rank}, {f.bytes} bytes)")
    tensors: dict[str, TensorEntry] = {}
    for name, t in doc["tensors"].items():
        shape = tuple(int(s) for s in t["shape"])
        if any(s < 0 for s in shape):
            raise CorruptCheckpointError(f"{where}: tensor {name!r} has a negative dimension in shape {list(shape)}")
        dtype = t["dtype"]
        itemsize = dtype_from_name(dtype, f"{where}: tensor {name!r}").itemsize
        boxes = []
        for raw in t["boxes"]:
            offs, lens, fi, off, nb, ck = raw
            box = SavedBox(tuple(int(x) for x in offs), tuple(int(x) for x in lens), int(fi), int(off), int(nb), int(ck))
            if (len(box.offsets) != len(shape) or len(box.lengths) != len(shape)
                    or any(o < 0 or l < 0 or o + l > s for o, l, s in zip(box.offsets, box.lengths, shape))):
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has a box {offs}+{lens} outside its shape {list(shape)}")
            if (box.nbytes != math.prod(box.lengths) * itemsize or not 0 <= box.file < len(files) or box.offset < 0
                    or box.offset + box.nbytes > files[box.file].bytes):
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has an inconsistent box record {raw}")
            boxes.append(box)
        tensors[name] = TensorEntry(shape, dtype, boxes)
    objects: dict[str, list[ObjectEntry]] = {}
    for key, entries in doc["objects"].items():
        objects[key] = []
        for e in entries:
            oe = ObjectEntry([int(r) for r in e["ranks"]], int(e["file"]), int(e["offset"]), int(e["nbytes"]), int(e["checksum"]))
            if (not 0 <= oe.file < len(files) or not oe.ranks or oe.offset < 0 or oe.nbytes < 0
                    or oe.offset + oe.nbytes > files[oe.file].bytes):
                raise CorruptCheckpointError(f"{where}: object {key!r} has an inconsistent record {e}")
            objects[key].append(oe)
    return Manifest(
        save_id=str(doc["save_id"]), world_size=int(doc["world_size"]), files=files, tensors=tensors,
        objects=objects, layout=dict(doc.get("layout") or {}), tool_version=str(doc.get("tool_version", "")),
        created=float(doc.get("created", 0.0)), version=version)
