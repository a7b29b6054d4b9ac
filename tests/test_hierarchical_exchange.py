"""Hierarchical all-to-all (node stage, then rail stage) moves exactly what the flat one moves.

- the route arithmetic, simulated in one process on grids whose group ranks are not in node
  order, forward and reverse;
- the transport on W gloo ranks (2 × 2, 3 × 2, 2 × 4 "nodes"), random uneven counts with empty
  segments: the received bytes equal the flat ``all_to_all_single``'s, with the plan's routes
  and with routes gathered over the node (checkpoint conversion's path);
- a whole Muon step on an FSDP2 model (uneven shapes, Muon and AdamW), with the hierarchical
  exchange on and off: parameters, metrics' logical bytes and a checkpoint of momentum held by
  its owners (overlap, fp8 momentum: its exponents take the gathered path) are bitwise equal;
- the options' checks.

The meta-device test of the peer counts at W = 64 is in tests/test_meta_device.py.
"""

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from titan_muon import Muon
from titan_muon.exchange.transport import (
    HIERARCHICAL_MIN_RANKS,
    Hierarchy,
    NodeLayout,
    Transport,
    build_route,
    choose_layout,
)

# ---------------------------------------------------------------- pure: layouts, choices, routes


def test_layout_of_a_group():
    layout = NodeLayout.of([0, 1, 2, 3, 4, 5], 2)
    assert layout.members == ((0, 1), (2, 3), (4, 5))
    assert layout.place(3) == (1, 1)
    assert layout.node_major() == (0, 1, 2, 3, 4, 5)
    assert layout.local_major() == (0, 3, 1, 4, 2, 5)
    # group rank i is global rank ranks[i]: nodes and locals follow global ranks
    layout = NodeLayout.of([5, 0, 4, 1], 4)
    assert layout.members == ((1, 3), (2, 0))
    assert NodeLayout.of([0, 1, 2, 4], 2) is None  # node 1 holds one rank of the group, the others two


def test_choice_of_layout():
    big = list(range(2 * HIERARCHICAL_MIN_RANKS))
    assert choose_layout("auto", big, 8).nodes == 2 * HIERARCHICAL_MIN_RANKS // 8
    assert choose_layout("auto", big[:HIERARCHICAL_MIN_RANKS], 8) is None  # at the threshold: flat
    assert choose_layout("auto", big, None) is None  # one node as far as Muon knows
    assert choose_layout("auto", big, len(big)) is None  # one node
    assert choose_layout(False, big, 8) is None
    assert choose_layout(True, list(range(4)), 2).members == ((0, 1), (2, 3))
    with pytest.raises(ValueError, match="hierarchical_exchange=True needs the number of ranks per node"):
        choose_layout(True, big, None)
    with pytest.raises(ValueError, match="hierarchical_exchange=True needs an exchange group of at least 2 nodes"):
        choose_layout(True, list(range(8)), 8)
    with pytest.raises(ValueError, match="different numbers of its ranks"):
        choose_layout(True, [0, 1, 2, 4], 2)


@pytest.mark.parametrize("value,match", [("yes", "hierarchical_exchange='yes'"), (1, "hierarchical_exchange=1")])
def test_bad_hierarchical_exchange_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], hierarchical_exchange=value)


@pytest.mark.parametrize("value", [0, -8, 2.0, True])
def test_bad_ranks_per_node_is_refused(value):
    with pytest.raises(ValueError, match="ranks_per_node="):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], ranks_per_node=value)


def _random_counts(world: int, seed: int) -> list[list[int]]:
    """counts[src][dst] elements, about a third of them empty, some multiples of 3."""
    rng = random.Random(seed)
    return [[rng.choice([0, 0, rng.randint(1, 9), 3 * rng.randint(1, 4)]) for _ in range(world)] for _ in range(world)]


def _segments(counts, src, world):
    """What `src` sends to each rank: distinct values (src, dst, index) packed in one float."""
    return [torch.tensor([1000.0 * src + 10.0 * dst + i / 100 for i in range(counts[src][dst])]) for dst in range(world)]


