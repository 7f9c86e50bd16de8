"""The stall and bytes a save reports about itself, checked from outside: a stopwatch around each
async save() call against the report's "stall", and the data files' sizes on disk against its
"total_bytes". One process, an MLP of 6 x Linear(2048) with Adam (~300 MB of state).

    .venv/bin/python bench/stall_outside.py
"""
import os
import tempfile
import time

import torch

import omnickpt

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(6)])
opt = torch.optim.Adam(model.parameters())
model(torch.randn(4, 2048)).sum().backward()
opt.step()
ckpt, root = omnickpt.Checkpointer(), tempfile.mkdtemp()
outside, reports = [], []
for i in range(6):
    t0 = time.perf_counter()
    handle = ckpt.save(f"{root}/s{i}", {"model": model, "optim": opt}, async_save=True)
    outside.append(time.perf_counter() - t0)
    reports.append(handle.wait())
print("stopwatch around save():    ", " ".join(f"{x:.4f}" for x in outside))
print("reported stall of each save:", " ".join(f"{r['phases']['stall']['median']:.4f}" for r in reports))
data = f"{root}/s5/data"
print("reported bytes", reports[-1]["total_bytes"], "data files on disk",
      sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data)))
ckpt.close()
