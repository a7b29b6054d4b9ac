"""Trace the real ``Muon.step()`` of every rank, as the device would see it, without a device.

Each rank runs on ``meta`` tensors over torch's fake process group (``tests/meta_device.py``):
the optimizer's own code plans, packs, exchanges, orthogonalizes and commits, and a dispatch
mode records, in issue order, what the host hands to the device:

- ``Kernel``: one aten op that launches work (views and allocations do not), with its FLOPs
  (torch's own ``flop_counter`` formulas), the bytes it reads and writes, its dtype and the
  titan_muon phase it ran in (``timing.phase`` markers);
- ``Collective``: a ``torch.distributed`` call, on which communicator, with the bytes this
  rank sends to and receives from each peer;
- ``Wait``: the compute stream waits for a collective (``Work.wait()``; a synchronous call);
- ``HostRead``: the host reads a device value (``.item()``, ``.tolist()``, a copy to the CPU).

Kernels, collectives and waits carry the stream they are issued on: "compute", or "relay" for
a hierarchical exchange's relay between its stages (titan_muon's ``relay`` phase), which on
CUDA runs on a stream of its own.

``scripts/replay.py`` replays the traces of all ranks with CUDA stream and NCCL semantics.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from meta_device import DeviceAudit, meta_process_group

aten = torch.ops.aten
_FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.detach.default,
         aten.lift_fresh.default, aten.set_.source_Storage_storage_offset}  # fmt: skip


@dataclass(frozen=True)
class Kernel:
    name: str
    flops: int
    bytes: int
    dtype: torch.dtype
    phase: str
    stream: str = "compute"


@dataclass(frozen=True)
class Collective:
    comm: tuple  # (global ranks of the communicator, which communicator over those ranks)
    kind: str
    sent: tuple[int, ...]  # bytes to each rank of the communicator, in its rank order
    received: tuple[int, ...]
    stream: str = "compute"  # the stream the communicator's stream waits for when it is issued


@dataclass(frozen=True)
class Wait:
    collective: int  # index of the collective in this rank's trace
    stream: str = "compute"  # the stream made to wait


@dataclass(frozen=True)
class HostRead:
    pass


@dataclass
class Trace:
    rank: int
    events: list = field(default_factory=list)
    collectives: int = 0
    metrics: dict = field(default_factory=dict)  # the optimizer's last_step_metrics for the traced step

    def add_collective(self, collective: Collective) -> int:
        self.events.append(collective)
        self.collectives += 1
        return self.collectives - 1


class _TracedWork:
    def __init__(self, trace: Trace, index: int, work, stream):
        self.trace, self.index, self.work, self.stream = trace, index, work, stream

    def wait(self, *args, **kwargs):
        self.trace.events.append(Wait(self.index, self.stream()))
        return True if self.work is None else self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return True


class _Recorder(DeviceAudit):
    """The suite's DeviceAudit (answers host reads on meta), recording kernels and host reads."""

    def __init__(self, trace: Trace):
        super().__init__("meta")
        self.trace = trace
        self.phases: list[str] = []

    def stream(self) -> str:
        return "relay" if "relay" in self.phases else "compute"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            if "enter" in func.__name__:
                self.phases.append(args[0].removeprefix("titan_muon/"))
            elif self.phases:
                self.phases.pop()
            return func(*args, **kwargs)
        reads = self.host_syncs
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.host_syncs > reads:
            self.trace.events.append(HostRead())
        elif func.namespace == "aten" and not func.is_view and func not in _FREE:
            self.trace.events.append(self._kernel(func, args, kwargs, out))
        return out

    def _kernel(self, func, args, kwargs, out) -> Kernel:
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tensors)
        formula = flop_registry.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula else 0
        dtype = tensors[0].dtype if tensors else torch.float32
        return Kernel(str(func), flops, moved, dtype, self.phases[-1] if self.phases else "step", self.stream())


