"""Several model parts per rank (torchtitan's interleaved / virtual-stage pipeline schedules):
one Muon per part, as the containers hold them (titan_muon/torchtitan/v022/optimizer.py and
v030/optimizer.py), stepping together.
"""

import pytest
import torch
from common import grads_for, make_params
from torch import nn

from titan_muon import Muon
from titan_muon.metrics import PART_MERGE_RULES
from titan_muon.torchtitan.muon import merged_step_metrics

# Two parts of different shapes, so that their per-element figures differ: fp8 momentum costs
# one exponent byte per row and 256 columns, 1 + 1/256 on 256 columns and 1 + 1/30 on 30.
PART_SHAPES = [{"a": (64, 256), "emb": (50, 16)}, {"d": (64, 30), "e": (3, 30), "bias": (17,)}]
ADAMW = {"emb", "bias"}


def _part(shapes, seed, **settings):
    tensors = {n: nn.Parameter(t) for n, t in make_params(seed, shapes).items()}
    groups = [
        {"params": [(n, t) for n, t in tensors.items() if n not in ADAMW]},
        {"params": [(n, t) for n, t in tensors.items() if n in ADAMW], "use_muon": False},
    ]
    return Muon(groups, **settings), tensors


def test_metrics_of_several_parts_merge_by_rule():
    """Merged metrics used to sum momentum_bytes_per_element (2.1 for two fp8 parts of ~1.05)
    and average rounds. Against one optimizer holding both parts' parameters (the same
    matrices, states and updates): ratios weighted by elements, amounts summed, peaks the max."""
    settings = dict(lr=0.02, momentum_dtype="fp8")
    parts = [_part(shapes, seed, **settings) for seed, shapes in enumerate(PART_SHAPES)]
    whole_tensors = {n: nn.Parameter(t.detach().clone()) for _, tensors in parts for n, t in tensors.items()}
    whole = Muon([{"params": [(n, t) for n, t in whole_tensors.items() if n not in ADAMW]},
                  {"params": [(n, t) for n, t in whole_tensors.items() if n in ADAMW], "use_muon": False}], **settings)  # fmt: skip
    # One step: its updates do not depend on how fp8 rounded the stored momentum (stochastic
    # rounding draws per parameter index, which differs between the parts and the whole).
    for opt, tensors in parts:
        for name, grad in grads_for(0, tensors).items():
            tensors[name].grad = grad
            whole_tensors[name].grad = grad.clone()
        opt.step()
    whole.step()
    per_part = [opt.last_step_metrics for opt, _ in parts]
    merged, one = merged_step_metrics([opt for opt, _ in parts]), whole.last_step_metrics
    assert set(merged) == set(one)
    # every figure is the sum or the largest of the parts', or weighted by its element count
    for key in ("muon/ns_flops", "muon/update_elements", "muon/momentum_elements", "muon/rounds"):
        assert merged[key] == sum(m[key] for m in per_part), key
    assert merged["muon/peak_transient_bytes"] == max(m["muon/peak_transient_bytes"] for m in per_part)
    assert merged["muon/skipped_steps"] == 0.0
    # Same matrices, states and updates as one optimizer: element counts and FLOPs are exact.
    for key in ("muon/ns_flops", "muon/update_elements", "muon/momentum_elements"):
        assert merged[key] == one[key], key
    # Bytes per element: exact ratios of integers, merged in float64 (a few ulps).
    per_element = merged["muon/momentum_bytes_per_element"]
    assert per_element == pytest.approx(one["muon/momentum_bytes_per_element"], rel=1e-12)
    assert 1 < per_element < 1 + 1 / 30
    # update RMS: the same lr-scaled updates; each part's sum of squares is an fp32 sum in
    # another grouping than the whole one's (~1e-7 relative).
    assert merged["muon/update_rms"] == pytest.approx(one["muon/update_rms"], rel=1e-5)
    # the parts' RMS differ (1.1e-3 on 16384 elements, 3.0e-3 on 2010): their plain mean is 40 % off
    rms = [m["muon/update_rms"] for m in per_part]
    assert sum(rms) / 2 != pytest.approx(one["muon/update_rms"], rel=0.1)


