"""titan_muon's ownership plan on real model shapes and up to 4096 ranks, simulated on one CPU.

    python scripts/simulate_scale.py                  # every preset, W = 8 ... 4096; writes docs/scale.md
    python scripts/simulate_scale.py --quick          # Llama-3 8B at W = 8 and 64, nothing written
    python scripts/simulate_scale.py --verify-shapes  # also compare the presets with torchtitan's models

No process group and no GPU. The plan (``plan.build_plan``), one rank's per-step tables
(``plan.rank_schedule``) and every rank's traffic (``layout.Sharding.holders``) come from the
functions the optimizer itself uses; the step's transient memory and an H100 step time are
modelled from them with the formulas in ``peak_transient_bytes`` and ``Hardware``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_muon.layout import Sharding, box_numel
from titan_muon.plan import Plan, RoundTables, Unit, build_plan, rank_tables
from titan_muon.redistribute import assemble, disassemble, local_piece, outbound_slots

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


from model_presets import (  # noqa: E402 - scripts/ was put on sys.path above
    ADAMW_PATTERNS, GPUS_PER_NODE, MUON_PATTERNS, PRESETS, Layout, Model, laid_out, node_of, ns_flops,
    torchtitan_muon_params, units_of,
)


# ------------------------------------------------------------------ traffic


@dataclass
class Traffic:
    """Elements each rank sends and receives on the outbound trip, to and from peers on its own
    node and on other nodes. The return trip is its mirror image (owners send every piece back)."""

    sent_near: np.ndarray
    sent_far: np.ndarray
    received_near: np.ndarray
    received_far: np.ndarray

    @property
    def sent(self) -> np.ndarray:
        return self.sent_near + self.sent_far

    @property
    def received(self) -> np.ndarray:
        return self.received_near + self.received_far

    @property
    def per_step(self) -> np.ndarray:
        """Elements each rank puts on the wire per step: outbound plus return trip (= plan.elements_sent)."""
        return self.sent + self.received


def traffic(
    units: Sequence[Unit], owners: Sequence[int], shardings: Sequence[Sharding], group: int, cache: dict | None = None
) -> Traffic:
    """Every unit's pieces go from their holders to the owner (nothing for the owner's own piece).
    `cache` keeps each (sharding, unit box)'s holders for later calls on the same shardings."""
    sent = np.zeros((2, group), dtype=np.int64)  # [near, far]
    received = np.zeros((2, group), dtype=np.int64)
    nodes = np.arange(group) // GPUS_PER_NODE
    pieces = {} if cache is None else cache
    for unit, owner in zip(units, owners):
        sharding = shardings[unit.param]
        key = (id(sharding), unit.box)
        if key not in pieces:
            held = [(rank, box_numel(box)) for rank, box in sharding.holders(unit.box)]
            pieces[key] = (np.array([r for r, _ in held], dtype=np.int64), np.array([n for _, n in held], dtype=np.int64))
        ranks, numels = pieces[key]
        if len(ranks) == 1:  # the common case for experts: one holder
            rank, numel = int(ranks[0]), int(numels[0])
            if rank != owner:
                far = int(node_of(rank) != node_of(owner))
                sent[far, rank] += numel
                received[far, owner] += numel
            continue
        away = ranks != owner
        far = (nodes[ranks] != nodes[owner]) & away
        near = away & ~far
        sent[0, ranks[near]] += numels[near]  # holders are distinct ranks: plain fancy indexing adds once each
        sent[1, ranks[far]] += numels[far]
        received[0, owner] += int(numels[near].sum())
        received[1, owner] += int(numels[far].sum())
    return Traffic(sent[0], sent[1], received[0], received[1])


# ------------------------------------------------------------------ hardware model


@dataclass(frozen=True)
class Hardware:
    """H100 SXM assumptions for the step-time estimate (all overridable on the command line).

    NS runs at ``ns_efficiency`` x 989 TFLOP/s (bf16 dense). An all-to-all moves each rank's
    same-node bytes over NVLink and its other-node bytes over InfiniBand at the same time; a
    trip takes the slowest rank's max(sent, received) per link. Each collective adds a fixed
    ``latency``. Compute and communication are added, not overlapped (the bucket window
    overlaps them in reality, so this errs high).
    """

    bf16_flops: float = 989e12
    ns_efficiency: float = 0.6
    nvlink_bytes_per_s: float = 360e9  # 80 % of NVLink 4's 450 GB/s per direction per GPU
    ib_bytes_per_s: float = 40e9  # 80 % of one 400 Gb/s NDR NIC per GPU
    latency_s: float = 30e-6  # per collective

    def ns_seconds(self, flops: float) -> float:
        return flops / (self.bf16_flops * self.ns_efficiency)

    def trip_seconds(self, t: Traffic, wire: int) -> float:
        near = np.maximum(t.sent_near, t.received_near) * wire / self.nvlink_bytes_per_s
        far = np.maximum(t.sent_far, t.received_far) * wire / self.ib_bytes_per_s
        return float(np.maximum(near, far).max()) if len(near) else 0.0

    def all_gather_seconds(self, elements: int, group: int, wire: int) -> float:
        """Ring all-gather of `elements` in total: each rank moves (group-1)/group of them,
        over NVLink within a node, else limited by InfiniBand."""
        link = self.nvlink_bytes_per_s if group <= GPUS_PER_NODE else self.ib_bytes_per_s
        return elements * wire * (group - 1) / group / link


# ------------------------------------------------------------------ memory model


