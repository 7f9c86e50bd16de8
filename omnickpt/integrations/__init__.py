"""omnickpt inside the trainers people use: one module per trainer, each importing its trainer only
when imported itself (`import omnickpt` never imports torchtitan, lightning or transformers).

- `omnickpt.integrations.torchtitan`: a checkpoint manager for torchtitan's `BaseCheckpointManager` seam
- `omnickpt.integrations.lightning`: a Lightning strategy whose saves and loads go through omnickpt
- `omnickpt.integrations.hf_trainer`: a Hugging Face `Trainer` mixin saving and resuming through omnickpt
- `omnickpt.dcp` (not here: it is a front door, not an integration): `save`/`async_save`/`load` shaped as DCP's
"""
