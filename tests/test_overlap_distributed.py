"""Sending gradients during backward changes nothing: overlap on == overlap off.

With overlap=True momentum lives on the owners and the raw gradients travel during backward;
step() corrects for gradient clipping (per matrix) and re-sends what changed otherwise.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from common import FP32_ULP, GRADIENT_RTOL, adamw_names, assert_within, feed_adamw_gradients, whole_gradients
from distributed import run_distributed
from sharded_fixtures import token_batches, next_token_loss, fsdp_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from titan_muon import Muon, build_param_groups

TAMPERED = "layers.1.w1.weight"


def muon_for(model, overlap, **overrides):
    settings = dict(lr=0.02, adjust_lr_fn="match_rms_adamw", exchange_memory_mb=0.002, overlap=overlap)
    return Muon(build_param_groups(model, adamw_lr=3e-3), **{**settings, **overrides})


def _train(rank, world, overlap, clip, micro_batches, tamper, steps=3, overrides=None, adamw_grads=None, gradient_rtol=GRADIENT_RTOL):
    """`adamw_grads`: the plain run's AdamW gradients, fed to the overlapped run's AdamW after
    checking its own against them (common.feed_adamw_gradients): only Muon's path differs."""
    model = fsdp_model(world)
    initial = {n: p.full_tensor() for n, p in model.named_parameters()}
    opt = muon_for(model, overlap, **(overrides or {}))
    sent_in_backward, bytes_backward, bytes_to_owners_in_step, reduced = [], [], [], []
    for s in range(steps):
        for m in range(micro_batches):
            tokens = token_batches(10 * s + m).chunk(world)[rank]
            (next_token_loss(model, tokens) / micro_batches).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        grad = dict(model.named_parameters())[TAMPERED].grad.to_local()
        if tamper == "scale":  # a per-matrix scaling after the hooks fired: corrected, not re-sent
            grad.mul_(0.95)
        elif tamper == "row":  # any other change: that bucket is sent again from step()
            grad[:1].add_(1e-3)
        if adamw_grads is None:
            reduced.append(whole_gradients(model, adamw_names(opt)))
        else:
            feed_adamw_gradients(model, opt, adamw_grads[s], f"step {s}", gradient_rtol)
        opt.step()
        opt.zero_grad()
        metrics = opt.last_step_metrics
        sent_in_backward.append(metrics.get("muon/rounds_sent_in_backward", 0.0))
        bytes_backward.append(metrics.get("muon/bytes_sent_in_backward", 0.0))
        bytes_to_owners_in_step.append(metrics["muon/bytes_sent_to_owners"])
    buckets_with_tampered = sum(
        any(opt.muon_params[engine.units[u].param].name == TAMPERED for u in members)
        for engine in opt.engines
        for members in engine.plan.rounds
    )
    return {
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        "initial": initial,
        "sent_in_backward": sent_in_backward,
        "bytes_backward": bytes_backward,
        "bytes_to_owners_in_step": bytes_to_owners_in_step,
        "buckets": sum(len(engine.plan.rounds) for engine in opt.engines),
        "buckets_with_tampered": buckets_with_tampered,
        "adamw_grads": reduced,
        "adamw": adamw_names(opt),
    }


@pytest.mark.parametrize(
    "world,clip,micro_batches,tamper",
    [(2, True, 2, None), (3, False, 1, None), (2, True, 1, "scale"), (2, True, 1, "row")],
    ids=["clip+accumulation", "uneven-3-ranks", "scaled-after-hook", "changed-after-hook-resent"],
)
def test_overlap_equals_no_overlap(world, clip, micro_batches, tamper):
    plain = run_distributed(_train, world, False, clip, micro_batches, tamper)
    overlapped = run_distributed(_train, world, True, clip, micro_batches, tamper, 3, None, plain[0]["adamw_grads"])
    for rank, (a, b) in enumerate(zip(plain, overlapped)):
        for name, tensor in a["params"].items():
            if name in a["adamw"]:  # the same gradients, elementwise: the last bit of p after each of 2 roundings a step
                bound = 3 * 2 * FP32_ULP * tensor.abs().max().item()
            else:
                # fp32 everywhere; the owner applies the clipping factor c to the gradient it
                # received instead of receiving c·g: one extra fp32 rounding per element, and c
                # is estimated from sums to about fp32 eps, so updates agree to ~1e-7 relative.
                bound = 1e-5
            assert_within(b["params"][name], tensor, bound, f"rank {rank} {name}")
    for result in overlapped:
        buckets = result["buckets"]
        if tamper == "row":
            expected = buckets - result["buckets_with_tampered"]
        else:
            expected = buckets
        # Step 1 learns how many micro-batches complete a bucket; later steps send once per bucket.
        assert result["sent_in_backward"][1:] == [float(expected)] * 2
        if tamper is None:
            # Every gradient piece left during backward: step() sent only the return trip.
            assert all(b > 0 for b in result["bytes_backward"])
            assert result["bytes_to_owners_in_step"][1:] == [0.0, 0.0]


