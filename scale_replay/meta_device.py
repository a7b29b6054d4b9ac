"""Run the optimizer on the `meta` device with a process group that accepts only `meta` tensors.

torch's fake process group, registered for the meta device alone, behaves like an NCCL-only
group: a collective handed a CPU tensor fails with "No backend type associated with device
type cpu". Meta tensors hold no data, so every host read is answered here (with zeros: the
optimizer encodes "all is well" as 0 in what it reads), and counted: each one would be a
GPU->host sync. See ../shared/notes/gpu-readiness.md.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import fake_pg
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_REGISTERED = False

_SCALAR_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
_COPIES = {aten._to_copy.default, aten.copy_.default, aten.to.dtype_layout, aten.to.device}


@contextlib.contextmanager
def meta_process_group(rank: int, world_size: int):
    """The default process group as rank `rank` of `world_size`, backend registered for meta only."""
    global _REGISTERED
    if not _REGISTERED:
        dist.Backend.register_backend("fake", fake_pg._create_fake_pg, extended_api=True, devices=["meta"])
        _REGISTERED = True
    dist.init_process_group("meta:fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class DeviceAudit(TorchDispatchMode):
    """Counts host syncs, host->device copies, collectives on other devices and aten ops."""

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device = torch.device(device)
        self.answer_reads = self.device.type == "meta"  # a real device answers for itself
        self.reset()

    def reset(self) -> None:
        self.host_syncs = 0
        self.host_to_device = 0
        self.foreign_collectives: list[tuple[str, list[str]]] = []
        self.ops: Counter = Counter()

    @property
    def op_count(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # titan_muon's named phases: markers, not device work
            return func(*args, **kwargs)
        self.ops[str(func)] += 1
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.namespace in ("c10d", "_c10d_functional"):
            foreign = [str(t.device) for t in tensors if t.device.type != self.device.type]
            if foreign:
                self.foreign_collectives.append((str(func), foreign))
        if func in _SCALAR_READS:
            if any(t.device.type == self.device.type for t in tensors):
                self.host_syncs += 1
                if self.answer_reads:
                    return False if func is not aten._local_scalar_dense.default else 0
            return func(*args, **kwargs)
        if func in _COPIES:
            target = kwargs.get("device") or (args[0].device if func is aten.copy_.default else None)
            source = args[1] if func is aten.copy_.default else args[0]
            if target is not None and torch.device(target).type == "cpu" and source.device.type == self.device.type:
                self.host_syncs += 1  # device -> host: the host waits for the device
                if self.answer_reads:
                    if func is aten.copy_.default:
                        return args[0].zero_()
                    return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype)
            if target is not None and torch.device(target).type == self.device.type and source.device.type == "cpu":
                if source.numel() > 0:
                    self.host_to_device += 1
        return func(*args, **kwargs)
