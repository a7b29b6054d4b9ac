"""Layouts, ownership plans and per-rank schedules are pure: tested here without any process group.

A whole exchange is simulated in one process: every rank's schedule packs its blocks, the
all-to-all is done by hand, owners assemble, and the return trip must give every rank back
exactly its block — for FSDP rows, tensor-parallel column blocks, FSDP over TP (strided) and
MoE experts.
"""

import itertools
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from titan_muon.layout import RankGrid, as_stack_shape, box_numel, chunk_range, sharding_of
from titan_muon.newton_schulz import newton_schulz_flops
from titan_muon.plan import Unit, assign_owners, build_plan, elements_sent, make_buckets, rank_schedule, shard_rows
from titan_muon.redistribute import assemble, disassemble, local_views, pack, unpack

TRANSFORMER = [(1024, 1024), (256, 1024), (256, 1024), (1024, 1024), (2816, 1024), (1024, 2816), (2816, 1024)] * 4


@pytest.mark.parametrize("rows,world", [(30, 4), (63, 2), (3, 4), (1, 3), (64, 4), (5, 4), (7, 3)])
def test_shard_rows_match_torch_chunk(rows, world):
    chunks = torch.arange(rows).chunk(world)
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks] + [(rows, rows)] * (world - len(chunks))
    assert shard_rows(rows, world) == expected
    assert [chunk_range(rows, world, r) for r in range(world)] == expected


def _grid(mesh_shape):
    return RankGrid(list(itertools.product(*[range(n) for n in mesh_shape])))


