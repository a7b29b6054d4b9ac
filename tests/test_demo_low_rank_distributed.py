"""Muon(demo=True, demo_compressor="low_rank") with the AdamW gradients sign-compressed (the
default demo_adamw="sign") on R replicas × S shards (gloo, CPU) against ReferenceLowRankDeMoMuon
and reference_sign_step, with the model, runs and records of test_demo_distributed.py."""

from __future__ import annotations

import math

import pytest
import torch
from common import FP32_ULP
from demo_reference import reference_sign_step
from distributed import run_distributed
from test_demo_distributed import (
    ADAMW,
    MUON,
    NS_GAIN,
    SETTINGS,
    _by_replica,
    _checkpoint_run,
    _demo_run,
    _failing_run,
    check_adamw,
)
from test_demo_low_rank import U32, _gamma, exact_step, low_rank_allowances, sign_align

from titan_muon.algorithm.newton_schulz import orthogonalize
from titan_muon.algorithm.update import update_scale
from titan_muon.demo import dct as demo
from titan_muon.demo import low_rank, sign

# The defaults (α 1, shared Nesterov momentum, β = μ = 0.99, sign-compressed AdamW gradients) with
# the low-rank compressor at rank 4: the 130×130 and the two 100×70 matrices all have k = 4. AdamW:
# the 70×3 head is sign-compressed, the 130 bias and the 3-element scale are averaged densely.
LOW_RANK = {**SETTINGS, "demo_compressor": "low_rank", "demo_rank": 4, "demo_adamw": "sign"}
COMPRESSED, DENSE = ("head",), ("bias", "scale")
STEPS = 4


