"""The only module that calls torch.distributed for Muon traffic.

Buffers travel as raw bytes (``uint8`` views) so any dtype works on every backend: gloo has
no float8 and its support for reduced precision differs between collectives. Every buffer
lives on the transport's device, the parameters' device: on CUDA the collectives run on the
NCCL group torchtitan created, with no host round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from titan_muon.timing import phase


@dataclass
class Exchange:
    """An all-to-all in flight: `wait()` returns the received buffer in the sent dtype."""

    received: Tensor
    work: dist.Work | None
    dtype: torch.dtype
    sent: Tensor | None = None  # kept alive until the collective has read it

    def wait(self) -> Tensor:
        if self.work is not None:
            with phase("wait"):
                self.work.wait()
            self.work = None
        self.sent = None
        return self.received.view(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.received.numel() + (0 if self.sent is None else self.sent.numel())


def _used_by_default_stream(*tensors: Tensor) -> None:
    if tensors[0].device.type != "cuda":
        return
    default = torch.cuda.default_stream(tensors[0].device)
    if torch.cuda.current_stream(tensors[0].device) != default:
        for t in tensors:
            t.record_stream(default)


class Transport:
    """Muon's collectives over one process group (None: a single process), on one device."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group = group
        self.device = torch.device(device)
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.bytes_sent = 0
        self.bytes_received = 0
        # Split sizes in bytes, per (element counts, item size): the schedules' count tuples
        # are fixed, so the O(world size) lists are built once, not per collective.
        self._byte_splits: dict[tuple[tuple[int, ...], int], tuple[list[int], int]] = {}

    def _split_bytes(self, counts: tuple[int, ...], itemsize: int) -> tuple[list[int], int]:
        """The byte split list of `counts` and the bytes that leave or reach other ranks."""
        key = (counts, itemsize)
        if key not in self._byte_splits:
            self._byte_splits[key] = ([c * itemsize for c in counts], itemsize * (sum(counts) - counts[self.rank]))
        return self._byte_splits[key]

    def all_to_all(
        self, send: Tensor, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], recv: Tensor | None = None
    ) -> Exchange:
        """Start an uneven all-to-all of `send` (1-D, counts in elements); returns at once.

        `recv` (uint8, optional) receives; otherwise a buffer is allocated. On CUDA, buffers
        made on another stream than the default one (FSDP2 runs the backward hooks on its
        post-reduce stream) are marked as used by the default stream, where ``step()`` reads
        them, so the caching allocator cannot hand their memory out early.
        """
        itemsize = send.element_size()
        if self.group is None:
            return Exchange(send.view(torch.uint8), None, send.dtype)
        recv_splits, received = self._split_bytes(tuple(recv_counts), itemsize)
        send_splits, sent = self._split_bytes(tuple(send_counts), itemsize)
        if recv is None:
            recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        _used_by_default_stream(recv, send)
        self.bytes_sent += sent
        self.bytes_received += received
        send_bytes = send.contiguous().view(torch.uint8)
        work = dist.all_to_all_single(
            recv,
            send_bytes,
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=self.group,
            async_op=True,
        )
        return Exchange(recv, work, send.dtype, send_bytes)

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        if self.group is not None:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def all_gather(self, send: Tensor) -> Tensor:
        """Every rank's `send` (1-D, the same size everywhere), as (world_size, numel), in rank
        order; blocks until done. Counted as a ring all-gather: every rank sends and receives
        (world_size − 1) blocks."""
        if self.group is None:
            return send.reshape(1, -1)
        out = torch.empty(self.world_size * send.numel(), dtype=send.dtype, device=self.device)
        dist.all_gather_single(out, send.contiguous(), group=self.group)
        nbytes = (self.world_size - 1) * send.numel() * send.element_size()
        self.bytes_sent += nbytes
        self.bytes_received += nbytes
        return out.view(self.world_size, -1)

    def check_same_everywhere(self, value: int, what: str) -> None:
        """Raise the same error on every rank unless all ranks pass the same 63-bit `value`.

        Runs once, when the optimizer is built (it reads the result on the host).
        """
        if self.group is None:
            return
        pair = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        self.all_reduce(pair, dist.ReduceOp.MAX)
        high, low = pair.tolist()
        if high != -low:
            raise RuntimeError(
                f"titan_muon: {what} differs between ranks of the process group "
                f"(this rank: {value:#x}). Every rank must build the optimizer from the same model "
                "with the same parameter order, shapes and settings."
            )


_LANE_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def outbound_lane_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The communicator that carries pieces to their owners: one per rank set, created once per
    process and reused. Returns travel on `group` itself (the mesh's group, idle during
    ``step()``), so on NCCL — one in-order stream per communicator — a return trip never
    queues ahead of the next outbound one."""
    if group is None:
        return None
    return cached_group(_LANE_GROUPS, tuple(sorted(dist.get_process_group_ranks(group))))


def cached_group(cache: dict[tuple[int, ...], dist.ProcessGroup], ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A process group over `ranks` from `cache`, created (by those ranks only) if missing or if
    it belonged to a process group world that has since been destroyed. Re-planning reuses it."""
    group = cache.get(ranks)
    if group is not None:
        try:
            dist.get_process_group_ranks(group)
        except (KeyError, ValueError, RuntimeError):  # not a group of the current world any more
            group = None
    if group is None:
        group = cache[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return group


class AcrossReplicas(Transport):
    """The step's agreements when the optimizer owns a replicate dimension (DeMo): an all-reduce
    over ``within`` (one replica's ranks) and then over ``replicas`` (this rank and the ranks at
    the same place in the other replicas) reduces over every rank of every replica, so every
    replica reaches the same verdict. ``rank`` is the global rank (unique, for error messages)."""

    def __init__(self, within: Transport, replicas: Transport):
        super().__init__(replicas.group, replicas.device)
        self.within, self.replicas = within, replicas
        self.world_size = within.world_size * replicas.world_size
        self.rank = dist.get_rank()

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        return self.replicas.all_reduce(self.within.all_reduce(tensor, op), op)
