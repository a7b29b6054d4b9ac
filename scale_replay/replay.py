"""Replay per-rank step traces (``scale_replay/step_trace.py``) with CUDA stream and NCCL semantics.

Per rank there is a host clock, one compute stream and one in-order stream per communicator:

- the host launches every kernel (``launch_s`` each) and every collective (``collective_host_s``);
  neither blocks it, except a ``HostRead``, which waits for the compute stream to drain;
- a kernel starts when the host has launched it and the compute stream is free; it takes its
  FLOPs at the matmul rate of its dtype or its bytes at the memory rate, whichever is longer, and
  at least ``min_kernel_s``;
- a collective starts when the host has issued it, the compute queued before it is done
  (ProcessGroupNCCL makes its stream wait for the current stream) and the previous collective of
  its communicator on this rank is done; it completes when every peer it exchanges bytes with has
  started it too (peers with zero bytes both ways are skipped), plus a latency per collective and
  per peer, plus its bytes over NVLink (peers on the node) or InfiniBand (other nodes), both at once;
- ``Wait`` makes the compute stream wait for the collective's completion (``Work.wait()`` on
  NCCL does not block the host);
- a hierarchical exchange's relay (events on the "relay" stream) runs on a second stream per
  rank: it first waits for the compute work queued before it (``wait_stream``), then for its
  first stage, regroups, and issues the second stage, while the compute stream goes on.

One pipeline stage can be replayed alone (``absent_ranks_keep_pace``): the ranks of a
collective that have no trace here (the other stages' ranks in the optimizer's pipeline
agreement) join it when the last traced member does, as stages that finish their optimizer
steps together would.

Every rate is a field of ``Hardware`` with its source beside it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from scale_replay.step_trace import Collective, HostRead, Kernel, Trace, Wait


@dataclass(frozen=True)
class Hardware:
    """One H100 SXM per rank, 8 per node on NVLink 4, nodes on 400 Gb/s InfiniBand NDR per GPU."""

    # Dense tensor-core peak 989 TFLOP/s bf16 (NVIDIA H100 SXM datasheet); large GEMMs such as
    # NS's 4096x14336 products reach 60-70 % of it in cuBLAS, so 0.65.
    bf16_matmul_flops: float = 0.65 * 989e12
    # fp32 without TF32 (torch's default matmul precision "highest"): 67 TFLOP/s peak (datasheet).
    fp32_matmul_flops: float = 0.8 * 67e12
    # HBM3 3.35 TB/s (datasheet); elementwise kernels reach about 80 %.
    memory_bytes_per_s: float = 0.8 * 3.35e12
    # The shortest kernel from launch to completion on an H100 is a few microseconds.
    min_kernel_s: float = 3e-6
    # Host cost of one eager aten op up to its CUDA launch (dispatcher + launch): 5-10 us is what
    # torch.profiler shows for eager PyTorch on server CPUs; 7 us.
    launch_s: float = 7e-6
    # Host cost of one call of a torch.compile'd pass over one block (its first kernel, "compiled"
    # in the trace): titan_muon's list wrapper, dynamo's guards, AOTAutograd's and inductor's
    # wrappers, the launch. 56 us hot on a Xeon (scripts/measure_compiled_call.py, 2026-11-28),
    # where each further block of the same call added 7.6 us (launch_s here); not yet measured on
    # a GPU's host.
    compiled_call_s: float = 56e-6
    # ProcessGroupNCCL's host work per collective (stream/event bookkeeping, enqueue).
    collective_host_s: float = 20e-6
    # A host read: the device->host copy and the host's wake-up after the stream drained.
    host_read_s: float = 15e-6
    # NVLink 4: 450 GB/s per direction per GPU (datasheet); NCCL's all-to-all reaches ~80 %.
    nvlink_bytes_per_s: float = 0.8 * 450e9
    # NDR 400 Gb/s = 50 GB/s per direction per GPU; NCCL reaches ~85 % on large messages.
    infiniband_bytes_per_s: float = 0.85 * 50e9
    # NCCL's fixed cost per collective kernel and per peer of an all-to-all (one send/recv pair):
    # nccl-tests' small-message latencies are ~10-20 us per collective.
    collective_latency_s: float = 15e-6
    near_peer_latency_s: float = 1e-6
    far_peer_latency_s: float = 3e-6
    gpus_per_node: int = 8

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def kernel_s(self, kernel: Kernel) -> float:
        compute = 0.0
        if kernel.flops:
            rate = self.bf16_matmul_flops if kernel.dtype in (torch.bfloat16, torch.float16) else self.fp32_matmul_flops
            compute = kernel.flops / rate
        return max(self.min_kernel_s, compute, kernel.bytes / self.memory_bytes_per_s)


@dataclass
class RankResult:
    finish_s: float = 0.0  # host and every stream done
    busy_s: dict = field(default_factory=lambda: defaultdict(float))  # compute time by phase
    wire_s: float = 0.0  # time this rank's all-to-all bytes take on the links, latency excluded
    bytes_sent: int = 0  # to other ranks
    host_busy_s: float = 0.0  # host time spent launching kernels and collectives and reading back
    host_reads: int = 0
    kernels: int = 0

    @property
    def newton_schulz_s(self) -> float:
        return self.busy_s.get("newton_schulz", 0.0)

    @property
    def ideal_s(self) -> float:
        """Issue 16's ideal: the rank's Newton–Schulz plus its bytes on the links. Not a lower bound:
        the wire overlaps Newton–Schulz, and the elementwise work and launches are left out."""
        return self.newton_schulz_s + self.wire_s

    @property
    def compute_s(self) -> float:
        return sum(self.busy_s.values())

    @property
    def bound_s(self) -> float:
        """What no schedule of this rank's work can go below: its compute stream's work, its bytes
        on the links and its host's launches, each alone, all perfectly overlapped."""
        return max(self.compute_s, self.wire_s, self.host_busy_s)