def test_every_metric_has_a_merge_rule():
    """A new metric without a rule would be merged wrongly in silence: refused instead."""
    opt, tensors = _part(PART_SHAPES[0], 0, lr=0.02, overlap=False)
    for name, grad in grads_for(0, tensors).items():
        tensors[name].grad = grad
    opt.step()
    assert set(opt.last_step_metrics) <= set(PART_MERGE_RULES)
    with pytest.raises(KeyError, match="muon/new_figure"):
        from titan_muon.metrics import merge_part_metrics

        merge_part_metrics([{"muon/new_figure": 1.0}])


# ------------------------------------------------ the parts agree on gradients together

PP, DP = 2, 2  # four ranks: two pipeline stages of two FSDP ranks, two model parts per rank
STAGE_PART_SHAPES = [{"a": (30, 64), "b": (63, 64), "emb": (50, 16)}, {"c": (3, 256), "d": (64, 30), "bias": (17,)}]
# A part of AdamW parameters only, as torchtitan's pipeline split makes them (["norm", "output"]).
ADAMW_ONLY_PART = {"norm": (16,), "output": (50, 16)}


def _container(optimizers):
    """torchtitan 0.2.2's container as the trainer steps it (without building a model)."""
    from titan_muon.torchtitan.v022.optimizer import MuonOptimizersContainer

    container = MuonOptimizersContainer.__new__(MuonOptimizersContainer)
    container.optimizers, container.qk_clips, container.qk_clip_metrics = optimizers, [], []
    return container


