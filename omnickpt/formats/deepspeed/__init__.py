"""DeepSpeed checkpoints, read as our manifest: a ZeRO-0/1/2/3 tag saved by `engine.save_checkpoint` (fp32
or bf16), or a universal folder of `ds_to_universal`, loads into any parallel layout at any world size
(`omnickpt.load(tag_folder, {"model": m, "optimizer": o})`), and `inspect`, `verify`, `diff`, `open` and
`convert` read it. Writing one is `omnickpt.export.deepspeed`; saving a live engine is
`omnickpt.adapters.deepspeed`. docs/deepspeed.md has the user's side.

A tag holds `mp_rank_00_model_states.pt` (ZeRO-0/1/2: the module in the training dtype, `param_shapes`,
counters, client_state) or one `zero_pp_rank_R_mp_rank_00_model_states.pt` per rank (ZeRO-3, whose module
tensors are empty), and one `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt` per data-parallel rank
holding its flat fp32 partition(s) and the inner optimizer's state of them. Each file is one torch.save
archive. One module per idea:
- `unpickle`: DeepSpeed's pickles through a restricted unpickler (`_GLOBALS`: torch's tensor rebuilders,
  containers, DeepSpeed's LossScaler, ZeroStageEnum and fragment_address as inert records); any other
  global is UnsafeCheckpointError before it is looked up, and nothing of the checkpoint runs;
- `archive`: a file's data.pkl read from its head, and each tensor's bytes located inside the archive
  (stored entries only), so a flat partition is boxes at its bytes, never materialised;
- `zero`: the pure rules (zero_to_fp32's) by which parameters lie in the ranks' partitions;
- `reader`: finding the tag (`latest`; a `latest` naming an unfinished tag is refused by name), checking
  that every rank's file is there, and building the manifest.
DeepSpeed stores no checksums: boxes carry sums=None and a DeepSpeed checkpoint's bytes are not verified.
Model-parallel (mp_rank > 0) and pipeline (layer_*) checkpoints are refused by name.
"""
from __future__ import annotations

from omnickpt.formats.deepspeed.reader import LATEST, read_manifest

__all__ = ["LATEST", "read_manifest"]
