"""The two libraries under test in the project's venv, behind the interface bench/scenario.py uses.

Both are used the way their documentation recommends for a training job:
- omnickpt: one Checkpointer per job; state = {"model": model, "optimizer": opt} (DDP/FSDP2 modules
  as they are); save() is durable by default (fsync of every data file, manifest by temp + fsync +
  rename).
- DCP: torch.distributed.checkpoint.save/async_save/load with checkpoint_id=path, i.e. the default
  FileSystemWriter/Reader; its sync_files=True default fsyncs every file it writes, so both saves
  are durable. The state dict comes from torch.distributed.checkpoint.state_dict.get_state_dict
  and goes back with set_state_dict (canonical parameter names in every layout, which is what makes
  its resharded loads work), and that time is counted: a user must pay it. async_save runs its
  collectives on a separate gloo group, as its documentation asks, so they cannot interleave with
  the training step's collectives; its default stager copies the state to fresh CPU memory on
  every call.
"""
from __future__ import annotations

import torch.distributed as dist


class OmniLib:
    name = "omnickpt"

    def __init__(self):
        import omnickpt
        self._ckpt = omnickpt.Checkpointer()

    @staticmethod
    def _state(model, opt):
        return {"model": model, "optimizer": opt}

    def save(self, path, model, opt, module):
        return self._ckpt.save(path, self._state(model, opt)).wait()

    def async_save(self, path, model, opt, module):
        return self._ckpt.save(path, self._state(model, opt), async_save=True)

    def wait(self, handle):
        return handle.wait()

    def load(self, path, model, opt, module):
        return self._ckpt.load(path, self._state(model, opt)).report

    def close(self):
        self._ckpt.close()


class OmniSamePriorityLib(OmniLib):
    """omnickpt with its background threads at the training thread's priority
    (Checkpointer(background_nice=None)): what the default's nicer threads are measured against."""
    name = "omnickpt-samepri"

    def __init__(self):
        import omnickpt
        self._ckpt = omnickpt.Checkpointer(background_nice=None)


class OmniDedupLib(OmniLib):
    """omnickpt loading with dedup_reads=True: where ranks want the same saved bytes (DDP replicas),
    one rank reads them and forwards them to the others over the process group. Only its load
    figures are measured (its saves are omnickpt's); compare them with omnickpt's, where every rank
    reads what it needs."""
    name = "omnickpt-dedup"
    loads_only = True

    def load(self, path, model, opt, module):
        return self._ckpt.load(path, self._state(model, opt), dedup_reads=True).report


class DCPLib:
    name = "dcp"

    def __init__(self):
        self._pg = dist.new_group(backend="gloo") if dist.is_initialized() else None

    @staticmethod
    def _state(model, opt):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def save(self, path, model, opt, module):
        import torch.distributed.checkpoint as dcp
        dcp.save(self._state(model, opt), checkpoint_id=path)
        return None

    def async_save(self, path, model, opt, module):
        import torch.distributed.checkpoint as dcp
        return dcp.async_save(self._state(model, opt), checkpoint_id=path, process_group=self._pg)

    def wait(self, handle):
        handle.result()
        return None

    def load(self, path, model, opt, module):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        sd = self._state(model, opt)
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return None

    def close(self):
        pass


class DCPReuseLib(DCPLib):
    """DCP's async_save with one DefaultStager kept for the whole job (passed as async_stager=): it
    caches its CPU copies and refills them on later saves, the way to reuse staging memory with
    DCP on CPU. Only its async figures are measured; its sync saves and loads are DCP's."""
    name = "dcp-reuse"
    async_only = True

    def __init__(self):
        super().__init__()
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        # No pinned/shared memory, no background staging, no non-blocking copies: the CPU-only options.
        self._stager = DefaultStager(StagingOptions(False, False, False, False))

    def async_save(self, path, model, opt, module):
        import torch.distributed.checkpoint as dcp
        return dcp.async_save(self._state(model, opt), checkpoint_id=path, process_group=self._pg,
                              async_stager=self._stager)

    def close(self):
        self._stager.close()


class OmniDCPLib(DCPLib):
    """DCP's calling code unchanged (get_state_dict / set_state_dict, the same state dict), with
    `from omnickpt import dcp` instead of torch's: omnickpt.dcp's save / async_save / load (issue 19).
    Its async save copies the state dicts' tensors eagerly (a state dict holds no optimizer whose step
    a lazy copy could hold back), so its stall is DCP-shaped code's, not omnickpt.save's."""
    name = "omnickpt-dcp"

    def save(self, path, model, opt, module):
        from omnickpt import dcp
        dcp.save(self._state(model, opt), checkpoint_id=path)
        return None

    def async_save(self, path, model, opt, module):
        from omnickpt import dcp
        return dcp.async_save(self._state(model, opt), checkpoint_id=path, process_group=self._pg)

    def load(self, path, model, opt, module):
        from omnickpt import dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        sd = self._state(model, opt)
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return None


LIBS = {"omnickpt": OmniLib, "omnickpt-samepri": OmniSamePriorityLib, "omnickpt-dcp": OmniDCPLib, "omnickpt-dedup": OmniDedupLib, "dcp": DCPLib, "dcp-reuse": DCPReuseLib}
