"""PyTorch Distributed Checkpoint (DCP) folders, read as our manifest (so one loads into any parallel layout,
at any world size). Writing one is `omnickpt.export.dcp.export_dcp`.

A DCP folder written by `FileSystemWriter` holds `.metadata`, a pickle of DCP's `Metadata` (every
flattened state-dict key: a tensor's global shape, dtype and chunks, or a non-tensor value; where each
item lies: file, offset, length), and `__<rank>_<n>.distcp` files. Each item in a .distcp file is one
`torch.save` archive (a zip). A tensor chunk's archive stores its storage uncompressed
(`<archive>/data/<key>`), so once the archive's zip headers and its `data.pkl` are read, the chunk is
one box pointing straight at its raw row-major bytes, and loading is the same planned, parallel,
ranged reading and resharding as for our own checkpoints.

One module per idea:
- `unpickle`: the restricted unpicklers and bounded zip decoding. Nothing in the folder is trusted or
  executed: `.metadata` is unpickled by `_MetadataUnpickler`, which admits only DCP's metadata classes and
  turns even those into inert records (any other global is refused with UnsafeCheckpointError before it is
  looked up); a tensor's `data.pkl` by `_TensorPickle`, which records its storage key, offset, shape and
  strides instead of calling anything (both are Python's own unpickler: no memo table sized by the pickle,
  BUILD on records only); non-tensor values (DCP's BytesStorageMetadata items) and Megatron's common.pt are
  unzipped by `_unzip_bounded` (never past MAX_INLINE_BYTES, whatever the archive declares) and only then
  decoded with `torch.load(weights_only=True)`, and re-encoded with encode_object;
- `metadata`: the folder's file names and `.metadata`'s records, validated before any data file is read;
- `archive`: locating a tensor chunk's bytes inside its torch.save archive (the zipfile module, stored
  entries only, nothing decompressed), from windows of the data files read up front;
- `names`: DCP's flat keys as omnickpt names (docs/dcp.md has the table): `Metadata.planner_data` keeps
  each flat key's path; a module's state dict `model/<fqn>`, an optimizer's state dict from
  `get_optimizer_state_dict` as omnickpt's optimizer adapter saves one (`<key>/state/<fqn>/<state key>`
  tensors and one object with the param groups naming their parameters), any other entry as one object; a
  Megatron-core `torch_dist` checkpoint (DCP underneath, flat ShardedTensor keys) as omnickpt's Megatron
  adapter names them;
- `reader`: `read_manifest`.
DCP stores no checksums we can use (the zip's CRC-32 covers a whole chunk, so a ranged read cannot
check it): boxes carry `sums=None`, and the tensor bytes of a DCP checkpoint are not verified on load.
"""
from __future__ import annotations

from omnickpt.formats.dcp.metadata import DATA_SUFFIX, MEGATRON_COMMON, MEGATRON_METADATA, METADATA_NAME
from omnickpt.formats.dcp.reader import read_manifest
from omnickpt.formats.dcp.unpickle import _METADATA_GLOBALS, MAX_INLINE_BYTES  # noqa: F401  (tests read the table)


# Moved up to omnickpt.export (exporters sit above the readers). Resolving them here would import the
# layer above, so asking for one names its new home instead.
_MOVED = {"export_dcp": "omnickpt.export.dcp.export_dcp (omnickpt.export.export_dcp)",
          "EXPORT_CHUNK_BYTES": "omnickpt.export.dcp.EXPORT_CHUNK_BYTES"}


def __getattr__(name: str):
    if name in _MOVED:
        # ImportError, not AttributeError: `from omnickpt.formats.dcp import export_dcp` would replace an
        # AttributeError with a bare "cannot import name", losing where the name went.
        raise ImportError(f"{__name__}.{name} moved to {_MOVED[name]}", name=__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DATA_SUFFIX", "MAX_INLINE_BYTES", "MEGATRON_COMMON", "MEGATRON_METADATA", "METADATA_NAME", "read_manifest"]