def _all_to_all(buffers, send_splits, recv_splits, members):
    """all_to_all_single among group ranks `members`, simulated: buffers / splits per member."""
    parts = {m: dict(zip(members, buffers[m].split(list(send_splits[m])))) for m in members}
    out = {}
    for m in members:
        pieces = [parts[src][m] for src in members]
        assert [p.numel() for p in pieces] == list(recv_splits[m])
        out[m] = torch.cat(pieces)
    return out


def _simulate(layout, routes, sends, reverse):
    """Both stages of every rank, simulated; returns each rank's received buffer."""

    def stage(buffers, group_of, splits):
        out = {}
        for members in {group_of(r) for r in buffers}:
            out.update(_all_to_all(buffers, {m: splits(m)[0] for m in members}, {m: splits(m)[1] for m in members}, members))
        return out

    def node_group(r):
        return layout.members[layout.place(r)[0]]

    def rail_group(r):
        return tuple(row[layout.place(r)[1]] for row in layout.members)

    def node_splits(r):
        return (routes[r].node_recv, routes[r].node_send) if reverse else (routes[r].node_send, routes[r].node_recv)

    def rail_splits(r):
        return (routes[r].rail_recv, routes[r].rail_send) if reverse else (routes[r].rail_send, routes[r].rail_recv)

    first, second = ((rail_group, rail_splits), (node_group, node_splits)) if reverse else ((node_group, node_splits), (rail_group, rail_splits))
    middle = stage(sends, *first)
    relayed = {}
    for r, buffer in middle.items():
        index = routes[r].backward if reverse else routes[r].forward
        relayed[r] = buffer.view(-1, routes[r].unit).index_select(0, index.long()).reshape(-1)
    return stage(relayed, *second)


@pytest.mark.parametrize("global_ranks,per_node", [(range(6), 2), (range(8), 4), ([3, 0, 5, 1, 4, 2], 2), ([7, 2, 9, 0, 4, 11, 6, 1, 3, 10, 8, 5], 3)])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_simulated_two_stages_deliver_what_the_flat_exchange_delivers(global_ranks, per_node, reverse):
    layout = NodeLayout.of(list(global_ranks), per_node)
    world = len(layout.members) * layout.per_node
    for seed in range(3):
        counts = _random_counts(world, seed)
        # a forward exchange takes segments in local-major order and delivers them node-major;
        # a reverse one the other way round
        take, deliver = (layout.node_major(), layout.local_major()) if reverse else (layout.local_major(), layout.node_major())
        sends = {}
        for src in range(world):
            segments = _segments(counts, src, world)
            sends[src] = torch.cat([segments[dst] for dst in sorted(range(world), key=take.__getitem__)])
        # the route is described in the forward sense: a reverse exchange's counts mirrored
        forward_counts = [list(col) for col in zip(*counts)] if reverse else counts
        routes = {}
        for r in range(world):
            node, _ = layout.place(r)
            mates = [forward_counts[m] for m in layout.members[node]]
            recv = [forward_counts[src][r] for src in range(world)]
            routes[r] = build_route(layout, r, forward_counts[r], recv, mates, "cpu")
        received = _simulate(layout, routes, sends, reverse)
        for dst in range(world):
            expected = [_segments(counts, src, world)[dst] for src in sorted(range(world), key=deliver.__getitem__)]
            assert torch.equal(received[dst], torch.cat(expected)), (seed, dst)


def test_route_index_is_in_rows_of_the_blocks_gcd():
    layout = NodeLayout.of(range(4), 2)
    counts = [[256 * (1 + (s + d) % 3) for d in range(4)] for s in range(4)]
    route = build_route(layout, 0, counts[0], [counts[s][0] for s in range(4)], [counts[0], counts[1]], "cpu")
    assert route.unit == 256 and route.forward.numel() == sum(route.node_recv) // 256
    assert route.forward.dtype == torch.int32


# ---------------------------------------------------------------- the transport on gloo


