"""MuonClip under context parallel (CP): each rank's queries against the whole sequence's keys.

torch 2.13's context-parallel SDPA does not run on CPU (``aten._scaled_dot_product_flash_attention_for_cpu``
has no DTensor sharding strategy; the math backend mixes DTensor and Tensor), so torchtitan's
``--parallelism.context_parallel_degree 2`` cannot train here. The distributed test emulates it
on gloo ranks with torchtitan's and torch's own pieces wherever they run on CPU:

* the tokens and RoPE positions are cut by torchtitan 0.2.2's ``prepare_context_parallel_input``
  (torch's ``_HeadTailLoadBalancer``, or no load balancer);
* the inner attentions get torch's ``_ContextParallel`` SDPA style (``parallelize_module``, as
  torchtitan applies it), so the recorder's hook runs after torch's and sees its DTensor inputs;
* only the attention itself is the test's own (:class:`GatheredCausalSDPA`): every rank's keys
  and values gathered with autograd, masked causally by the positions torchtitan handed out.
  That is exact attention, so every later layer sees what the one-process run sees.

The reference is the same model on the whole sequence in one process (CP 1), recorded and
clipped by the same QKClip without context parallel; the one-process recording itself is
checked against brute force in tests/test_clip.py.
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import GatherAlongSequence, causal_mask_over_ranks, run_distributed
from test_clip import SEQ, llama, mla, tokens
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental._attention import (
    _ContextParallel,
    _HeadTailLoadBalancer,
)
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.context_parallel import prepare_context_parallel_input
from torchtitan.models.attention import ScaledDotProductAttentionWrapper

from titan_muon.attention.clip import QKClip
from titan_muon.attention.logits import (
    ContextParallelSequence,
    MaxLogitRecorder,
    block_max_logits,
    causal_key_ranges,
    gathered_key_positions,
    sharded_sequence_positions,
)
from titan_muon.torchtitan.cpu import use_cpu_device
from titan_muon.torchtitan.qk_clip import (
    build_model_part_qk_clips,
    use_context_parallel_load_balancer,
)

TIMEOUT = 300.0  # each rank builds two small models and runs one step: seconds, even on a loaded CPU


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("world", [2, 3, 4])
def test_head_tail_positions_are_torchs_load_balancer(world):
    """Our positions of each rank's tokens, against torch's _HeadTailLoadBalancer (what torchtitan
    shards with) and against the rule written out: rank r holds chunk r, then chunk 2W-1-r."""
    local_len = 6
    chunk = local_len // 2
    by_rule = [p for r in range(world) for c in (r, 2 * world - 1 - r) for p in range(c * chunk, (c + 1) * chunk)]
    ours = sharded_sequence_positions("headtail", world, local_len)
    assert ours.tolist() == by_rule
    torch_order = _HeadTailLoadBalancer(world * local_len, world, "cpu")._generate_indices()
    assert torch.equal(ours, torch_order.reshape(-1))
    assert sharded_sequence_positions(None, world, local_len).tolist() == list(range(world * local_len))


@pytest.mark.parametrize("load_balancer", ["headtail", None])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_query_stretch_gets_every_key_it_may_see(load_balancer, world):
    """Exhaustive over ranks and queries: the gathered keys are the whole sequence once, the
    stretches tile the rank's queries, each stretch's key range holds every key at or before each
    of its queries' positions (so skipping the keys outside it loses nothing), and every key of the
    range outside its mask window precedes all of its queries (so leaving it unmasked is right)."""
    local_len = 6
    key_positions = gathered_key_positions(load_balancer, world, local_len)
    assert sorted(key_positions.tolist()) == list(range(world * local_len))
    sharded = sharded_sequence_positions(load_balancer, world, local_len)
    multiplied = 0
    for rank in range(world):
        query_positions = sharded[rank * local_len : (rank + 1) * local_len]
        ranges = causal_key_ranges(load_balancer, world, rank, local_len)
        assert [i for part in ranges for i in range(part.query_start, part.query_stop)] == list(range(local_len))
        for part in ranges:
            keys = key_positions[part.key_start : part.key_stop]
            unmasked = torch.ones(len(keys), dtype=torch.bool)
            unmasked[part.mask_start : part.mask_stop] = False
            for i in range(part.query_start, part.query_stop):
                visible = (key_positions <= query_positions[i]).nonzero().flatten()
                assert part.key_start <= int(visible.min()) and int(visible.max()) < part.key_stop
                assert bool((keys[unmasked] <= query_positions[i]).all())
            multiplied += (part.query_stop - part.query_start) * (part.key_stop - part.key_start)
    # Query-key products over all ranks: the causal triangle plus at most one chunk square per
    # stretch (the diagonal), never the whole L x L square.
    seq = world * local_len
    stretches = 2 * world if load_balancer else world
    assert multiplied <= seq * (seq + 1) // 2 + stretches * (seq // stretches) ** 2


def test_bad_load_balancers_are_named():
    with pytest.raises(ValueError, match="context_parallel_load_balancer = 'zigzag'"):
        ContextParallelSequence(None, "zigzag")
    with pytest.raises(NotImplementedError, match="'ptrr' .* FlexAttention"):
        sharded_sequence_positions("ptrr", 2, 4)
    with pytest.raises(ValueError, match="two equal chunks, but a rank holds 5 tokens"):
        sharded_sequence_positions("headtail", 2, 5)


# fp32: sums of 8 products, ~1e-7 relative. bf16 (the per-head 2-D matmul path on CPU): the
# reference takes the same bf16 inputs in fp64, the recording rounds each logit once to bf16
# (2^-8 relative) after accumulating in fp32.
TOLERANCES = {torch.float32: 1e-6, torch.bfloat16: 2**-8}


@pytest.mark.parametrize("dtype", TOLERANCES)
@pytest.mark.parametrize("block_bytes", [None, 3 * 13 * 2])  # one block, or 1 query row a block
def test_positional_causal_mask_equals_the_dense_max(block_bytes, dtype):
    """Queries at some positions against keys in a shuffled order, masked by position, against a dense
    fp64 reference from the same inputs."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 5, 8, generator=g).to(dtype), torch.randn(2, 3, 13, 8, generator=g).to(dtype)
    key_positions = torch.randperm(13, generator=g)
    query_positions = key_positions[[1, 4, 7, 8, 12]]  # this "rank's" queries, as in context parallel
    got = block_max_logits(q, k, query_positions=query_positions, key_positions=key_positions, block_bytes=block_bytes)
    logits = torch.einsum("bhid,bhjd->bhij", q.double(), k.double().repeat_interleave(2, dim=1)) / math.sqrt(8)
    allowed = key_positions[None, :] <= query_positions[:, None]
    expected = logits.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3))
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    # The same with the mask applied only where a key can follow a query: here sorted keys, the
    # queries' own stretch last, as in context parallel's contiguous slices.
    sorted_keys = torch.arange(13)
    own = torch.arange(8, 13)
    windowed = block_max_logits(q, k, query_positions=own, key_positions=sorted_keys, masked_keys=(8, 13), block_bytes=block_bytes)
    allowed = sorted_keys[None, :] <= own[:, None]
    expected = logits.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(windowed.double(), expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="positions of shapes"):
        block_max_logits(q, k, query_positions=query_positions[:3], key_positions=key_positions)