def _parts_run(rank, world, policy, nan_part, overlap, adamw_only_part=False):
    """Two model parts per rank (virtual stages k·PP + stage), each its own Muon with the
    pipeline group; at step 1 one entry of part `nan_part`'s gradient is NaN on rank 0 only;
    step 2 is normal again. Gradients come from a backward (loss Σ <p, g> on each rank's rows),
    so with overlap the rounds leave during backward. ``adamw_only_part``: part 1 holds no Muon matrix."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    parts = []
    for k, shapes in enumerate(STAGE_PART_SHAPES[:1] + [ADAMW_ONLY_PART] if adamw_only_part else STAGE_PART_SHAPES):
        module = nn.Module()
        for name, tensor in make_params(10 * k + stage, shapes).items():
            module.register_parameter(name, nn.Parameter(distribute_tensor(tensor, mesh["dp"], [Shard(0)])))
        named = dict(module.named_parameters())
        adamw = ADAMW | set(ADAMW_ONLY_PART)
        groups = [g for g in ({"params": [(n, p) for n, p in named.items() if n not in adamw]},
                              {"params": [(n, p) for n, p in named.items() if n in adamw], "use_muon": False}) if g["params"]]  # fmt: skip
        opt = Muon(groups, lr=0.02, momentum=0.9, exchange_memory_mb=0.01, nonfinite_grads=policy, overlap=overlap,
                   pipeline_group=mesh["pp"].get_group())  # fmt: skip
        parts.append((opt, named, shapes))
    container = _container([opt for opt, _, _ in parts])
    plans = []  # each part's commit plan inside the container's step
    for opt, _, _ in parts:
        opt.register_step_pre_hook(lambda o, args, kwargs: plans.append(o.commit_plan))
    outcome, unchanged = "stepped", None
    for step in range(3):
        terms = []
        for k, (opt, named, shapes) in enumerate(parts):
            full = grads_for(step, {n: torch.empty(s) for n, s in shapes.items()})
            if step == 1 and k == nan_part:
                first = next((n for n in shapes if n not in ADAMW | set(ADAMW_ONLY_PART)), "output")
                full[first][0, 0] = float("nan") if dist.get_rank() == 0 else 0.0  # row 0: rank 0's shard only
            for name, p in named.items():
                local = distribute_tensor(full[name], mesh["dp"], [Shard(0)], src_data_rank=None).to_local()
                terms.append((p.to_local() * local).sum())
        sum(terms).backward()
        before = [{n: p.full_tensor() for n, p in named.items()} for _, named, _ in parts]
        try:
            container.step()
        except FloatingPointError as error:
            outcome = str(error)
        for opt, _, _ in parts:
            opt.zero_grad()
        after = [{n: p.full_tensor() for n, p in named.items()} for _, named, _ in parts]
        if step == 1:
            unchanged = [all(torch.equal(b[n], a[n]) for n in b) for b, a in zip(before, after)]
    return {"outcome": outcome, "unchanged": unchanged, "skipped": [opt.skipped_steps for opt, _, _ in parts],
            "plans": plans, "plan_alone": parts[0][0].commit_plan,
            "params": [{n: p.full_tensor() for n, p in named.items()} for _, named, _ in parts]}  # fmt: skip


@pytest.mark.parametrize(
    "policy,nan_part,overlap",
    [("skip", 0, False), ("skip", 1, False), ("raise", 0, False), ("raise", 1, False), ("raise", 1, True)],
)
def test_a_nonfinite_gradient_in_one_part_skips_or_raises_every_part_on_every_rank(policy, nan_part, overlap):
    """Each part's agreement paired it with the same part elsewhere only: a NaN in part 1
    skipped part 1 while part 0 had stepped; "raise" raised after part 0 had written. With
    overlap, the parts after the one that raised settle what they sent during backward, so the
    next step runs on every rank (and equals the run without overlap)."""
    from distributed import run_distributed

    results = run_distributed(_parts_run, PP * DP, policy, nan_part, overlap, timeout=240)
    for rank, result in enumerate(results):
        assert result["unchanged"] == [True, True], (rank, result["outcome"], result["unchanged"])
        # stepped together, the parts commit atomically: a later part's reservation would come after
        # an earlier part wrote; one part alone with the same pipeline group streams (fp32 momentum)
        assert set(result["plans"]) == {(False, False)} and result["plan_alone"] == (not overlap, not overlap), (rank, result["plans"])
        if policy == "skip":
            assert result["outcome"] == "stepped" and result["skipped"] == [1, 1], (rank, result["outcome"], result["skipped"])
        else:
            assert "non-finite" in result["outcome"] and "no parameter or state was changed" in result["outcome"], (rank, result)
    if overlap:
        plain = run_distributed(_parts_run, PP * DP, policy, nan_part, False, timeout=240)
        for rank, (a, b) in enumerate(zip(plain, results)):
            for k, (part_a, part_b) in enumerate(zip(a["params"], b["params"])):
                for name, tensor in part_a.items():
                    # no clipping: overlap does the same fp32 math (test_overlap_distributed.py)
                    assert torch.equal(part_b[name], tensor), (rank, k, name)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_part_without_muon_matrices_agrees_with_every_part_on_every_rank(policy):
    """Part 1 holds AdamW parameters only and a NaN on rank 0: its agreement used to span rank 0
    alone, so rank 0 skipped (or raised) while rank 1 stepped, and gloo timed out. Every part on
    every rank now skips or raises together, with nothing changed."""
    from distributed import run_distributed

    for rank, result in enumerate(run_distributed(_parts_run, PP * DP, policy, 1, False, True, timeout=240)):
        assert result["unchanged"] == [True, True], (rank, result["outcome"], result["unchanged"])
        if policy == "skip":
            assert result["outcome"] == "stepped" and result["skipped"] == [1, 1], (rank, result["outcome"], result["skipped"])
        else:
            assert "non-finite" in result["outcome"] and "no parameter or state was changed" in result["outcome"], (rank, result)
