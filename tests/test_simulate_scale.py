"""The scale model: traces of the real step (scale_replay/step_trace.py) and their replay with CUDA and
NCCL semantics (scale_replay/replay.py), checked on hand-built traces whose timing follows from the
rules alone, and on traces of the real step whose bytes and FLOPs are known independently."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from scale_replay.replay import Hardware, replay
from scale_replay.step_trace import (
    Collective,
    HostRead,
    Kernel,
    Parallelism,
    Trace,
    Wait,
    trace_rank,
)

from titan_muon.algorithm.newton_schulz import newton_schulz_flops

# Round numbers, so expected times are sums of a few terms: a kernel of 1 GB takes 1 ms, a launch
# 1 us, a collective has 10 us latency plus 1 us per peer, 1 GB crosses NVLink in 10 ms.
HW = Hardware(
    bf16_matmul_flops=1e15, fp32_matmul_flops=1e14, memory_bytes_per_s=1e12, min_kernel_s=0.0, launch_s=1e-6, compiled_call_s=5e-6,
    collective_host_s=0.0, host_read_s=0.0, nvlink_bytes_per_s=1e11, infiniband_bytes_per_s=1e10,
    collective_latency_s=1e-5, near_peer_latency_s=1e-6, far_peer_latency_s=2e-6, gpus_per_node=2,
)  # fmt: skip
MS = 1e-3


def kernel(ms: float, phase: str = "step") -> Kernel:
    return Kernel("k", 0, int(ms * 1e9), torch.float32, phase)


def swap(comm, peers: int, me: int, nbytes: int) -> Collective:
    """An all-to-all in which `me` sends `nbytes` to every other rank of `peers` and receives as much."""
    counts = tuple(0 if p == me else nbytes for p in range(peers))
    return Collective(comm, "all_to_all", counts, counts)


def test_kernels_queue_behind_the_host_and_each_other():
    launch_bound = replay([Trace(0, [kernel(0.0001) for _ in range(100)])], HW)[0]  # 0.1 us kernels, 1 us launches
    assert launch_bound.finish_s == pytest.approx(100 * 1e-6 + 0.1e-6)
    compute_bound = replay([Trace(0, [kernel(1.0) for _ in range(10)])], HW)[0]
    assert compute_bound.finish_s == pytest.approx(1e-6 + 10 * MS)
    matmul = Kernel("mm", int(2e12), 1000, torch.bfloat16, "newton_schulz")  # 2 TFLOP at 1 PFLOP/s
    result = replay([Trace(0, [matmul])], HW)[0]
    assert result.finish_s == pytest.approx(1e-6 + 2 * MS) and result.newton_schulz_s == pytest.approx(2 * MS)


def test_a_compiled_pass_costs_the_host_a_compiled_call():
    """A call of a torch.compile'd pass (its first kernel is "compiled" in the trace, step_trace.py)
    costs the host compiled_call_s; its further kernels, like eager ops, launch_s each."""
    call, more = (Kernel(name, 0, 100, torch.float32, "pack") for name in ("compiled", "fused"))  # 0.1 us of memory traffic each
    result = replay([Trace(0, [call, more, call, kernel(0.0001)])], HW)[0]
    assert result.host_busy_s == pytest.approx(2 * 5e-6 + 2 * 1e-6)
    assert result.finish_s == pytest.approx(2 * 5e-6 + 2 * 1e-6 + 0.1e-6)


def test_a_wait_holds_the_stream_not_the_host_and_a_read_drains_it():
    comm = ((0, 1), 0)
    events = {r: [swap(comm, 2, r, 10**9), Wait(0), kernel(1.0), HostRead(), kernel(1.0)] for r in (0, 1)}
    events[1] = [kernel(5.0)] + events[1]  # rank 1 joins 5 ms late
    results = replay([Trace(r, e) for r, e in events.items()], HW)
    arrival = 1e-6 + 5 * MS + 1e-5 + 1e-6 + 10 * MS  # rank 1's kernel, latency + 1 peer, 1 GB over NVLink
    # Rank 0's host launched the kernel after the wait at once (1 us), but the stream ran it after the data.
    assert results[0].finish_s == pytest.approx(arrival + 1 * MS + 1e-6 + 1 * MS)
    assert results[0].wire_s == pytest.approx(10 * MS) and results[0].bytes_sent == 10**9


def test_peers_without_bytes_are_not_waited_for():
    comm = ((0, 1, 2, 3), 0)
    late = [kernel(50.0)]
    traces = []
    for r in range(4):
        pair = 1 - r if r < 2 else 5 - r  # 0 <-> 1 and 2 <-> 3
        counts = tuple(10**8 if p == pair else 0 for p in range(4))
        traces.append(Trace(r, (late if r == 3 else []) + [Collective(comm, "all_to_all", counts, counts), Wait(0)]))
    results = replay(traces, HW)
    # 0 and 1 share a node (2 GPUs per node) and finish after 100 MB on NVLink, not after rank 3's 50 ms.
    assert results[0].finish_s == pytest.approx(1e-5 + 1e-6 + 1 * MS)
    assert results[2].finish_s == pytest.approx(1e-6 + 50 * MS + 1e-5 + 1e-6 + 1 * MS)


def test_bytes_to_other_nodes_take_the_infiniband_rate():
    comm = ((0, 1, 2, 3), 0)
    traces = [Trace(r, [swap(comm, 4, r, 10**8), Wait(0)]) for r in range(4)]
    result = replay(traces, HW)[0]
    # Rank 0: 100 MB to rank 1 (NVLink, 1 ms) and 200 MB to ranks 2, 3 (InfiniBand, 20 ms) at the same time.
    assert result.finish_s == pytest.approx(1e-5 + 1e-6 + 2 * 2e-6 + 20 * MS)


def _rounds_with_one_owner_each(shared: bool, owners: int = 4) -> float:
    """Rank 0 holds every matrix; round b's matrix goes to rank b + 1, which computes 10 ms and sends
    it back. Two rounds are in flight and each outbound is queued before the round's NS, as in
    ``ExchangeEngine.run``. On one communicator rank 0's outbound of round b + 3 queues behind its
    return of round b, which completes only when round b's owner is done: at most three owners
    compute at once, however many there are (the wave-3 finding in miniature)."""
    ranks = owners + 1
    outbound, back = (tuple(range(ranks)), 0), (tuple(range(ranks)), 0 if shared else 1)
    events = {me: [] for me in range(ranks)}
    index = {me: {} for me in range(ranks)}

    def collective(me, key, comm, owner, to_owner):
        holder_side = tuple(10**6 if (me == 0 and p == owner) else 0 for p in range(ranks))
        owner_side = tuple(10**6 if (me == owner and p == 0) else 0 for p in range(ranks))
        sent, received = (holder_side, owner_side) if to_owner else (owner_side, holder_side)
        events[me].append(Collective(comm, "all_to_all", sent, received))
        index[me][key] = sum(isinstance(e, Collective) for e in events[me]) - 1

    for me in range(ranks):
        collective(me, ("out", 0), outbound, 1, True)
        collective(me, ("out", 1), outbound, 2, True)
        for b in range(owners):
            events[me].append(Wait(index[me][("out", b)]))
            if b + 2 < owners:
                collective(me, ("out", b + 2), outbound, b + 3, True)
            if me == b + 1:
                events[me].append(kernel(10.0, "newton_schulz"))
            collective(me, ("back", b), back, b + 1, False)
        events[me] += [Wait(index[me][("back", b)]) for b in range(owners)]
    return max(r.finish_s for r in replay([Trace(me, events[me]) for me in range(ranks)], HW).values())


def test_returns_on_their_own_communicator_let_every_owner_compute_at_once():
    # The trips add tens of microseconds (1 MB, latencies) to whole 10 ms rounds of compute.
    within = {"abs": 1 * MS}
    assert _rounds_with_one_owner_each(shared=False) == pytest.approx(10 * MS, **within)
    assert _rounds_with_one_owner_each(shared=False, owners=8) == pytest.approx(10 * MS, **within)
    assert _rounds_with_one_owner_each(shared=True) == pytest.approx(20 * MS, **within)
    assert _rounds_with_one_owner_each(shared=True, owners=8) == pytest.approx(30 * MS, **within)


def test_a_collective_nobody_else_joins_is_reported():
    comm = ((0, 1), 0)
    with pytest.raises(RuntimeError, match="deadlock"):
        replay([Trace(0, [swap(comm, 2, 0, 10), Wait(0)]), Trace(1, [])], HW)


def test_a_relay_waits_on_its_own_stream_and_the_compute_stream_goes_on():
    """A hierarchical exchange's relay (wait for stage 1, regroup, stage 2) runs on the relay
    stream: compute queued after it does not wait for stage 1."""
    comm, rail = ((0, 1), 0), ((0, 1), 1)
    relay_kernel = Kernel("gather", 0, int(1e9), torch.uint8, "relay", "relay")
    traces = [Trace(r, [swap(comm, 2, r, 10**9), Wait(0, "relay"), relay_kernel, replace(swap(rail, 2, r, 10), stream="relay"),
                        kernel(1.0), Wait(1)]) for r in (0, 1)]  # fmt: skip
    results = replay(traces, HW)
    stage_one = 1e-5 + 1e-6 + 10 * MS  # latency + 1 peer + 1 GB over NVLink
    for r in (0, 1):
        # the compute kernel ran right away; the relay's gather after stage 1, then stage 2
        assert results[r].busy_s["step"] == pytest.approx(1 * MS)
        assert results[r].finish_s == pytest.approx(stage_one + 1 * MS + 1e-5 + 1e-6 + 10 / 1e11)


# ------------------------------------------------------------------ traces of the real step

SHAPES = [(96, 64), (64, 96), (40, 64), (130, 70), (64, 64)]  # uneven rows on 4 ranks, both orientations


@pytest.fixture(scope="module")
def traces():
    muon = [(f"layers.{i}.w", shape) for i, shape in enumerate(SHAPES)]
    adamw = [("embedding", (50, 64)), ("norm", (64,))]
    return [trace_rank(r, 4, muon, adamw, comm_dtype="bf16", ns_dtype="bf16") for r in range(4)]


def test_traced_exchanges_match_between_ranks(traces):
    """What rank r records sending to p is what p records receiving from r, collective by collective."""
    per_rank = [[e for e in t.events if isinstance(e, Collective)] for t in traces]
    assert len({len(c) for c in per_rank}) == 1
    for step in zip(*per_rank):
        assert len({c.comm for c in step}) == 1
        for r in range(4):
            for p in range(4):
                assert step[r].sent[p] == step[p].received[r]
    communicators = {c.comm for c in per_rank[0] if c.kind == "all_to_all"}
    assert len(communicators) == 2, "outbound and return trips each have a communicator"


def test_traced_bytes_and_flops_are_the_steps(traces):
    # Outbound bf16 pieces to owners: every element that does not start on its owner, twice (there and back).
    total = sum(t.metrics["muon/bytes_sent"] for t in traces)
    traced = sum(
        sum(b for p, b in enumerate(e.sent) if p != t.rank)
        for t in traces for e in t.events if isinstance(e, Collective) and e.kind == "all_to_all"
    )  # fmt: skip
    assert traced == total > 0
    # Each matrix's owner holds one of torch.chunk's row blocks; the rest crosses, both ways, in bf16.
    def crossing(rows, cols, owner_rows):
        return 2 * 2 * (rows - owner_rows) * cols

    blocks = [[len(c) for c in torch.arange(rows).chunk(4)] + [0] * 4 for rows, _ in SHAPES]
    assert sum(crossing(r, c, max(b)) for (r, c), b in zip(SHAPES, blocks)) <= total
    assert total <= sum(crossing(r, c, min(b[:4])) for (r, c), b in zip(SHAPES, blocks))
    # Newton–Schulz FLOPs: every matrix once, on one owner, 5 steps (torch's flop formulas, counted per mm).
    ns = sum(e.flops for t in traces for e in t.events if isinstance(e, Kernel) and e.phase == "newton_schulz")
    assert ns == sum(newton_schulz_flops(*s, 5) for s in SHAPES)


def test_compiled_passes_are_one_call_per_list_of_blocks(traces):
    """The shard side's pass and the commit hand each round's blocks to one compiled call
    (update.COMPILED_LIST at most; its first kernel is "compiled", the others "fused"): on every
    rank, in both phases, no call has more kernels than that, and there are fewer calls than
    kernels (these rounds carry several blocks; one call per block would make them equal)."""
    from titan_muon.algorithm.update import COMPILED_LIST

    for t in traces:
        for phase in ("pack", "commit_round"):
            kinds = [e.name for e in t.events if isinstance(e, Kernel) and e.phase == phase and e.name in ("compiled", "fused")]
            calls = "".join("c" if k == "compiled" else "f" for k in kinds).split("c")[1:]  # each call: its further kernels
            assert kinds and kinds[0] == "compiled" and all(len(more) < COMPILED_LIST for more in calls)
            assert len(calls) < len(kinds), (t.rank, phase, kinds)


def test_the_gradient_check_counts_its_muon_share(traces):
    """The non-finite check reads every gradient once, AdamW's too (fp32 here): its bytes per Muon
    element are the Muon gradients' 4 bytes, counted in the total beyond NS. Beside that one pass it
    handles a few per-parameter scalars (norms, flags, the agreement's vector; < 128 bytes per parameter in all), which only
    on shapes this small show up."""
    from scale_replay.step_trace import bytes_per_muon_element

    sides = bytes_per_muon_element(traces)
    scalars = max(128 * (len(SHAPES) + 2) / t.gradient_elements for t in traces)
    assert 4.0 <= sides["check"] <= 4.0 + scalars
    assert sides["total"] == pytest.approx(sides["check"] + sides["shard"] + sides["owner"] + sides["commit"])
    assert all(t.gradient_elements > t.muon_elements for t in traces)


def test_hierarchical_traces_match_and_replay():
    """Hierarchical exchange (2 nodes of 2): every all-to-all runs over a node or a rail of 2 ranks,
    on a node and a rail communicator per lane; the bytes match between ranks and the step's
    metric; the relays run on the relay stream; the replay completes."""
    muon = [(f"layers.{i}.w", shape) for i, shape in enumerate(SHAPES)]
    traces = [trace_rank(r, 4, muon, [("norm", (64,))], comm_dtype="bf16", ns_dtype="bf16", hierarchical_exchange=True,
                         ranks_per_node=2) for r in range(4)]  # fmt: skip
    per_rank = [[e for e in t.events if isinstance(e, Collective) and e.kind == "all_to_all"] for t in traces]
    for step in zip(*per_rank):
        for c in step:
            assert len(c.comm[0]) == 2
    for r, collectives in enumerate(per_rank):
        assert len({c.comm for c in collectives}) == 4  # node and rail, outbound and return lanes
        assert {c.stream for c in collectives} == {"compute", "relay"}
        for c in collectives:
            for i, p in enumerate(c.comm[0]):
                peer = per_rank[p][collectives.index(c)]
                assert peer.comm == c.comm and peer.received[c.comm[0].index(r)] == c.sent[i]
        traced = sum(sum(b for p, b in zip(c.comm[0], c.sent) if p != r) for c in collectives)
        assert traced == traces[r].metrics["muon/bytes_sent"] > 0
    assert any(isinstance(e, Kernel) and e.stream == "relay" for e in traces[0].events)
    results = replay(traces, HW)
    assert all(result.finish_s > 0 for result in results.values())


def test_llama3_8b_on_8_ranks_is_close_to_its_bound():
    from scale_replay import simulate as simulate_scale

    row = simulate_scale.simulate(simulate_scale.Case("Llama-3 8B", 8), workers=1, log=lambda _: None)
    assert row.idle_ranks == 0
    # The plan's balance property (tests/test_plan.py): 224 matrices are >= 4 W units.
    assert row.ns_balance <= 1.1
    # The bound overlaps everything; what no schedule hides is the first round's outbound trip and the
    # last round's return. Rounds hold equal Newton–Schulz work, not equal bytes: each trip is at most
    # twice the busiest rank's wire time over the rounds.
    unhidden = 2 * 2 * row.busiest("wire_s") / row.rounds
    assert row.step_s <= row.bound_s + unhidden, (
        f"replayed step {row.step_s * 1e3:.1f} ms vs bound {row.bound_s * 1e3:.1f} ms + {unhidden * 1e3:.1f} ms"
    )
    assert row.one_lane_s >= row.step_s * (1 - 1e-9)


# ------------------------------------------------------------------ torchtitan's parallel layouts


def _ns_flops_traced(trace) -> int:
    return sum(e.flops for e in trace.events if isinstance(e, Kernel) and e.phase == "newton_schulz")


def _bytes_to_others(trace) -> int:
    return sum(
        sum(b for p, b in zip(e.comm[0], e.sent) if p != trace.rank)
        for e in trace.events if isinstance(e, Collective) and e.kind == "all_to_all"
    )  # fmt: skip


# Four dense matrices of one Newton–Schulz class (64 x 32 and 32 x 64 cost and weigh the same)
# and 3 stacks of 8 experts of another (48 x 32 and 32 x 48 likewise): 24 experts, 6 per rank.
MOE_DENSE = [(f"layers.0.attention.{n}.weight", (64, 32)) for n in ("wq", "wk", "wv")] + [("layers.0.attention.wo.weight", (32, 64))]
MOE_EXPERTS = [("layers.0.moe.experts.w1", (8, 48, 32)), ("layers.0.moe.experts.w2", (8, 32, 48)), ("layers.0.moe.experts.w3", (8, 48, 32))]


@pytest.mark.parametrize("ep", [4, 2], ids=["ep4-efsdp1", "ep2-efsdp2"])
def test_expert_parallel_leaves_experts_with_their_holders(ep):
    """DP 4 with EP 4 (experts whole on their EP rank) or EP 2 x efsdp 2 (FSDP2 splits each EP
    rank's experts along the expert dimension, strided: still whole experts, 6 per rank). The
    balanced plan is one dense matrix and the rank's own 6 experts per owner (the round's level is
    exactly 1 dense + 6 experts), so the only bytes are the dense matrices' row shards."""
    parallelism = Parallelism(4, ep=ep)
    traces = [trace_rank(r, 4, MOE_DENSE + MOE_EXPERTS, [("norm", (32,))], parallelism=parallelism, comm_dtype="bf16",
                         ns_dtype="bf16") for r in range(4)]  # fmt: skip
    # Per rank: its 16-row shard of the 3 dense matrices it does not own goes out, and as an owner
    # it sends the 3 other ranks' shards of its own matrix back; bf16, 2 bytes an element.
    dense_shard = 64 // 4 * 32
    for t in traces:
        assert _bytes_to_others(t) == t.metrics["muon/bytes_sent"] == 2 * 3 * dense_shard * 2
        assert _ns_flops_traced(t) == newton_schulz_flops(64, 32, 5) + 6 * newton_schulz_flops(48, 32, 5)
    results = replay(traces, HW)
    assert all(result.finish_s > 0 for result in results.values())


def test_tensor_parallel_shards_every_matrix_over_fsdp_times_tp():
    """FSDP 2 x TP 2 under the Llama TP plan: column-wise wq and w1 (TP splits rows, FSDP2 splits
    each TP rank's rows), row-wise wo and w2 (TP splits columns, FSDP2 rows). Each rank holds a
    quarter of every matrix, so one exchange over all 4 ranks carries three quarters of each
    matrix to its owner and back; each matrix is orthogonalized once."""
    shapes = {"attention.wq": (64, 32), "attention.wo": (32, 64), "feed_forward.w1": (96, 32), "feed_forward.w2": (32, 96)}
    muon = [(f"layers.0.{name}.weight", shape) for name, shape in shapes.items()]
    adamw = [("tok_embeddings.weight", (50, 32)), ("layers.0.attention_norm.weight", (32,))]
    parallelism = Parallelism(2, tp=2)
    assert parallelism.name == "FSDP 2 × TP 2"
    traces = [trace_rank(r, 4, muon, adamw, parallelism=parallelism, comm_dtype="bf16", ns_dtype="bf16") for r in range(4)]
    exchanges = {e.comm[0] for t in traces for e in t.events if isinstance(e, Collective) and e.kind == "all_to_all"}
    assert exchanges == {(0, 1, 2, 3)}
    # Exact: every rank holds numel / 4 of every matrix (all dimensions divide), bf16 both ways.
    expected = sum(2 * 2 * (rows * cols * 3 // 4) for rows, cols in shapes.values())
    assert sum(_bytes_to_others(t) for t in traces) == sum(t.metrics["muon/bytes_sent"] for t in traces) == expected
    assert sum(_ns_flops_traced(t) for t in traces) == sum(newton_schulz_flops(*s, 5) for s in shapes.values())


def test_pipeline_stages_trace_their_own_layers_and_replay_alone():
    """PP 2 x DP 2 of a 4-layer Llama: stage 0 (ranks 0, 1) has the embedding and layers 0-1,
    stage 1 (ranks 2, 3) layers 2-3, the final norm and the output. Each stage's exchange stays
    among its ranks; the only collective across stages is the optimizer's pipeline agreement,
    which a stage replayed alone completes with the other stage keeping pace."""
    from scale_replay import simulate as simulate_scale
    from scale_replay.model_presets import llama3

    model = llama3("tiny", 32, layers=4, heads=4, kv_heads=2, ffn=96)
    parallelism = Parallelism(2, pp=2)
    stages = [simulate_scale.stage_params(model, 2, s) for s in range(2)]
    assert {n.split(".")[1] for n, _ in stages[0][0]} == {"0", "1"} and {n.split(".")[1] for n, _ in stages[1][0]} == {"2", "3"}
    assert "tok_embeddings.weight" in dict(stages[0][1]) and "output.weight" in dict(stages[1][1])
    assert "output.weight" not in dict(stages[0][1]) and "tok_embeddings.weight" not in dict(stages[1][1])
    for stage, (muon, adamw) in enumerate(stages):
        ranks = parallelism.stage_ranks(stage)
        traces = [trace_rank(r, 4, muon, adamw, parallelism=parallelism, comm_dtype="bf16", ns_dtype="bf16") for r in ranks]
        assert sum(_ns_flops_traced(t) for t in traces) == sum(newton_schulz_flops(*shape, 5) for _, shape in muon)
        for t in traces:
            comms = {e.comm[0] for e in t.events if isinstance(e, Collective)}
            pipeline = (t.rank % 2, t.rank % 2 + 2)  # this rank and its counterpart in the other stage
            assert comms == {tuple(ranks), pipeline}
        with pytest.raises(RuntimeError, match="deadlock"):
            replay(traces, HW)
        assert all(result.finish_s > 0 for result in replay(traces, HW, absent_ranks_keep_pace=True).values())


def test_pipeline_layers_split_as_torchtitan_does():
    """Against torchtitan 0.2.2's own split (its default: embedding and output count as a layer)."""
    from scale_replay import simulate as simulate_scale
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    for layers, stages in [(61, 4), (4, 2), (32, 4), (80, 8), (48, 3)]:
        theirs = generate_llm_fqn_per_model_part(stages, layers)
        ours = simulate_scale.pipeline_layers(layers, stages)
        assert [[f"layers.{i}" for i in r] for r in ours] == [[m for m in part if m.startswith("layers.")] for part in theirs]
    kimi = simulate_scale.Case("Kimi-K2 1T", 256, ep=64, pp=4)
    assert kimi.stage == 1 and kimi.traced_ranks == range(64, 128)  # 16 MoE layers, the first of two such stages
    first = simulate_scale.Case("Kimi-K2 1T", 256, ep=64, pp=4, only_stage=0)
    assert first.stage == 0 and first.traced_ranks == range(0, 64) and first.layout.endswith("stage 0 traced")


def test_pipeline_stages_hide_their_steps_behind_the_forwards_ahead_of_them():
    """Stage s gets the next step's first microbatch after stages 0 … s − 1 each ran one forward;
    the job waits for the latest stage. Stages after the busiest that were not replayed count at
    its step; an earlier one missing is an error, not a guess."""
    from scale_replay import simulate as simulate_scale
    from scale_replay.model_presets import Model

    forward = [0.060, 0.064, 0.064, 0.060]
    exposed = simulate_scale.pipeline_exposed_s
    assert exposed({0: 0.100, 1: 0.150}, forward, 4, busiest=1) == pytest.approx(0.100)  # stage 1: 0.150 − 0.060
    assert exposed({0: 0.100, 1: 0.200}, forward, 4, busiest=1) == pytest.approx(0.140)
    assert exposed({0: 0.010, 1: 0.300}, forward, 4, busiest=1) == pytest.approx(0.240)  # stages 2, 3 hide more
    with pytest.raises(ValueError, match="stage 0 comes before the busiest"):
        exposed({1: 0.150}, forward, 4, busiest=1)
    # a forward is 2 FLOPs per active parameter per token; routed experts count 8 of their number
    toy = Model("toy", (("layers.0.attention.wq", (4, 8)), ("layers.0.moe.experts.w1", (16, 4, 8))), dim=8, vocab=10)
    assert simulate_scale.stage_forward_s(toy, 1, 0, tokens=100, flops_per_gpu=1e6) == pytest.approx(2 * (32 + 8 * 32) * 100 / 1e6)


def test_kimi_rows_compare_like_for_like_within_one_exchange_window():
    """The calibration's Kimi K2 figure at the default window and at the wide one: each from its
    own window's stage 0 and busiest stage, never mixing them; a window without stage 0 gives none."""
    from scale_replay import simulate as simulate_scale

    def row(stage, window, step, adamw):
        case = simulate_scale.Case("Kimi-K2 1T", 256, ep=64, pp=4, only_stage=0 if stage == 0 else None, exchange_memory_mb=window)
        finish = lambda s: {0: SimpleNamespace(finish_s=s)}  # noqa: E731
        return simulate_scale.Row(case, finish(step), {}, finish(adamw), [], 0.0)

    forward = [0.060, 0.064, 0.064, 0.060]
    rows = [row(1, None, 0.140, 0.030), row(0, None, 0.127, 0.021), row(1, 8192, 0.139, 0.030), row(0, 8192, 0.122, 0.021)]
    stages, busiest, exposed = simulate_scale.kimi_like_for_like(rows, forward, None)
    assert busiest is rows[0] and stages[0] is rows[1] and exposed["step_s"] == pytest.approx(0.127)
    stages, busiest, exposed = simulate_scale.kimi_like_for_like(rows, forward, 8192)
    assert busiest is rows[2] and stages[0] is rows[3] and exposed == {"step_s": pytest.approx(0.122), "adamw_s": pytest.approx(0.021)}
    assert simulate_scale.kimi_like_for_like(rows[:1], forward, None)[1] is None
    wide = rows[3].case
    assert wide.settings["exchange_memory_mb"] == 8192 and wide.layout.endswith("stage 0 traced, exchange_memory_mb = 8192")
    assert "exchange_memory_mb" not in rows[1].case.settings


def test_gather_everything_floor_is_the_groups_whole_newton_schulz():
    """DMuon's calibration row: gather-everything Muon runs every matrix's NS on every rank, so its step
    is at least the sum of the owners' NS; the owner step is compared against that floor."""
    from scale_replay import simulate as simulate_scale
    results = {rank: SimpleNamespace(newton_schulz_s=ns, finish_s=0.1) for rank, ns in enumerate([0.02, 0.03, 0.025, 0.025])}
    row = simulate_scale.Row(simulate_scale.Case("Llama-3 8B", 4), results, {}, {}, [], 0.0)
    assert simulate_scale.gather_everything_floor_s(row) == pytest.approx(0.1)
    (dmuon, canzona) = simulate_scale.owner_versus_gather_rows([row])
    assert "at least 1.0–1.0x (Llama-3 8B W = 4: 1.0x" in dmuon and "0.15 (the low ends)" in dmuon
    assert canzona.startswith("| Canzona")


def test_calibration_costs_an_ns_call_as_the_replay_does():
    """scripts/calibrate_replay.py: a tiny call is launch-bound (every kernel waits for its launch:
    kernels × launch_s plus the last kernel's minimum time); a large one is its matrix products at
    the bf16 rate plus its passes at the memory rate, never less than the FLOPs alone."""
    from scale_replay.calibrate import modelled_seconds

    hardware = Hardware()
    seconds, kernels = modelled_seconds(hardware, 1, 8, 16, torch.bfloat16, "standard", True)
    assert seconds == pytest.approx(kernels * hardware.launch_s + hardware.min_kernel_s)
    seconds, _ = modelled_seconds(hardware, 2, 4096, 14336, torch.bfloat16, "standard", True)
    products = 2 * newton_schulz_flops(4096, 14336, 5) / hardware.bf16_matmul_flops
    # the passes (scaling, casts) move a few copies of 2 x 4096 x 14336 elements: under 5 % here
    assert products <= seconds <= 1.05 * products
