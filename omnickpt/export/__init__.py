"""Exporters: a checkpoint of any format omnickpt reads, written in another format. They sit above the
readers (omnickpt.formats: readers only) and read their source through the checkpoint reader
(omnickpt.reader.CheckpointReader); omnickpt.convert calls them.

- `hf.py`: `export_hf`, a Hugging Face safetensors folder (one state entry: a model's weights);
- `mapping.py`: export_hf's `mapping=`, a model's own state-dict adapter (torchtitan's `to_hf`) applied
  per layer group (docs/hf_mapping.md);
- `dcp.py`: `export_dcp`, a PyTorch DCP folder that `dcp.load` reads at any world size;
- `deepspeed.py`: `export_deepspeed`, a DeepSpeed universal checkpoint (a model and its Adam state) that a
  DeepSpeed engine loads with load_universal at any data-parallel size and ZeRO stage (docs/deepspeed_export.md);
- `destination.py`: what every writer checks before writing (local, not the source, nothing it would
  write over) and how a failed export leaves the destination as it found it.
"""
from __future__ import annotations

from omnickpt.export.dcp import export_dcp
from omnickpt.export.deepspeed import export_deepspeed
from omnickpt.export.hf import export_hf

__all__ = ["export_dcp", "export_deepspeed", "export_hf"]
