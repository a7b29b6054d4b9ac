"""Who orthogonalizes what, in which round, and what each rank sends where: pure functions of shapes and placements.

Newton–Schulz needs whole matrices, but under FSDP2 (and TP, EP) every rank holds only a
block of each. Every matrix ("unit": a parameter, one expert of a grouped MoE weight, or a
row block of one when attention heads are split) gets one owner rank, and the units are
grouped into **rounds** in which every owner has about the same Newton–Schulz work: equal
units (same cost and size) are dealt out in waves of ``per_owner × W``, each owner taking
``per_owner`` of them (as many as fit the round's memory budget on the owner), and the few
left over are packed into mixed rounds, costliest first. Rounds run in the order backward
finishes their gradients. Per round every rank sends the pieces it holds to the owners with
one ``all_to_all_single``, owners orthogonalize, and a second ``all_to_all_single`` with the
mirrored split sizes brings each rank its pieces back.

Because all owners work in every round, a step whose rounds follow each other strictly still
keeps all W ranks busy: the sum over rounds of the busiest owner's work stays close to the
total over W (tests/test_plan.py checks it on Llama-3, DeepSeek-V3 and Kimi-K2 shapes up to
W = 4096).

:func:`build_plan` decides owners and rounds (the same on every rank: the optimizer checks a
fingerprint once); :func:`rank_tables` turns the plan into the tables one rank needs per step
— split sizes and buffer offsets — computed once, so a step only reads them. Nothing here
touches torch.distributed.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from titan_muon.algorithm.newton_schulz import newton_schulz_flops
from titan_muon.base.layout import Box, Sharding, box_numel, chunk_range


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
    rounds: tuple[tuple[int, ...], ...]  # unit indices, in communication order

    def fingerprint(self) -> int:
        """A 63-bit digest of the whole plan, equal on ranks that computed the same plan."""
        digest = hashlib.sha256(repr((self.world_size, self.units, self.owners, self.rounds)).encode())
        return int.from_bytes(digest.digest()[:8], "little") >> 1

    def owner_loads(self, costs: Sequence[float]) -> list[list[float]]:
        """Per round, each owner's total cost."""
        loads = []
        for members in self.rounds:
            row = [0.0] * self.world_size
            for u in members:
                row[self.owners[u]] += costs[u]
            loads.append(row)
        return loads

    def critical_cost(self, costs: Sequence[float]) -> float:
        """Σ over rounds of the busiest owner's cost: the Newton–Schulz time of a step whose
        rounds run strictly one after another (the plan's balance property bounds it)."""
        return sum(max(row) for row in self.owner_loads(costs))


# A round's level may exceed the even share of the remaining work by this much, so that whole
# units fill the last round instead of spilling a sliver into one more.
LEVEL_SLACK = 1.02
# With overlap a round takes at most 1/OVERLAP_MIN_ROUNDS of the whole step's work (unless one
# unit is more), so even a model whose matrices all fit one round's memory gets rounds that leave
# during backward. Without overlap fewer, larger rounds batch more matrices per Newton–Schulz call.
OVERLAP_MIN_ROUNDS = 8


