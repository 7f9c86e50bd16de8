"""The `omnickpt` command line: inspect, verify, compare, convert checkpoints and read save reports.

    omnickpt inspect PATH [--json] [--boxes] [--filter GLOB]... [--tree] [--no-values]
                                                what the checkpoint holds (manifest and object values)
    omnickpt verify PATH [--json] [--workers N] completeness and every checksum; exit 1 on a problem
    omnickpt diff A B [--atol X] [--rtol Y] [--include GLOB]... [--exclude GLOB]... [--all] [--json]
                                                what differs between two checkpoints; exit 1 when they differ
    omnickpt convert SRC DST --to hf|dcp|deepspeed|omnickpt [--key K] [--dtype D [--allow-lossy-cast]]
                     [--max-shard-size S] [--transform T]... [--mapping MODULE:FUNCTION]
                     [--optimizer-key K] [--tag T] [--overwrite]   (the last three: deepspeed only)
                                                write a checkpoint in another format (never over existing files,
                                                never inside SRC)
    omnickpt report PATH [--json] [--png FILE] [--trace FILE]
                                                per-rank, per-phase timings of the save that wrote PATH
    omnickpt clear-memory JOB [--json]          free a job's memory-tier checkpoints on this machine
    omnickpt --version

Every command reads any format omnickpt reads (its own, Hugging Face and DCP folders). Exit
status: 0 when all is well, 1 when a checkpoint is missing, not committed or damaged (or, for
diff, when the two differ), 2 for a usage error.

Each command is a library function (omnickpt.describe, verify, diff, read_report, convert.convert,
clear_memory); this package parses the arguments, prints (the text of each command in its module:
cli/inspect.py, verify.py, diff.py, report.py) and chooses the exit status.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from omnickpt.errors import CheckpointError, NotCommittedError


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _non_negative(text: str) -> float:
    x = float(text)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return x


def _size(text: str) -> int:
    from omnickpt.convert import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype(text: str) -> str:
    """A floating-point dtype as the command line spells it: a torch name (bfloat16, float16, float32) or a
    usual short one (bf16, fp16, half, fp32, float): the spellings omnickpt.reader.as_dtype takes."""
    from omnickpt.reader import as_dtype
    try:
        dtype = as_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not dtype.is_floating_point:
        raise argparse.ArgumentTypeError(f"{text!r} is {dtype}, not a floating-point dtype; use bfloat16 (bf16), "
                                         "float16 (fp16, half) or float32 (fp32, float)")
    return str(dtype).removeprefix("torch.")


def _transform(text: str):
    from omnickpt.convert import parse_transform
    try:
        return parse_transform(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _progress(args) -> bool:
    return not args.no_progress and sys.stderr.isatty()


def _parser() -> argparse.ArgumentParser:
    from omnickpt.version import __version__
    p = argparse.ArgumentParser(prog="omnickpt", description="Inspect, verify, compare and convert checkpoints.")
    p.add_argument("--version", action="version", version=f"omnickpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ins = sub.add_parser("inspect", help="list tensors, objects, files and the saved layout of a checkpoint",
                         description="List what a checkpoint holds: tensors from its manifest (no tensor data is "
                                     "read), object values decoded safely (never unpickled), the saved layout.")
    ins.add_argument("path", metavar="PATH", help="checkpoint directory (the one holding manifest.json, or a "
                                                  "Hugging Face / DCP folder)")
    ins.add_argument("--json", action="store_true", help="print a JSON document for scripts")
    ins.add_argument("--boxes", action="store_true", help="with --json: list every saved box of every tensor")
    ins.add_argument("--filter", action="append", default=[], metavar="GLOB",
                     help="list only tensors whose name matches this fnmatch pattern (repeatable: any may match), "
                          "e.g. 'model/layers.0.*'")
    ins.add_argument("--tree", action="store_true", help="group tensor names by their '/' and '.' parts, with sizes")
    ins.add_argument("--no-values", action="store_true", help="do not read and show object values")
    ver = sub.add_parser("verify", help="check that every data file is there and every checksum matches",
                         description="Check completeness and every box's and object's CRC32C. Exit status 1 "
                                     "on any problem, one line per problem naming the file and tensor.")
    ver.add_argument("path", metavar="PATH", help="checkpoint directory (the one holding manifest.json)")
    ver.add_argument("--json", action="store_true", help="print the result as JSON")
    ver.add_argument("--workers", type=_positive, default=None, metavar="N",
                     help="reader threads (default: 2 per core, at most 8)")
    dif = sub.add_parser("diff", help="compare two checkpoints: tensors, shapes, dtypes, values, objects",
                         description="Compare two checkpoints of any formats omnickpt reads: tensors only in one, "
                                     "shape and dtype differences, the largest absolute and relative difference of "
                                     "each tensor's values (relative to B; streamed in slabs), objects by value. "
                                     "Exit status 1 when they differ beyond --atol/--rtol (|a-b| <= atol + rtol*|b|).")
    dif.add_argument("a", metavar="A", help="first checkpoint")
    dif.add_argument("b", metavar="B", help="second checkpoint (the reference of relative differences)")
    dif.add_argument("--atol", type=_non_negative, default=0.0, metavar="X", help="absolute tolerance (default 0)")
    dif.add_argument("--rtol", type=_non_negative, default=0.0, metavar="Y", help="relative tolerance (default 0)")
    dif.add_argument("--include", action="append", default=[], metavar="GLOB",
                     help="compare only what this pattern selects (repeatable: any may match), as load's include=: "
                          "a state key ('model'), a name under it, or an fnmatch pattern ('model/layers.0.*')")
    dif.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                     help="leave out what this pattern selects (repeatable), e.g. 'optimizer' against a Hugging Face "
                          "export, which holds the model only")
    dif.add_argument("--all", action="store_true", help="list identical tensors and objects too")
    dif.add_argument("--json", action="store_true", help="print the comparison as JSON")
    dif.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal)")
    con = sub.add_parser("convert", help="write a checkpoint in another format (hf, dcp, deepspeed, omnickpt)",
                         description="Write SRC (any format omnickpt reads) as a new checkpoint DST: a Hugging Face "
                                     "safetensors folder (hf), PyTorch DCP (dcp), a DeepSpeed universal checkpoint "
                                     "(deepspeed: a model and its Adam state, for engine.load_checkpoint with "
                                     "load_universal) or omnickpt. DST must not exist or be empty (deepspeed: hold "
                                     "no latest, latest_universal or the tag, unless --overwrite). Transforms are "
                                     "written as Python calls of omnickpt.transforms with literal arguments (parsed, "
                                     "never evaluated), e.g. --transform "
                                     "'Rename({\"decoder.layers.*.mlp.fc1.weight\": \"layers.*.fc1.weight\"})' "
                                     "or --transform 'Rename.regex(\"^model/module\\\\.\", \"model/\")'.")
    con.add_argument("src", metavar="SRC", help="the checkpoint to convert")
    con.add_argument("dst", metavar="DST", help="where to write it (must not exist, or be empty)")
    con.add_argument("--to", required=True, choices=("hf", "dcp", "deepspeed", "omnickpt"),
                     help="the format to write")
    con.add_argument("--key", metavar="KEY",
                     help="only this state key's tensors (hf: the entry exported as the model, never an optimizer's; "
                          "default: the only entry holding a model's tensors, else 'model'; '.' for the tensors "
                          "saved at the top level of the state, a flat model {'layer.weight': ...})")
    con.add_argument("--dtype", type=_dtype, metavar="DTYPE",
                     help="cast floating-point tensors: bfloat16 (bf16), float16 (fp16, half), float32 (fp32, "
                          "float), float64 (fp64, double)")
    con.add_argument("--allow-lossy-cast", action="store_true",
                     help="with --dtype: cast even where finite values become inf or non-zero values become 0 "
                          "(refused by default, naming the tensor); the result lists the counts per tensor")
    con.add_argument("--max-shard-size", type=_size, metavar="SIZE",
                     help="largest data file: bytes or 500MB, 5GB, 2GiB (hf default 5GB; omnickpt default 1GiB, "
                          "about twice that is held in memory)")
    con.add_argument("--transform", type=_transform, action="append", default=[], metavar="CALL",
                     help="a declared transform applied first (repeatable, in order), e.g. "
                          "'SplitFused(\"mlp.fc1.weight\", into=[\"mlp.gate.weight\", \"mlp.up.weight\"])'")
    con.add_argument("--mapping", metavar="MODULE:FUNCTION",
                     help="hf only: make the folder's tensors with this function {name: tensor} -> {hf name: tensor}, "
                          "e.g. one wrapping torchtitan's StateDictAdapter.to_hf (renames and permutes q/k rows), "
                          "called on one layer's tensors at a time. It is IMPORTED, which runs that module's code "
                          "(the current directory is on the import path): name only code you trust")
    con.add_argument("--optimizer-key", metavar="KEY",
                     help="deepspeed only: the state key of the optimizer (default: the entry holding one; --key "
                          "names the model's)")
    con.add_argument("--tag", metavar="TAG", help="deepspeed only: the tag folder to write (default global_step<N>)")
    con.add_argument("--overwrite", action="store_true",
                     help="deepspeed only: replace the DeepSpeed checkpoint DST holds (its latest pointers and a tag "
                          "of the same name; the old tag is removed once the new one is complete)")
    con.add_argument("--json", action="store_true", help="print the result as JSON")
    con.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal)")
    rep = sub.add_parser("report", help="per-rank, per-phase timings of the save that wrote a checkpoint",
                         description="Show the save report (report.json) of a checkpoint, or a report saved to a "
                                     "JSON file: per-rank phase seconds, the slowest phase and rank; draw a "
                                     "per-rank timeline (--png) or write a Chrome/Perfetto trace (--trace).")
    rep.add_argument("path", metavar="PATH", help="checkpoint directory, or a report JSON file")
    rep.add_argument("--json", action="store_true", help="print the summary as JSON")
    rep.add_argument("--png", metavar="FILE", help="draw the per-rank timeline to this PNG file (needs matplotlib)")
    rep.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (traceEvents JSON) to FILE")
    clr = sub.add_parser("clear-memory", help="free a job's memory-tier checkpoints from this machine's shared memory",
                         description="Remove the shared-memory checkpoints of CheckpointManager(memory='shm://JOB') "
                                     "on this machine (after the job is gone and its durable copy is safe).")
    clr.add_argument("job", metavar="JOB", help="the job name given as memory='shm://JOB'")
    clr.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "diff":
            return _diff(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "report":
            return _report(args)
        if args.command == "clear-memory":
            from omnickpt.storage.shm import clear_memory
            freed = clear_memory(args.job)
            print(json.dumps({"job": args.job, "freed_bytes": freed}) if args.json
                  else f"freed {freed} bytes of shared memory of job {args.job}")
            return 0
        return _verify(args)
    except NotCommittedError as e:
        print(f"omnickpt {args.command}: {e}", file=sys.stderr)
        return 1
    except CheckpointError as e:
        print(f"omnickpt {args.command}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:   # `omnickpt inspect ... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return 0


def _inspect(args) -> int:
    from omnickpt.cli.inspect import format_text
    from omnickpt.contents import describe
    doc = describe(args.path, boxes=args.boxes, filters=args.filter, tree=args.tree, values=not args.no_values)
    print(json.dumps(doc, indent=2) if args.json else format_text(doc))
    return 0


def _diff(args) -> int:
    from omnickpt.cli.diff import format_text
    from omnickpt.compare import diff
    if "" in args.include + args.exclude:
        print("omnickpt diff: --include and --exclude take a non-empty pattern, e.g. 'model' or 'optim/*'",
              file=sys.stderr)
        return 2
    report = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, progress=_progress(args),
                  include=args.include, exclude=args.exclude)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_text(report, show_all=args.all))
    return 1 if report.differs else 0


def _convert(args) -> int:
    from omnickpt.convert import convert
    result = convert(args.src, args.dst, to=args.to, key=args.key, dtype=args.dtype,
                     max_shard_size=args.max_shard_size, transforms=args.transform, progress=_progress(args),
                     allow_lossy_cast=args.allow_lossy_cast, mapping=args.mapping,
                     optimizer_key=args.optimizer_key, tag=args.tag, overwrite=args.overwrite)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        # an hf export lists its files by name: counted here, as the other targets count theirs
        details = ", ".join(f"{k} {len(v) if isinstance(v, list) else v}"
                            for k in ("tag", "params", "tensors", "objects", "files", "bytes")
                            if (v := result.get(k)) is not None)
        # which entry an hf export wrote: the exporter picks it when --key is not given
        source = f" from {result['entry']}" if result.get("entry") else ""
        print(f"converted {args.src} -> {result['path']} ({args.to}){source}" + (f": {details}" if details else "")
              + (f" in {result['seconds']:.2f} s" if isinstance(result.get("seconds"), float) else ""))
        for line in _convert_notes(result, args.to):
            print(f"note: {line}")
    return 0


def _convert_notes(result: dict, to: str) -> list[str]:
    """What the conversion lost or carried over lossy, one line per kind and tensor."""
    lines = []
    lossy = result.get("lossy") or {}
    if lossy:
        schemes = ", ".join(sorted({r["scheme"] for r in lossy.values()}))
        worst = max(r["max_error"] for r in lossy.values())
        kept = ("recorded in the new manifest" if to == "omnickpt"
                else f"the {to} format cannot record this: the copy reads as exact")
        lines.append(f"{len(lossy)} tensor(s) are lossy copies (quantized {schemes} by the source's save, largest "
                     f"error {worst:.3g}); {kept}")
    for name, c in sorted((result.get("lossy_casts") or {}).items()):
        lines.append(f"{name}: the cast turned {c['overflow']} finite value(s) into inf and {c['flush']} non-zero "
                     "value(s) into 0")
    return lines


def _report(args) -> int:
    from omnickpt.cli.report import format_text
    from omnickpt.monitor.report import draw_png, summary, write_trace
    from omnickpt.reader import read_report
    report = read_report(args.path)
    doc = summary(report)
    if args.png:
        draw_png(report, args.png)
    if args.trace:
        write_trace(report, args.trace)
    print(json.dumps(doc, indent=2) if args.json else format_text(doc))
    if not args.json:
        for what, path in (("timeline", args.png), ("trace", args.trace)):
            if path:
                print(f"{what} written to {path}")
    return 0


def _verify(args) -> int:
    from omnickpt.cli.verify import format_text
    from omnickpt.integrity import verify
    report = verify(args.path, workers=args.workers)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(format_text(report))
        if not report.ok:
            print(f"FAILED {report.path}: {len(report.problems)} problem(s)", file=sys.stderr)
    return 0 if report.ok else 1


__all__ = ["main"]
