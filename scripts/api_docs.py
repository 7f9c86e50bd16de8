#!/usr/bin/env python3
"""Write docs/api.md, the API reference, from the docstrings of omnickpt's public names.

    python scripts/api_docs.py           # rewrite docs/api.md
    python scripts/api_docs.py --check   # exit 1 (and say which sections) when docs/api.md is out of date

Public names: `omnickpt.__all__` (plus `omnickpt.open`), then each front door and integration module's
`__all__` (or, without one, the functions and classes it defines whose names do not start with `_`).
Each name gets its signature and its docstring; a class also gets its public methods and properties,
those defined in omnickpt's own classes (not a trainer base class's). The output depends on the source
only: the same tree writes the same file (memory addresses are dropped from default values). A module
that cannot be imported here (its trainer package is not installed) keeps its section of the existing
file, with a warning, so that regenerating in a smaller environment does not drop it; tests/test_docs.py
runs --check in the dev environment, where every module imports.

Only the standard library's `inspect`: the reference is one page of Markdown, which needs no site
generator, and the test can rebuild it anywhere the package imports.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "api.md"

# The modules documented, in this order, with one line saying what each is for.
MODULES = (
    ("omnickpt", "Saving and loading in a training job, reading and checking checkpoints, the errors."),
    ("omnickpt.dcp", "The DCP-shaped front door: `from omnickpt import dcp` in the place of "
                     "`import torch.distributed.checkpoint as dcp` ([dcp.md](dcp.md))."),
    ("omnickpt.integrations.torchtitan", "A checkpointer for torchtitan's `BaseCheckpointManager` seam "
                                         "([integrations/torchtitan.md](integrations/torchtitan.md))."),
    ("omnickpt.integrations.lightning", "Lightning strategies whose saves and loads go through omnickpt "
                                        "([integrations/lightning.md](integrations/lightning.md))."),
    ("omnickpt.integrations.hf_trainer", "A Hugging Face `Trainer` saving and resuming through omnickpt "
                                         "([integrations/hf_trainer.md](integrations/hf_trainer.md))."),
    ("omnickpt.integrations.deepspeed", "A live DeepSpeed engine's whole state through omnickpt "
                                        "([integrations/deepspeed.md](integrations/deepspeed.md), "
                                        "[deepspeed.md](deepspeed.md))."),
    ("omnickpt.export", "Writing other formats from any checkpoint omnickpt reads: Hugging Face, DCP, "
                        "DeepSpeed universal ([deepspeed_export.md](deepspeed_export.md))."),
)

HEADER = """# API reference

Generated from the docstrings by `python scripts/api_docs.py`; do not edit by hand (tests/test_docs.py
fails when this page and the docstrings disagree). The guides are [the README](../README.md) and the
pages beside this one.
"""

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def public_names(module) -> list[str]:
    """`__all__` in its own order, else what the module itself defines, sorted."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return sorted(n for n, v in vars(module).items()
                  if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
                  and getattr(v, "__module__", None) == module.__name__)


class _Source(str):
    """An annotation kept as source text (`from __future__ import annotations`), shown without quotes."""

    def __repr__(self) -> str:
        return str(self)


