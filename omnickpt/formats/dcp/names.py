"""DCP's flat keys as omnickpt names (docs/dcp.md has the table): a module's state dict `model/<fqn>`, an
optimizer's state dict as omnickpt's optimizer adapter saves one (`<key>/state/<fqn>/<state key>` tensors and
one object with the param groups naming their parameters), any other entry as one object; a Megatron-core
`torch_dist` checkpoint's ShardedTensor keys as omnickpt's Megatron adapter names them."""
from __future__ import annotations

import math
import pickle
from typing import Any, Callable

from omnickpt.errors import CorruptCheckpointError, UnsupportedError
from omnickpt.format import SavedBox, ShardRef, TensorEntry
from omnickpt.format.manifest import dtype_name, overlap_problem
from omnickpt.formats.dcp.archive import _read_whole, _Windows
from omnickpt.formats.dcp.metadata import _Chunk, _DcpTensor, _Parsed
from omnickpt.formats.dcp.unpickle import _brief, _Budget, _size

_MEGATRON_OPTIMIZER = "optimizer.state."


# ---------------------------------------------------------------------- names
def _top_keys(parsed: _Parsed) -> set[str]:
    return {str(p[0]) for p in _paths(parsed).values()}


def _paths(parsed: _Parsed) -> dict[str, tuple]:
    """Each flat key's path in the state dict DCP was given: planner_data's, or (without it: a planner
    that did not flatten) the key itself as a top-level key."""
    return {fqn: parsed.paths.get(fqn, (fqn,)) for fqn in [*parsed.tensors, *parsed.values]}


def _megatron_entries(parsed: _Parsed, located: dict, values: dict, index: dict[str, int],
                      where: str) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """A Megatron torch_dist checkpoint's items, named as omnickpt's Megatron adapter names them.

    Its keys are Megatron's ShardedTensor keys, with no state key above them: tensors are the model's
    (`model/<key>`), except `optimizer.state.<state key>.<param key>` (`optimizer/state/<param key>/<state
    key>`); ShardedObjects (`<key>/shard_<offset>_<shape>`, e.g. extra states) are objects `model/<key>`, or
    `optimizer/<key>` for keys starting with "optimizer.". A tensor saved with a `flattened_range`
    (distributed-optimizer state) is stored as Megatron's "N-D flattened" reformulation, global shape
    [X // x, Y // y, ..., x * y * ...] with the original shape in `mcore_data`: each chunk, a flat range of
    one local block, becomes the boxes of that range in the original tensor (layout.flat_range_to_boxes).
    """
    tensors: dict[str, TensorEntry] = {}
    for fqn, t in parsed.tensors.items():
        name = _megatron_name(fqn)
        orig = _nd_reformulated_shape(parsed.mcore_data.get(fqn))
        if orig is None:
            tensors[name] = TensorEntry(t.shape, dtype_name(t.dtype), _chunk_boxes(t, located[fqn], index))
        else:
            tensors[name] = _unflattened(fqn, t, orig, located[fqn], index, where)
    objects = {f"{'optimizer' if fqn.startswith('optimizer.') else 'model'}/{fqn}": v for fqn, v in values.items()}
    return tensors, objects


def _megatron_name(fqn: str) -> str:
    """omnickpt's name for a Megatron tensor key: optimizer state under its parameter, all else the model's."""
    if fqn.startswith(_MEGATRON_OPTIMIZER):
        state_key, _, param = fqn[len(_MEGATRON_OPTIMIZER):].partition(".")
        if state_key and param:
            return f"optimizer/state/{param}/{state_key}"
    return f"model/{fqn}"


def _nd_reformulated_shape(mcore: Any) -> Any:
    """The original shape a tensor's `mcore_data` records when it was saved N-D flattened, else None (as yet
    unchecked: it comes from the metadata pickle)."""
    return mcore.get("nd_reformulated_orig_global_shape") if isinstance(mcore, dict) else None


def _chunk_boxes(t: _DcpTensor, located: list[tuple[_Chunk, int]], index: dict[str, int]) -> list[SavedBox]:
    """One box per stored chunk, at its located bytes; chunks with no elements store nothing and have none."""
    return [SavedBox(c.offsets, c.sizes, index[c.item.path], at, math.prod(c.sizes) * t.dtype.itemsize, None)
            for c, at in located if c.item is not None]


