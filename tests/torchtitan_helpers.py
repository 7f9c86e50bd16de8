"""torchtitan's own training components, tiny, on CPU ranks, and a training loop that drives a checkpoint
manager exactly as torchtitan 0.3's Trainer.train() does (load(step=load_step); per step: forward,
backward, maybe_wait_for_staging(), optimizers.step(), lr_schedulers.step(), save(step, last_step)).

What replaces the Trainer's CUDA-only pieces (torchtitan's Trainer itself needs a CUDA device,
FlexAttention's backward and PREMUL_SUM reductions):
- the model is torchtitan's llama3 Decoder (Llama3Model, its fused-QKV attention with the state-dict
  hooks that split wqkv into wq/wk/wv, ComplexRoPE, RMSNorm) at dim 64, 2 layers, vocab 256, with
  torchtitan's ScaledDotProductAttention instead of FlexAttention (no CPU backward);
- FSDP2 is torchtitan's apply_fsdp_to_decoder over a 1-D CPU mesh (fp32 params and reductions);
  activation checkpointing is torchtitan's FullAC;
- optimizer, LR schedule: torchtitan's OptimizersContainer (default_adamw, for-loop) and
  LRSchedulersContainer (warmup 2, linear decay), as its llama3 debug config builds them;
- data: torchtitan's ParallelAwareDataloader over a synthetic stateful IterableDataset (its test
  data lives in git LFS) yielding a different token sequence per (sample, dp rank);
- train_state: an object with the Trainer's state_dict()/load_state_dict() ({"step", "ntokens_seen"}).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

DIM, HEADS, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 2, 256, 16, 2


def model_config():
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )
    layers = _build_llama3_layers(fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, hidden_dim=128,
                                  rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000,
                                                          scaling="llama"),
                                  attn_backend="flex")
    for layer in layers:   # FlexAttention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)))


class TokenDataset(IterableDataset):
    """Synthetic, stateful: sample i of dp rank r is seeded by (i, r)."""

    def __init__(self, dp_rank: int):
        self.dp_rank, self.index = dp_rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 * self.index + self.dp_rank)
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            self.index += 1
            yield tokens[:-1], tokens[1:]

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


class TrainState:
    """The Trainer's own entry in `states` ("train_state": the Trainer: step and ntokens_seen)."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class Job:
    """One trainer's components, built as torchtitan builds them, and its checkpointer."""

    def __init__(self, checkpoint_config, folder: str, *, seed: int = 0, ac: bool = False, steps: int = 6):
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.optimizer import LRSchedulersContainer
        from torchtitan.components.optimizer.optimizer import default_adamw
        from torchtitan.models.llama3 import Llama3StateDictAdapter
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cfg = model_config()
        torch.manual_seed(seed)
        model = cfg.build()
        model.init_weights() if hasattr(model, "init_weights") else None
        if ac:
            from torchtitan.distributed.activation_checkpoint import FullAC
            FullAC.Config().build().apply(model)
        if self.world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
            mesh = init_device_mesh("cpu", (self.world,), mesh_dim_names=("dp_shard",))
            apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                                  pp_enabled=False)
            from torch.distributed.fsdp import FSDPModule
            for m in model.modules():   # gloo has no PREMUL_SUM (torchtitan sets a divide factor of 1)
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        self.model = model
        optimizer_config = default_adamw(lr=8e-3)
        optimizer_config.implementation = "for-loop"   # "fused" is CUDA only
        self.optimizers = optimizer_config.build(model_parts=[model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                          min_lr_factor=0.0).build(optimizers=self.optimizers,
                                                                                   training_steps=steps)
        self.dataloader = ParallelAwareDataloader(TokenDataset(self.rank), dp_rank=self.rank,
                                                  dp_world_size=self.world, batch_size=BATCH)
        self.train_state = TrainState()
        self.steps = steps
        self.sd_adapter = Llama3StateDictAdapter(cfg, None)
        self.checkpointer = checkpoint_config.build(
            dataloader=self.dataloader, model_parts=[model], optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"train_state": self.train_state},
            sd_adapter=self.sd_adapter, base_folder=folder)

    def train(self, load_step: int = -1, stop_after: int | None = None) -> dict[int, float]:
        """Trainer.train(): load, then steps until `steps` (or `stop_after`: a job killed after that
        step's save). Returns {step: this rank's loss}; `self.at_load` holds full_params() right after
        the load."""
        self.at_load = self.full_params() if self.checkpointer.load(step=load_step) else None
        losses = {}
        it = iter(self.dataloader)
        while self.train_state.step < self.steps:
            self.train_state.step += 1
            step = self.train_state.step
            self.optimizers.zero_grad()
            inputs, labels = next(it)
            logits = self.model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            self.train_state.ntokens_seen += labels.numel()
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            losses[step] = loss.item()
            self.checkpointer.save(step, last_step=(step == self.steps))
            if stop_after is not None and step == stop_after:
                break
        return losses

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter and Adam moment, whole (all-gathered), by name."""
        out = {}
        for name, p in self.model.named_parameters():
            out[name.replace("_checkpoint_wrapped_module.", "")] = _full(p.detach())
        if not any(o.state for o in self.optimizers):   # state_dict() would make it (a zero-lr step)
            return out
        for key, v in self.optimizers.state_dict().items():
            if isinstance(v, torch.Tensor):
                out["optim." + key.replace("_checkpoint_wrapped_module.", "")] = _full(v)
        return out

    def close(self):
        self.checkpointer.close()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()