class _Rank:
    def __init__(self, trace: Trace):
        self.trace = trace
        self.position = 0
        self.host = 0.0
        self.compute = 0.0
        self.relay = 0.0  # the relay stream of hierarchical exchanges
        self.sequence: dict[tuple, int] = defaultdict(int)  # collectives issued per communicator
        self.keys: list[tuple] = []  # (communicator, sequence) of each of this rank's collectives
        self.result = RankResult()

    @property
    def done(self) -> bool:
        return self.position == len(self.trace.events)


class Replay:
    def __init__(self, traces: list[Trace], hardware: Hardware, absent_ranks_keep_pace: bool = False):
        self.hardware = hardware
        self.absent_ranks_keep_pace = absent_ranks_keep_pace
        self.ranks = {t.rank: _Rank(t) for t in traces}
        self.starts: dict[tuple, dict[int, float]] = defaultdict(dict)  # (comm, seq) -> rank -> start
        self.records: dict[tuple, dict[int, Collective]] = defaultdict(dict)
        self.ends: dict[tuple, dict[int, float]] = {}  # (comm, seq) -> rank -> completion

    def run(self) -> dict[int, RankResult]:
        while not all(rank.done for rank in self.ranks.values()):
            progressed = False
            for rank in self.ranks.values():
                progressed |= self._advance(rank)
            if not progressed:
                stuck = {r: rank.trace.events[rank.position] for r, rank in self.ranks.items() if not rank.done}
                raise RuntimeError(f"replay: the traces deadlock (a collective some rank never joins): {stuck}")
        for rank in self.ranks.values():
            ends = [self.ends[key][rank.trace.rank] for key in rank.keys]
            rank.result.finish_s = max([rank.host, rank.compute, rank.relay, *ends])
        return {r: rank.result for r, rank in self.ranks.items()}

    def _advance(self, rank: _Rank) -> bool:
        hw, result, start_position = self.hardware, rank.result, rank.position
        while not rank.done:
            event = rank.trace.events[rank.position]
            if isinstance(event, Kernel):
                launch = hw.compiled_call_s if event.name == "compiled" else hw.launch_s
                rank.host += launch
                result.host_busy_s += launch
                duration = hw.kernel_s(event)
                if event.stream == "relay":
                    rank.relay = max(rank.host, rank.relay) + duration
                else:
                    rank.compute = max(rank.host, rank.compute) + duration
                result.busy_s[event.phase] += duration
                result.kernels += 1
            elif isinstance(event, Collective):
                sequence = rank.sequence[event.comm]
                previous = (event.comm, sequence - 1)
                if sequence and previous not in self.ends:
                    break  # the communicator's stream is still busy with a collective not yet resolved
                rank.host += hw.collective_host_s
                result.host_busy_s += hw.collective_host_s
                stream = rank.relay if event.stream == "relay" else rank.compute
                ready = stream if sequence == 0 else max(stream, self.ends[previous][rank.trace.rank])
                key = (event.comm, sequence)
                rank.sequence[event.comm] += 1
                rank.keys.append(key)
                self.starts[key][rank.trace.rank] = max(rank.host, ready)
                self.records[key][rank.trace.rank] = event
                if len(self.starts[key]) == self._joining(event.comm[0]):
                    self._complete(key)
            elif isinstance(event, Wait):
                key = rank.keys[event.collective]
                if key not in self.ends:
                    break
                if event.stream == "relay":  # after waiting for the compute stream's work so far
                    rank.relay = max(rank.relay, rank.compute, self.ends[key][rank.trace.rank])
                else:
                    rank.compute = max(rank.compute, self.ends[key][rank.trace.rank])
            elif isinstance(event, HostRead):
                rank.host = max(rank.host, rank.compute) + hw.host_read_s
                result.host_busy_s += hw.host_read_s
                result.host_reads += 1
            rank.position += 1
        return rank.position != start_position

    def _joining(self, members: tuple[int, ...]) -> int:
        """How many ranks must start a collective over `members` before it can complete."""
        if self.absent_ranks_keep_pace:
            return sum(1 for rank in members if rank in self.ranks)
        return len(members)

    def _complete(self, key: tuple) -> None:
        hw = self.hardware
        members = key[0][0]
        starts, ends = dict(self.starts[key]), {}
        last = max(starts.values())
        for rank in members:
            starts.setdefault(rank, last)  # a rank without a trace here joins with the last traced one
        for rank in members:
            if rank not in self.ranks:
                continue
            event = self.records[key][rank]
            if event.kind == "all_reduce":
                nbytes, size = event.sent[0], len(members)
                bandwidth = hw.nvlink_bytes_per_s if len({hw.node(r) for r in members}) == 1 else hw.infiniband_bytes_per_s
                hops = 2 * math.ceil(math.log2(size)) if size > 1 else 0
                joined = max(starts.values())
                ends[rank] = joined + hw.collective_latency_s + hops * hw.near_peer_latency_s + 2 * nbytes * (size - 1) / size / bandwidth
                continue
            near = [0, 0]  # bytes out, bytes in
            far = [0, 0]
            joined, near_peers, far_peers = starts[rank], 0, 0
            for peer_index, peer in enumerate(members):
                out, into = event.sent[peer_index], event.received[peer_index]
                if peer == rank or not (out or into):
                    continue
                joined = max(joined, starts[peer])
                if hw.node(peer) == hw.node(rank):
                    near[0], near[1], near_peers = near[0] + out, near[1] + into, near_peers + 1
                else:
                    far[0], far[1], far_peers = far[0] + out, far[1] + into, far_peers + 1
            wire = max(max(near) / hw.nvlink_bytes_per_s, max(far) / hw.infiniband_bytes_per_s)
            latency = hw.collective_latency_s + near_peers * hw.near_peer_latency_s + far_peers * hw.far_peer_latency_s
            ends[rank] = joined + latency + wire
            result = self.ranks[rank].result
            result.wire_s += wire
            result.bytes_sent += near[0] + far[0]
        self.ends[key] = ends


def replay(traces: list[Trace], hardware: Hardware | None = None, absent_ranks_keep_pace: bool = False) -> dict[int, RankResult]:
    return Replay(traces, hardware or Hardware(), absent_ranks_keep_pace).run()
