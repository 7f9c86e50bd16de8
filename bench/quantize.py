"""Lossy quantization of optimizer state (save(quantize_optimizer="int8" | "fp8"), omnickpt/format/quant.py)
on a trained model: bytes on disk, save and load seconds, the error recorded per moment tensor, and
what a resume from the quantized checkpoint does to training; alone and with compression="bytesplit-zstd".

    .venv/bin/python bench/quantize.py                    # train 50 steps, resume 20
    .venv/bin/python bench/quantize.py --steps 200 --resume-steps 50 --runs 5

The model and data are bench/compression.py's (its _train): a small GPT (vocab 2048, dim 256, 4
layers, ~4.2 M parameters) trained --steps steps with Adam (lr 1e-3) on a synthetic corpus with
structure, so that exp_avg and exp_avg_sq have the distributions training gives them (Adam's state
is twice the weights: the part quantization shrinks).

Per configuration (plain, int8, fp8, each without and with bytesplit-zstd), --runs times: a sync,
durable omnickpt.save of {"model", "optimizer"} and a load of it into a copy of the model and its
optimizer; bytes of the data files, save and load seconds (medians). From the manifest
(`omnickpt.open(path).manifest.quantized`: {name: {"scheme", "max_error"}}), per quantized tensor
the recorded max_error divided by that tensor's max |value| (its own scale), the largest and the
median over the exp_avg tensors and over the exp_avg_sq tensors; the loaded moments are compared
with the originals to check that the recorded error is the real one (measured <= recorded), and the
weights and step counts must load bitwise exact. Why the error relative to max |value| is not the
whole story: a linear int8 grid rounds an element to 0 below half a step (absmax / 254 of its
256-element block), and exp_avg_sq, a square, spans twice the orders of magnitude of exp_avg, so an
element whose exp_avg_sq rounds to 0 can keep a non-zero exp_avg; Adam's next step there is then
~lr * m_hat / eps instead of ~lr. The first version of quant.py did exactly that (564 elements, one
step 9.6e3x too large; this benchmark found it); root blocks now prevent it. So per scheme also: how many exp_avg_sq elements > 0 load as 0 (and of them with
exp_avg != 0), and the largest bias-corrected step |m_hat / (sqrt(v_hat) + eps)| from the loaded
moments against the exact ones.

Effect on training: from the plain checkpoint (twice: the noise floor, 0 when training is
deterministic) and from each quantized one, a fresh copy of the model and optimizer is loaded and
trained --resume-steps more steps on the same fixed batches; reported: the final loss, its
difference relative to the resume from the exact checkpoint, the largest relative loss difference
over the resumed steps, and the largest weight difference after them relative to the weight's max
|value|. A quantized configuration with bytesplit-zstd loads the same values as without (the codec
is lossless; checked bitwise), so its resume is not repeated. Results to bench/out/quantize.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

CONFIGS = [(None, None), ("int8", None), ("fp8", None),
           (None, "bytesplit-zstd"), ("int8", "bytesplit-zstd"), ("fp8", "bytesplit-zstd")]


def _label(scheme, codec) -> str:
    return "+".join(x for x in (scheme or "plain", codec) if x)


def _batches(n: int, seed: int = 3):
    """n batches of compression.py's corpus (its successor table: the first draw of generator seed 1)."""
    import torch
    succ = torch.randint(0, 2048, (2048, 8), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = [torch.randint(0, 2048, (16,), generator=gen)]
        for _ in range(32):
            seq.append(succ[seq[-1], torch.randint(0, 8, (16,), generator=gen)])
        out.append(torch.stack(seq, 1))
    return out


def _copy(model, opt):
    """A separate model and Adam with the same values (what a load overwrites)."""
    import torch
    m = copy.deepcopy(model)
    o = torch.optim.Adam(m.parameters(), lr=1e-3)
    o.load_state_dict(copy.deepcopy(opt.state_dict()))
    return m, o


def _train_on(model, opt, batches) -> list[float]:
    import torch
    losses = []
    for idx in batches:
        out = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _moments(model, opt) -> dict:
    """Checkpoint name -> tensor of the optimizer's state ("optimizer/state/<param>/<key>")."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"optimizer/state/{names[id(p)]}/{k}": v for p, st in opt.state.items() for k, v in st.items()}


def _bits(t):
    import torch
    return t.detach().reshape(-1).view(torch.uint8) if t.dim() else t.detach().reshape(1).view(torch.uint8)


def _data_bytes(path: str) -> int:
    d = os.path.join(path, "data")
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def _errors(model, opt, lmodel, lopt, quantized: dict) -> dict:
    """Recorded and measured errors of the quantized tensors, relative to each tensor's max |value|;
    weights and step counts must be exact."""
    import torch
    for (n, p), (_, q) in zip(model.named_parameters(), lmodel.named_parameters()):
        assert torch.equal(_bits(p), _bits(q)), f"weight {n} did not load exact"
    orig, back = _moments(model, opt), _moments(lmodel, lopt)
    rows, worst_excess = {}, 0.0
    for name, t in orig.items():
        if name.endswith("/step") or not t.is_floating_point():
            assert torch.equal(_bits(t), _bits(back[name])), f"{name} did not load exact"
            continue
        if name not in quantized:
            assert torch.equal(_bits(t), _bits(back[name])), f"{name} is not quantized yet did not load exact"
            continue
        scale = t.abs().max().item()
        measured = (t.double() - back[name].double()).abs().max().item()
        recorded = quantized[name]["max_error"]
        worst_excess = max(worst_excess, measured - recorded)
        rows[name] = {"max_abs": scale, "recorded": recorded, "measured": measured,
                      "recorded_rel": recorded / scale if scale else 0.0}
    summary = {"tensors": len(rows), "measured_minus_recorded_max": worst_excess}
    for kind in ("exp_avg", "exp_avg_sq"):
        rel = [r["recorded_rel"] for n, r in rows.items() if n.endswith(f"/{kind}")]
        if not rel:
            continue
        worst = max((n for n in rows if n.endswith(f"/{kind}")), key=lambda n: rows[n]["recorded_rel"])
        summary[kind] = {"max_rel": max(rel), "median_rel": statistics.median(rel), "worst_tensor": worst}
    if quantized:
        summary["adam_step"] = _adam_steps(model, opt, orig, back)
    return {"summary": summary, "per_tensor": rows}


def _adam_steps(model, opt, orig: dict, back: dict) -> dict:
    """What the next Adam step would do with the loaded moments against the exact ones: the
    bias-corrected step direction m_hat / (sqrt(v_hat) + eps) (times lr, the change of a weight).
    An exp_avg_sq element that quantization rounds to 0 while its exp_avg stays non-zero gets a
    step of ~m_hat / eps instead of ~1."""
    (b1, b2), eps = opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]
    out = {"v_flushed": 0, "v_flushed_m_nonzero": 0, "max_step_exact": 0.0, "max_step_loaded": 0.0,
           "worst_tensor": None, "worst_growth": 0.0}
    for n, _ in model.named_parameters():
        key = f"optimizer/state/{n}"
        t = float(orig[f"{key}/step"])
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        m, v, mq, vq = (d[f"{key}/{k}"].double() for d in (orig, back) for k in ("exp_avg", "exp_avg_sq"))
        flushed = (v > 0) & (vq == 0)
        out["v_flushed"] += int(flushed.sum())
        out["v_flushed_m_nonzero"] += int((flushed & (mq != 0)).sum())
        step = ((m / c1) / ((v / c2).sqrt() + eps)).abs().max().item()
        stepq = ((mq / c1) / ((vq / c2).sqrt() + eps)).abs().max().item()
        out["max_step_exact"] = max(out["max_step_exact"], step)
        out["max_step_loaded"] = max(out["max_step_loaded"], stepq)
        if stepq / max(step, 1e-30) > out["worst_growth"]:
            out["worst_growth"], out["worst_tensor"] = stepq / max(step, 1e-30), n
    out["lr"] = opt.param_groups[0]["lr"]
    return out


def main(argv=None) -> int:
    import torch

    import omnickpt
    from compression import _train
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--resume-steps", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a new temporary folder)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    _, loss, model, opt = _train(args.steps)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(t.numel() * t.element_size() for n, t in _moments(model, opt).items() if not n.endswith("/step"))
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.0f} s (loss {loss:.3f}); weights "
          f"{weights / 1e6:.1f} MB, Adam moments {moments / 1e6:.1f} MB; {args.runs} runs")
    torch.manual_seed(0)
    batches = _batches(args.resume_steps)
    doc = {"steps": args.steps, "resume_steps": args.resume_steps, "runs": args.runs, "loss": loss,
           "weights_bytes": weights, "moment_bytes": moments, "results": {}}
    root = tempfile.mkdtemp(prefix="omnickpt-bench-quantize-", dir=args.dir)
    kept = {}    # label -> path of one checkpoint, for the resumes
    print(f"{'config':<20} {'MB on disk':>10} {'vs plain':>8} {'save s':>7} {'load s':>7} "
          f"{'exp_avg err max/med':>20} {'exp_avg_sq err max/med':>23}")
    try:
        loaded = {}
        for scheme, codec in CONFIGS:
            label = _label(scheme, codec)
            saves, loads, size, err = [], [], 0, None
            for run in range(args.runs):
                path = os.path.join(root, f"{label}-{run}")
                lmodel, lopt = _copy(model, opt)
                t = time.perf_counter()
                omnickpt.save(path, {"model": model, "optimizer": opt}, quantize_optimizer=scheme,
                              compression=codec).wait()
                saves.append(time.perf_counter() - t)
                size = _data_bytes(path)
                t = time.perf_counter()
                omnickpt.load(path, {"model": lmodel, "optimizer": lopt})
                loads.append(time.perf_counter() - t)
                if run == 0:
                    kept[label] = path
                    with omnickpt.open(path) as r:
                        quantized = dict(r.manifest.quantized)
                    err = _errors(model, opt, lmodel, lopt, quantized) if scheme else None
                    if scheme is None:
                        assert not quantized
                        _errors(model, opt, lmodel, lopt, {})   # everything exact
                    loaded[label] = {n: t.clone() for n, t in _moments(lmodel, lopt).items()}
                else:
                    shutil.rmtree(path)
            row = {"scheme": scheme, "compression": codec, "bytes_on_disk": size, "save_s": statistics.median(saves),
                   "load_s": statistics.median(loads), "saves_s": saves, "loads_s": loads}
            if err is not None:
                row["errors"] = err
            doc["results"][label] = row
            plain = doc["results"]["plain"]["bytes_on_disk"]
            e = (f"{err['summary']['exp_avg']['max_rel']:>9.2e}/{err['summary']['exp_avg']['median_rel']:<9.2e} "
                 f"{err['summary']['exp_avg_sq']['max_rel']:>11.2e}/{err['summary']['exp_avg_sq']['median_rel']:<9.2e}"
                 if err else f"{'exact':>20} {'exact':>23}")
            print(f"{label:<20} {size / 1e6:>10.2f} {size / plain:>8.3f} {row['save_s']:>7.3f} {row['load_s']:>7.3f} {e}")
            if codec and scheme:   # lossless codec: the same values as the scheme alone
                same = all(torch.equal(_bits(a), _bits(loaded[scheme][n])) for n, a in loaded[label].items())
                row["same_values_as_without_compression"] = same
                assert same, f"{label} loads other values than {scheme} alone"

        print("\nthe next Adam step from the loaded moments: |m_hat / (sqrt(v_hat) + eps)|, largest element")
        print(f"{'config':<8} {'v>0 stored as 0':>15} {'of them m!=0':>12} {'max step exact':>14} "
              f"{'max step loaded':>15}  worst tensor (growth)")
        for label in ("int8", "fp8"):
            a = doc["results"][label]["errors"]["summary"]["adam_step"]
            print(f"{label:<8} {a['v_flushed']:>15} {a['v_flushed_m_nonzero']:>12} {a['max_step_exact']:>14.3g} "
                  f"{a['max_step_loaded']:>15.3g}  {a['worst_tensor']} ({a['worst_growth']:.3g}x)")

        # Effect on training: resume from each checkpoint on the same batches.
        print(f"\nresume {args.resume_steps} steps on the same batches (loss at the end of training {loss:.4f})")
        print(f"{'from':<13} {'final loss':>10} {'rel. diff':>10} {'max rel. diff':>13} {'weights rel. diff':>17}  "
              "worst weight tensor")
        resumes = {}
        ref_model = None
        for label in ("plain", "plain (again)", "int8", "fp8"):
            lmodel, lopt = _copy(model, opt)
            with torch.no_grad():   # the load must supply every value
                for p in lmodel.parameters():
                    p.fill_(float("nan"))
                for t in _moments(lmodel, lopt).values():
                    if t.is_floating_point() and t.dim():
                        t.fill_(float("nan"))
            omnickpt.load(kept[label.split()[0]], {"model": lmodel, "optimizer": lopt})
            losses = _train_on(lmodel, lopt, batches)
            if ref_model is None:
                ref_model, ref = lmodel, losses
            wdiffs = {n: ((p - q).abs().max() / q.abs().max().clamp_min(1e-30)).item()
                      for (n, p), q in zip(lmodel.named_parameters(), ref_model.parameters())}
            wdiff = max(wdiffs.values())
            r = {"losses": losses, "final_loss": losses[-1], "final_rel_diff": (losses[-1] - ref[-1]) / ref[-1],
                 "max_rel_diff": max(abs(a - b) / b for a, b in zip(losses, ref)), "weights_max_rel_diff": wdiff,
                 "weights_worst_tensor": max(wdiffs, key=wdiffs.get)}
            resumes[label] = r
            print(f"{label:<13} {r['final_loss']:>10.5f} {r['final_rel_diff']:>+10.2e} {r['max_rel_diff']:>13.2e} "
                  f"{wdiff:>17.2e}  {r['weights_worst_tensor'] if wdiff else ''}")
        doc["resume"] = resumes
    finally:
        shutil.rmtree(root, ignore_errors=True)
    doc["seconds"] = time.perf_counter() - t0
    print(f"total {doc['seconds']:.0f} s")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "quantize.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
