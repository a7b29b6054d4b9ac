"""Who orthogonalizes what, and what each rank sends where: pure functions of shapes and placements.

Newton–Schulz needs whole matrices, but under FSDP2 (and TP, EP) every rank holds only a
block of each. Every matrix ("unit": a parameter, one expert of a grouped MoE weight, or a
row block of one when attention heads are split) gets one owner rank. Units are packed into
buckets in the order backward produces their gradients; per bucket every rank sends the
pieces it holds to the owners with one ``all_to_all_single``, owners orthogonalize, and a
second ``all_to_all_single`` with the mirrored split sizes brings each rank its pieces back.

:func:`build_plan` decides owners and buckets (the same on every rank: the optimizer checks
a fingerprint once); :func:`rank_schedule` turns the plan into the tables one rank needs per
step — split sizes and buffer offsets — computed once, so a step only reads them. Nothing
here touches torch.distributed.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from titan_muon.layout import Box, Sharding, box_numel, chunk_range
from titan_muon.newton_schulz import newton_schulz_flops


def shard_rows(num_rows: int, world_size: int) -> list[tuple[int, int]]:
    """Row range [start, end) each rank holds under FSDP2 / DTensor ``Shard(0)`` (torch.chunk split)."""
    return [chunk_range(num_rows, world_size, r) for r in range(world_size)]


@dataclass(frozen=True)
class Unit:
    """One matrix for Newton–Schulz: rows [row_start, row_end) of matrix `matrix` of parameter `param`."""

    param: int
    matrix: int
    row_start: int
    row_end: int
    cols: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def box(self) -> Box:
        return ((self.matrix, self.matrix + 1), (self.row_start, self.row_end), (0, self.cols))


@dataclass(frozen=True)
class Plan:
    world_size: int
    units: tuple[Unit, ...]
    owners: tuple[int, ...]  # owner rank of each unit
    buckets: tuple[tuple[int, ...], ...]  # unit indices, in communication order

    def fingerprint(self) -> int:
        """A 63-bit digest of the whole plan, equal on ranks that computed the same plan."""
        digest = hashlib.sha256(repr((self.world_size, self.units, self.owners, self.buckets)).encode())
        return int.from_bytes(digest.digest()[:8], "little") >> 1


def make_buckets(unit_bytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive units, each bucket at most `bucket_bytes` unless a single unit is larger."""
    buckets: list[list[int]] = []
    filled = 0
    for u, size in enumerate(unit_bytes):
        if not buckets or filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(u)
        filled += size
    return buckets


def assign_owners(
    costs: Sequence[int],
    world_size: int,
    *,
    numels: Sequence[int] | None = None,
    local_pieces: Sequence[dict[int, int]] | None = None,
    shard_numels: Sequence[int] | None = None,
    slack: float = 0.05,
) -> list[int]:
    """Longest-processing-time greedy on Newton–Schulz cost, aware of bytes.

    Costliest unit first. Without byte information: to the least loaded rank (lowest on
    ties), which keeps the busiest owner within the mean plus one unit. With it
    (``numels[u]``, ``local_pieces[u] = {rank: elements of u that rank holds}``,
    ``shard_numels[r]``): among the least loaded rank and the ranks holding part of the unit,
    those whose load stays within ``slack`` × the mean load of the least loaded one are
    eligible, and the one whose traffic stays lowest against its 2× shard bound wins (ties:
    more local elements, then less load). A rank sends, per step, its shard's pieces of units
    owned elsewhere plus the other ranks' pieces of the units it owns: owning u changes that
    by ``numel(u) − 2 · local(u)``.
    """
    owners = [-1] * len(costs)
    loads = [0] * world_size
    heap = [(0, r) for r in range(world_size)]  # (load, rank); every change of a load pushes a fresh entry
    byte_aware = numels is not None and local_pieces is not None and shard_numels is not None
    sent = list(shard_numels) if byte_aware else []
    margin = slack * sum(costs) / max(world_size, 1)
    for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
        while heap[0][0] != loads[heap[0][1]]:  # stale: that rank's current load was pushed when it changed
            heapq.heappop(heap)
        least = heap[0][1]
        rank = least
        if byte_aware:
            candidates = {least, *local_pieces[u]}

            def score(r: int) -> tuple:
                after = sent[r] + numels[u] - 2 * local_pieces[u].get(r, 0)
                return (max(0, after - 2 * shard_numels[r]), -local_pieces[u].get(r, 0), loads[r], r)

            eligible = [r for r in candidates if loads[r] <= loads[least] + margin]
            rank = min(eligible, key=score)
            sent[rank] += numels[u] - 2 * local_pieces[u].get(rank, 0)
        owners[u] = rank
        loads[rank] += costs[u]
        heapq.heappush(heap, (loads[rank], rank))
    return owners


