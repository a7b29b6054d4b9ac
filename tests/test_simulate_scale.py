"""The scale simulator (scripts/simulate_scale.py) counts what the optimizer's own tables say.

Quick mode runs Llama-3 8B shapes at W = 8 and 64; a tiny dense + MoE model checks the
simulator's all-rank traffic against every rank's ``rank_schedule`` exactly.
"""

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

from titan_muon.plan import build_plan, rank_tables

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "simulate_scale.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("simulate_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(sim):
    return sim.run(sim.QUICK, sim.Hardware(), check=True, log=lambda _: None)


def _rows(out):
    yield from out["plan"]
    yield from out["scaled"]
    yield from (r for triple in out["step"] for r in triple)
    yield from (r for _, r in out["options"])


def test_quick_mode_invariants(sim, quick):
    model = sim.PRESETS["Llama-3 8B"]
    assert model.matrices == 224 and len(list(_rows(quick))) > 8
    for row in _rows(quick):
        # Newton–Schulz work is conserved: the per-rank loads add up to the units' FLOPs.
        units = sim.units_of(model, split_heads=row.units != model.matrices)
        assert row.units == len(units)
        assert int(row.ns.sum()) == row.ns_total * (row.group if row.scheme == "gather-everything" else 1)
        assert row.ns_total == sum(sim.ns_flops(u) for u in units)
        # Bytes are conserved: every element sent is received by someone.
        assert row.sent_total == row.received_total
        assert int(row.per_step.sum()) == row.sent_total + row.received_total
        if row.scheme != "gather-everything":
            # Every unit has positive cost, so idle ranks are exactly those with no NS work.
            assert row.idle == row.group - row.owners == int((row.ns == 0).sum())


def test_quick_mode_figures_are_plausible(sim, quick):
    fsdp8 = next(r for r in quick["plan"] if r.world == 8 and r.layout == "FSDP")
    # 224 matrices on 8 ranks: LPT balances (the goal), nobody idles.
    assert fsdp8.imbalance <= 1.1 and fsdp8.idle == 0 and sim.goal(fsdp8) == "met"
    # Each rank's shard of every matrix leaves once and comes back: at most twice the shard
    # (plan.py's traffic bound); the shard is 1/8 of the Muon elements here.
    shard = sim.PRESETS["Llama-3 8B"].elements / 8
    assert fsdp8.per_step.max() <= 2 * shard
    # The returned updates are kept until the commit: the peak is at least 2 bytes per shard element.
    assert fsdp8.peak_bytes >= 2 * shard and fsdp8.peak_overlap_bytes >= fsdp8.peak_bytes
    titan, _, gather = next(t for t in quick["step"] if t[0].world == 8)
    assert gather.ns.max() == pytest.approx(8 * titan.ns.mean())  # every rank does everything
    assert sim.step_seconds(titan, sim.Hardware(), overlap=True) < sim.step_seconds(titan, sim.Hardware())
    text = sim.render(quick, sim.QUICK, sim.Hardware(), "python scripts/simulate_scale.py --quick", (1.0, 1.0, 0.0))
    assert "| Llama-3 8B | 64 | FSDP |" in text and "Split: attention head blocks" in text


def _tiny_model(sim):
    """Dense matrices with uneven rows, a 3-D expert stack with fewer experts than ranks, and
    head-split attention."""
    params = (
        ("layers.0.attention.wq.weight", (24, 16)),
        ("layers.0.moe.experts.w1", (5, 12, 16)),
        ("layers.0.feed_forward.w2.weight", (16, 37)),
        ("layers.1.attention.wq.weight", (24, 16)),
    )
    return sim.Model("tiny", params, {"layers.0.attention.wq.weight": 8, "layers.1.attention.wq.weight": 8})


LAYOUTS = [  # (W, layout arguments, Split)
    (8, {}, False),
    (16, {}, True),
    (16, {"shard_group": 8}, False),
    (3, {}, False),
    (8, {"expert_parallel": 2}, False),  # efsdp·ep = 8 > 5 experts: expert rows over efsdp
    (4, {"expert_parallel": 2}, False),  # 4 ≤ 5: FSDP2's strided Shard(0) on top of EP
]