def _transport_run(rank, world, per_node):
    from titan_muon.exchange.transport import lane_hierarchy

    group = dist.group.WORLD
    layout = NodeLayout.of(list(range(world)), per_node)
    flat = Transport(group, torch.device("cpu"))
    lanes = {"outbound": Transport(group, "cpu", lane_hierarchy(group, layout, "outbound")),
             "return": Transport(group, "cpu", lane_hierarchy(group, layout, "return"))}  # fmt: skip
    assert isinstance(lanes["outbound"].hierarchy, Hierarchy) and lanes["return"].hierarchy.reverse
    node_major, local_major = layout.node_major(), layout.local_major()
    assert node_major == tuple(range(world))  # consecutive nodes: node-major is rank order
    checked = 0
    for seed, dtype in ((0, torch.float32), (1, torch.bfloat16), (2, torch.float64)):
        counts = _random_counts(world, seed)
        segments = [s.to(dtype) for s in _segments(counts, rank, world)]
        send_counts, recv_counts = tuple(counts[rank]), tuple(counts[src][rank] for src in range(world))
        expected = flat.all_to_all(torch.cat(segments), send_counts, recv_counts).wait()
        node, _ = layout.place(rank)
        route = build_route(layout, rank, send_counts, recv_counts, [counts[m] for m in layout.members[node]], "cpu")
        local_order = sorted(range(world), key=local_major.__getitem__)
        forward_send = torch.cat([segments[d] for d in local_order])
        for given in (route, None):  # the plan's route, or gathered over the node
            got = lanes["outbound"].all_to_all(forward_send, send_counts, recv_counts, route=given).wait()
            assert got.dtype == dtype and torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), (seed, given is None)
            checked += 1
        # the reverse lane sends node-major (rank order) and delivers local-major: the mirror of
        # the same forward route, as a round's return trip uses it
        mirrored = [list(col) for col in zip(*counts)]
        back_send = torch.cat([s.to(dtype) for s in _segments(mirrored, rank, world)])
        back_expected = flat.all_to_all(back_send, tuple(mirrored[rank]), tuple(mirrored[s][rank] for s in range(world))).wait()
        pieces = back_expected.split([mirrored[s][rank] for s in range(world)])
        for given in (route, None):
            got = lanes["return"].all_to_all(back_send, tuple(mirrored[rank]), tuple(counts[rank]), route=given).wait()
            assert torch.equal(got.view(torch.uint8), torch.cat([pieces[s] for s in local_order]).view(torch.uint8))
            checked += 1
    peers = {"node": dist.get_process_group_ranks(lanes["outbound"].hierarchy.node_group),
             "rail": dist.get_process_group_ranks(lanes["outbound"].hierarchy.rail_group)}  # fmt: skip
    return checked, peers


@pytest.mark.parametrize("world,per_node", [(4, 2), (6, 2), (8, 4)], ids=["2x2", "3x2", "2x4"])
def test_transport_two_stages_equal_flat_all_to_all(world, per_node):
    results = run_distributed(_transport_run, world, per_node, timeout=240)
    for rank, (checked, peers) in enumerate(results):
        assert checked == 12
        node = rank // per_node
        assert peers["node"] == list(range(node * per_node, (node + 1) * per_node))
        assert peers["rail"] == list(range(rank % per_node, world, per_node))


# ---------------------------------------------------------------- a whole Muon step with FSDP2