def signature(obj) -> str:
    """`(args) -> result` as inspect renders it, or "" where there is none (a builtin's)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    empty = inspect.Signature.empty
    sig = sig.replace(
        parameters=[p.replace(annotation=_Source(p.annotation)) if isinstance(p.annotation, str) else p
                    for p in sig.parameters.values()],
        return_annotation=(_Source(sig.return_annotation) if isinstance(sig.return_annotation, str)
                           else sig.return_annotation) if sig.return_annotation is not empty else empty)
    return _ADDRESS.sub("", str(sig))


def own_doc(obj) -> str:
    """The object's own docstring, cleaned; a class's or function's inherited one only when it comes
    from omnickpt (an Exception's or a trainer's text is not this API's contract)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not doc and inspect.isclass(obj):
        for base in obj.__mro__[1:]:
            if base.__module__.startswith("omnickpt") and base.__dict__.get("__doc__"):
                doc = base.__dict__["__doc__"]
                break
    return inspect.cleandoc(doc) if doc else ""


def members(cls) -> list[tuple[str, object]]:
    """A class's public methods and properties defined by omnickpt's classes in its MRO (nearest first)."""
    seen: dict[str, object] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("omnickpt"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value) or isinstance(value, property):
                seen[name] = value
    return sorted(seen.items())


def document(qualname: str, obj) -> list[str]:
    """The Markdown of one public name."""
    lines = [f"### `{qualname}`", ""]
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj) or callable(obj):
        kind = "class" if inspect.isclass(obj) else "def"
        lines += ["```python", f"{kind} {qualname.rsplit('.', 1)[1]}{signature(obj)}", "```", ""]
    else:
        lines += [f"A `{type(obj).__name__}`.", ""]
        return lines
    doc = own_doc(obj)
    lines += [doc, ""] if doc else []
    if inspect.isclass(obj):
        for name, member in members(obj):
            if isinstance(member, property):
                lines.append(f"- `{name}` (property)" + (f": {_first_line(own_doc(member.fget))}"
                                                          if member.fget is not None and own_doc(member.fget) else ""))
            else:
                doc = own_doc(member)
                lines.append(f"- `{name}{signature(member)}`" + (f": {_first_line(doc)}" if doc else ""))
        if lines[-1] != "":
            lines.append("")
    return lines


def _first_line(doc: str) -> str:
    """A docstring's first paragraph, on one line (a method's summary in its class's list)."""
    return " ".join(doc.split("\n\n", 1)[0].split())


def module_section(name: str, purpose: str, module) -> str:
    lines = [f"## `{name}`", "", purpose, ""]
    names = public_names(module)
    if name == "omnickpt":
        names = names + ["open"]     # kept out of __all__ (it would shadow the builtin under import *)
    for public in names:
        obj = getattr(module, public)
        if name == "omnickpt" and public == "open":
            lines += ["### `omnickpt.open`", "",
                      "`omnickpt.open(path)` is `omnickpt.CheckpointReader(path)`: the same class under the name "
                      "that reads as what it does (as `safetensors.safe_open`). See `omnickpt.CheckpointReader`.", ""]
            continue
        lines += document(f"{name}.{public}", obj)
    return "\n".join(lines).rstrip() + "\n"


def existing_sections(text: str) -> dict[str, str]:
    """The sections of a written docs/api.md by module name (to keep those not importable here)."""
    sections: dict[str, str] = {}
    parts = re.split(r"^(?=## `)", text, flags=re.M)
    for part in parts[1:]:
        match = re.match(r"## `([^`]+)`", part)
        if match:
            sections[match.group(1)] = part.rstrip() + "\n"
    return sections


def render(previous: str = "") -> tuple[str, list[str]]:
    """The whole page, and the modules that could not be imported (their old sections kept)."""
    sys.path.insert(0, str(ROOT))
    old = existing_sections(previous)
    sections, missing = [HEADER], []
    for name, purpose in MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
            if name in old:
                sections.append(old[name])
            continue
        sections.append(module_section(name, purpose, module))
    return "\n".join(sections), missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/api.md instead of writing it")
    args = parser.parse_args(argv)
    previous = OUTPUT.read_text() if OUTPUT.exists() else ""
    text, missing = render(previous)
    for m in missing:
        print(f"api_docs: not importable here, its section is kept as it was: {m}", file=sys.stderr)
    if args.check:
        if text == previous:
            return 0
        new, old = existing_sections(text), existing_sections(previous)
        stale = sorted(n for n in set(new) | set(old) if new.get(n) != old.get(n))
        print(f"{OUTPUT.relative_to(ROOT)} is out of date (sections: {', '.join(stale) or 'header'}): "
              "run python scripts/api_docs.py", file=sys.stderr)
        return 1
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}: {text.count(chr(10) + '### ')} names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