def build_rounds(
    costs: Sequence[float],
    numels: Sequence[int],
    world_size: int,
    *,
    owner_bytes: Callable[[int], float],
    round_bytes: float,
    local_pieces: Sequence[dict[int, int]] | None = None,
    min_rounds: int = 1,
) -> tuple[list[list[int]], list[int]]:
    """Owner-balanced rounds: ``(rounds, owners)``, rounds as lists of unit indices.

    Units are given in the order backward finishes their gradients; units of equal cost and
    size form a class and are taken in that order. Each round gets a level: as many units of
    the costliest remaining class as fit ``round_bytes`` on one owner (``owner_bytes(u)``: what
    unit u costs its owner in memory during a round), times their cost — but no more than an
    even share of all the work left, and never less than one unit of that class. Then every class,
    costliest first, fills the owners up to that level and within the memory budget, least
    loaded owner first, so an owner that got one big matrix and one that got many small ones
    do about the same work. A class with at least ``per_owner × world_size`` units left fills a
    round alone, exactly ``per_owner`` per owner. Rounds are ordered by the last unit they wait for.

    ``local_pieces[u] = {rank: elements of u that rank holds}`` lets a unit held mostly by one
    rank (an MoE expert under expert parallelism) stay with that rank when it has room: it then
    sends nothing for that unit.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    owners = [-1] * len(costs)
    grouped: dict[tuple[float, int], list[int]] = defaultdict(list)
    for u in range(len(costs)):
        grouped[(costs[u], numels[u])].append(u)
    classes = [_Class(cost, owner_bytes(members[0]), members) for (cost, _), members in sorted(grouped.items(), key=lambda kv: (-kv[0][0], -kv[0][1]))]
    round_share = sum(costs) / (world_size * min_rounds)
    rounds: list[list[int]] = []
    while True:
        classes = [c for c in classes if c.left]
        if not classes:
            break
        top = classes[0]
        by_memory = top.cost * max(1, int(round_bytes // max(top.bytes, 1.0)))
        even_share = sum(c.cost * c.left for c in classes) / world_size
        level = max(top.cost, min(by_memory, LEVEL_SLACK * even_share, round_share))
        loads, memory = [0.0] * world_size, [0.0] * world_size
        taken: list[int] = []
        for c in classes:
            taken += _fill(c, level, round_bytes, loads, memory, local_pieces, owners, rotate=len(rounds))
        rounds.append(sorted(taken))
    rounds.sort(key=lambda r: (r[-1], r[0]))
    return rounds, owners


class _Class:
    """Interchangeable units (equal cost and size), in backward order; `next` is the first not yet placed."""

    def __init__(self, cost: float, nbytes: float, members: list[int]):
        self.cost, self.bytes, self.members, self.next = cost, nbytes, members, 0

    @property
    def left(self) -> int:
        return len(self.members) - self.next


def _fill(c: _Class, level, round_bytes, loads, memory, local_pieces, owners, rotate: int) -> list[int]:
    """Place units of class `c` on owners with room under `level` and `round_bytes` (an owner
    with nothing yet always takes one); returns the units placed."""
    world = len(loads)
    room = [0] * world
    for r in range(world):
        if loads[r] == 0:
            by_cost = max(1, int((level + 1e-9 * level) // c.cost)) if c.cost > 0 else c.left
            by_memory = max(1, int(round_bytes // max(c.bytes, 1.0)))
        else:
            by_cost = int((level - loads[r] + 1e-9 * level) // c.cost) if c.cost > 0 else c.left
            by_memory = int((round_bytes - memory[r]) // max(c.bytes, 1.0))
        room[r] = max(0, min(by_cost, by_memory))
    count = min(c.left, sum(room))
    if count == 0:
        return []
    units = c.members[c.next : c.next + count]
    c.next += count
    placed: dict[int, int] = {}
    rest = []
    for u in units:  # a unit held mostly by one rank stays there if that rank has room
        holder = next((r for r in _concentrated_holders(u, local_pieces, world) if room[r] > placed.get(r, 0)), None)
        if holder is None:
            rest.append(u)
        else:
            owners[u] = holder
            placed[holder] = placed.get(holder, 0) + 1
    # the rest one at a time to the least loaded rank with room (ties: a rotating start, so
    # successive rounds do not always favour the same ranks)
    heap = [(loads[r] + placed.get(r, 0) * c.cost, (r - rotate) % world, r) for r in range(world) if room[r] > placed.get(r, 0)]
    heapq.heapify(heap)
    for u in rest:
        load, key, r = heapq.heappop(heap)
        owners[u] = r
        placed[r] = placed.get(r, 0) + 1
        if room[r] > placed[r]:
            heapq.heappush(heap, (load + c.cost, key, r))
    for r, n in placed.items():
        loads[r] += n * c.cost
        memory[r] += n * c.bytes
    return units


def _concentrated_holders(u: int, local_pieces, world: int) -> list[int]:
    """Ranks holding at least twice an even share of unit u, most elements first."""
    if local_pieces is None or world == 1 or not local_pieces[u]:
        return []
    pieces = local_pieces[u]
    numel = sum(pieces.values())
    return sorted((r for r, n in pieces.items() if n * world >= 2 * numel), key=lambda r: (-pieces[r], r))


def build_plan(
    units: Sequence[Unit],
    shardings: Sequence[Sharding],
    world_size: int,
    round_bytes: float,
    cost: Callable[[Unit], float] | None = None,
    owner_bytes_per_element: float = 20.0,
    max_holders: int = 8,
    min_rounds: int = 1,
) -> Plan:
    """Owners and rounds for `units` (given in backward order).

    ``shardings[unit.param]`` says which ranks hold which part of each unit; ``cost(unit)`` is
    its Newton–Schulz cost (default: FLOPs of 5 standard steps). ``round_bytes`` is the memory
    one round may take on an owner, where a unit takes ``owner_bytes_per_element`` bytes per
    element (received pieces, the assembled matrix, Newton–Schulz workspace, its result and
    return buffer). Units spread over more than ``max_holders`` ranks gain nothing from
    locality and are placed on load alone.
    """
    cost = cost or (lambda unit: newton_schulz_flops(unit.rows, unit.cols, 5))
    costs = [cost(unit) for unit in units]
    numels = [unit.numel for unit in units]
    local_pieces = []
    for unit in units:
        holders = list(itertools.islice(shardings[unit.param].holders(unit.box), max_holders + 1))
        local_pieces.append({} if len(holders) > max_holders else {r: box_numel(piece) for r, piece in holders})
    rounds, owners = build_rounds(
        costs, numels, world_size, owner_bytes=lambda u: numels[u] * owner_bytes_per_element,
        round_bytes=round_bytes, local_pieces=local_pieces, min_rounds=min_rounds,
    )  # fmt: skip
    return Plan(world_size, tuple(units), tuple(owners), tuple(tuple(r) for r in rounds))


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
class RoundTables:
    """One rank's view of one round. The return trip uses the same tables mirrored:
    owners send ``inbound``'s layout back with ``recv_counts`` as split sizes, and this rank
    receives its updates in ``outbound``'s layout."""

    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    outbound: tuple[Piece, ...]  # ordered by owner, then round order
    inbound: tuple[Piece, ...]  # pieces of owned units, ordered by source rank, then round order
    owned: tuple[int, ...]  # units this rank owns, round order

    @property
    def send_numel(self) -> int:
        return sum(self.send_counts)

    @property
    def recv_numel(self) -> int:
        return sum(self.recv_counts)