# ---------------------------------------------------------------- CP 2 against CP 1


class GatheredCausalSDPA(ScaledDotProductAttentionWrapper):
    """Exact causal attention of this rank's queries over every rank's keys and values (the test's
    stand-in for torch's ring attention, which has no CPU kernel): an autograd all-gather along the
    sequence, and a mask from the global positions torchtitan gave this rank's tokens."""

    def __init__(self, group, positions):
        super().__init__()
        self.group = group
        self.allowed = causal_mask_over_ranks(group, positions)  # (local queries, all keys)

    def forward(self, q, k, v, *, scale=None, enable_gqa=False, is_causal=True):
        q, k, v = (t.to_local() if isinstance(t, DTensor) else t for t in (q, k, v))
        k, v = (GatherAlongSequence.apply(t, self.group) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed, scale=scale, enable_gqa=enable_gqa)


def loss_of(output, tokens_in_batch):
    """A loss that sums over tokens, so the CP ranks' losses add up to the one-process loss."""
    return output.float().square().sum() / (tokens_in_batch * output.shape[-1])


def sgd_step(model, forward, tokens_in_batch, reduce_gradients=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_of(forward(), tokens_in_batch).backward()
    if reduce_gradients is not None:
        reduce_gradients(model)
    optimizer.step()
    return optimizer


def _cp_run(rank, world, model_kind, load_balancer):
    build = {"gqa": llama, "mla": mla}[model_kind]
    batch = tokens(batch=2)  # (2, SEQ): the same whole sequences on every rank
    use_cpu_device()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=world, tp=1, pp=1, ep=1, etp=1, world_size=world)
    cp_mesh = dims.get_mesh("cp")
    cp_group = cp_mesh.get_group()

    # CP 1: the whole sequence in one process.
    reference = build()
    reference_clip = QKClip(reference, tau=1.0)
    reference_optimizer = sgd_step(reference, lambda: reference(batch), batch.numel())

    # CP `world`: this rank's slice of every sequence, cut by torchtitan.
    model = build()
    local_tokens, _, extra = prepare_context_parallel_input(batch, batch.clone(), {}, cp_mesh, torch.device("cpu"), load_balancer)
    positions = extra["positions"]
    for block in model.layers.values():
        block.attention.inner_attention = GatheredCausalSDPA(cp_group, positions[0])
        parallelize_module(block.attention.inner_attention, cp_mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))

    # Without the sequence layout the recorder refuses, on every rank, before any collective.
    unaware = MaxLogitRecorder.attach(model)
    with pytest.raises(NotImplementedError, match="sharded along the sequence .*context_parallel="):
        model(local_tokens, positions=positions)
    unaware.remove()

    # As the torchtitan adapter builds it (the CP layout from the cp mesh, the world as the group),
    # then told the run's load balancer as titan_muon's trainer does.
    (qk_clip,) = build_model_part_qk_clips([model], SimpleNamespace(qk_clip_tau=1.0, qk_clip_alpha=0.5, qk_clip_recording="auto"), dims)
    assert qk_clip.group is None and qk_clip.recorder.context_parallel.load_balancer == "headtail"
    use_context_parallel_load_balancer([qk_clip], load_balancer)
    assert qk_clip.recorder.context_parallel == ContextParallelSequence(cp_group, load_balancer)

    def sum_gradients_over_cp(m):  # what FSDP over dp_shard x cp does with the gradients
        for p in m.parameters():
            dist.all_reduce(p.grad, group=cp_group)

    optimizer = sgd_step(model, lambda: model(local_tokens, positions=positions), batch.numel(), sum_gradients_over_cp)

    # The step's maxima, all-reduced as reduce_and_clip does it (MAX twice is MAX once).
    reference_s = reference_clip.recorder.all_reduce().clone()
    s = qk_clip.recorder.all_reduce().clone()
    # tau in the widest gap between the reference's maxima: some heads clip, some not.
    values = reference_s[torch.isfinite(reference_s)].sort().values
    gap = (values[1:] - values[:-1]).argmax()
    reference_clip.tau = qk_clip.tau = float(values[gap] + values[gap + 1]) / 2
    reference_metrics = reference_clip.reduce_and_clip(reference_optimizer)
    metrics = qk_clip.reduce_and_clip(optimizer)
    return {
        "reference_s": reference_s,
        "s": s,
        "tau": qk_clip.tau,
        "gap": float(values[gap + 1] - values[gap]),
        "reference_metrics": dict(reference_metrics),
        "metrics": dict(metrics),
        "reference_weights": {n: p.detach().clone() for n, p in reference.named_parameters()},
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("model_kind, load_balancer", [("gqa", "headtail"), ("mla", "headtail"), ("gqa", None)])
def test_context_parallel_records_and_clips_as_one_process(model_kind, load_balancer):
    results = run_distributed(_cp_run, 2, model_kind, load_balancer, timeout=TIMEOUT)
    assert SEQ % 4 == 0  # head-tail on 2 ranks: 4 chunks
    for rank, result in enumerate(results):
        expected_s, s = result["reference_s"], result["s"]
        # Every (layer, head) maximum. The same fp32 dot products, but q and k come out of layers
        # whose attention ran as SDPA over the whole sequence (reference) or over gathered keys
        # with an explicit mask (CP): rounding of ~1e-7 relative per operation, through sums of
        # <= 36 products and a softmax over <= 12 keys per layer, stays well below 1e-5 relative
        # (the logits here are O(1..30)).
        torch.testing.assert_close(s, expected_s, rtol=1e-5, atol=1e-5)
        # The same heads clipped: tau sits mid-gap, and the gap is far wider than that tolerance.
        assert result["gap"] > 1e-3
        clipped, expected_clipped = s > result["tau"], expected_s > result["tau"]
        assert torch.equal(clipped, expected_clipped)
        assert 0 < int(expected_clipped.sum()) < int(expected_s.isfinite().sum())
        expected, got = result["reference_metrics"], result["metrics"]
        assert got["qk_clip/heads_clipped"] == expected["qk_clip/heads_clipped"] == int(expected_clipped.sum())
        # Weights after SGD (gradients summed over the CP ranks in another order) and the clip:
        # relative rounding of the same size, on weights of O(0.4).
        for name, weight in result["reference_weights"].items():
            torch.testing.assert_close(result["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")
    # Every rank ends with the same weights (the all-reduced maxima are identical).
    for name in results[0]["weights"]:
        assert torch.equal(results[0]["weights"][name], results[1]["weights"][name])
