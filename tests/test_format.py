"""The on-storage format: manifest round trip and validation, safe object encoding, checksums."""
from __future__ import annotations

import collections
import copy
import dataclasses
import json
import math
import random

import numpy as np
import pytest
import torch

from omnickpt.adapters.rng import RNGState
from omnickpt.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedError
from omnickpt.format import (CHUNK_BYTES, FORMAT_VERSION, MAGIC, ColumnTable, Sums, FileEntry, Manifest, ObjectEntry, SavedBox, ShardRef, TensorEntry, checksum,
                             decode_object, dtype_from_name, dtype_name, encode_object)
from omnickpt.format.checksum import checksum as crc32c_of
from omnickpt.format.manifest import _PRELUDE, WindowBox
from omnickpt.format.records import table_span
from omnickpt.format.objects import _NDARRAY, _PICKLE

import msgpack


# ---------------------------------------------------------------------------------------- manifest
def _manifest() -> Manifest:
    files = [FileEntry("data/abc-r00000.bin", 0, 4096), FileEntry("data/abc-r00001.bin", 1, 2048)]
    tensors = {
        "model/w": TensorEntry((4, 6), "float32", [
            SavedBox.stored((0, 0), (2, 6), 0, 0, 48, [123]),
            SavedBox.stored((2, 0), (2, 6), 1, 0, 48, [456])]),
        "model/b": TensorEntry((6,), "bfloat16", [SavedBox.stored((0,), (6,), 0, 64, 12, [7])]),
        "optim/state/w/step": TensorEntry((), "float32", [SavedBox.stored((), (), 0, 128, 4, [8])]),
        "empty": TensorEntry((0, 3), "int64", []),
    }
    objects = {"rng": [ObjectEntry([0], 0, 192, 100, 9), ObjectEntry([1], 1, 64, 100, 10)],
               "extra": [ObjectEntry([0, 1], 0, 320, 30, 11)]}
    return Manifest(save_id="abc", world_size=2, files=files, tensors=tensors, objects=objects,
                    layout={"world_size": 2, "frameworks": {"model": "fsdp2"}, "mesh": [2]},
                    tool_version="0.1.0", created=1700000000.25)


def test_manifest_round_trip_is_exact():
    m = _manifest()
    raw = m.encode()
    assert raw[:8] == MAGIC and FORMAT_VERSION == 3
    back = Manifest.decode(raw)
    assert back == m
    assert back.object_for_rank("rng", 1).checksum == 10
    assert back.object_for_rank("rng", 5).ranks == [0]     # a rank that did not save gets rank 0's value
    c = back.tensors["model/w"].columns
    assert c.offsets.tolist() == [[0, 0], [2, 0]] and c.nbytes.tolist() == [48, 48] and c.crcs.tolist() == [123, 456]


def test_version_2_json_manifests_still_round_trip():
    m = dataclasses.replace(_manifest(), version=2)
    raw = m.encode()
    doc = json.loads(raw)   # plain JSON: any tool can read it, nothing needs to be executed
    assert doc["format"] == "omnickpt" and doc["version"] == 2 and doc["checksum"] == "crc32c"
    back = Manifest.decode(raw)
    assert back == m and back.version == 2


def _doc() -> dict:
    return json.loads(dataclasses.replace(_manifest(), version=2).encode())


def _decode(doc) -> Manifest:
    return Manifest.decode(json.dumps(doc).encode(), where="ckpt/manifest.json")