@contextlib.contextmanager
def _traced_collectives(trace: Trace, stream=lambda: "compute"):
    """Record torch.distributed's collectives (titan_muon calls them through its transport);
    `stream()` names the stream they are issued on."""
    ordinals: dict[object, tuple] = {}
    original_all_to_all, original_all_reduce = dist.all_to_all_single, dist.all_reduce

    def communicator(group) -> tuple:
        if group not in ordinals:  # the n-th communicator over these ranks: the same on every rank
            ranks = tuple(dist.get_process_group_ranks(group))
            ordinals[group] = (ranks, sum(1 for other in ordinals.values() if other[0] == ranks))
        return ordinals[group]

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):  # fmt: skip
        comm = communicator(group)
        index = trace.add_collective(Collective(comm, "all_to_all", tuple(input_split_sizes), tuple(output_split_sizes), stream()))
        work = original_all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if async_op:
            return _TracedWork(trace, index, work, stream)
        trace.events.append(Wait(index, stream()))
        return work

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        comm = communicator(group or dist.group.WORLD)
        size = len(comm[0])
        nbytes = tensor.numel() * tensor.element_size()
        index = trace.add_collective(Collective(comm, "all_reduce", (nbytes,) * size, (nbytes,) * size, stream()))
        work = original_all_reduce(tensor, op=op, group=group, async_op=async_op)
        if async_op:
            return _TracedWork(trace, index, work, stream)
        trace.events.append(Wait(index, stream()))
        return work

    dist.all_to_all_single, dist.all_reduce = all_to_all_single, all_reduce
    try:
        yield
    finally:
        dist.all_to_all_single, dist.all_reduce = original_all_to_all, original_all_reduce


# ------------------------------------------------------------------ models on meta


def _local_rows(rows: int, parts: int, index: int) -> int:
    chunk = -(-rows // parts)  # FSDP2 splits dim 0 like torch.chunk
    return max(0, min(rows, (index + 1) * chunk) - min(rows, index * chunk))


def _sharded(shape: tuple[int, ...], mesh, placements, shard_dim: int) -> nn.Parameter:
    local = torch.empty(_local_rows(shape[0], mesh.size(shard_dim), mesh.get_local_rank(shard_dim)), *shape[1:], device="meta")
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride))


def _param_groups(muon: list[tuple[str, tuple[int, ...]]], adamw: list[tuple[str, tuple[int, ...]]], mesh, placements,
                  shard_dim: int) -> list[dict]:  # fmt: skip
    def build(params):
        return [_sharded(shape, mesh, placements, shard_dim) for _, shape in params]

    return [
        {"params": build(muon), "param_names": [n for n, _ in muon], "use_muon": True, "matrix_stacks": True},
        {"params": build(adamw), "param_names": [n for n, _ in adamw], "use_muon": False, "lr": 1e-3},
    ]


def trace_rank(rank: int, world: int, muon: list, adamw: list, shard_group: int | None = None, **settings) -> Trace:
    """The events of rank `rank`'s second ``Muon.step()`` (the first creates the state) on a model
    with the `muon` and `adamw` parameters ((name, shape) pairs) sharded over `world` ranks (FSDP),
    or over HSDP shard groups of `shard_group` ranks; `settings` go to ``Muon``."""
    from titan_muon import Muon

    with meta_process_group(rank, world):
        if shard_group is None:
            mesh, placements, shard_dim = init_device_mesh("meta", (world,)), [Shard(0)], 0
        else:
            mesh, placements, shard_dim = init_device_mesh("meta", (world // shard_group, shard_group)), [Replicate(), Shard(0)], 1
        groups = _param_groups(muon, adamw, mesh, placements, shard_dim)
        params = [p for g in groups for p in g["params"]]
        trace = Trace(rank)
        recorder = _Recorder(Trace(rank))
        with recorder:
            optimizer = Muon(groups, lr=0.02, **settings)
            for step in range(2):
                for p in params:
                    p.grad = DTensor.from_local(torch.empty_like(p.to_local()), p.device_mesh, p.placements, run_check=False,
                                                shape=p.shape, stride=p.stride())  # fmt: skip
                recorder.trace = trace if step == 1 else Trace(rank)
                with _traced_collectives(recorder.trace, recorder.stream):
                    optimizer.step()
                optimizer.zero_grad()
            recorder.trace = Trace(rank)  # reading the metrics is the logging step's sync, not the step's
            trace.metrics = {k: float(v) for k, v in optimizer.last_step_metrics.items() if isinstance(v, (int, float))}
        return trace