def build_plan(
    units: Sequence[Unit],
    shardings: Sequence[Sharding],
    world_size: int,
    bucket_bytes: int,
    cost: Callable[[Unit], int] | None = None,
    max_holders: int = 8,
) -> Plan:
    """Bucket `units` in the given order (4-byte elements for sizing) and give each an owner.

    ``shardings[unit.param]`` says which ranks hold which part of each unit; ``cost(unit)`` is
    its Newton–Schulz cost (default: FLOPs of 5 standard steps). Units spread over more
    than ``max_holders`` ranks gain nothing from locality and are placed on load alone.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cost = cost or (lambda unit: newton_schulz_flops(unit.rows, unit.cols, 5))
    buckets = make_buckets([4 * unit.numel for unit in units], bucket_bytes)
    costs = [cost(unit) for unit in units]
    local_pieces = []
    for unit in units:
        holders = list(itertools.islice(shardings[unit.param].holders(unit.box), max_holders + 1))
        local_pieces.append({} if len(holders) > max_holders else {r: box_numel(piece) for r, piece in holders})
    shard_numels = [0] * world_size
    repeats = Counter(shardings[param] for param in {u.param for u in units})  # models repeat a few shardings
    for sharding, count in repeats.items():
        for r in range(world_size):
            shard_numels[r] += count * box_numel(sharding.box(r))
    owners = assign_owners(
        costs, world_size, numels=[u.numel for u in units], local_pieces=local_pieces, shard_numels=shard_numels
    )
    return Plan(world_size, tuple(units), tuple(owners), tuple(tuple(b) for b in buckets))


# ------------------------------------------------------------------ per-rank tables


@dataclass(frozen=True)
class Piece:
    """The part of a unit one rank holds, and where it sits in an exchange buffer.

    ``peer``: for an outbound piece the owner it goes to; for an inbound piece the rank it
    comes from. ``rows`` / ``cols``: the piece's place inside the unit. ``local``: for outbound
    pieces, (matrix, row start, row end) inside this rank's local (matrices, rows, cols) stack;
    an outbound piece always spans the local block's columns.
    """

    unit: int
    peer: int
    offset: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    local: tuple[int, int, int] = (0, 0, 0)

    @property
    def numel(self) -> int:
        return (self.rows[1] - self.rows[0]) * (self.cols[1] - self.cols[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])


@dataclass(frozen=True)
class BucketSchedule:
    """One rank's view of one bucket. The return trip uses the same tables mirrored:
    owners send ``inbound``'s layout back with ``recv_counts`` as split sizes, and this rank
    receives its updates in ``outbound``'s layout."""

    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    outbound: tuple[Piece, ...]  # ordered by owner, then bucket order
    inbound: tuple[Piece, ...]  # pieces of owned units, ordered by source rank, then bucket order
    owned: tuple[int, ...]  # units this rank owns, bucket order

    @property
    def send_numel(self) -> int:
        return sum(self.send_counts)

    @property
    def recv_numel(self) -> int:
        return sum(self.recv_counts)