@pytest.mark.parametrize("world,layout,split", LAYOUTS)
def test_traffic_equals_every_ranks_schedule(sim, world, layout, split):
    model = _tiny_model(sim)
    layout = sim.Layout(**layout)
    group = layout.group_size(world)
    shardings = layout.shardings(model, world)
    units = sim.units_of(model, split)
    plan = build_plan(units, shardings, group, round_bytes=1024)
    moved = sim.traffic(plan.units, plan.owners, shardings, group)
    schedules = [rank_tables(plan, shardings, r) for r in range(group)]
    for r, tables in enumerate(schedules):
        sent_near = sum(c for s in tables for peer, c in enumerate(s.send_counts) if peer != r and peer // 8 == r // 8)
        sent_far = sum(c for s in tables for peer, c in enumerate(s.send_counts) if peer // 8 != r // 8)
        received = sum(s.recv_numel - s.recv_counts[r] for s in tables)
        assert (moved.sent_near[r], moved.sent_far[r], moved.received[r]) == (sent_near, sent_far, received)
    for b in range(len(plan.rounds)):  # per bucket, what r sends to o is what o expects from r
        for r, o in itertools.product(range(group), repeat=2):
            assert schedules[r][b].send_counts[o] == schedules[o][b].recv_counts[r]
    assert moved.sent.sum() == moved.received.sum()


def test_peak_memory_grows_with_the_window(sim):
    model = _tiny_model(sim)
    shardings = sim.Layout().shardings(model, 2)
    plan = build_plan(sim.units_of(model), shardings, 2, round_bytes=512)  # 2 owners: one matrix each a round
    assert len(plan.rounds) > 3
    for r in range(2):
        tables = rank_tables(plan, shardings, r)
        peaks = [sim.peak_transient_bytes(tables, plan.units, w, 2, 2, False) for w in (1, 2, len(tables))]
        assert peaks[-1] == max(peaks)  # everything in flight at once is the largest
        shard = sum(s.send_numel for s in tables)
        assert peaks[0] >= 2 * shard  # the returned updates alone


def test_presets_have_the_published_sizes(sim):
    """Muon elements plus what stays in AdamW (embeddings, output head, router; norms are < 0.01 B)
    give the models' published parameter counts; matrix counts follow from the architectures."""
    presets = sim.PRESETS
    assert (presets["Llama-3 8B"].elements + 2 * 128256 * 4096) / 1e9 == pytest.approx(8.03, abs=0.01)
    assert (presets["Llama-3 70B"].elements + 2 * 128256 * 8192) / 1e9 == pytest.approx(70.55, abs=0.01)
    assert (presets["Llama-3 405B"].elements + 2 * 128256 * 16384) / 1e9 == pytest.approx(405.85, abs=0.01)
    router = 58 * 256 * 7168
    assert (presets["DeepSeek-V3 671B"].elements + 2 * 129280 * 7168 + router) / 1e9 == pytest.approx(671.0, abs=0.1)
    assert [presets[n].matrices for n in ("Llama-3 8B", "Llama-3 70B", "Llama-3 405B")] == [32 * 7, 80 * 7, 126 * 7]
    # MoE layers: 3 expert stacks and 3 shared-expert matrices; MLA: 5 matrices per layer.
    assert presets["DeepSeek-V3 671B"].matrices == 58 * 3 * 256 + 61 * 5 + 3 * 3 + 58 * 3
    assert presets["Kimi-K2 1T"].matrices == 60 * 3 * 384 + 61 * 5 + 1 * 3 + 60 * 3


@pytest.mark.parametrize("world,layout,split", LAYOUTS[:3] + LAYOUTS[4:5])
def test_aten_ops_counted_per_kind_of_bucket_equal_a_full_count(sim, world, layout, split):
    import torch

    model = _tiny_model(sim)
    layout = sim.Layout(**layout)
    group = layout.group_size(world)
    shardings = layout.shardings(model, world)
    plan = build_plan(sim.units_of(model, split), shardings, group, round_bytes=1024)
    for r in range(group):
        tables = rank_tables(plan, shardings, r)
        stacks = {i: torch.empty(*(hi - lo for lo, hi in s.box(r)), device="meta") for i, s in enumerate(shardings)}
        with sim.OpCounter() as counter:
            sim.redistribute_on_meta(tables, plan.units, stacks)
        assert sim.aten_ops(tables, plan.units, shardings, r) == counter.ops > 0