def _check_low_rank(rep, replicas, steps, what, settings=LOW_RANK) -> list[float]:
    """Every step, teacher-forced from the run's own state before it (parameters, every replica's
    momentum, the warm start, the shared momentum) with the gradients it used, against the exact
    (float64) reference step, Frobenius norms:

    * q, every replica's momentum and the warm start P̄ (column signs aligned): the allowances of
      test_demo_low_rank.low_rank_allowances (fp32 products and sums, the QR first order plus 4x
      its measured fp32 rounding);
    * the shared momentum S' = βS + (1 − β)q: (1 − β)·|Δq| + |8u(|S| + |q|)| (each side's lerp or
      multiply-adds: at most 4 roundings of magnitudes ≤ |S| + |q|, test_demo_distributed's
      elementwise argument); the Nesterov input (1 − β)q + βS': (1 − β)|Δq| + β|ΔS| + |8u(|S'| + |q|)|;
    * parameters: lr·scale·(NS_GAIN·|Δin|/|in|·|U| + 4·e_NS) + 2u·| |W| + lr·scale·|U| | as in
      test_demo_distributed, e_NS the fp32 Newton–Schulz's measured rounding on the exact input.

    Returns per step the largest fraction of an allowance used."""
    s, beta, alpha, rank = settings, settings["momentum"], settings["demo_alpha"], settings["demo_rank"]
    used = []
    for step in range(steps):
        before = rep[0]["initial"] if step == 0 else rep[0]["params"][step - 1]
        worst = 0.0
        for n in MUON:
            shape = before[n].shape
            old = [torch.zeros(shape) if step == 0 else rep[r]["momenta"][step - 1][n] for r in range(replicas)]
            factor = torch.zeros(shape[0], rank) if step == 0 else rep[0]["factors"][step - 1][n]
            shared = torch.zeros(shape) if step == 0 else rep[0]["shared"][step - 1][n]
            grads = [rep[r]["grads"][step][n] for r in range(replicas)]
            exact = exact_step(old, factor, grads, shared, beta, alpha, rank, s["nesterov"], s["lr"], s["weight_decay"], before[n])
            allow = low_rank_allowances(old, factor, grads, exact, beta, alpha, rank)

            def check(value, expected, allowance, label, where=f"{what} step {step}", n=n):
                nonlocal worst
                diff = (value.double() - expected).norm().item()
                assert diff <= allowance, f"{where} {label} of {n}: {diff / allowance:.3g} of the allowance"
                worst = max(worst, diff / allowance)

            for r in range(replicas):
                assert torch.equal(rep[r]["q"][step][n], rep[0]["q"][step][n]), f"{what} step {step}: q of {n} differs between replicas"
                assert torch.equal(rep[r]["factors"][step][n], rep[0]["factors"][step][n]), f"{what} step {step}: P̄ of {n} differs"
                assert torch.equal(rep[r]["shared"][step][n], rep[0]["shared"][step][n]), f"{what} step {step}: S of {n} differs"
                check(rep[r]["momenta"][step][n], exact.momenta[r]["w"], allow["momenta"][r], f"momentum of replica {r}")
            q_exact = exact.last_q["w"]
            check(rep[0]["q"][step][n], q_exact, allow["q"], "q")
            k = low_rank.effective_rank(*shape, rank)
            left = rep[0]["factors"][step][n]
            assert not left[:, k:].any()
            check(sign_align(left[:, :k], exact.factors["w"][:, :k]), exact.factors["w"][:, :k], allow["left"], "warm start")
            shared_exact = exact.shared["w"]
            q_abs = q_exact.abs() + allow["q"]
            s_allow = (1 - beta) * allow["q"] + (8 * U32 * (shared.double().abs() + q_abs)).norm().item()
            check(rep[0]["shared"][step][n], shared_exact, s_allow, "shared momentum")
            in_exact = exact.last_input["w"]
            in_allow = (1 - beta) * allow["q"] + beta * s_allow + (8 * U32 * (shared_exact.abs() + q_abs)).norm().item()
            ns_in = rep[0]["input"][step][n]
            check(ns_in, in_exact, in_allow, "Newton–Schulz input")
            u32, u64 = orthogonalize(in_exact.float(), 5), orthogonalize(in_exact, 5, dtype=torch.float64)
            lr_scale = s["lr"] * update_scale(None, *shape)
            rounding = 2 * U32 * (before[n].double().abs() + lr_scale * u64.abs()).norm().item()
            allowed = lr_scale * (NS_GAIN * (ns_in.double() - in_exact).norm().item() / in_exact.norm().item() * u64.norm().item()
                                  + 4 * (u32.double() - u64).norm().item()) + rounding  # fmt: skip
            check(rep[0]["params"][step][n], exact.params["w"], allowed, "parameter")
        used.append(worst)
    check_sign_adamw(rep, replicas, steps, what)
    return used


def check_sign_adamw(rep, replicas, steps, what):
    """The AdamW gradients, every step teacher-forced from each replica's error feedback before it
    and the gradient it computed: every replica averages the same bits; a compressed one equals
    reference_sign_step's mean within Σ_r |Δs_r| / R + γ_R·mean_r s_r elementwise (s_r a row's scale:
    the fp32 mean of |x| over cols within γ_cols·s_r of the exact one; sign·s is exact, then the
    replica sum and ÷R round), and each replica's new error x − s·sign within |Δs_r| + u·(|e'| + |Δs_r|)
    (the subtraction; the signs are the same bits, x being one IEEE addition on both sides); a dense
    one is (g_0 + g_1)/2 exactly (one commutative addition, an exact halving). Then AdamW on the
    run's averages: torch's fused AdamW to the last bit of two roundings a step."""
    for step in range(steps):
        for n in ADAMW:
            average = rep[0]["adamw_grads"][step][n]
            for r in range(replicas):
                assert torch.equal(rep[r]["adamw_grads"][step][n], average), f"{what} step {step}: AdamW gradient of {n} differs"
            grads = [rep[r]["grads"][step][n] for r in range(replicas)]
            if n in DENSE:
                assert torch.equal(average, (grads[0] + grads[1]) / 2), f"{what} step {step} dense {n}"
                continue
            errors = [rep[r]["adamw_errors"][step].get(n, torch.zeros_like(grads[r])) for r in range(replicas)]
            exact, new_errors, scales = reference_sign_step(errors, grads)
            cols = grads[0].shape[-1]
            d_scales = [_gamma(cols) * s for s in scales]
            bound = sum(d[:, None] for d in d_scales) / replicas + _gamma(replicas) * sum(s[:, None] for s in scales) / replicas
            assert ((average.double() - exact).abs() <= bound.expand(-1, cols).reshape(exact.shape)).all(), f"{what} step {step} AdamW gradient of {n}"
            if step + 1 < steps:
                for r in range(replicas):
                    kept = rep[r]["adamw_errors"][step + 1][n].double()
                    e_bound = d_scales[r][:, None] + U32 * (new_errors[r].abs().reshape(-1, cols) + d_scales[r][:, None])
                    assert ((kept - new_errors[r]).abs().reshape(-1, cols) <= e_bound).all(), f"{what} step {step} error feedback of {n}, replica {r}"
    check_adamw(rep, replicas, steps, what, [rep[0]["adamw_grads"][step] for step in range(steps)])