def _unflattened(fqn: str, t: _DcpTensor, orig: Any, located: list[tuple[_Chunk, int]], index: dict[str, int],
                 where: str) -> TensorEntry:
    """An N-D flattened Megatron tensor as its original shape, each chunk's flat range as boxes in it."""
    shape = _original_shape(fqn, t, orig, where)
    block = tuple(s // f for s, f in zip(shape, t.shape))
    boxes: list[SavedBox] = []
    for c, at in located:
        if c.item is not None:
            boxes += _block_range_boxes(fqn, c, at, block, t.dtype.itemsize, index, where)
    # The chunks were checked not to overlap in the flattened shape; checked again where they land.
    problem = overlap_problem(shape, boxes)
    if problem:
        raise CorruptCheckpointError(f"{where}: Megatron tensor {fqn!r}: {problem}; the metadata is damaged")
    return TensorEntry(shape, dtype_name(t.dtype), boxes)


def _original_shape(fqn: str, t: _DcpTensor, orig: Any, where: str) -> tuple[int, ...]:
    """`orig` as a shape that the stored shape [X // x, ..., x * y * ...] is a regular grid of."""
    try:
        shape = _size(orig)
    except pickle.UnpicklingError:
        shape = ()
    n = len(shape)
    if (not n or len(t.shape) != n + 1 or any(f < 1 or s % f for s, f in zip(shape, t.shape))
            or math.prod(s // f for s, f in zip(shape, t.shape)) != t.shape[n]):
        raise CorruptCheckpointError(
            f"{where}: Megatron tensor {fqn!r} is stored flattened as shape {list(t.shape)}, which is no regular "
            f"grid of its original shape {_brief.repr(orig)}; the checkpoint's metadata is damaged")
    return shape


def _block_range_boxes(fqn: str, c: _Chunk, at: int, block: tuple[int, ...], itemsize: int, index: dict[str, int],
                       where: str) -> list[SavedBox]:
    """The boxes of one chunk of an N-D flattened tensor: a flat range of one local block, whose bytes lie
    contiguously from `at`."""
    from omnickpt.layout import flat_range_to_boxes
    n = len(block)
    if any(size != 1 for size in c.sizes[:n]):
        raise CorruptCheckpointError(
            f"{where}: Megatron tensor {fqn!r}: chunk {list(c.offsets)}+{list(c.sizes)} spans several local "
            "blocks of a flattened tensor; the metadata is damaged")
    origin = tuple(o * b for o, b in zip(c.offsets[:n], block))
    boxes = []
    done = 0
    for box in flat_range_to_boxes(block, c.offsets[n], c.sizes[n]):
        offsets = tuple(o + b for o, b in zip(origin, box.offsets))
        boxes.append(SavedBox(offsets, box.lengths, index[c.item.path], at + done * itemsize,
                              box.numel * itemsize, None))
        done += box.numel
    return boxes


def _entries(paths: dict[str, tuple], parsed: _Parsed, located: dict, values: dict, index: dict[str, int],
             windows: _Windows, where: str, budget: _Budget) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """omnickpt's tensors and objects for the DCP items, top-level key by top-level key.

    - an optimizer (sub-paths `state/<fqn>/<k>` and `param_groups/<i>/<field>`, or flattened
      `state.<fqn>.<k>` and `param_groups.<fqn>.<field>`): tensors `<key>/state/<fqn>/<k>`, one object
      {"param_groups": [{..., "params": [fqn, ...]}], "state": {fqn: {k: non-tensor value}}};
    - a module (one level of names, tensors and `*_extra_state` values only): tensors `<key>/<name>`,
      its extra states as the object {name: value};
    - top-level tensors, when one of their names holds a "." or is a parameter an optimizer entry's state
      names (a model's state dict saved flat): the module "model" (unless the state dict has a "model" entry);
    - anything else: one object, the nested value rebuilt, its tensors read into it.
    """
    groups = _groups(paths, parsed, where)
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, Any] = {}

    def add_tensor(name: str, fqn: str) -> None:
        t = parsed.tensors[fqn]
        tensors[name] = TensorEntry(t.shape, dtype_name(t.dtype), _chunk_boxes(t, located[fqn], index))

    def leaf(fqn: str) -> Any:
        if fqn in values:
            return values[fqn]
        return _read_whole(fqn, parsed.tensors[fqn], located[fqn], windows, budget, where)

    for key, members in groups.items():
        optimizer = _optimizer_form([s for s, _ in members])
        if optimizer is not None:
            objects[key] = _optimizer(key, members, optimizer, parsed, leaf, add_tensor)
        elif _module_form(members, parsed):
            extra = _module(key, members, parsed, values, add_tensor)
            if extra:
                objects[key] = extra
        else:
            objects[key] = _nest([(s, leaf(f)) for s, f in members], key, where)
    return tensors, objects


def _as_saved_entries(paths: dict[str, tuple], parsed: _Parsed, located: dict, values: dict, index: dict[str, int],
                      where: str) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """The DCP items under the keys DCP saved them with, as omnickpt's generic adapter saves a nested
    value (what `omnickpt.dcp.load` reads, so that the state dict `dcp.load` accepts loads the folder):
    each top-level entry one object, the nested value rebuilt with a ShardRef where each tensor is, the
    tensor named by its path joined with "/" (`optimizer/state/fc.weight/exp_avg`); a tensor saved at
    the top level is a tensor of that name with no object. Nothing is read here: tensors stay boxes."""
    tensors: dict[str, TensorEntry] = {}
    groups: dict[str, list[tuple[tuple, Any]]] = {}
    for fqn, path in paths.items():
        top = str(path[0])
        if not top or "/" in top:
            raise UnsupportedError(f"{where}: the DCP state dict has a top-level key {top!r}; omnickpt state keys "
                                   "are non-empty and hold no '/'")
        if fqn in parsed.tensors:
            name = "/".join(str(p) for p in path)
            if name in tensors:
                raise UnsupportedError(f"{where}: DCP keys of two tensors both read as {name!r} (a key holding '/'); "
                                       "load this checkpoint with omnickpt.load into modules, or with dcp.load")
            t = parsed.tensors[fqn]
            tensors[name] = TensorEntry(t.shape, dtype_name(t.dtype), _chunk_boxes(t, located[fqn], index))
            if len(path) > 1:
                groups.setdefault(top, []).append((tuple(path[1:]), ShardRef(name)))
        else:
            groups.setdefault(top, []).append((tuple(path[1:]), values[fqn]))
    objects = {key: _nest(leaves, key, where) for key, leaves in groups.items()}
    return tensors, objects


def _groups(paths: dict[str, tuple], parsed: _Parsed, where: str) -> dict[str, list[tuple[tuple, str]]]:
    """The flat keys by top-level key (a flat model's under "model"), each as (sub-path, flat key)."""
    flat_model = _flat_model(paths, parsed)
    groups: dict[str, list[tuple[tuple, str]]] = {}
    for fqn, path in paths.items():
        top, sub = path[0], path[1:]
        if flat_model and not sub and (fqn in parsed.tensors or fqn.endswith("_extra_state")):
            top, sub = "model", (fqn,)
        groups.setdefault(str(top), []).append((sub, fqn))
    bad = next((k for k in groups if "/" in k or not k), None)
    if bad is not None:
        raise UnsupportedError(f"{where}: the DCP state dict has a top-level key {bad!r}; omnickpt state keys are "
                               "non-empty and hold no '/'")
    return groups


def _flat_model(paths: dict[str, tuple], parsed: _Parsed) -> bool:
    """Whether the top-level tensors are a model's state dict saved flat."""
    # A model's state dict saved flat (dcp.save(model.state_dict()), torchtitan) puts its tensors at the top
    # level: parameter names hold dots, or (a model with no submodules, an nn.Linear's "weight") are the names
    # the optimizer saved beside it keys its state by. Once one is, every top-level tensor is the model's;
    # otherwise an optimizer beside them would be the checkpoint's only entry with tensors.
    params = _optimizer_params(paths)
    return "model" not in {str(p[0]) for p in paths.values()} and any(
        len(p) == 1 and ("." in fqn or fqn in params) for fqn, p in paths.items() if fqn in parsed.tensors)


def _module(key: str, members: list[tuple[tuple, str]], parsed: _Parsed, values: dict,
            add_tensor: Callable[[str, str], None]) -> dict[str, Any]:
    """A module's tensors (through `add_tensor`), and its extra states, the object returned."""
    extra = {}
    for (name,), fqn in members:
        if fqn in parsed.tensors:
            add_tensor(f"{key}/{name}", fqn)
        else:
            extra[name] = values[fqn]
    return extra


def _optimizer_params(paths: dict[str, tuple]) -> set[str]:
    """The parameter names the state of the state dict's optimizer entries is keyed by."""
    subs: dict[str, list[tuple]] = {}
    for path in paths.values():
        subs.setdefault(str(path[0]), []).append(path[1:])
    names: set[str] = set()
    for members in subs.values():
        form = _optimizer_form(members)
        if form == "nested":
            names |= {s[1] for s in members if s[0] == "state"}
        elif form == "flat":
            names |= {s[0][len("state."):].rpartition(".")[0] for s in members if s[0].startswith("state.")}
    return names


def _module_form(members: list[tuple[tuple, str]], parsed: _Parsed) -> bool:
    """A module's state dict: one level of names, tensors and nothing else but `*_extra_state` values (all
    that nn.Module.state_dict holds). A dict that also holds other values is a plain value."""
    return (all(len(s) == 1 and isinstance(s[0], str) for s, _ in members)
            and any(f in parsed.tensors for _, f in members)
            and all(f in parsed.tensors or s[0].endswith("_extra_state") for s, f in members))


def _optimizer_form(subs: list[tuple]) -> str | None:
    """"nested" or "flat" when the sub-paths are those of get_optimizer_state_dict's output (nested, or
    with flatten_optimizer_state_dict=True), else None."""
    if not any(s and s[0] == "param_groups" or s and str(s[0]).startswith("param_groups.") for s in subs):
        return None
    if all(len(s) == 3 and s[0] in ("state", "param_groups") and isinstance(s[2], str)
           and isinstance(s[1], str if s[0] == "state" else int) for s in subs):
        return "nested"
    if all(len(s) == 1 and isinstance(s[0], str) and s[0].startswith(("state.", "param_groups.")) for s in subs):
        return "flat"
    return None


def _optimizer(key: str, members: list[tuple[tuple, str]], form: str, parsed: _Parsed, leaf: Callable[[str], Any],
               add_tensor: Callable[[str, str], None]) -> dict:
    """The object omnickpt's optimizer adapter saves, and its state tensors (through `add_tensor`)."""
    extra: dict[str, dict[str, Any]] = {}
    groups: dict[int, dict[str, Any]] = {}
    per_param: dict[str, dict[str, Any]] = {}    # flat form: each parameter's group fields
    for sub, fqn in members:
        if form == "nested":
            kind, owner, field = sub
        else:
            kind, _, rest = sub[0].partition(".")
            owner, _, field = rest.rpartition(".")
        if kind == "state":
            if fqn in parsed.tensors:
                add_tensor(f"{key}/state/{owner}/{field}", fqn)
            else:
                extra.setdefault(owner, {})[field] = leaf(fqn)
        elif form == "nested":
            groups.setdefault(owner, {})[field] = leaf(fqn)
        else:
            per_param.setdefault(owner, {})[field] = leaf(fqn)
    if form == "flat":
        # Flattened param groups repeat the group's fields per parameter: parameters with the same
        # fields are one group (two groups with identical fields cannot be told apart).
        merged: dict[str, dict[str, Any]] = {}
        for fqn, fields in per_param.items():
            sig = repr(sorted(fields.items()))
            merged.setdefault(sig, {**fields, "params": []})["params"].append(fqn)
        return {"param_groups": list(merged.values()), "state": extra}
    return {"param_groups": [groups[i] for i in sorted(groups)], "state": extra}


def _nest(leaves: list[tuple[tuple, Any]], key: str, where: str) -> Any:
    """The value DCP flattened into `leaves` (sub-path, value): dicts, and lists where the keys are indices."""
    if len(leaves) == 1 and not leaves[0][0]:
        return leaves[0][1]
    root: dict = {}
    for sub, value in leaves:
        if not sub:
            raise CorruptCheckpointError(f"{where}: state entry {key!r} is both a value and a container in the DCP "
                                         "metadata; the metadata is damaged")
        node = root
        for part in sub[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CorruptCheckpointError(f"{where}: state entry {key!r} has a value where a container is; the "
                                             "DCP metadata is damaged")
        node[sub[-1]] = value

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: lists(v) for k, v in node.items()}
        if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
            return [out[i] for i in range(len(out))]
        return out

    return lists(root)