def test_overlap_with_bf16_communication_catches_changes_per_matrix():
    """comm_dtype=bf16: the check runs on the fp32 gradients, so a change to one matrix's
    gradient after its hook is still caught (re-sent), and a scaling is still exact."""
    overrides = {"comm_dtype": "bf16"}
    for tamper in ("row", "scale"):
        plain = run_distributed(_train, 2, False, True, 1, tamper, 3, overrides)
        # Gradients travel in fp32 and owners round the Nesterov input to bf16 as the shard side
        # does, so the Muon paths differ only by the clipping factor c: the owner scales the
        # gradient it received (one fp32 rounding, c itself estimated to ~1 ulp). That moves a
        # Nesterov input by ~2 fp32 ulps, which flips its bf16 rounding only within 2 ulps of a
        # rounding boundary (~2^-15 of the entries). A flip changes one NS input entry by one
        # bf16 ulp (2^-8 relative), moved by NS's gain (<= ~12 on these shapes): well under 1 %
        # of the parameter's change over 3 steps; the rest is fp32 rounding (1e-5, as fp32).
        overlapped = run_distributed(_train, 2, True, True, 1, tamper, 3, overrides, plain[0]["adamw_grads"])
        for a, b in zip(plain, overlapped):
            for name, tensor in a["params"].items():
                if name in a["adamw"]:  # the same gradients, elementwise: the last bit of p after each of 2 roundings a step
                    bound = 3 * 2 * FP32_ULP * tensor.abs().max().item()
                else:
                    bound = 0.01 * (tensor - a["initial"][name]).abs().max().item() + 1e-5
                assert_within(b["params"][name], tensor, bound, f"{tamper}: {name}")
        result = overlapped[0]
        expected = result["buckets"] - (result["buckets_with_tampered"] if tamper == "row" else 0)
        assert result["sent_in_backward"][1:] == [float(expected)] * 2, tamper


def _hsdp_model(world):
    """TinyTransformerish under HSDP: 2 replicas of a 2-rank FSDP group."""
    from sharded_fixtures import TinyTransformerish
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyTransformerish()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)
    return model


def _train_skipping(rank, world, overlap, comm_dtype, skip_step=1, steps=3, hsdp=False):
    """Three steps; in `skip_step` layer 1 is left out of the forward, so its parameters get no
    gradient on any rank (FSDP2 never runs that unit): torch.optim leaves such parameters and
    their state alone, and so must either mode."""
    model = _hsdp_model(world) if hsdp else fsdp_model(world)
    opt = muon_for(model, overlap, comm_dtype=comm_dtype)
    before = {}
    for s in range(steps):
        model.skip = frozenset({1}) if s == skip_step else frozenset()
        next_token_loss(model, token_batches(s).chunk(world)[rank]).backward()  # HSDP: every rank its own batch
        opt.step()
        opt.zero_grad()
        if s == skip_step:
            before = {n: p.full_tensor() for n, p in model.named_parameters() if n.startswith("layers.1.")}
    return {"params": {n: p.full_tensor() for n, p in model.named_parameters()}, "skipped_layer_after_skip": before}