@pytest.fixture(scope="module")
def low_rank_two_by_two():
    return run_distributed(_demo_run, 4, 2, 2, STEPS, None, LOW_RANK)


def test_replicas_stay_bit_identical_and_follow_the_reference(low_rank_two_by_two):
    """R = 2 × S = 2, 4 steps, each replica its own batches: the same bits of every parameter, q,
    warm start and shared momentum in every replica, each replica its own momentum, and every
    step within the allowances of _check_low_rank (measured: ≲ 2 % used)."""
    rep = _by_replica(low_rank_two_by_two, 2)
    for step in range(STEPS):
        for n in rep[0]["params"][step]:
            assert torch.equal(rep[0]["params"][step][n], rep[1]["params"][step][n]), (step, n)
        for n in MUON:
            assert not torch.equal(rep[0]["momenta"][step][n], rep[1]["momenta"][step][n])
    used = _check_low_rank(rep, 2, STEPS, "low_rank R=2 S=2")
    assert max(used) < 0.2, used


def test_layout_independence_one_vs_two_shards(low_rank_two_by_two):
    """R = 2 × S = 1 fed S = 2's gradients: the owners run the same whole-matrix math on the same
    bits (and the same batches), and an all-reduce over 2 replicas adds two numbers whichever
    order its ring takes, so momenta, q, warm starts, S and NS inputs are bit-identical; the
    parameters agree to the last bit of each of the shard updates' two roundings a step."""
    rep2 = _by_replica(low_rank_two_by_two, 2)
    fed = [[rep2[r]["grads"][step] for r in range(2)] for step in range(STEPS)]
    rep1 = _by_replica(run_distributed(_demo_run, 2, 2, 1, STEPS, fed, LOW_RANK), 2)
    for step in range(STEPS):
        for n in MUON:
            for key in ("q", "input", "shared", "factors"):
                assert torch.equal(rep1[0][key][step][n], rep2[0][key][step][n]), (key, step, n)
            for r in range(2):
                assert torch.equal(rep1[r]["momenta"][step][n], rep2[r]["momenta"][step][n]), (step, n, r)
        for n, p in rep2[0]["params"][step].items():
            bound = (step + 1) * 2 * FP32_ULP * p.abs().max().item()
            assert (rep1[0]["params"][step][n] - p).abs().max().item() <= bound, (step, n)


