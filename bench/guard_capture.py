"""Per-step cost of guard()'s capture: a save() call with every= that does not save, inside
guard() (captures) and outside it (does not), on a state with a torchdata StatefulDataLoader,
RNGState, an LR scheduler, an AdamW optimizer and an MLP with BatchNorm (`layers` x (Linear, BN))."""
import tempfile, time, warnings
import torch
from torch import nn
import omnickpt
from torchdata.stateful_dataloader import StatefulDataLoader
warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def run(layers, workers, bn=True, calls=300):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(256, 256)] + ([nn.BatchNorm1d(256)] if bn else [])
    model = nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)
    loader = StatefulDataLoader(torch.randn(100000, 256), batch_size=8, shuffle=True, num_workers=workers,
                                generator=torch.Generator().manual_seed(0))
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader, "rng": omnickpt.RNGState()}
    out = {}
    with tempfile.TemporaryDirectory() as root:
        mgr = omnickpt.CheckpointManager(root, every=10**6)
        it = iter(loader)
        model(next(it)).sum().backward(); opt.step(); sched.step()
        mgr.save(0, state)                       # the one save the cadence makes
        for where in ("outside", "inside"):
            times = []
            with (mgr.guard(state) if where == "inside" else open("/dev/null")):
                for step in range(calls):
                    next(it)                     # the loader moves, as in training
                    t0 = time.perf_counter()
                    mgr.save(len(times) + 1 + (calls if where == "inside" else 0), state)
                    times.append(time.perf_counter() - t0)
            out[where] = sorted(times)[len(times) // 2] * 1e6
        mgr.close()
    stable = 3 * len(list(model.parameters()))
    print(f"{layers:4d} x (Linear{', BN' if bn else ''}), loader workers={workers}: {stable:5d} params+moments, "
          f"{len(list(model.buffers())):4d} buffers: save() not due, median {out['outside']:5.0f} us outside "
          f"guard(), {out['inside']:6.0f} us inside")


for layers in (4, 64, 256):
    for workers in (0, 2):
        run(layers, workers)
run(256, 0, bn=False)