def _outbound_raw(plan: Plan, shardings: Sequence[Sharding], round_index: int, rank: int,
                  boxes: Mapping[int, Box] | None) -> list[tuple]:  # fmt: skip
    """(owner, unit, rows, cols, local) of each piece `rank` holds of the round's units, round order."""
    raw = []
    for u in plan.rounds[round_index]:
        unit = plan.units[u]
        mine = boxes[unit.param] if boxes is not None else shardings[unit.param].box(rank)
        piece = _intersection(mine, unit.box)
        if piece is None:
            continue
        (m0, _), (r0, r1), (c0, c1) = piece
        local = (m0 - mine[0][0], r0 - mine[1][0], r1 - mine[1][0])
        raw.append((plan.owners[u], u, (r0 - unit.row_start, r1 - unit.row_start), (c0, c1), local))
    return raw


def round_tables(
    plan: Plan, shardings: Sequence[Sharding], round_index: int, rank: int, boxes: Mapping[int, Box] | None = None,
    send_order: Sequence[int] | None = None, recv_order: Sequence[int] | None = None,
) -> RoundTables:  # fmt: skip
    """`rank`'s tables for one round; ``boxes[param]`` (optional) is `rank`'s block of each parameter.

    ``send_order[peer]`` / ``recv_order[peer]``: where each peer's segment sits in the send /
    receive buffer of the outbound trip (default: rank order, as a flat ``all_to_all_single``
    takes them; a hierarchical transport takes another order, ``transport.NodeLayout``)."""
    members = plan.rounds[round_index]
    send_counts: dict[int, int] = {}  # peer -> elements; most peers get nothing
    recv_counts: dict[int, int] = {}
    outbound_raw = _outbound_raw(plan, shardings, round_index, rank, boxes)
    send_key = (lambda peer: peer) if send_order is None else send_order.__getitem__
    recv_key = (lambda peer: peer) if recv_order is None else recv_order.__getitem__
    outbound_raw.sort(key=lambda p: send_key(p[0]))  # stable: round order within an owner
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
    inbound_raw.sort(key=lambda p: (recv_key(p[0]), p[1]))
    inbound, offset = [], 0
    for src, _, u, rows, cols in inbound_raw:
        piece = Piece(u, src, offset, rows, cols)
        inbound.append(piece)
        recv_counts[src] = recv_counts.get(src, 0) + piece.numel
        offset += piece.numel
    world = plan.world_size
    return RoundTables(
        split_sizes(send_counts, world), split_sizes(recv_counts, world), tuple(outbound), tuple(inbound), owned
    )


