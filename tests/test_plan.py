"""The ownership plan is pure: tested here without any process group."""

import itertools

import pytest
import torch

from titan_muon.newton_schulz import newton_schulz_flops
from titan_muon.plan import Unit, assign_owners, build_plan, make_buckets, shard_rows


def whole(shapes):
    return [Unit(i, 0, rows, cols, rows) for i, (rows, cols) in enumerate(shapes)]


TRANSFORMER = [(1024, 1024), (256, 1024), (256, 1024), (1024, 1024), (2816, 1024), (1024, 2816), (2816, 1024)] * 4


@pytest.mark.parametrize("rows,world", [(30, 4), (63, 2), (3, 4), (1, 3), (64, 4), (5, 4), (7, 3)])
def test_shard_rows_match_torch_chunk(rows, world):
    chunks = torch.arange(rows).chunk(world)
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks] + [(rows, rows)] * (world - len(chunks))
    assert shard_rows(rows, world) == expected


def test_unit_rows_on_each_rank_cover_the_unit_once():
    for world, (rows, start, end) in itertools.product([1, 2, 3, 4], [(30, 0, 30), (30, 5, 17), (3, 1, 3)]):
        unit = Unit(0, start, end, 8, rows)
        covered = []
        for r in range(world):
            lo, hi = unit.rows_on(r, world)
            assert 0 <= lo <= hi <= unit.rows
            covered += range(lo, hi)
            shard_start, shard_end = shard_rows(rows, world)[r]
            local_lo, local_hi = unit.rows_in_shard(r, world)
            assert local_hi - local_lo == hi - lo
            if hi > lo:
                assert shard_start + local_lo == start + lo and shard_start + local_hi <= shard_end
        assert covered == list(range(unit.rows))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_unit_has_one_owner_and_counts_are_mirrored(world):
    shapes = [(30, 64), (63, 64), (3, 256), (64, 30), (128, 128)] * 3
    plan = build_plan(whole(shapes), world, bucket_bytes=64 * 1024)
    assert sorted(u for b in plan.buckets for u in b) == list(range(len(shapes)))
    assert all(0 <= o < world for o in plan.owners)
    for b in range(len(plan.buckets)):
        sends = [plan.send_counts(b, r) for r in range(world)]
        recvs = [plan.recv_counts(b, r) for r in range(world)]
        for src, dst in itertools.product(range(world), repeat=2):
            assert sends[src][dst] == recvs[dst][src]
        assert sum(map(sum, sends)) == sum(shapes[u][0] * shapes[u][1] for u in plan.buckets[b])


def test_plan_is_deterministic_and_fingerprint_tracks_inputs():
    a = build_plan(whole(TRANSFORMER), 4, 8 << 20)
    assert a == build_plan(whole(TRANSFORMER), 4, 8 << 20)
    assert a.fingerprint() == build_plan(whole(TRANSFORMER), 4, 8 << 20).fingerprint()
    changed = TRANSFORMER[:-1] + [(2816, 1025)]
    assert a.fingerprint() != build_plan(whole(changed), 4, 8 << 20).fingerprint()
    assert a.fingerprint() != build_plan(whole(TRANSFORMER), 3, 8 << 20).fingerprint()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_lpt_balances_newton_schulz_flops(world):
    plan = build_plan(whole(TRANSFORMER), world, 16 << 20)
    loads = [plan.ns_flops(r, 5) for r in range(world)]
    biggest = max(newton_schulz_flops(r, c, 5) for r, c in TRANSFORMER)
    assert sum(loads) == sum(newton_schulz_flops(r, c, 5) for r, c in TRANSFORMER)
    # LPT guarantee: no rank exceeds the mean by more than the largest single job.
    assert max(loads) <= sum(loads) / world + biggest
    assert max(loads) / (sum(loads) / world) < 1.15


def test_assign_owners_is_longest_processing_time_first():
    assert assign_owners([1, 5, 3, 3], 2) == [0, 0, 1, 1]
    assert assign_owners([4, 4, 1], 2) == [0, 1, 0]
    assert assign_owners([2, 2], 4) == [0, 1]


def test_buckets_respect_the_cap_except_for_oversized_units():
    assert make_buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert make_buckets([], 8) == []


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_sent_at_most_twice_the_local_shard(world):
    plan = build_plan(whole(TRANSFORMER), world, 16 << 20)
    for r in range(world):
        local = sum(u.numel_on(r, world) for u in plan.units)
        assert plan.elements_sent(r) <= 2 * local