def peak_transient_bytes(
    schedules: Sequence[RoundTables], units: Sequence[Unit], window: int, wire: int, ns: int, overlap: bool
) -> int:
    """Upper bound of the step's transient memory on one rank, from its tables (optimizer.py).

    Per bucket b: S_b elements this rank sends (its pieces, its own included), R_b elements it
    receives (the pieces of the matrices it owns); ``wire`` / ``ns`` bytes per element on the
    wire / in Newton–Schulz. Without overlap, while bucket b is orthogonalized:

      exchange(b) = wire·Σ_{j=b}^{b+window-1} (S_j + R_j)   outbound buffers in flight (send + receive)
                  + 4·S_{b+window-1}                        fp32 Nesterov pieces of the bucket being packed
                  + wire·Σ_{j=b-window}^{b} R_j             return-trip send buffers in flight
                  + NS(b)                                   R_b·(2·ns + 4) + 2·ns·Σ_owned min(m, n)²
                                                            (input, iterate, fp32 result; Gram and its square)
      held        = wire·Σ_b S_b                            returned updates: views of the return buffers,
                                                            kept until the commit (which adds them to the
                                                            parameters in place, mixed dtypes, no copy)
      peak        = held + max_b exchange(b)

    With overlap (momentum on the owners), backward already left every bucket's send and
    receive buffers; step() drops each once its bucket is orthogonalized, while the owners
    keep the new fp32 momentum of each matrix they processed until the commit (4·R_j) and
    nothing is packed in step(). While bucket b is orthogonalized:
      wire·Σ_{j≥b}(S_j + R_j) + 4·Σ_{j<b} R_j + wire·Σ_{j=b-window}^{b} R_j + NS(b), plus held.
    """
    send = [sum(p.numel for p in s.outbound) for s in schedules]  # = send_numel, without summing W counts
    recv = [sum(p.numel for p in s.inbound) for s in schedules]
    squares = [sum(min(units[u].shape) ** 2 for u in s.owned) for s in schedules]
    ns_bytes = [r * (2 * ns + 4) + 2 * ns * q for r, q in zip(recv, squares)]
    n = len(schedules)
    returning = [wire * sum(recv[max(0, b - window) : b + 1]) for b in range(n)]
    held = wire * sum(send)
    if overlap:
        during = [
            wire * sum(send[j] + recv[j] for j in range(b, n)) + 4 * sum(recv[:b]) + returning[b] + ns_bytes[b]
            for b in range(n)
        ]
        return held + max(during, default=0)
    exchange = 0
    for b in range(n):
        ahead = range(b, min(n, b + window))
        outbound = wire * sum(send[j] + recv[j] for j in ahead) + 4 * send[ahead[-1]]
        exchange = max(exchange, outbound + returning[b] + ns_bytes[b])
    return held + exchange


# ------------------------------------------------------------------ host time per step


def _lpt_owners(costs: Sequence[int], world: int) -> list[int]:
    """DistMuon-like owners: longest processing time first, to the least loaded rank."""
    loads, owners = [0] * world, [0] * len(costs)
    for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
        owners[u] = min(range(world), key=lambda r: (loads[r], r))
        loads[owners[u]] += costs[u]
    return owners


def _size_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """DistMuon-like buckets: consecutive units up to `bucket_bytes` (a larger unit alone)."""
    buckets: list[list[int]] = []
    filled = 0
    for u, size in enumerate(sizes):
        if not buckets or filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(u)
        filled += size
    return buckets


def walk_tables(schedules: Sequence[RoundTables], units: Sequence[Unit]) -> int:
    """Read every table entry step() reads: outbound pieces when packing and unpacking,
    inbound pieces when assembling and disassembling, the owned units, the split sizes."""
    touched = 0
    for schedule in schedules:
        for piece in schedule.outbound:  # _send / _outbound_source, then _receive_updates / unpack
            touched += units[piece.unit].param + piece.local[2] + piece.offset + piece.numel
        for piece in schedule.inbound:  # assemble, then disassemble
            touched += piece.unit + piece.rows[1] + piece.cols[1] + piece.offset + piece.numel
        touched += len(schedule.owned) + len(schedule.send_counts) + len(schedule.recv_counts)
    return touched


def split_lists(schedules: Sequence[RoundTables], rank: int, itemsize: int, cache: dict | None = None) -> int:
    """What transport.all_to_all does per call for its byte split lists: a lookup in a cache
    keyed by the schedule's count tuple (hashing W ints, in C); the lists are built once."""
    cache = {} if cache is None else cache
    total = 0
    for schedule in schedules:
        for counts in (schedule.send_counts, schedule.recv_counts):
            key = (counts, itemsize)
            if key not in cache:
                cache[key] = ([c * itemsize for c in counts], itemsize * (sum(counts) - counts[rank]))
            total += cache[key][1]
    return total