@pytest.mark.parametrize("comm_dtype", ["fp32", "bf16"])
def test_overlap_equals_no_overlap_exactly_without_clipping(comm_dtype):
    """Without gradient clipping both modes build fp32 momentum from the same fp32 gradients
    and orthogonalize the same matrices (the owner rounds its Nesterov input to the wire dtype
    as the shard side does), so every weight is bit for bit the same — with bf16 on the wire too
    (overlap used to send bf16-rounded raw gradients and build momentum from them). A layer
    left out of one step's forward keeps its weights and momentum in both modes."""
    plain = run_distributed(_train_skipping, 2, False, comm_dtype)
    overlapped = run_distributed(_train_skipping, 2, True, comm_dtype)
    for a, b in zip(plain, overlapped):
        for name, tensor in a["params"].items():
            assert torch.equal(b["params"][name], tensor), name
    # the skipped step did not move layer 1 (compare with the weights after step 0)
    first = run_distributed(_train_skipping, 2, True, comm_dtype, None, 1)[0]["params"]
    for name, tensor in overlapped[0]["skipped_layer_after_skip"].items():
        assert torch.equal(tensor, first[name]), name


def test_overlap_under_hsdp_equals_no_overlap_exactly():
    """HSDP (2 replicas x 2 shards): owners are planned inside each shard group and the
    gradients that travel during backward are the replicas' all-reduced ones; without clipping
    both modes give the same weights bit for bit."""
    plain = run_distributed(_train_skipping, 4, False, "bf16", None, 3, True)
    overlapped = run_distributed(_train_skipping, 4, True, "bf16", None, 3, True)
    for a, b in zip(plain, overlapped):
        for name, tensor in a["params"].items():
            assert torch.equal(b["params"][name], tensor), name


def _checkpoint_roundtrip(rank, world, path, save, momentum_dtype, adamw_grads=None):
    """Owner-held momentum goes through DCP laid out like the parameters, so it reshards.
    Flattened optimizer state dicts, as torchtitan uses (their loader reads optimizer.state's keys).
    The resumed run's last step feeds AdamW the saving run's gradients (`adamw_grads`)."""
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model = fsdp_model(world)
    opt = muon_for(model, overlap=True, momentum_dtype=momentum_dtype)
    steps = 2 if save else 0
    for s in range(steps):
        next_token_loss(model, token_batches(s).chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    if save:
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    else:
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    next_token_loss(model, token_batches(5).chunk(world)[rank]).backward()
    if adamw_grads is None:
        adamw_grads = whole_gradients(model, adamw_names(opt))
    else:
        feed_adamw_gradients(model, opt, adamw_grads, "after the load")
    opt.step()
    return {"params": {n: p.full_tensor() for n, p in model.named_parameters()}, "adamw_grads": adamw_grads, "adamw": adamw_names(opt)}


@pytest.mark.parametrize("load_world,momentum_dtype", [(1, "fp32"), (3, "fp8")])
def test_owner_momentum_checkpoint_reshards(tmp_path, load_world, momentum_dtype):
    straight = run_distributed(_checkpoint_roundtrip, 2, str(tmp_path), True, momentum_dtype)
    resumed = run_distributed(_checkpoint_roundtrip, load_world, str(tmp_path), False, momentum_dtype, straight[0]["adamw_grads"])
    for name, tensor in straight[0]["params"].items():
        if name in straight[0]["adamw"]:  # the same gradients, elementwise: the last bit of p, twice
            bound = 2 * FP32_ULP * tensor.abs().max().item()
        else:
            # One step of the same fp32 math on another layout: FSDP gradient pieces summed in
            # another order (~1e-7 relative) feed NS; a step moves a matrix by <= 0.04.
            bound = 1e-5
        assert_within(resumed[0]["params"][name], tensor, bound, name)


def _replan(rank, world):
    import torch.distributed as dist
    from torch import nn

    created = []
    original = dist.new_group

    def counting(*args, **kwargs):
        created.append(args[0] if args else kwargs.get("ranks"))
        return original(*args, **kwargs)

    dist.new_group = counting
    try:
        model = fsdp_model(world)
        groups = build_param_groups(model, adamw_lr=3e-3)
        opt = Muon(groups[:1], lr=0.02, overlap=True)
        first = len(created)
        extra = nn.Parameter(torch.zeros(3))
        opt.add_param_group({"params": [("extra", extra)], "use_muon": False})
        opt.add_param_group(groups[1])
        second = Muon(groups[:1], lr=0.02, overlap=True)  # another optimizer over the same ranks
        return {"first": first, "after": len(created), "alive": second.transport.world_size}
    finally:
        dist.new_group = original


def test_replanning_creates_no_new_process_groups():
    for result in run_distributed(_replan, 2):
        assert result["first"] == 1  # the twin group for overlapped sends
        assert result["after"] == result["first"], "re-planning created process groups again"