def _muon_run(rank, world, per_node, steps):
    from sharded_fixtures import token_batches, next_token_loss, fsdp_model

    from titan_muon import build_param_groups

    out = {}
    for hierarchical in (True, False):
        runs = {}
        for name, overrides in (("plain", {}), ("overlap-fp8", {"overlap": True, "momentum_dtype": "fp8"})):
            model = fsdp_model(world)
            opt = Muon(build_param_groups(model, adamw_lr=3e-3), lr=0.02, adjust_lr_fn="match_rms_adamw",
                       exchange_memory_mb=0.002, hierarchical_exchange=hierarchical, ranks_per_node=per_node, **overrides)  # fmt: skip
            if hierarchical:
                assert all(e.outbound.hierarchy is not None for e in opt.engines if e.sharded) and any(e.sharded for e in opt.engines)
            for s in range(steps):
                next_token_loss(model, token_batches(s, batch=2 * world).chunk(world)[rank]).backward()
                opt.step()
                opt.zero_grad()
            metrics = opt.last_step_metrics
            state = opt.state_dict()["state"] if name == "overlap-fp8" else {}
            if name == "overlap-fp8":  # and back: owners' blocks rebuilt from the saved layout
                before = {k: {n: v.clone() for n, v in block.items()} for k, block in opt.owner_blocks.items()}
                opt.load_state_dict(opt.state_dict())
                for k, block in opt.owner_blocks.items():
                    for n, v in block.items():
                        assert torch.equal(v, before[k][n]), (k, n)
            runs[name] = {
                "params": {n: p.full_tensor() for n, p in model.named_parameters()},
                "state": {i: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in st.items()} for i, st in state.items()},
                "rounds": metrics["muon/rounds"],
                "to_owners": metrics["muon/bytes_sent_to_owners"],
                "bytes_sent": metrics["muon/bytes_sent"],
            }
        out[hierarchical] = runs
    return out


def _equal(a, b, where):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), where
    else:
        assert a == b, where


@pytest.mark.parametrize("world,per_node", [(4, 2), (8, 4)], ids=["2x2", "2x4"])
def test_muon_step_is_bitwise_the_same_with_hierarchical_exchange(world, per_node):
    results = run_distributed(_muon_run, world, per_node, 3, timeout=300)
    for rank, result in enumerate(results):
        on, off = result[True], result[False]
        for name in on:
            assert on[name]["rounds"] > 1
            for key in ("params", "state", "rounds", "to_owners"):
                _equal(on[name][key], off[name][key], f"rank {rank} {name} {key}")
            # relayed bytes travel twice (node, then rail): what the rank puts on the wire grows
            assert on[name]["bytes_sent"] >= off[name]["bytes_sent"]


def test_tables_in_a_hierarchical_order_hold_the_same_pieces():
    """The tables a hierarchical lane uses list the flat tables' pieces (same counts, same
    pieces per peer) in the lanes' buffer orders, and the send counts the routes are built from
    are the tables' own."""
    from torch.distributed.tensor import Shard

    from titan_muon.base.layout import RankGrid, sharding_of
    from titan_muon.exchange.plan import Unit, build_plan, rank_tables, send_counts_by_round

    world = 6
    shapes = [(30, 64), (63, 64), (3, 256), (64, 30), (48, 48), (130, 70)] * 3
    grid = RankGrid([(r,) for r in range(world)])
    shardings = [sharding_of(s, (Shard(0),), (world,), grid) for s in shapes]
    units = [Unit(p, 0, 0, rows, cols) for p, (rows, cols) in enumerate(shapes)]
    plan = build_plan(units, shardings, world, round_bytes=30_000)
    assert len(plan.rounds) > 1
    layout = NodeLayout.of(list(range(world)), 2)
    for rank in range(world):
        flat = rank_tables(plan, shardings, rank)
        ordered = rank_tables(plan, shardings, rank, layout.local_major(), layout.node_major())
        assert send_counts_by_round(plan, shardings, rank) == tuple(t.send_counts for t in flat)
        for f, o in zip(flat, ordered):
            assert (f.send_counts, f.recv_counts, f.owned) == (o.send_counts, o.recv_counts, o.owned)
            strip = lambda pieces: sorted((p.unit, p.peer, p.rows, p.cols, p.local) for p in pieces)  # noqa: E731
            assert strip(f.outbound) == strip(o.outbound) and strip(f.inbound) == strip(o.inbound)
            assert [layout.local_major()[p.peer] for p in o.outbound] == sorted(layout.local_major()[p.peer] for p in o.outbound)
            assert [p.offset for p in o.outbound] == list(itertools.accumulate([0] + [p.numel for p in o.outbound]))[:-1]