def redistribute_on_meta(schedules: Sequence[RoundTables], units: Sequence[Unit], stacks: dict[int, torch.Tensor]) -> None:
    """step()'s calls into redistribute.py for one rank, on meta tensors (shapes only): every
    view, cat and cast the host dispatches, without data."""
    key_of = lambda u: units[u].shape  # noqa: E731 - one group of settings
    for schedule in schedules:
        send = torch.empty(schedule.send_numel, dtype=torch.bfloat16, device="meta")
        for piece, slot in outbound_slots(schedule, send):
            slot.copy_(local_piece(stacks[units[piece.unit].param], piece))
        received = torch.empty(sum(p.numel for p in schedule.inbound), dtype=send.dtype, device="meta")
        results = {}
        for batch in assemble(schedule, received, units, key_of, torch.bfloat16):
            results.update(zip(batch.units, batch.matrices.unbind(0)))
        back = disassemble(schedule, results, torch.bfloat16, "meta")
        list(outbound_slots(schedule, torch.empty(send.numel(), dtype=back.dtype, device="meta")))


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (a stand-in for a GPU step's host-side launches)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def seconds(fn, *args, repeat: int = 1) -> float:
    """Best CPU time of `repeat` calls: this shared machine's wall clock includes waiting for a core."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn(*args)
        best = min(best, time.process_time() - start)
    return best


# ------------------------------------------------------------------ one configuration


SCHEMES = ("titan_muon", "DistMuon-like", "gather-everything")


@dataclass
class Row:
    model: str
    world: int
    layout: str
    scheme: str
    group: int
    units: int
    buckets: int
    ns: np.ndarray  # NS FLOPs per group rank
    ns_total: int  # sum over units
    biggest_unit: int  # NS FLOPs of the costliest unit
    per_step: np.ndarray  # elements on the wire per rank and step
    trip_s: float  # one all-to-all trip (bf16), or the all-gather
    collectives: int
    overlap_possible: bool
    plan_s: float = float("nan")
    schedule_s: float = float("nan")
    host_tables_ms: float = float("nan")
    host_splits_ms: float = float("nan")
    aten_ops: int = 0
    shard_elements: int = 0  # the larger Muon shard of the measured ranks
    peak_bytes: int = 0
    peak_overlap_bytes: int = 0
    sent_total: int = 0
    received_total: int = 0
    idle: int = 0
    owners: int = 0

    @property
    def ns_mean(self) -> float:
        return float(self.ns.mean())

    @property
    def imbalance(self) -> float:
        return float(self.ns.max()) / self.ns_mean if self.ns_mean else 1.0

    @property
    def bound(self) -> float:
        """The best NS max/mean any whole-unit plan can reach: the costliest unit is indivisible."""
        return max(1.0, self.biggest_unit / self.ns_mean) if self.ns_mean else 1.0

    def vs_ideal(self, world: int) -> float:
        """Busiest rank's NS over the total spread evenly on all W ranks (HSDP replicas repeat it)."""
        return float(self.ns.max()) / (self.ns_total / world)


def plan_for(
    scheme: str, units: list[Unit], shardings: list[Sharding], group: int, bucket_bytes: int
) -> tuple[Plan, float]:
    start = time.process_time()
    if scheme == "DistMuon-like":
        # torchtitan's DistMuon: greedy LPT on ns·s²·(2l+s) (proportional to NS FLOPs), owners
        # chosen on load alone, one packed all_to_all out and one back per bucket.
        owners = _lpt_owners([ns_flops(u) for u in units], group)
        buckets = _size_buckets([4 * u.numel for u in units], bucket_bytes)
        plan = Plan(group, tuple(units), tuple(owners), tuple(tuple(b) for b in buckets))
    else:
        plan = build_plan(units, shardings, group, bucket_bytes)
    plan.fingerprint()  # the constructor checks it across ranks
    return plan, time.process_time() - start


def simulate(
    model: Model,
    world: int,
    layout: Layout,
    scheme: str,
    *,
    bucket_bytes: int,
    window: int,
    hardware: Hardware,
    split_heads: bool = False,
    host: bool = True,
    check: bool = False,
) -> Row:
    group = layout.group_size(world)
    units = units_of(model, split_heads)
    costs = [ns_flops(u) for u in units]
    placed = laid_out(model, world, layout)
    shardings = placed.shardings
    common = dict(model=model.name, world=world, layout=layout.name, scheme=scheme, group=group, units=len(units))
    common |= dict(ns_total=sum(costs), biggest_unit=max(costs))
    if scheme == "gather-everything":
        elements = model.elements
        held = np.zeros(group, dtype=np.int64)
        for sharding in {id(s): s for s in shardings}.values():
            count = sum(s is sharding for s in shardings)
            held += count * np.array([box_numel(sharding.box(r)) for r in range(group)], dtype=np.int64)
        per_rank = elements - held
        buckets = -(-4 * elements // bucket_bytes)
        row = Row(**common, buckets=buckets, ns=np.full(group, sum(costs)), per_step=2 * per_rank,
                  trip_s=hardware.all_gather_seconds(elements, group, 2), collectives=buckets, overlap_possible=False)  # fmt: skip
        row.sent_total = row.received_total = int(per_rank.sum())
        row.owners = group
        return row

    plan, plan_s = plan_for(scheme, units, shardings, group, bucket_bytes)
    loads = np.zeros(group, dtype=np.int64)
    np.add.at(loads, np.array(plan.owners), np.array(costs, dtype=np.int64))
    moved = traffic(plan.units, plan.owners, shardings, group, placed.holders)
    row = Row(**common, buckets=len(plan.rounds), ns=loads, per_step=moved.per_step, trip_s=hardware.trip_seconds(moved, 2),
              collectives=2 * len(plan.rounds) + (2 if scheme == "titan_muon" else 0),
              overlap_possible=scheme == "titan_muon", plan_s=plan_s)  # fmt: skip
    row.sent_total, row.received_total = int(moved.sent.sum()), int(moved.received.sum())
    row.owners = len(set(plan.owners))
    row.idle = group - row.owners
    if not host:
        return row

    busiest = int(loads.argmax())
    measured = sorted({0, busiest})  # rank 0 holds the largest shard (torch.chunk), `busiest` the most NS work
    start = time.process_time()
    schedules = {r: rank_tables(plan, shardings, r) for r in measured}
    row.schedule_s = (time.process_time() - start) / len(measured)
    if check:
        _check_against_schedules(plan, shardings, schedules, moved)
    row.host_tables_ms = 1e3 * max(seconds(walk_tables, schedules[r], plan.units, repeat=3) for r in measured)
    row.host_splits_ms = 1e3 * max(_split_lists_seconds(schedules[r], r) for r in measured)
    row.aten_ops = max(aten_ops(schedules[r], plan.units, shardings, r) for r in measured)
    row.shard_elements = max(sum(p.numel for s in schedules[r] for p in s.outbound) for r in measured)
    row.peak_bytes = max(peak_transient_bytes(schedules[r], plan.units, window, 2, 2, False) for r in measured)
    row.peak_overlap_bytes = max(peak_transient_bytes(schedules[r], plan.units, window, 2, 2, True) for r in measured)
    return row


def _split_lists_seconds(schedules: Sequence[RoundTables], rank: int, sample: int = 200) -> float:
    """Per-step cost with a warm cache (the first step builds it), timed on up to `sample`
    buckets and scaled to all."""
    part, cache = schedules[:sample], {}
    split_lists(part, rank, 2, cache)
    return seconds(split_lists, part, rank, 2, cache, repeat=2) * len(schedules) / max(1, len(part))


def aten_ops(schedules: Sequence[RoundTables], units: Sequence[Unit], shardings: Sequence[Sharding], rank: int) -> int:
    """aten ops of step()'s redistribute calls for one rank. Their control flow depends only on
    the shapes of a bucket's pieces and owned matrices, so buckets alike in those (one MoE
    expert each, or none of this rank's) are counted once per kind."""
    stacks = {}
    for index, sharding in enumerate(shardings):
        box = sharding.box(rank)
        stacks[index] = torch.empty(*(hi - lo for lo, hi in box), dtype=torch.float32, device="meta")
    kinds: dict[tuple, list[RoundTables]] = {}
    for s in schedules:
        kind = (
            tuple(p.shape for p in s.outbound),
            tuple((units[p.unit].shape, p.shape, p.cols) for p in s.inbound),
            tuple(units[u].shape for u in s.owned),
        )
        kinds.setdefault(kind, []).append(s)
    total = 0
    for alike in kinds.values():
        with OpCounter() as counter:
            redistribute_on_meta(alike[:1], units, stacks)
        total += counter.ops * len(alike)
    return total


def _check_against_schedules(plan: Plan, shardings, schedules: dict[int, tuple[RoundTables, ...]], moved: Traffic) -> None:
    """The holder-based traffic equals what the measured ranks' tables send and receive."""
    for r, tables in schedules.items():
        sent = sum(s.send_numel - s.send_counts[r] for s in tables)
        received = sum(s.recv_numel - s.recv_counts[r] for s in tables)
        assert (sent, received) == (int(moved.sent[r]), int(moved.received[r])), (r, sent, received)


# ------------------------------------------------------------------ report


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def ms(s: float) -> str:
    return "–" if s != s else (f"{s * 1e3:.0f}" if s >= 0.1 else f"{s * 1e3:.1f}")


def goal(row: Row) -> str:
    """NS max/mean ≤ 1.1 whenever units ≥ 4 × group ranks."""
    if row.units < 4 * row.group:
        return "n/a"
    if row.imbalance <= 1.1:
        return "met"
    return "missed (bound)" if row.bound > 1.1 else "missed"


def step_seconds(row: Row, hardware: Hardware, overlap: bool = False) -> float:
    ns = hardware.ns_seconds(float(row.ns.max()))
    if row.scheme == "gather-everything":
        return ns + row.trip_s + row.collectives * hardware.latency_s
    trips = 1 if overlap else 2
    return ns + trips * row.trip_s + row.collectives * hardware.latency_s


def plan_table(rows: Sequence[Row], hardware: Hardware) -> list[str]:
    lines = [
        "| model | W | layout | units | buckets | idle ranks | NS max/mean (bound) | goal | GB sent/rank max / mean | "
        "collectives | step ms (overlap) | peak transient GiB (overlap) | plan s | tables s | host ms/step: tables + splits | "
        "aten ops/step |",
        "|---|---:|---|---:|---:|---:|---|---|---|---:|---|---|---:|---:|---|---:|",
    ]
    for r in rows:
        sent = f"{r.per_step.max() * 2 / 1e9:.2f} / {r.per_step.mean() * 2 / 1e9:.2f}"
        step = f"{ms(step_seconds(r, hardware))} ({ms(step_seconds(r, hardware, overlap=True))})"
        lines.append(
            f"| {r.model} | {r.world} | {r.layout} | {r.units} | {r.buckets} | {r.idle} | {r.imbalance:.2f} ({r.bound:.2f}) | "
            f"{goal(r)} | {sent} | {r.collectives} | {step} | {gib(r.peak_bytes)} ({gib(r.peak_overlap_bytes)}) | "
            f"{r.plan_s:.2f} | {r.schedule_s:.2f} | {r.host_tables_ms:.1f} + {r.host_splits_ms:.1f} | {r.aten_ops} |"
        )
    return lines


def step_table(groups: Sequence[Sequence[Row]], hardware: Hardware) -> list[str]:
    lines = [
        "| model | W | layout | titan_muon NS ms | comm ms (2 trips) | latency ms | step ms | with overlap | "
        "DistMuon-like NS / step ms | DistMuon-like GB/rank max | gather-everything NS / step ms | gather GB/rank |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    for titan, dist, gather in groups:
        lines.append(
            f"| {titan.model} | {titan.world} | {titan.layout} | {ms(hardware.ns_seconds(titan.ns.max()))} | {ms(2 * titan.trip_s)} | "
            f"{ms(titan.collectives * hardware.latency_s)} | {ms(step_seconds(titan, hardware))} | "
            f"{ms(step_seconds(titan, hardware, overlap=True))} | "
            f"{ms(hardware.ns_seconds(dist.ns.max()))} / {ms(step_seconds(dist, hardware))} | {dist.per_step.max() * 2 / 1e9:.2f} | "
            f"{ms(hardware.ns_seconds(gather.ns.max()))} / {ms(step_seconds(gather, hardware))} | {gather.per_step.max() * 2 / 1e9:.2f} |"
        )
    return lines


def options_table(rows: Sequence[tuple[str, Row]], hardware: Hardware) -> list[str]:
    lines = [
        "| model | W | option | units | idle ranks | NS max/mean | NS max / (total/W) | busiest NS ms | GB sent/rank max | step ms (overlap) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for option, r in rows:
        lines.append(
            f"| {r.model} | {r.world} | {option} | {r.units} | {r.idle} | {r.imbalance:.2f} | {r.vs_ideal(r.world):.2f} | "
            f"{ms(hardware.ns_seconds(r.ns.max()))} | {r.per_step.max() * 2 / 1e9:.2f} | {ms(step_seconds(r, hardware))}"
            + (f" ({ms(step_seconds(r, hardware, overlap=True))})" if r.overlap_possible else "")
            + " |"
        )
    return lines


# ------------------------------------------------------------------ main


@dataclass
class Config:
    models: list[str]
    worlds: list[int]
    hsdp: list[int]  # shard group sizes
    option_worlds: list[int]  # W at which the balancing options are compared
    scaled_worlds: list[int]  # W at which buckets of bucket_mb × W / 8 are simulated too
    bucket_mb: float = 64.0
    window: int = 2
    expert_parallel: int = 64  # EP degree of the MoE layout (DeepSeek-V3 trained with EP 64)


FULL = Config(list(PRESETS), [8, 64, 256, 1024, 4096], [8, 64], [1024, 4096], [1024, 4096])
QUICK = Config(["Llama-3 8B"], [8, 64], [8], [64], [64])


def run(config: Config, hardware: Hardware, *, check: bool = False, log=print) -> dict[str, list]:
    """Every table's rows; `check` compares the traffic with the measured ranks' tables."""
    bucket_bytes = int(config.bucket_mb * 2**20)
    kw = dict(window=config.window, hardware=hardware, check=check)
    out: dict[str, list] = {"plan": [], "step": [], "options": [], "scaled": []}
    for name in config.models:
        model = PRESETS[name]
        layouts = [Layout()]
        if any(len(shape) == 3 for _, shape in model.params):
            layouts.append(Layout(expert_parallel=config.expert_parallel))
        for world, layout in itertools.product(config.worlds, layouts):
            if layout.expert_parallel and world < layout.expert_parallel:
                continue
            start = time.perf_counter()
            titan = simulate(model, world, layout, "titan_muon", bucket_bytes=bucket_bytes, **kw)
            dist = simulate(model, world, layout, "DistMuon-like", bucket_bytes=bucket_bytes, host=False, **kw)
            gather = simulate(model, world, layout, "gather-everything", bucket_bytes=bucket_bytes, **kw)
            out["plan"].append(titan)
            out["step"].append((titan, dist, gather))
            if world in config.option_worlds and layout == Layout():
                out["options"] += [("whole matrices, byte-aware LPT (default)", titan), ("whole matrices, LPT on NS FLOPs only", dist)]
                split = simulate(model, world, layout, "titan_muon", bucket_bytes=bucket_bytes, split_heads=True, host=False, **kw)
                out["options"].append(("Split: attention head blocks", split))
                for size in config.hsdp:
                    if size < world:
                        hsdp = simulate(model, world, Layout(size), "titan_muon", bucket_bytes=bucket_bytes, host=False, **kw)
                        out["options"].append((f"HSDP, shard group {size}", hsdp))
            if world in config.scaled_worlds:
                out["scaled"].append(simulate(model, world, layout, "titan_muon", bucket_bytes=bucket_bytes * world // 8, **kw))
            log(f"{name} W={world} {layout.name}: {time.perf_counter() - start:.1f} s")
        for size in config.hsdp:  # independent of W: each shard group plans alone
            out["plan"].append(simulate(model, max(config.worlds + [size]), Layout(size), "titan_muon", bucket_bytes=bucket_bytes, **kw))
    return out


def render(out: dict[str, list], config: Config, hardware: Hardware, command: str, elapsed: tuple[float, float, float]) -> str:
    machine = _cpu_name()
    date = datetime.date.today().isoformat()
    h = hardware
    text = f"""# titan_muon at scale (simulated)

`{command}` on {machine} (2 cores, shared: load average {elapsed[2]:.0f} at the start), {date}, torch
{torch.__version__}; the run took {elapsed[0]:.0f} s wall, {elapsed[1]:.0f} s of CPU. Host times below are CPU times.
Written by `scripts/simulate_scale.py`; invariants checked by `tests/test_simulate_scale.py`
(traffic equals every rank's `rank_schedule` on FSDP, HSDP, EP and Split layouts; bytes and
NS FLOPs conserved; idle ranks = ranks without NS work).

{{key}}

## How it is simulated

No GPU and no process group: the plan (`plan.build_plan`), per-rank tables
(`plan.rank_schedule`) and every rank's traffic (`Sharding.holders`) come from the functions
the optimizer runs. Buckets of {config.bucket_mb:g} MiB (and of {config.bucket_mb:g} MiB × W/8, which the optimizer's default max(64, 8·W) MiB gives),
`buckets_in_flight` = {config.window}, bf16 on the wire and in Newton–Schulz (the GPU
default `"auto"`); fp32 on the wire doubles every byte figure. NS is costed as the standard
iteration's FLOPs (`ns_algorithm="standard"`); the default `"auto"` runs Gram NS on MLP and
k/v shapes, about 0.57× those FLOPs there, so NS times here are upper bounds.

**What is simulated.** The Muon matrices `build_param_groups` picks: attention, dense and
shared-expert MLPs, and routed experts as one `(experts, out, in)` stack each, one matrix
per expert (passed to Muon with `muon_patterns={list(MUON_PATTERNS)}`; the 2-D router gate is
kept in AdamW with `adamw_patterns={list(ADAMW_PATTERNS)}`). Embeddings, output head, norms
and router are AdamW and not simulated. Shapes come from torchtitan 0.2.2's `llama3_args`
and `deepseekv3_args["671B"]`, and Kimi-K2's published config (DeepSeek-V3 with 384
experts, 64 heads, one dense layer); `--verify-shapes` builds each model on `meta` and
compares every Muon parameter's name and shape.

**Layouts.** FSDP: every parameter `Shard(0)` over all W ranks — routed experts too: without
EP torchtitan 0.2.2 shards experts with their transformer block on the expert dimension, so
at W > experts the ranks past the expert count hold no expert. FSDP+EP {{ep}} (MoE presets,
W ≥ {{ep}}): dense parameters as FSDP; experts `Shard(0)` over `ep` = {{ep}} and FSDP'd over
`efsdp` = W / {{ep}} — FSDP2's `_StridedShard(0)`, or `Shard(1)` (expert rows) once efsdp·ep >
experts, as torchtitan's parallelize chooses; all on one exchange group of W ranks, as the
optimizer requires. HSDP: `(Replicate, Shard(0))` with a shard group of 8 (one node) or 64
ranks; Muon plans over the shard group, so every replica repeats the same NS work and the
figures do not depend on W. 8 GPUs per node; FSDP ranks and shard groups are consecutive.

**Schemes.** *titan_muon*: whole-matrix owners by LPT on NS FLOPs, byte-aware (a holder of
the matrix wins when its load stays within 5 % of the mean of the least loaded). *DistMuon-like*
(torchtitan main's `DistMuon`): its LPT cost ns·s²·(2l+s) is proportional to NS FLOPs, so
the same LPT without the byte-aware choice, same buckets, one all-to-all out and one back
per bucket, no overlap with backward. *gather-everything*: every rank all-gathers every
matrix and runs all NS itself.

**Step-time model** (H100 SXM): NS of the busiest owner at {h.ns_efficiency:.0%} of
{h.bf16_flops / 1e12:.0f} TFLOP/s bf16; an all-to-all trip takes the slowest rank's
max(sent, received) bytes, same-node bytes over NVLink at {h.nvlink_bytes_per_s / 1e9:.0f} GB/s
and other-node bytes over InfiniBand at {h.ib_bytes_per_s / 1e9:.0f} GB/s per GPU at the same time;
all-gather: ring, (g−1)/g of the bytes per rank at NVLink speed within a node, else IB;
{h.latency_s * 1e6:.0f} µs per collective; compute and communication added (the window overlaps
them in reality). *With overlap*: the outbound trip leaves during backward (only gradients
travel) and is not counted. FSDP's own collectives, AdamW and the element-wise update are
not included.

**Peak transient bytes** per rank (the larger of rank 0, which holds the largest shard, and
the busiest owner), from `peak_transient_bytes` in the script, with S_b / R_b the elements a
rank sends / receives in bucket b:
held = 2·ΣS (returned updates are views of the return buffers, kept until the commit);
exchange(b) = 2·Σ_(window ahead)(S+R) + 4·S (fp32 Nesterov pieces being packed) + 2·Σ_(window behind)R
(return sends) + NS(b) = R_b·(2·2+4) + 2·2·Σ min(m,n)²; commit = held + 4·ΣS (updates cast to the
fp32 parameters a group at once); peak = max(held + max_b exchange(b), commit). With overlap:
2·Σ(S+R) (backward's buffers, alive until step() waits) + 4·ΣR (owners' new momentum until the
commit) + max(return window + NS, 4·ΣS).

**Host time per step** (what step() reads on the host from the precomputed tables), for the
slower of rank 0 and the busiest owner: *tables* walks every piece, count and owned unit the
step reads; *splits* is what `transport.all_to_all` recomputes per call from the counts (byte
split lists and sums, O(W) Python per call, two calls per bucket; timed on ≤ 200 buckets and
scaled). *aten ops/step*: step()'s `pack`/`assemble`/`disassemble`/`unpack` calls run on
`meta` tensors under an op counter — the tensor ops a GPU step dispatches from the host for
redistribution (transport's buffer views and the collectives themselves not included).
*plan s*: `build_plan` + fingerprint; *tables s*: one rank's `rank_schedule`.

"""
    text = text.replace("{key}", "\n".join(key_figures(out, config, hardware))).replace("{ep}", str(config.expert_parallel))
    text += "## Plans, traffic, memory and host time (FSDP rows per W; HSDP rows hold for any W)\n\n"
    text += "\n".join(plan_table(out["plan"], hardware)) + "\n\n"
    text += "*bound*: the lowest NS max/mean any whole-matrix plan can reach (the costliest unit / the mean). "
    text += "*goal*: NS max/mean ≤ 1.1 whenever units ≥ 4 × ranks (`n/a`: fewer units); `missed (bound)`: no whole-matrix plan can meet it.\n\n"
    text += "## Estimated H100 optimizer step, side by side (bf16 wire and NS)\n\n"
    text += "\n".join(step_table(out["step"], hardware)) + "\n\n"
    text += f"## Buckets that grow with W: bucket_size_mb = {config.bucket_mb:g} × W / 8\n\n"
    text += "\n".join(plan_table(out["scaled"], hardware)) + "\n\n"
    text += "## When whole matrices cannot balance: options\n\n"
    text += "\n".join(options_table(out["options"], hardware)) + "\n\n"
    return text


def _find(rows, model: str, world: int, layout: str = "FSDP", scheme: str = "titan_muon") -> Row | None:
    return next((r for r in rows if (r.model, r.world, r.layout, r.scheme) == (model, world, layout, scheme)), None)


def key_figures(out: dict[str, list], config: Config, hardware: Hardware, world: int = 1024) -> list[str]:
    """The headline table at one W, then the findings, with figures taken from the rows."""
    if world not in config.worlds:
        world = config.worlds[-1]
    flat = [r for triple in out["step"] for r in triple]
    lines = [
        f"## Key figures at W = {world}",
        "",
        f"| model | layout | units | NS max/mean (bound) | busiest NS ms | host ms/step, {config.bucket_mb:g} MiB buckets: tables + splits | "
        f"host ms/step, buckets × W/8 | step ms (overlap), {config.bucket_mb:g} MiB | step ms (overlap), buckets × W/8 | "
        "DistMuon-like step ms | gather-everything step ms |",
        "|---|---|---:|---|---:|---|---|---|---|---:|---:|",
    ]
    for titan, dist, gather in (t for t in out["step"] if t[0].world == world):
        scaled = _find(out["scaled"], titan.model, world, titan.layout)
        scaled_host = f"{scaled.host_tables_ms:.1f} + {scaled.host_splits_ms:.1f}" if scaled else "–"
        scaled_step = f"{ms(step_seconds(scaled, hardware))} ({ms(step_seconds(scaled, hardware, True))})" if scaled else "–"
        lines.append(
            f"| {titan.model} | {titan.layout} | {titan.units} | {titan.imbalance:.2f} ({titan.bound:.2f}) | "
            f"{ms(hardware.ns_seconds(titan.ns.max()))} | {titan.host_tables_ms:.1f} + {titan.host_splits_ms:.1f} | {scaled_host} | "
            f"{ms(step_seconds(titan, hardware))} ({ms(step_seconds(titan, hardware, True))}) | {scaled_step} | "
            f"{ms(step_seconds(dist, hardware))} | {ms(step_seconds(gather, hardware))} |"
        )
    lines += ["", "## Findings", ""] + findings(out, config, hardware, world, flat)
    return lines


def findings(out, config: Config, hardware: Hardware, world: int, flat: list[Row]) -> list[str]:
    titans = [r for r in flat if r.scheme == "titan_muon"]
    at = [r for r in titans if r.world == world]
    dense = [r for r in at if r.layout == "FSDP" and r.units == PRESETS[r.model].matrices and r.model.startswith("Llama")]
    moe = [r for r in at if r.model not in {d.model for d in dense}]
    scaled = [r for r in out["scaled"] if r.world == world]
    text = []

    def span(values, fmt="{:.1f}"):
        if not values:
            return "–"
        low, high = fmt.format(min(values)), fmt.format(max(values))
        return low if low == high else f"{low}–{high}"

    if at:
        text.append(
            f"- **Host work per step at W = {world}.** Reading the precomputed tables costs {span([r.host_tables_ms for r in dense])} ms "
            f"of CPU per step for the dense presets and {span([r.host_tables_ms for r in moe])} ms for the MoE presets with "
            f"{config.bucket_mb:g} MiB buckets ({span([r.buckets for r in moe], '{:,}')} buckets: one expert each), "
            f"{span([r.host_tables_ms for r in scaled])} ms with buckets of {config.bucket_mb:g} MiB × W/8 (the optimizer's default, "
            "max(64, 8·W) MiB). `transport.all_to_all` builds its W-long byte split lists once per schedule and then looks them "
            f"up: {span([r.host_splits_ms for r in at], '{:,.1f}')} ms per step here ({span([r.host_splits_ms for r in scaled], '{:,.1f}')} ms "
            "with the larger buckets). The goal (< 5 ms) holds for every preset with the default bucket size."
        )
    goal_rows = [r for r in titans if r.units >= 4 * r.group]
    missed = [r for r in goal_rows if r.imbalance > 1.1]
    text.append(
        f"- **Balance.** NS max/mean ≤ 1.1 holds in {len(goal_rows) - len(missed)} of the {len(goal_rows)} configurations with "
        "units ≥ 4 × ranks" + (
            "; it fails in " + ", ".join(sorted({f"{r.model} at W = {r.world} ({r.imbalance:.2f}, bound {r.bound:.2f})" for r in missed}))
            + ": one unit (a dense-layer MLP matrix) costs more than a rank's mean share, so no whole-matrix plan can meet it; "
            f"the busiest owner then needs {span([hardware.ns_seconds(r.ns.max()) * 1e3 for r in missed], '{:.0f}')} ms of NS."
            if missed else "."
        )
    )
    idle = [r for r in titans if r.layout == "FSDP" and r.idle and r.units == PRESETS[r.model].matrices]
    if idle:
        floor = {r.model: hardware.ns_seconds(r.ns.max()) * 1e3 for r in idle}
        text.append(
            "- **Fewer matrices than ranks** (" + ", ".join(f"{m}: {PRESETS[m].matrices} matrices" for m in floor) + "): LPT gives "
            "the costliest matrices to distinct ranks and the other ranks own nothing (e.g. "
            + ", ".join(f"{r.idle} of {r.world}" for r in idle if r.world == world)
            + f" at W = {world}); the busiest owner holds one MLP matrix, so NS time stops falling at "
            + ", ".join(f"{v:.1f} ms ({m})" for m, v in floor.items())
            + ". NS max/mean then equals its bound (the plan is the best whole-matrix plan) and grows with W while the "
            "absolute NS time stays flat. Options (last table): Split into attention head blocks adds units but leaves the "
            "MLP matrices that set the maximum (and changes the math: heads are orthogonalized separately); owners within "
            "HSDP shard groups balance inside each group (max/mean ≈ 1) but every replica repeats all the NS work, so the "
            f"busiest rank does {world // max(config.hsdp)}× (group {max(config.hsdp)}) to {world // min(config.hsdp)}× "
            f"(group {min(config.hsdp)}) the ideal share at W = {world} — slower in absolute time. "
            "Row blocks of one matrix would not be the same math and are not considered. What would lower the floor is "
            "running one matrix's NS on several ranks (e.g. a node computing X·Xᵀ and the products in blocks): not implemented."
        )
    pairs = list({(t.model, t.world): (t, d) for t, d, _ in out["step"] if d.per_step.max() > 1.2 * t.per_step.max()}.values())
    if pairs:
        text.append(
            "- **Byte-aware owners vs DistMuon-like.** For dense matrices under FSDP both send the same bytes (every rank holds an "
            "equal slice of every matrix, so no owner saves any). Where matrices live whole on few ranks — routed experts — "
            "titan_muon keeps them with their holders: " + ", ".join(
                f"{t.model} W = {t.world}: {t.per_step.max() * 2 / 1e9:.2f} vs {d.per_step.max() * 2 / 1e9:.1f} GB per rank"
                for t, d in pairs[:4]) + ", for at most "
            + f"{max((t.ns.max() / d.ns.max() - 1) * 100 for t, d in pairs):.0f} % more NS on the busiest owner."
        )
    gathers = [g for _, _, g in out["step"] if g.world == world]
    if gathers:
        text.append(
            f"- **Gather-everything** makes every rank run all the NS: {span([hardware.ns_seconds(g.ns.max()) for g in gathers], '{:.1f}')} s "
            f"per step at any W, plus all-gathering every Muon matrix ({span([g.per_step.max() * 2 / 1e9 for g in gathers], '{:,.0f}')} GB per rank)."
        )
    moe_rows = [r for r in titans if r.world == world and r.model in {m.model for m in moe}]
    if moe_rows and scaled:
        best = [r for r in scaled if r.model in {m.model for m in moe}]
        text.append(
            f"- **Bucket size for MoE models.** A {config.bucket_mb:g} MiB bucket holds one expert (2048 × 7168 fp32 = 56 MiB), so "
            f"DeepSeek-V3 / Kimi-K2 run {span([r.collectives for r in moe_rows], '{:,}')} collectives per step; at "
            f"{hardware.latency_s * 1e6:.0f} µs each that alone is {span([r.collectives * hardware.latency_s for r in moe_rows], '{:.1f}')} s "
            f"and dominates the step. Buckets of {config.bucket_mb:g} MiB × W/8 (the default's size per rank at W = 8) cut this to "
            f"{span([r.collectives for r in best], '{:,}')} collectives and the estimated step to "
            f"{span([step_seconds(r, hardware) * 1e3 for r in best], '{:.0f}')} ms at W = {world}, with the same peak memory: "
            "bucket_size_mb should grow with W (or be defined per rank)."
        )
    ep = [(r, _find(titans, r.model, r.world)) for r in titans if r.layout.startswith("FSDP+EP") and r.world == world]
    if ep:
        text.append(
            "- **Experts without EP.** FSDP2's `Shard(0)` of E experts on W > E ranks gives whole experts to the first ranks "
            "and none to the others (torch.chunk), so those ranks hold and send most of the Muon bytes: at "
            f"W = {world} peak transient {span([f.peak_bytes / 2**30 for _, f in ep])} GiB and up to "
            f"{span([f.per_step.max() * 2 / 1e9 for _, f in ep])} GB per step; with EP {config.expert_parallel} (torchtitan switches "
            "expert FSDP to rows once efsdp·ep > experts) experts spread over all ranks: "
            f"{span([r.peak_bytes / 2**30 for r, _ in ep])} GiB and {span([r.per_step.max() * 2 / 1e9 for r, _ in ep])} GB, balanced."
        )
    smallest = [r for r in titans if r.world == min(config.worlds) and r.layout == "FSDP" and r.shard_elements]
    largest = [r for r in titans if r.world == world and r.shard_elements]
    if smallest and largest:
        per_element = [r.peak_bytes / r.shard_elements for r in smallest]
        text.append(
            "- **Memory.** Two terms. The updates: the returned bf16 updates (2 B per element of the rank's Muon shard, kept "
            "until the commit by design: nothing changes before every rank got through; the commit adds them to the fp32 "
            "parameters in place, without a converted copy). The window: the buckets in flight plus the owner's whole "
            "matrices in NS (about 10 B per element it owns in a bucket). At W = "
            f"{min(config.worlds)} the peak is {span(per_element, '{:.1f}')} B per element of the larger measured shard; at "
            f"W = {world} it is {span([r.peak_bytes / 2**30 for r in largest], '{:.2f}')} GiB, and in "
            f"{sum(r.peak_bytes > 4.05 * r.shard_elements for r in largest)} of {len(largest)} rows the window dominates "
            "(shards are small, but an owner still receives whole matrices). "
            "With overlap, the buffers received during backward are alive when step() starts and are dropped bucket by "
            "bucket, while the owners' new fp32 momentum accumulates until the commit."
        )
    plan_s = [r.plan_s for r in titans]
    text.append(
        f"- **Planning cost** (once, when the optimizer is built, on every rank): `build_plan` + fingerprint "
        f"{span(plan_s, '{:.2f}')} s of CPU, one rank's tables {span([r.schedule_s for r in titans], '{:.2f}')} s, on this loaded machine."
    )
    return text


def _cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def verify_shapes(names: Sequence[str]) -> None:
    for name in names:
        expected = list(PRESETS[name].params)
        actual = torchtitan_muon_params(name)
        if actual != expected:
            diff = next(i for i, (a, b) in enumerate(itertools.zip_longest(actual, expected)) if a != b)
            raise SystemExit(f"{name}: preset differs from torchtitan at parameter {diff}: {actual[diff:diff + 1]} vs {expected[diff:diff + 1]}")
        print(f"{name}: {len(actual)} Muon parameters match torchtitan 0.2.2")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Llama-3 8B at W = 8 and 64 only; writes nothing")
    parser.add_argument("--verify-shapes", action="store_true", help="compare the presets with torchtitan's models built on meta")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--buckets-in-flight", type=int, default=2)
    parser.add_argument("--ns-efficiency", type=float, default=Hardware.ns_efficiency)
    parser.add_argument("--nvlink-gbps", type=float, default=Hardware.nvlink_bytes_per_s / 1e9, help="GB/s per GPU per direction")
    parser.add_argument("--ib-gbps", type=float, default=Hardware.ib_bytes_per_s / 1e9, help="GB/s per GPU per direction")
    parser.add_argument("--latency-us", type=float, default=Hardware.latency_s * 1e6)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "scale.md")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    config.bucket_mb, config.window = args.bucket_mb, args.buckets_in_flight
    hardware = Hardware(ns_efficiency=args.ns_efficiency, nvlink_bytes_per_s=args.nvlink_gbps * 1e9,
                        ib_bytes_per_s=args.ib_gbps * 1e9, latency_s=args.latency_us * 1e-6)  # fmt: skip
    if args.verify_shapes:
        verify_shapes(config.models)
    load = os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    out = run(config, hardware, check=args.quick)
    elapsed = (time.perf_counter() - start, time.process_time() - cpu, load)
    command = "python scripts/simulate_scale.py" + ("".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])))
    text = render(out, config, hardware, command.strip(), elapsed)
    if args.quick:
        print(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out} ({elapsed[0]:.0f} s wall, {elapsed[1]:.0f} s CPU)")


if __name__ == "__main__":
    main()