def bucket_schedule(
    plan: Plan, shardings: Sequence[Sharding], bucket: int, rank: int, boxes: Sequence[Box] | None = None
) -> BucketSchedule:
    """`rank`'s tables for one bucket; ``boxes[param]`` (optional) is `rank`'s block of each parameter."""
    members = plan.buckets[bucket]
    send_counts: dict[int, int] = {}  # peer -> elements; most peers get nothing
    recv_counts: dict[int, int] = {}
    outbound_raw = []
    for u in members:
        unit = plan.units[u]
        mine = boxes[unit.param] if boxes is not None else shardings[unit.param].box(rank)
        piece = _intersection(mine, unit.box)
        if piece is None:
            continue
        (m0, _), (r0, r1), (c0, c1) = piece
        local = (m0 - mine[0][0], r0 - mine[1][0], r1 - mine[1][0])
        outbound_raw.append((plan.owners[u], u, (r0 - unit.row_start, r1 - unit.row_start), (c0, c1), local))
    outbound_raw.sort(key=lambda p: p[0])  # stable: bucket order within an owner
    outbound, offset = [], 0
    for owner, u, rows, cols, local in outbound_raw:
        piece = Piece(u, owner, offset, rows, cols, local)
        outbound.append(piece)
        send_counts[owner] = send_counts.get(owner, 0) + piece.numel
        offset += piece.numel

    owned = tuple(u for u in members if plan.owners[u] == rank)
    inbound_raw = []
    for order, u in enumerate(owned):
        unit = plan.units[u]
        for src, ((_, _), (r0, r1), (c0, c1)) in shardings[unit.param].holders(unit.box):
            inbound_raw.append((src, order, u, (r0 - unit.row_start, r1 - unit.row_start), (c0, c1)))
    inbound_raw.sort(key=lambda p: (p[0], p[1]))
    inbound, offset = [], 0
    for src, _, u, rows, cols in inbound_raw:
        piece = Piece(u, src, offset, rows, cols)
        inbound.append(piece)
        recv_counts[src] = recv_counts.get(src, 0) + piece.numel
        offset += piece.numel
    world = plan.world_size
    return BucketSchedule(
        split_sizes(send_counts, world), split_sizes(recv_counts, world), tuple(outbound), tuple(inbound), owned
    )


def rank_schedule(plan: Plan, shardings: Sequence[Sharding], rank: int) -> tuple[BucketSchedule, ...]:
    """Everything `rank` needs per step, bucket by bucket: computed once, read every step."""
    boxes = [sharding.box(rank) for sharding in shardings]
    return tuple(bucket_schedule(plan, shardings, b, rank, boxes) for b in range(len(plan.buckets)))


@functools.lru_cache(maxsize=8)
def _no_traffic(world: int) -> tuple[int, ...]:
    return (0,) * world


def split_sizes(counts: dict[int, int], world: int) -> tuple[int, ...]:
    """Per-peer element counts as the dense tuple ``all_to_all_single`` takes. A rank takes no
    part in most buckets of a large model (one MoE expert per bucket at W = 1024): those share
    one all-zero tuple, so the tables stay small."""
    if not counts:
        return _no_traffic(world)
    dense = [0] * world
    for peer, count in counts.items():
        dense[peer] = count
    return tuple(dense)


def _intersection(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def elements_sent(schedules: Sequence[BucketSchedule], rank: int) -> int:
    """Elements `rank` puts on the wire per step (outbound + return trip), self excluded."""
    return sum(
        s.send_numel - s.send_counts[rank] + s.recv_numel - s.recv_counts[rank] for s in schedules
    )


def ns_cost(plan: Plan, rank: int, cost: Callable[[Unit], int]) -> int:
    return sum(cost(u) for u, owner in zip(plan.units, plan.owners) if owner == rank)