def test_bytes_metrics(low_rank_two_by_two):
    """demo/bytes_sent: the ring all-reduces of each owner's factors, 2(R − 1)/R · 4(m + n)·k per
    matrix it owns; demo/bytes_dense as with DCT; demo/adamw_bytes_sent the AdamW traffic (dense
    all-reduce of 1-D gradients, all-gather of the sign payloads); the totals their sums and a
    dense fp32 all-reduce of every gradient of the rank."""
    replicas = 2
    for record in low_rank_two_by_two:
        payload = sum(low_rank.payload_bytes(rows, cols, LOW_RANK["demo_rank"]) for rows, cols in record["owned_shapes"])
        dense = sum(demo.dense_bytes(rows, cols) for rows, cols in record["owned_shapes"])
        for metrics in record["metrics"]:
            assert metrics["demo/bytes_sent"] == demo.allreduce_bytes_sent(payload, replicas) == 2 * (replicas - 1) / replicas * payload
            assert metrics["demo/bytes_dense"] == demo.allreduce_bytes_sent(dense, replicas)
            # AdamW: the dense tensors' ring all-reduce, the compressed one's all-gather of
            # 4·rows + ⌈rows·cols / 8⌉ bytes padded to a multiple of 4, (R − 1) times.
            shapes = record["adamw_local_shapes"]
            signed = sum(sign.payload_bytes(*shapes[n]) for n in COMPRESSED if shapes[n][0])
            adamw = demo.allreduce_bytes_sent(4 * sum(math.prod(shapes[n]) for n in DENSE), replicas) + (replicas - 1) * (signed + -signed % 4)
            assert metrics["demo/adamw_bytes_sent"] == adamw
            assert metrics["demo/total_bytes_sent"] == metrics["demo/bytes_sent"] + adamw
            assert metrics["demo/total_bytes_dense"] == demo.allreduce_bytes_sent(dense + 4 * record["adamw_local_numel"], replicas)
    # 130×130 at k = 4: (130 + 130)·4 fp32 = 4,160 bytes, at R = 2 sent once.
    assert low_rank.payload_bytes(130, 130, 4) == 4160


def test_failing_owners_stop_every_replica():
    """In replica 1 one owner fails before its round's first all-reduce and the other between the
    two (in its QR): all 4 ranks raise (the other replica's all-reduces are still matched by zeros:
    nothing hangs) and no parameter, momentum, warm start, shared momentum or AdamW state changes."""
    for outcome, unchanged in run_distributed(_failing_run, 4, "owner and basis", LOW_RANK, timeout=180):
        assert outcome.startswith("raised:") and "no parameter or optimizer state was changed" in outcome, outcome
        assert unchanged


def test_checkpoint_resumes_exactly(tmp_path):
    """3 steps on 2 × 2, a DCP checkpoint, loaded on 2 × 1 over other weights: every replica's
    momentum and AdamW error feedback (saved per replica) and the replica-identical warm start and
    shared momentum (saved once, resharded along the rows like the weights) come back bit for bit, and the 4th step, on the same gradients,
    equals the straight run's up to the last bits of the shard updates."""
    path = str(tmp_path / "low_rank_checkpoint")
    straight = run_distributed(_checkpoint_run, 4, 2, 2, path, True, None, LOW_RANK)
    fed = [next(r["grads"] for r in straight if r["replica"] == k) for k in range(2)]
    loaded = run_distributed(_checkpoint_run, 2, 2, 1, path, False, fed, LOW_RANK)
    for k in range(2):
        for key in ("momenta", "shared", "factors"):
            before = {n: m for r in straight if r["replica"] == k for n, m in r[key].items()}
            after = {n: m for r in loaded if r["replica"] == k for n, m in r[key].items()}
            assert sorted(after) == sorted(before) == sorted(MUON), key
            for n in MUON:
                assert before[n].abs().sum() > 0 and torch.equal(after[n], before[n]), (key, k, n)
        for r in (r for r in loaded if r["replica"] == k):  # every rank of the replica holds all of it (gathered)
            errors_before = next(x for x in straight if x["replica"] == k)["adamw_errors"]
            assert sorted(r["adamw_errors"]) == list(COMPRESSED)
            for n in COMPRESSED:
                assert errors_before[n].abs().sum() > 0 and torch.equal(r["adamw_errors"][n], errors_before[n]), (k, n)
    expected = straight[0]["params"]
    for n, p in loaded[0]["params"].items():
        assert (p - expected[n]).abs().max() <= 2 * FP32_ULP * expected[n].abs().max(), n