# (global shape, mesh shape, placements): FSDP, uneven, HSDP-like, TP colwise/rowwise, FSDP over
# TP (FSDP2 puts _StridedShard on its dim), EP x FSDP on experts, expert rows.
LAYOUTS = [
    ((30, 64), (4,), [Shard(0)]),
    ((3, 256), (4,), [Shard(0)]),
    ((63, 10), (3,), [Shard(1)]),
    ((10, 6), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((7, 10), (2, 2), [Shard(0), Shard(1)]),
    ((9, 7), (3, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((6, 8, 5), (2, 2), [Shard(0), Shard(0)]),
    ((3, 8, 5), (2, 2), [Shard(0), Shard(1)]),
    ((5, 12), (2, 3), [Replicate(), Shard(0)]),
]


@pytest.mark.parametrize("shape,mesh_shape,placements", LAYOUTS)
def test_boxes_match_dtensor(shape, mesh_shape, placements):
    """Each rank's block equals what DTensor computes for that coordinate (torch's own function)."""
    grid = _grid(mesh_shape)
    sharding = sharding_of(shape, placements, mesh_shape, grid)
    offset = 3 - len(shape)
    for rank, coordinate in enumerate(grid.coordinates):
        local_shape, global_offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
        box = sharding.box(rank)[offset:]
        assert tuple(hi - lo for lo, hi in box) == tuple(local_shape), (coordinate, box, local_shape)
        if all(local_shape):
            assert tuple(lo for lo, _ in box) == tuple(global_offset)


@pytest.mark.parametrize("shape,mesh_shape,placements", LAYOUTS)
def test_holders_are_the_ranks_whose_blocks_meet_the_region(shape, mesh_shape, placements):
    grid = _grid(mesh_shape)
    sharding = sharding_of(shape, placements, mesh_shape, grid)
    rng = random.Random(0)
    stack = as_stack_shape(shape)
    for _ in range(20):
        region = []
        for n in stack:
            lo = rng.randrange(n)
            region.append((lo, rng.randrange(lo + 1, n + 1)))
        region = tuple(region)
        expected = {}
        for rank in range(len(grid)):
            piece = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(sharding.box(rank), region))
            if box_numel(piece) > 0 and all(lo < hi for lo, hi in piece):
                expected.setdefault(rank, piece)
        found = dict(sharding.holders(region))
        # Replicated mesh dimensions hold copies: only the group's own ranks (one per block) are listed.
        assert set(found) <= set(expected) and sum(map(box_numel, found.values())) == box_numel(region)


def test_buckets_respect_size_and_order():
    assert make_buckets([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert make_buckets([10, 1, 1], 8) == [[0], [1, 2]]  # an oversized unit gets its own bucket
    assert make_buckets([], 8) == []


def test_longest_processing_time_balances_newton_schulz_work():
    costs = [newton_schulz_flops(r, c, 5) for r, c in TRANSFORMER]
    for world in (2, 3, 4, 8):
        owners = assign_owners(costs, world)
        loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
        assert max(loads) <= sum(costs) / world + max(costs)  # LPT's bound


def _units(shapes, blocks=None):
    units = []
    for p, shape in enumerate(shapes):
        matrices, rows, cols = as_stack_shape(shape)
        size = (blocks or {}).get(p, rows)
        for m in range(matrices):
            for start in range(0, rows, size):
                units.append(Unit(p, m, start, min(rows, start + size), cols))
    return units


def _simulate(shapes, mesh_shape, placements, blocks=None, bucket_bytes=4096):
    """Every rank sends its blocks to the owners and gets them back through the schedules."""
    grid = _grid(mesh_shape)
    world = len(grid)
    shardings = [sharding_of(s, placements, mesh_shape, grid) for s in shapes]
    units = _units(shapes, blocks)
    plan = build_plan(units, shardings, world, bucket_bytes)
    schedules = [rank_schedule(plan, shardings, r) for r in range(world)]
    full = [torch.randn(*as_stack_shape(s)) for s in shapes]
    local = {
        (r, p): full[p][tuple(slice(lo, hi) for lo, hi in shardings[p].box(r))] for r in range(world) for p in range(len(shapes))
    }
    returned = {key: torch.full_like(t, float("nan")) for key, t in local.items()}
    for b in range(len(plan.buckets)):
        sends = [
            pack(local_views(schedules[r][b].outbound, lambda piece, r=r: local[(r, plan.units[piece.unit].param)]), torch.float32, "cpu")
            for r in range(world)
        ]
        for r in range(world):
            assert sends[r].numel() == sum(schedules[r][b].send_counts)
            for o in range(world):  # what r sends to o is what o expects from r
                assert schedules[r][b].send_counts[o] == schedules[o][b].recv_counts[r]
        received = [_all_to_all(sends, [s[b] for s in schedules], r) for r in range(world)]
        results = {}
        for r in range(world):
            for batch in assemble(schedules[r][b], received[r], plan.units, lambda u: plan.units[u].shape):
                for u, matrix in zip(batch.units, batch.matrices):
                    unit = plan.units[u]
                    assert torch.equal(matrix, full[unit.param][unit.matrix, unit.row_start : unit.row_end])
                    results[(r, u)] = matrix * 2  # stand-in for Newton-Schulz
        backs = [
            disassemble(schedules[r][b], {u: m for (o, u), m in results.items() if o == r}, torch.float32, "cpu")
            for r in range(world)
        ]
        for r in range(world):
            mine = _all_to_all(backs, [s[b] for s in schedules], r, back=True)
            for piece, update in zip(schedules[r][b].outbound, unpack(schedules[r][b], mine)):
                m, r0, r1 = piece.local
                returned[(r, plan.units[piece.unit].param)][m, r0:r1] = update
    for key, t in local.items():
        assert torch.equal(returned[key], 2 * t), key
    return plan, schedules, shardings


def _all_to_all(buffers, schedules, rank, back=False):
    """What `rank` receives when every rank sends `buffers` split by its schedule's counts."""
    parts = []
    for src, (buffer, schedule) in enumerate(zip(buffers, schedules)):
        counts = schedule.recv_counts if back else schedule.send_counts
        start = sum(counts[:rank])
        parts.append(buffer[start : start + counts[rank]])
    return torch.cat(parts)


@pytest.mark.parametrize(
    "shapes,mesh_shape,placements,blocks",
    [
        ([(30, 64), (63, 64), (3, 256), (64, 30)], (4,), [Shard(0)], None),
        ([(30, 64), (63, 64)], (3,), [Shard(0)], {0: 10, 1: 7}),  # Split blocks straddling shards
        ([(10, 6), (12, 8)], (2, 2), [_StridedShard(0, split_factor=2), Shard(0)], None),  # FSDP over TP colwise
        ([(7, 10), (12, 9)], (2, 2), [Shard(0), Shard(1)], None),  # FSDP x TP rowwise: column blocks
        ([(6, 8, 5)], (2, 2), [Shard(0), Shard(0)], None),  # experts over EP x FSDP
        ([(3, 8, 5)], (2, 2), [Shard(0), Shard(1)], None),  # experts over EP, rows over FSDP
    ],
    ids=["fsdp", "split", "fsdp-over-tp", "tp-rowwise", "experts", "experts-rows"],
)
def test_exchange_round_trip_is_exact(shapes, mesh_shape, placements, blocks):
    _simulate(shapes, mesh_shape, placements, blocks)


def test_traffic_bound_per_rank():
    """Each rank sends its pieces of matrices owned elsewhere plus the other ranks' pieces of
    the matrices it owns. With owners chosen with bytes in mind that stays within 2x its shard
    for the shapes of the issue that found 2.44x with NS-FLOPs-only owners."""
    shapes = [(30, 64), (63, 64), (64, 63), (3, 256), (128, 96), (96, 128), (7, 5), (256, 64)]
    plan, schedules, shardings = _simulate(shapes, (3,), [Shard(0)], bucket_bytes=2**20)
    costs = [newton_schulz_flops(u.rows, u.cols, 5) for u in plan.units]
    flop_only = assign_owners(costs, 3)
    for r in range(3):
        shard = sum(box_numel(s.box(r)) for s in shardings)
        assert elements_sent(schedules[r], r) <= 2 * shard
    loads = [sum(c for c, o in zip(costs, plan.owners) if o == r) for r in range(3)]
    flop_loads = [sum(c for c, o in zip(costs, flop_only) if o == r) for r in range(3)]
    assert max(loads) <= 1.05 * max(flop_loads)  # the byte-aware choice costs little NS balance


def test_plan_is_deterministic_and_fingerprinted():
    shardings = [sharding_of(s, [Shard(0)], (4,), _grid((4,))) for s in TRANSFORMER]
    a = build_plan(_units(TRANSFORMER), shardings, 4, 2**20)
    b = build_plan(_units(TRANSFORMER), shardings, 4, 2**20)
    assert a == b and a.fingerprint() == b.fingerprint()
    c = build_plan(_units(TRANSFORMER[:-1]), shardings, 4, 2**20)
    assert c.fingerprint() != a.fingerprint()