def rank_tables(plan: Plan, shardings: Sequence[Sharding], rank: int, send_order: Sequence[int] | None = None,
                recv_order: Sequence[int] | None = None) -> tuple[RoundTables, ...]:  # fmt: skip
    """Everything `rank` needs per step, round by round: computed once, read every step
    (buffer orders as in :func:`round_tables`)."""
    boxes = _boxes(plan, shardings, rank)
    return tuple(round_tables(plan, shardings, r, rank, boxes, send_order, recv_order) for r in range(len(plan.rounds)))


def send_counts_by_round(plan: Plan, shardings: Sequence[Sharding], rank: int) -> tuple[tuple[int, ...], ...]:
    """`rank`'s send counts per round (``rank_tables(...)[r].send_counts`` without the rest of the
    tables): what a hierarchical exchange's relay needs to know of its node-mates."""
    boxes = _boxes(plan, shardings, rank)
    counts = []
    for r in range(len(plan.rounds)):
        per_peer: dict[int, int] = {}
        for owner, _, rows, cols, _ in _outbound_raw(plan, shardings, r, rank, boxes):
            per_peer[owner] = per_peer.get(owner, 0) + (rows[1] - rows[0]) * (cols[1] - cols[0])
        counts.append(split_sizes(per_peer, plan.world_size))
    return tuple(counts)


def _boxes(plan: Plan, shardings: Sequence[Sharding], rank: int) -> dict[int, Box]:
    return {param: shardings[param].box(rank) for param in {unit.param for unit in plan.units}}  # this plan's parameters only


@functools.lru_cache(maxsize=8)
def _no_traffic(world: int) -> tuple[int, ...]:
    return (0,) * world


def split_sizes(counts: dict[int, int], world: int) -> tuple[int, ...]:
    """Per-peer element counts as the dense tuple ``all_to_all_single`` takes. A rank takes no
    part in some rounds of a large model: those share one all-zero tuple, so the tables stay small."""
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


def elements_sent(schedules: Sequence[RoundTables], rank: int) -> int:
    """Elements `rank` puts on the wire per step (outbound + return trip), self excluded."""
    return sum(
        s.send_numel - s.send_counts[rank] + s.recv_numel - s.recv_counts[rank] for s in schedules
    )