MALFORMED = {
    "wrong format name": (lambda d: d.update(format="safetensors"), "not an omnickpt manifest"),
    "newer version": (lambda d: d.update(version=FORMAT_VERSION + 1), "upgrade omnickpt"),
    "version 3 as JSON": (lambda d: d.update(version=3), "must be binary"),
    "missing files": (lambda d: d.pop("files"), "malformed manifest"),
    "box outside shape": (lambda d: d["tensors"]["model/w"]["boxes"][1].__setitem__(0, [3, 0]), "outside its shape"),
    "box of wrong rank": (lambda d: d["tensors"]["model/w"]["boxes"][0].__setitem__(0, [0]), "outside its shape"),
    "box byte count": (lambda d: d["tensors"]["model/w"]["boxes"][0].__setitem__(4, 47), "inconsistent box"),
    "box file index": (lambda d: d["tensors"]["model/w"]["boxes"][0].__setitem__(2, 2), "inconsistent box"),
    "box negative offset": (lambda d: d["tensors"]["model/w"]["boxes"][0].__setitem__(3, -1), "inconsistent box"),
    "box beyond its file": (lambda d: d["tensors"]["model/w"]["boxes"][1].__setitem__(3, 2040), "inconsistent box"),
    "box record too short": (lambda d: d["tensors"]["model/w"]["boxes"][0].pop(), "malformed manifest"),
    "unknown dtype": (lambda d: d["tensors"]["model/b"].update(dtype="os.system"), "unknown dtype"),
    "dtype not a string": (lambda d: d["tensors"]["model/b"].update(dtype=["float32"]), "unknown dtype"),
    "negative dimension": (lambda d: d["tensors"]["empty"].update(shape=[-1, 3]), "negative dimension"),
    "object without ranks": (lambda d: d["objects"]["extra"][0].update(ranks=[]), "inconsistent record"),
    "object file index": (lambda d: d["objects"]["extra"][0].update(file=9), "inconsistent record"),
    "object beyond its file": (lambda d: d["objects"]["extra"][0].update(nbytes=5000), "inconsistent record"),
    "file size negative": (lambda d: d["files"][0].update(bytes=-1), "inconsistent record"),
    "non-numeric shape": (lambda d: d["tensors"]["model/w"].update(shape=["a", 6]), "malformed manifest"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifests_are_rejected_with_the_reason(case):
    edit, reason = MALFORMED[case]
    doc = _doc()
    edit(doc)
    with pytest.raises(CorruptCheckpointError, match=reason) as info:
        _decode(doc)
    assert "ckpt/manifest.json" in str(info.value)     # names the file


@pytest.mark.parametrize("raw", [b"", b"{not json", b"\xff\xfe", b"[1, 2]", b"null", b'"manifest"'])
def test_manifest_that_is_not_a_json_object_is_corrupt(raw):
    with pytest.raises(CorruptCheckpointError, match="ckpt/manifest.json"):
        Manifest.decode(raw, where="ckpt/manifest.json")


@pytest.mark.parametrize("path", ["../outside.bin", "data/../../outside.bin", "/etc/passwd", "..", "data/./x.bin",
                                  "data//x.bin", "C:/x.bin", "data\\..\\x.bin", "", "data/x\x00.bin"])
def test_data_file_paths_that_could_escape_the_checkpoint_are_unsafe(path):
    doc = _doc()
    doc["files"][1]["path"] = path
    with pytest.raises(UnsafeCheckpointError):
        _decode(doc)


@pytest.mark.parametrize("path", ["data/abc-r00001.bin", "..data/x.bin", "x.bin", "data/sub/x..bin"])
def test_ordinary_data_file_paths_are_accepted(path):
    doc = _doc()
    doc["files"][1]["path"] = path
    assert _decode(doc).files[1].path == path


def test_version_1_json_manifests_still_decode_with_one_crc_per_box():
    doc = _doc()
    doc["version"] = 1
    del doc["chunk_bytes"]
    for t in doc["tensors"].values():
        for b in t["boxes"]:
            b[5] = b[5][0]     # version 1: one CRC of the whole box
    m = _decode(doc)
    box = m.tensors["model/w"].boxes[1]
    assert m.version == 1 and box.checksum == 456 and box.sums.size == 48
    c = m.tensors["model/w"].columns
    assert c.crcs.tolist() == [123, 456] and c.sums(0) == m.tensors["model/w"].boxes[0].sums and c.sums(1) == box.sums


# Version 3: a prelude (magic, version, header bytes, array bytes, crc32c), the JSON header, the arrays.
def _v3_split(raw: bytes):
    _, version, head_len, _, _, _ = _PRELUDE.unpack_from(raw)
    head = json.loads(raw[_PRELUDE.size:_PRELUDE.size + head_len])
    arrays = {k: np.frombuffer(raw, dtype=spec["dtype"], count=spec["count"],
                               offset=_PRELUDE.size + head_len + spec["offset"]).copy()
              for k, spec in head["arrays"].items()}
    return version, head, arrays


def _v3_pack(version, head, arrays, reseal=True) -> bytes:
    """A hostile writer: any header and arrays, with a checksum that matches them."""
    blobs, pos = [], 0
    override = head.pop("_override", None)
    for k, a in arrays.items():
        if k in head["arrays"]:
            head["arrays"][k].update(dtype=a.dtype.str, count=int(a.size), offset=pos)
        blob = a.tobytes() + bytes(-a.nbytes % 8)
        blobs.append(blob)
        pos += len(blob)
    if override:
        head["arrays"][override[0]].update(override[1])
    h = json.dumps(head).encode()
    h += b" " * (-(len(h) + _PRELUDE.size) % 8)
    body = h + b"".join(blobs)
    return _PRELUDE.pack(MAGIC, version, len(h), pos, crc32c_of(body) if reseal else 0, 0) + body


def test_v3_is_a_compact_binary_header_plus_columns():
    raw = _manifest().encode()
    version, head, arrays = _v3_split(raw)
    assert version == 3 and head["version"] == 3 and head["format"] == "omnickpt"
    assert head["tensors"]["model/w"] == {"shape": [4, 6], "dtype": "float32", "boxes": 2, "chunks": 2}
    assert arrays["offsets"].tolist() == [0, 0, 2, 0, 0] and arrays["crcs"].tolist() == [123, 456, 7, 8]
    assert arrays["offsets"].dtype == np.uint8          # narrow integers where they fit
    assert Manifest.decode(_v3_pack(version, head, arrays)) == _manifest()


def _hostile(edit):
    version, head, arrays = _v3_split(_manifest().encode())
    out = edit(head, arrays)
    version = out if type(out) is int else version
    return _v3_pack(version, head, arrays)


def _set(arrays, key, i, value):
    arrays[key] = arrays[key].astype("<i8")
    arrays[key][i] = value


HOSTILE_V3 = {
    "box outside shape": (lambda h, a: _set(a, "offsets", 2, 3), "outside its shape"),
    "boxes overlap": (lambda h, a: _set(a, "offsets", 2, 1), "overlap"),
    "negative offset": (lambda h, a: _set(a, "offset", 0, -8), "outside the 2 data files"),
    "file index": (lambda h, a: _set(a, "file", 1, 2), "outside the 2 data files"),
    "offset that overflows": (lambda h, a: _set(a, "offset", 1, (1 << 63) - 8), "outside the 2 data files"),
    "box that overflows": (lambda h, a: _set(a, "offsets", 2, (1 << 63) - 1), "outside its shape"),
    "huge shape": (lambda h, a: h["tensors"]["model/w"].update(shape=[1 << 31, 1 << 31]), "impossible shape"),
    "beyond its file": (lambda h, a: _set(a, "offset", 1, 2040), "outside the 2 data files"),
    "more boxes than rows": (lambda h, a: h["tensors"]["model/w"].update(boxes=3), "tensor index needs"),
    "chunk count": (lambda h, a: (h["tensors"]["model/w"].update(chunks=3), a.update(
        crcs=np.array([1, 2, 3, 4, 5], dtype="<u4")))[0], "declares 3 chunk checksums"),
    "array dtype": (lambda h, a: a.update(file=a["file"].astype("<f8")), "no valid description"),
    "array outside": (lambda h, a: h.update(_override=("crcs", {"offset": 1 << 40})), "lies outside"),
    "crcs not u4": (lambda h, a: a.update(crcs=a["crcs"].astype("<i8")), "no valid description"),
    "missing array": (lambda h, a: h["arrays"].pop("lengths"), "no valid description"),
    "tensor index": (lambda h, a: h["tensors"].update({"model/b": [6]}), "no valid index record"),
    # the checksummed header agrees with the prelude: a real newer version (a prelude alone saying so is damage)
    "newer version": (lambda h, a: (h.update(version=FORMAT_VERSION + 1), FORMAT_VERSION + 1)[1], "upgrade omnickpt"),
    "damaged version field": (lambda h, a: FORMAT_VERSION + 1, "version field is damaged"),
    "header says v2": (lambda h, a: h.update(version=2), "version-2 manifest must be JSON"),
    "unsafe path": (lambda h, a: h["files"][0].update(path="../x.bin"), "escapes"),
    "unknown dtype": (lambda h, a: h["tensors"]["model/b"].update(dtype="object"), "unknown dtype"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_V3))
def test_v3_hostile_fields_are_refused_naming_the_file(case):
    edit, reason = HOSTILE_V3[case]
    raw = _hostile(edit)
    error = UnsafeCheckpointError if case == "unsafe path" else CorruptCheckpointError
    with pytest.raises(error, match=reason) as info:
        Manifest.decode(raw, where="ckpt/manifest.json")
    assert "ckpt/manifest.json" in str(info.value)


@pytest.mark.parametrize("shape, reason", [([4.0, 6], "shape"), ([True, 6], "shape"), ([-4, 6], "impossible shape"),
                                           ([[4], 6], "shape")])
def test_v3_a_bad_shape_after_many_good_ones_of_its_look_is_refused(shape, reason):
    # Records of one (dtype, shape) are checked once and the rest looked up: a later record whose
    # shape only compares equal ([4.0, 6], [True, 6]) or differs must still be checked in full.
    m = _manifest()
    for i in range(5):
        m.tensors[f"model/w{i}"] = TensorEntry((4, 6), "float32", [SavedBox.stored((0, 0), (4, 6), 0, 512 + 96 * i,
                                                                                    96, [i])])
    version, head, arrays = _v3_split(m.encode())
    assert Manifest.decode(_v3_pack(version, head, arrays)).tensors["model/w4"].shape == (4, 6)
    head["tensors"]["model/w4"]["shape"] = shape
    with pytest.raises(CorruptCheckpointError, match=reason) as info:
        Manifest.decode(_v3_pack(version, head, arrays), where="ckpt/manifest.json")
    assert "model/w4" in str(info.value) and "ckpt/manifest.json" in str(info.value)


@pytest.mark.parametrize("cut", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_v3_truncated_anywhere_is_corrupt(cut):
    raw = _manifest().encode()
    n = max(len(MAGIC), int(len(raw) * cut))
    with pytest.raises(CorruptCheckpointError, match="ckpt/manifest.json.*(truncated|too short)"):
        Manifest.decode(raw[:n], where="ckpt/manifest.json")


def test_v3_any_flipped_byte_is_caught_by_its_checksum():
    raw = bytearray(_manifest().encode())
    for i in range(_PRELUDE.size, len(raw), 7):
        bad = bytearray(raw)
        bad[i] ^= 0x10
        with pytest.raises(CorruptCheckpointError, match="checksum does not match"):
            Manifest.decode(bytes(bad), where="ckpt/manifest.json")


def test_v3_decodes_only_the_named_tensors_and_makes_boxes_on_first_use():
    # model/w's rows are damaged: a reader that wants only model/b never looks at them.
    raw = _hostile(lambda h, a: _set(a, "file", 1, 2))
    with pytest.raises(CorruptCheckpointError):
        Manifest.decode(raw)
    m = Manifest.decode(raw, names=["model/b", "optim/state/w/step", "not/there"])
    assert sorted(m.tensors) == ["model/b", "optim/state/w/step"]
    entry = m.tensors["model/b"]
    assert entry._boxes is None and entry._load is not None      # nothing made per box yet
    assert entry.box_count == 1 and entry._boxes is None
    assert entry.boxes == _manifest().tensors["model/b"].boxes
    whole = Manifest.decode(_manifest().encode())
    assert all(t._boxes is None for t in whole.tensors.values())
    assert whole.tensors["model/w"].nbytes == 96 and whole.tensors["model/w"]._boxes is None


@pytest.mark.parametrize("layout", ["rows", "columns", "shuffled", "grid"])
def test_v3_checks_overlaps_of_many_boxes_in_bulk(layout):
    # 96 boxes of a (96, 96) tensor: disjoint they decode, and moving one box by one element
    # (onto its neighbour) is refused whichever path (bulk or per tensor) checks the layout.
    n = 96
    if layout == "grid":
        boxes = [((8 * i, 8 * j), (8, 8)) for i in range(12) for j in range(8)]
        shape = (96, 64)
    else:
        boxes = [((i, 0), (1, n)) if layout != "columns" else ((0, i), (n, 1)) for i in range(n)]
        shape = (n, n)
        if layout == "shuffled":
            random.Random(3).shuffle(boxes)
    def manifest(bxs):
        sb = [SavedBox.stored(o, ln, 0, 4096 * k, math.prod(ln) * 4, [k]) for k, (o, ln) in enumerate(bxs)]
        return Manifest("x", 1, [FileEntry("data/x.bin", 0, 4096 * len(bxs))], {"t": TensorEntry(shape, "float32", sb)},
                        {})
    assert Manifest.decode(manifest(boxes).encode()).tensors["t"].box_count == len(boxes)
    (o0, o1), ln = boxes[5]
    boxes[5] = ((o0, o1 + 1) if layout == "columns" else (o0 + 1, o1), ln)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        Manifest.decode(manifest(boxes).encode())


def test_entries_built_from_boxes_and_from_columns_agree():
    for name, t in _manifest().tensors.items():
        c = t.columns
        back = TensorEntry(t.shape, t.dtype, columns=c)
        assert back == t and back.boxes == t.boxes and back.nbytes == t.nbytes, name
    # A transform's derived box (a window of a stored box) has no row: the entry stays object-based.
    w = WindowBox((0, 0), (2, 3), 0, 0, 48, Sums(0, 48, CHUNK_BYTES, (1,)), base_lengths=(2, 6), base_start=(0, 0))
    assert TensorEntry((2, 3), "float32", [w]).columns is None


def test_a_million_boxes_round_trip_in_columns():
    n = 1_000_000
    rows = np.arange(n, dtype=np.int64)
    table = ColumnTable(offsets=np.stack([rows, np.zeros(n, dtype=np.int64)], 1),
                        lengths=np.ones((n, 2), dtype=np.int64), file=rows % 3, offset=(rows // 3) * 64,
                        nbytes=np.full(n, 4, dtype=np.int64), sums_start=np.arange(n + 1, dtype=np.int64),
                        crcs=(rows * 2654435761 % (1 << 32)).astype(np.uint32))
    files = [FileEntry(f"data/x-r{r:05d}.bin", r, (n // 3 + 1) * 64) for r in range(3)]
    m = Manifest(save_id="x", world_size=3, files=files, tensors={"t": table.entry((n, 1), "float32", 0, n)},
                 objects={})
    back = Manifest.decode(m.encode())
    c = back.tensors["t"].columns
    assert len(c) == n and (c.offsets[:, 0] == rows).all() and (c.crcs == table.crcs).all()
    assert (c.offset == table.offset).all() and (c.file == table.file).all()


def _table_manifest(order=None, compression=None, quantized=None):
    """A manifest as a save builds it: every tensor's rows of one ColumnTable (padded to 3 dims),
    tensors of rank 0 to 3, one without boxes, several boxes and chunks per tensor."""
    specs = [("step", (), 1), ("bias", (8,), 2), ("empty", (0, 4), 0), ("w", (6, 4), 3), ("cube", (2, 3, 4), 2)]
    offs, lens, nbytes, counts, entries, row = [], [], [], [], [], 0
    for name, shape, n in specs:
        for i in range(n):
            lead = shape[0] // n if shape else 1
            o = [i * lead] + [0] * (len(shape) - 1) if shape else []
            ln = [lead] + list(shape[1:]) if shape else []
            offs.append(o + [0] * (3 - len(o)))
            lens.append(ln + [0] * (3 - len(ln)))
            nb = 4 * math.prod(ln) if shape else 4
            nbytes.append(nb)
            counts.append(-(-nb // 16))
        entries.append((name, shape, row, row + n))
        row += n
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    k = int(starts[-1])
    table = ColumnTable(offsets=np.array(offs, dtype=np.int64), lengths=np.array(lens, dtype=np.int64),
                        file=np.arange(row, dtype=np.int64) % 2, offset=np.cumsum([0] + nbytes[:-1]).astype(np.int64),
                        nbytes=np.array(nbytes, dtype=np.int64), sums_start=starts,
                        crcs=(np.arange(k) * 2654435761 % (1 << 32)).astype(np.uint32), chunk_bytes=16,
                        stored=None if compression is None else np.arange(1, k + 1, dtype=np.int64), codec=compression)
    quantized = quantized or {}
    tensors = {name: table.entry(shape, "float32", a, b, quantized.get(name, {}).get("scheme"))
               for name, shape, a, b in ([entries[i] for i in order] if order else entries)}
    files = [FileEntry(f"data/x-r{r:05d}.bin", r, 1000) for r in range(2)]
    return Manifest(save_id="x", world_size=2, files=files, tensors=tensors, objects={}, chunk_bytes=16,
                    compression=compression, quantized=quantized, created=1.0)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_saves_table_encodes_in_bulk_to_the_bytes_of_its_entries_one_by_one(compression):
    bulk = _table_manifest(compression=compression)
    assert table_span(list(bulk.tensors.values())) is not None
    one_by_one = _table_manifest(compression=compression)
    for t in one_by_one.tensors.values():
        t.columns   # decoded: no longer the table's rows, so encoded tensor by tensor
    assert table_span(list(one_by_one.tensors.values())) is None
    data = bulk.encode()
    assert data == one_by_one.encode()
    back = Manifest.decode(data)
    for name, t in _table_manifest(compression=compression).tensors.items():
        assert back.tensors[name] == t, name
    # Entries not in the table's row order are encoded one by one, to the same manifest.
    shuffled = _table_manifest(order=[3, 0, 4, 2, 1], compression=compression)
    assert table_span(list(shuffled.tensors.values())) is None
    assert Manifest.decode(shuffled.encode()).tensors == back.tensors


def test_a_saves_table_with_a_codec_the_manifest_does_not_name_is_refused_in_bulk_too():
    m = _table_manifest(compression="zstd", quantized={"w": {"scheme": "int8", "max_error": 0.5}})
    assert Manifest.decode(m.encode()).quantized["w"]["scheme"] == "int8"
    m.quantized = {}
    with pytest.raises(ValueError, match="tensor 'w': its boxes are stored with compression 'int8'"):
        m.encode()


def test_every_supported_dtype_has_a_stable_name():
    for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
               torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
               torch.float8_e5m2):
        assert dtype_from_name(dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(CorruptCheckpointError, match="unknown dtype"):
        dtype_from_name("FloatTensor")


class _CountingStorage:
    """A LocalStorage that records every ranged read: (offset, bytes)."""

    def __init__(self, root):
        from omnickpt.storage import LocalStorage
        self._st, self.reads = LocalStorage(str(root)), []

    def read_into(self, rel, offset, buffers):
        self.reads.append((offset, sum(len(b) for b in buffers)))
        self._st.read_into(rel, offset, buffers)

    def __getattr__(self, name):
        return getattr(self._st, name)


def test_read_header_reads_only_the_prelude_and_the_header(tmp_path):
    from omnickpt.format import read_header
    from omnickpt.format.v3 import PRELUDE, prelude
    m = _manifest()
    m.tensors["big"] = TensorEntry((4096, 8), "float32", [
        SavedBox.stored((i, 0), (1, 8), 0, 0, 32, [i]) for i in range(4096)])
    m.files[0].bytes = 1 << 20
    raw = m.encode()
    (tmp_path / "manifest.json").write_bytes(raw)
    st = _CountingStorage(tmp_path)
    header = read_header(st, "manifest.json")
    p = prelude(raw)
    assert st.reads == [(0, PRELUDE.size), (PRELUDE.size, p.header_bytes)]    # never the arrays
    assert p.array_bytes > 8 * p.header_bytes
    assert header["save_id"] == "abc" and header["version"] == 3 and len(header["files"]) == 2
    assert header["tensors"]["big"]["boxes"] == 4096
    # a JSON manifest (versions 1, 2) has no header of its own
    (tmp_path / "manifest.json").write_bytes(dataclasses.replace(_manifest(), version=2).encode())
    assert read_header(st, "manifest.json") is None


@pytest.mark.parametrize("damage, said", [
    (lambda raw: b"", "empty"),
    (lambda raw: b"GARBAGE!" + raw[8:], "neither a version-3 prelude nor JSON"),
    (lambda raw: raw[:40], "truncated"),
    (lambda raw: raw[:8] + (7).to_bytes(4, "little") + raw[12:], "version 7"),
    (lambda raw: raw[:32] + b"[" + raw[33:], "unreadable"),
])
def test_read_header_refuses_what_it_cannot_read(tmp_path, damage, said):
    from omnickpt.format import read_header
    from omnickpt.storage import LocalStorage
    (tmp_path / "manifest.json").write_bytes(damage(_manifest().encode()))
    with pytest.raises(CorruptCheckpointError, match=said) as e:
        read_header(LocalStorage(str(tmp_path)), "manifest.json", where="ckpt", advice="do this")
    assert str(e.value).startswith("ckpt: ") and str(e.value).endswith("; do this")


# ----------------------------------------------------------------------------------------- objects
def _roundtrip(value, **kw):
    return decode_object(encode_object(value, **kw), **kw)


def test_rng_states_round_trip_and_restore_the_same_streams():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    sd = RNGState().state_dict()
    expected = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    back = _roundtrip(sd)
    # The python state is a tuple holding a tuple: types must survive for random.setstate().
    assert isinstance(back["python"], tuple) and isinstance(back["python"][1], tuple)
    assert isinstance(back["numpy"][1], np.ndarray) and back["numpy"][1].dtype == np.uint32
    assert back["torch"].dtype == torch.uint8 and torch.equal(back["torch"], sd["torch"])
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    RNGState().load_state_dict(back)
    assert torch.equal(torch.rand(4), expected[0])
    assert np.array_equal(np.random.rand(4), expected[1])
    assert [random.random() for _ in range(4)] == expected[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_tensors_of_every_dtype_round_trip_bit_exactly(dtype):
    base = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)) * 10
    t = base.to(dtype) if dtype is not torch.complex64 else torch.complex(base, -base)
    back = _roundtrip({"t": t, "scalar": t[1, 2], "empty": t[:0], "strided": t.t()})
    for key, want in {"t": t, "scalar": t[1, 2], "empty": t[:0], "strided": t.t()}.items():
        got = back[key]
        assert got.dtype == dtype and got.shape == want.shape, key
        # compare bytes: NaN-free equality for every dtype, bfloat16 and float8 included
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), key


def test_parameters_are_saved_as_plain_tensors():
    p = torch.nn.Parameter(torch.ones(2))
    back = _roundtrip(p)
    assert type(back) is torch.Tensor and torch.equal(back, torch.ones(2))


@pytest.mark.parametrize("arr", [
    np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(6, dtype=">i4"), np.array([True, False]),
    np.zeros((0, 2), dtype=np.int16), np.array(3.5), np.arange(10, dtype=np.uint64)[::3],
    np.array([1 + 2j], dtype=np.complex128)])
def test_numpy_arrays_round_trip(arr):
    back = _roundtrip(arr)
    assert isinstance(back, np.ndarray) and back.dtype == arr.dtype and back.shape == arr.shape
    assert np.array_equal(back, arr)
    back.flags.writeable = True     # a private copy, not a view of the checkpoint's bytes


def test_numpy_scalars_keep_their_type():
    for v in (np.float64(1.5), np.float32(2.5), np.int64(-3), np.uint8(7), np.bool_(True)):
        back = _roundtrip(v)
        assert type(back) is type(v) and back == v


def test_containers_keep_their_structure():
    value = {"t": (1, (2.5, "x"), [3, (4,)]), "s": {1, 2}, "od": collections.OrderedDict(a=1, b=[None, True]),
             "bytes": b"\x00\x01", "dtype": torch.bfloat16, "ref": ShardRef("model/w"), 7: "int key"}
    back = _roundtrip(value)
    assert back == {"t": (1, (2.5, "x"), [3, (4,)]), "s": {1, 2}, "od": {"a": 1, "b": [None, True]},
                    "bytes": b"\x00\x01", "dtype": torch.bfloat16, "ref": ShardRef("model/w"), 7: "int key"}
    assert isinstance(back["t"], tuple) and isinstance(back["t"][1], tuple) and isinstance(back["t"][2], list)
    assert back["od"]["b"][1] is True


class _Opaque:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, _Opaque) and other.x == self.x


def test_arbitrary_objects_need_pickle_opt_in_on_both_sides():
    with pytest.raises(UnsupportedError, match=r"sched.*_Opaque.*allow_pickle=True"):
        encode_object({"a": _Opaque(1)}, where="sched")
    with pytest.raises(UnsupportedError, match="allow_pickle"):
        encode_object(np.array([object()], dtype=object), where="sched")
    raw = encode_object({"a": _Opaque(1)}, allow_pickle=True, where="sched")
    with pytest.raises(UnsafeCheckpointError, match=r"sched.*pickle.*allow_pickle=True"):
        decode_object(raw, where="sched")
    assert decode_object(raw, allow_pickle=True) == {"a": _Opaque(1)}


def test_crafted_payloads_are_refused_without_executing_anything():
    # An object-dtype numpy payload would let numpy unpickle; an unknown extension is refused too.
    crafted = msgpack.ExtType(_NDARRAY, msgpack.packb(["|O", [1], b"\x00" * 8], use_bin_type=True))
    with pytest.raises(UnsafeCheckpointError, match="numpy dtype"):
        decode_object(msgpack.packb(crafted, use_bin_type=True))
    with pytest.raises(UnsafeCheckpointError, match="unknown extension"):
        decode_object(msgpack.packb(msgpack.ExtType(99, b""), use_bin_type=True))
    pickled = msgpack.packb(msgpack.ExtType(_PICKLE, b"cos\nsystem\n(S'true'\ntR."), use_bin_type=True)
    with pytest.raises(UnsafeCheckpointError):
        decode_object(pickled)


def test_encoding_does_not_alias_the_live_value():
    t = torch.zeros(3)
    raw = encode_object({"t": t})
    t += 1          # training goes on after the snapshot
    assert torch.equal(decode_object(raw)["t"], torch.zeros(3))


# --------------------------------------------------------------------------------------- checksums
def test_checksum_is_crc32c_and_can_be_fed_in_pieces():
    assert checksum(b"123456789") == 0xE3069283      # the CRC-32C check value (RFC 3720)
    data = bytes(range(256)) * 1000
    crc = 0
    for i in range(0, len(data), 777):
        crc = checksum(memoryview(data)[i:i + 777], crc)
    assert crc == checksum(data)
    assert checksum(b"") == 0
    damaged = bytearray(data)
    damaged[12345] ^= 1
    assert checksum(damaged) != checksum(data)


def test_manifest_deep_copy_equality_detects_a_changed_checksum():
    # The manifest's dataclasses compare by value: tools (diff, cache checks) rely on it.
    m = _manifest()
    m2 = copy.deepcopy(m)
    assert m2 == m
    b = m2.tensors["model/w"].boxes[0]
    b.sums = dataclasses.replace(b.sums, crcs=(b.sums.crcs[0] + 1,))
    assert m2 != m
