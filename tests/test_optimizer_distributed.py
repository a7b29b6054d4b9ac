"""W ranks (gloo, CPU) compute what one process computes: hand-made DTensors, HSDP, a real FSDP2 model.

Every run goes through tests/distributed.py, which kills all ranks and fails after a timeout.
"""

import pytest
import torch
from common import (
    FP32_ULP,
    adamw_names,
    assert_within,
    feed_adamw_gradients,
    make_params,
    whole_gradients,
)
from distributed import run_distributed
from sharded_fixtures import (
    MUON,
    SHAPES,
    TinyTransformerish,
    check_equal_to_one_process,
    dtensor_run,
    fsdp_model,
    next_token_loss,
    one_process_run,
    token_batches,
)

from titan_muon import Muon

@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_run_equals_one_process(world):
    results = run_distributed(dtensor_run, world, (world,), 4, {})
    expected = one_process_run(4)
    for r, result in enumerate(results):
        check_equal_to_one_process(result["params"], expected, 4, f"W={world} rank {r}")
        assert result["measured"] == [False, True, False, True]
        # Communication accounting: outbound shards + returning rows of owned matrices.
        ratio = result["bytes_sent"] / result["local_muon_bytes"]
        print(f"W={world} rank {r}: Muon bytes sent {result['bytes_sent']:.0f} = {ratio:.2f}x local shard bytes")
        assert 0 < result["bytes_sent"] <= 2 * result["local_muon_bytes"]


def test_fp8_momentum_distributed_equals_fp8_one_process():
    """Row-following scales and layout-independent stochastic rounding: W ranks == one process."""
    results = run_distributed(dtensor_run, 3, (3,), 4, {"momentum_dtype": "fp8"})
    expected = one_process_run(4, momentum_dtype="fp8")
    for r, result in enumerate(results):
        check_equal_to_one_process(result["params"], expected, 4, f"rank {r}")


def test_gram_newton_schulz_distributed_equals_one_process():
    """ns_algorithm="gram" on every shape (auto would pick it only from 128 rows): the owner
    runs the same kernels as one process, so the same fp32 bound applies."""
    results = run_distributed(dtensor_run, 3, (3,), 3, {"ns_algorithm": "gram"})
    expected = one_process_run(3, ns_algorithm="gram")
    for r, result in enumerate(results):
        check_equal_to_one_process(result["params"], expected, 3, f"rank {r}")


def test_hsdp_mesh_equals_one_process():
    results = run_distributed(dtensor_run, 4, (2, 2), 3, {})
    expected = one_process_run(3)
    for r, result in enumerate(results):
        check_equal_to_one_process(result["params"], expected, 3, f"rank {r}")


def test_bf16_communication_and_polar_express_stay_close_to_one_process():
    overrides = {"comm_dtype": "bf16", "ns_coefficients": "polar_express"}
    results = run_distributed(dtensor_run, 2, (2,), 2, overrides)
    expected = one_process_run(2, ns_coefficients="polar_express")
    for name in MUON:
        delta = expected[name] - make_params(0, SHAPES)[name]
        # bf16 keeps 8 bits: the matrices NS receives and the updates it returns are each
        # rounded by <= 2^-9 relative, which moves an update by a few times that: 2 % of the
        # parameter's total change bounds it (fp32 rounding is ~1e-5 of that).
        assert_within(results[0]["params"][name], expected[name], 0.02 * delta.abs().max().item(), name)


# ---------------------------------------------------------------- a real FSDP2 model


def _fsdp_run(rank, world, steps):
    from titan_muon import build_param_groups

    model = fsdp_model(world)
    opt = Muon(build_param_groups(model, adamw_lr=3e-3), lr=0.02, adjust_lr_fn="match_rms_adamw")
    reduced = []
    for s in range(steps):
        tokens = token_batches(s).chunk(world)[rank]
        next_token_loss(model, tokens).backward()
        reduced.append(whole_gradients(model, adamw_names(opt)))
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.full_tensor() for n, p in model.named_parameters()}, "adamw_grads": reduced}


FSDP_STEPS = 3


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_model_equals_one_process(world):
    """The one-process AdamW is fed the gradients the W ranks reduced (common.feed_adamw_gradients):
    its own are checked against them, and its parameters must then agree to a few ulps."""
    from titan_muon import build_param_groups

    results = run_distributed(_fsdp_run, world, FSDP_STEPS)
    torch.manual_seed(0)
    model = TinyTransformerish()
    opt = Muon(build_param_groups(model, adamw_lr=3e-3), lr=0.02, adjust_lr_fn="match_rms_adamw")
    for s in range(FSDP_STEPS):
        next_token_loss(model, token_batches(s)).backward()
        feed_adamw_gradients(model, opt, results[0]["adamw_grads"][s], f"W={world} step {s}")
        opt.step()
        opt.zero_grad()
    adamw = set(adamw_names(opt))
    for name, p in model.named_parameters():
        for result in results:
            if name in adamw:
                # Same gradients, elementwise math on shards: at most the last bit of p after
                # each of its two roundings a step (weight decay, update).
                bound = FSDP_STEPS * 2 * FP32_ULP * p.abs().max().item()
            else:
                # Muon gradients are summed in another order too (~1e-6 relative); NS normalizes
                # them, and each of 3 steps moves a matrix by <= lr·0.2·sqrt(63)·1.2 ≈ 0.04, so
                # rounding moves parameters by ~1e-7; a wrong update would move them by ~1e-2.
                bound = 1e-5
            assert_within(result["params"][name], p.detach(), bound, f"W={world} {name}")
