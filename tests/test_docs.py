"""The documentation's code runs and says what the code does: the README's Python examples run end to end
in a temporary folder, the docs/interop.md recipe that starts FSDP2 from a Hugging Face folder gives
`from_pretrained`'s loss on 2 gloo ranks, and docs/api.md is what scripts/api_docs.py writes from the
docstrings now."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from tests.dist import run_ranks

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(path: Path) -> list[tuple[str, str]]:
    """(the heading above it, its code) for each ```python block of a Markdown file, in order."""
    blocks, heading = [], ""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            blocks.append((heading, "\n".join(lines[i + 1:j]) + "\n"))
            i = j
        i += 1
    return blocks


# ---------------------------------------------------------------------------------------------- README

# README blocks that cannot run in one process without outside services or a sharded model, by a line
# they contain. Everything else runs, in order, in one namespace (later blocks use the Example's
# `state`, `manager`, `model`).
_NOT_RUN = {
    'framework="fsdp2"': "ByteCheckpoint's call shape names FSDP2, which needs a sharded model",
    "s3://my-bucket": "needs an S3 endpoint",
    "llama-hf-folder": "needs a Hugging Face model folder and a DCP checkpoint",
}

# What the README's prose leaves to the reader (`train_step()`, `steps`, `step`), made as small as can be.
_PRELUDE = """
steps = 12
step = 3
def train_step():
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_readme_python_examples_run(tmp_path, monkeypatch):
    blocks = python_blocks(ROOT / "README.md")
    run = [(h, code) for h, code in blocks if not any(marker in code for marker in _NOT_RUN)]
    # the Example, how often, smaller checkpoints, checkpoint at failure, omnickpt.open: a README block
    # that stops running (a new marker above) must be a decision, not an accident
    assert len(run) >= 5, [h for h, _ in run]
    namespace: dict = {"__name__": "__readme__"}
    for i, (heading, code) in enumerate(run):
        # Each block writes its own roots ("ckpt/run" again, with every=), as a reader trying it would:
        # in a folder of its own, except the blocks reading what the Example wrote.
        folder = tmp_path if i == 0 or "omnickpt.open(" in code else tmp_path / f"block{i}"
        folder.mkdir(exist_ok=True)
        monkeypatch.chdir(folder)
        if i == 1:
            exec(_PRELUDE, namespace)
        try:
            exec(compile(code, f"README.md block under '{heading}'", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"README.md: the Python block under '{heading}' fails: {e!r}\n{code}") from e
        if i == 0:
            # the Example's resume: steps 75 and 100 kept, state at step 100
            assert sorted(p.name for p in (tmp_path / "ckpt/run").iterdir() if p.name.startswith("global_")) == [
                "global_step_100", "global_step_75"]
            assert namespace["state"]["extra"]["step"] == 100


def test_readme_open_snippet_names_what_the_example_saved(tmp_path, monkeypatch):
    # The snippet reads the tensors and objects of the Example's own checkpoint: the names it asks for
    # are ones the Example saves (a Linear's `weight`, the `extra` dict's `step`).
    monkeypatch.chdir(tmp_path)
    example = python_blocks(ROOT / "README.md")[0][1]
    snippet = next(code for _, code in python_blocks(ROOT / "README.md") if "omnickpt.open(" in code)
    namespace: dict = {}
    exec(example, namespace)
    exec(snippet, namespace)
    model = namespace["model"]
    assert torch.equal(namespace["rows"], model.weight.detach()[:2])
    assert namespace["step"] == 100


def test_readme_states_the_every_rule_the_manager_follows(tmp_path):
    # README: "the first save() call of a manager saves ..., then every multiple of N, and any step N or
    # more steps after the last save".
    import omnickpt
    state = {"model": torch.nn.Linear(2, 2)}
    manager = omnickpt.CheckpointManager(tmp_path / "a", every=5)
    assert [s for s in range(1, 13) if manager.save(s, state) is not None] == [1, 5, 10]
    manager.wait()
    again = omnickpt.CheckpointManager(tmp_path / "a", every=5)           # a restarted job resumed at 12
    assert [s for s in range(13, 22) if again.save(s, state) is not None] == [13, 15, 20]
    sparse = omnickpt.CheckpointManager(tmp_path / "b", every=5)          # save() called every 3rd step
    assert [s for s in range(0, 30, 3) if sparse.save(s, state) is not None] == [0, 6, 12, 15, 21, 27]
    readme = (ROOT / "README.md").read_text()
    assert "first `save()` call" in readme and "at least N steps after" in readme


# ------------------------------------------------------------------------------ docs/interop.md recipe

def _tiny_llama(folder: Path, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    return model


def _batch() -> torch.Tensor:
    return torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))


def _run_recipe(rank: int, world_size: int, folder: str, code: str):
    os.chdir(folder)          # the recipe names its folder "llama-folder", relative
    namespace: dict = {"__name__": "__recipe__"}
    exec(compile(code, "docs/interop.md FSDP2 recipe", "exec"), namespace)
    model = namespace["model"]
    from torch.distributed.tensor import DTensor
    # before the forward: FSDP2 may keep the root's parameters unsharded after one
    unsharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    with torch.no_grad():
        loss = model(_batch(), labels=_batch()).loss
    return loss, unsharded


def test_interop_fsdp2_recipe_gives_from_pretrained_loss(tmp_path):
    from transformers import AutoModelForCausalLM
    _tiny_llama(tmp_path / "llama-folder")
    heading, code = next((h, c) for h, c in python_blocks(ROOT / "docs/interop.md")
                         if h == "Load a Hugging Face folder into any layout")
    assert "to_empty" in code and "init_device_mesh" in code
    results = run_ranks(2, _run_recipe, str(tmp_path), code)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "llama-folder")
    with torch.no_grad():
        expected = reference(_batch(), labels=_batch()).loss
    assert torch.isfinite(expected)
    for loss, unsharded in results:
        assert unsharded == []                          # the recipe did shard the model
        assert torch.equal(loss, expected), (loss, expected)


def test_interop_cast_on_load_from_a_bf16_folder(tmp_path):
    # docs/interop.md: a bf16 folder loads into a float32 model with cast=True (exactly: bf16 -> fp32)
    from transformers import AutoModelForCausalLM
    import omnickpt
    saved = _tiny_llama(tmp_path / "bf16", dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_config(saved.config, dtype=torch.float32)
    with pytest.raises(omnickpt.MismatchError, match="bfloat16"):
        omnickpt.load(tmp_path / "bf16", {"model": model})
    omnickpt.load(tmp_path / "bf16", {"model": model}, cast=True)
    for name, p in saved.state_dict().items():
        assert model.state_dict()[name].dtype == torch.float32
        assert torch.equal(model.state_dict()[name], p.float()), name


# ---------------------------------------------------------------------------------------- docs/api.md

def _api_docs():
    import importlib.util
    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts/api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date():
    # in this process (torch and the trainers are imported once): what `scripts/api_docs.py --check` does
    api_docs = _api_docs()
    previous = (ROOT / "docs/api.md").read_text()
    text, missing = api_docs.render(previous)
    assert missing == [], f"in the dev environment every documented module imports: {missing}"
    assert text == previous, "docs/api.md is out of date: run python scripts/api_docs.py"


def test_api_reference_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    api_docs = _api_docs()
    stale = tmp_path / "api.md"
    stale.write_text((ROOT / "docs/api.md").read_text().replace("Owns the I/O threads", "Owned the threads"))
    monkeypatch.setattr(api_docs, "OUTPUT", stale)
    monkeypatch.setattr(api_docs, "ROOT", tmp_path)
    assert api_docs.main(["--check"]) == 1
    assert "out of date (sections: omnickpt)" in capsys.readouterr().err


def test_api_reference_documents_every_public_name():
    import omnickpt
    text = (ROOT / "docs/api.md").read_text()
    headings = set(re.findall(r"^### `omnickpt\.([A-Za-z_]+)", text, flags=re.M))
    assert set(omnickpt.__all__) | {"open"} <= headings
