"""Zero-redundancy load (dedup_reads=True) against every rank reading: DDP, 2 gloo ranks, ~400 MB of
model+Adam state; medians of 3 loads. Run: .venv/bin/python bench/dedup_load.py"""
import os, sys, time, statistics; sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import torch, omnickpt
from dist import run_ranks
def work(rank, ws, root):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    h = 1024
    layers = []
    for _ in range(4): layers += [torch.nn.Linear(h, 4*h), torch.nn.Linear(4*h, h)]
    m = DDP(torch.nn.Sequential(*layers))
    opt = torch.optim.Adam(m.parameters())
    for p in m.parameters(): p.grad = torch.ones_like(p)
    opt.step()
    omnickpt.save(root, {"model": m, "optimizer": opt}).wait()
    out = {False: [], True: []}
    for i in range(3):
        for d in (False, True):
            torch.distributed.barrier()
            t = time.perf_counter(); omnickpt.load(root, {"model": m, "optimizer": opt}, dedup_reads=d); out[d].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in out.items()}
if __name__ == "__main__":
    import tempfile
    print(run_ranks(2, work, tempfile.mkdtemp() + "/c"))
