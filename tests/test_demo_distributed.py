"""Muon(demo=True) on R replicas × S shards (gloo, CPU) against the loop reference of DeMo-Muon.

FSDP2 shards each replica's model over its own shard mesh only; the optimizer owns the
replicate dimension (docs/demo.md). Every replica trains on its own batches.
"""

from __future__ import annotations

import math

import pytest
import torch
from common import FP32_ULP
from demo_reference import ReferenceDeMoMuon
from distributed import run_distributed
from test_demo import U32, _transform_bounds
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_muon import Muon
from titan_muon.algorithm.newton_schulz import orthogonalize
from titan_muon.algorithm.update import update_scale
from titan_muon.demo import dct as demo
from titan_muon.demo.low_rank import LEFT_FACTOR_KEY
from titan_muon.demo.sign import ERROR_KEY
from titan_muon.demo.step import SHARED_MOMENTUM_KEY

MUON = ("w1", "w2", "w3")
ADAMW = ("bias", "head", "scale")
# The defaults' DeMo-Muon (issue 27): α = 1 and a shared Nesterov momentum over the average.
# AdamW gradients averaged densely here (demo_adamw="dense"); test_demo_low_rank_distributed runs the
# default sign compression.
SETTINGS = dict(lr=0.02, weight_decay=0.01, momentum=0.99, nesterov=True, ns_algorithm="standard", demo_chunk=64, demo_topk=8, demo_alpha=1.0,
                demo_shared_momentum=True, demo_adamw="dense")  # fmt: skip
# DeMo as published (before issue 27): no shared momentum, α 0.2, no Nesterov.
PUBLISHED = {**SETTINGS, "nesterov": False, "demo_alpha": 0.2, "demo_shared_momentum": False}
ADAMW_SETTINGS = dict(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
BATCH = 8  # per replica, split over its shards


class Net(nn.Module):
    """Muon matrices 130×130 and two 100×70 (one batch on their owner when they meet there);
    AdamW: a 130 bias, a 70×3 head and a 3-element scale (rows uneven on 2 shards)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)  # the same parameters in every replica
        self.w2 = nn.Parameter(torch.randn(130, 130, generator=g) / math.sqrt(130))
        self.w1 = nn.Parameter(torch.randn(100, 70, generator=g) / 10)
        self.w3 = nn.Parameter(torch.randn(100, 70, generator=g) / 10)
        self.bias = nn.Parameter(0.1 * torch.randn(130, generator=g))
        self.head = nn.Parameter(torch.randn(70, 3, generator=g) / math.sqrt(70))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        h = torch.tanh(x @ self.w2 + self.bias)
        a = torch.tanh(h[:, :100] @ self.w1) + torch.tanh(h[:, 30:] @ self.w3)
        return (a @ self.head) * self.scale


def _batch(step: int, replica: int):
    g = torch.Generator().manual_seed(100 * step + replica)
    return torch.randn(BATCH, 130, generator=g), torch.randn(BATCH, 3, generator=g)


def _groups(model):
    named = dict(model.named_parameters())
    return [
        {"params": [(n, named[n]) for n in MUON]},
        {"params": [(n, named[n]) for n in ADAMW], "use_muon": False, **ADAMW_SETTINGS},
    ]


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _owner_momenta(opt, key: str = "momentum_buffer") -> dict[str, torch.Tensor]:
    """The whole momenta (`key`: the replica's own, or SHARED_MOMENTUM_KEY) this rank owns, by
    parameter name (no row blocks here: one unit each)."""
    out = {}
    for (s, u), block in opt.owner_blocks.items():
        unit = opt.engines[s].units[u]
        out[opt.muon_params[unit.param].name] = block[key].clone()
    return out


def _record_q(opt, steps: list[dict], inputs: list[dict]) -> None:
    """Keep every q (the average of the replicas' decoded payloads) in ``steps[-1]`` and what the
    owners hand to Newton–Schulz (the shared momentum's Nesterov input) in ``inputs[-1]``, by
    parameter name: wrappers around Replicas.round_inputs and its shared-momentum step."""
    original, shared = opt.replicas.round_inputs, opt.replicas._shared_momentum_input

    def name(engine, u):
        return opt.muon_params[engine.units[u].param].name

    def recording(s, r, engine, batches, *args):
        out = original(s, r, engine, batches, *args)
        for batch, ns_input in zip(batches, out):
            for u, matrix in zip(batch.units, ns_input):
                inputs[-1][name(engine, u)] = matrix.clone()
                if not opt.demo.shared_momentum:  # Newton–Schulz gets q itself
                    steps[-1][name(engine, u)] = matrix.clone()
        return out

    def recording_shared(round_, batch, average):
        for u, matrix in zip(batch.units, average):
            steps[-1][name(round_.engine, u)] = matrix.clone()
        return shared(round_, batch, average)

    opt.replicas.round_inputs = recording
    opt.replicas._shared_momentum_input = recording_shared


def _demo_run(rank, world, replicas, shards, steps, fed_grads=None, settings=SETTINGS):
    """`fed_grads[step][replica]`: whole gradients to use instead of this run's own (after
    checking they are close): another layout's gradients, so that only the layout differs."""
    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("dp_replicate", "dp_shard"))
    replica, shard = mesh.get_coordinate()
    model = Net()
    fully_shard(model, mesh=mesh["dp_shard"])
    opt = Muon(_groups(model), **settings, demo=True, replicate_group=mesh.get_group("dp_replicate"))
    record = {"initial": {n: _full(p) for n, p in model.named_parameters()}, "grads": [], "params": [], "momenta": [], "q": [], "metrics": [],
              "shared": [], "input": [], "factors": [], "adamw_errors": [], "adamw_grads": []}  # fmt: skip
    _record_q(opt, record["q"], record["input"])
    for step in range(steps):
        x, y = _batch(step, replica)
        loss = ((model(x.chunk(shards)[shard]) - y.chunk(shards)[shard]) ** 2).mean()
        loss.backward()
        params = dict(model.named_parameters())
        if fed_grads is not None:
            for n, p in params.items():
                own, given = _full(p.grad), fed_grads[step][replica][n]
                assert (own - given).abs().max() <= 1e-4 * given.abs().max(), n  # summation order only
                p.grad.to_local().copy_(distribute_tensor(given, p.grad.device_mesh, p.grad.placements, src_data_rank=None).to_local())
        record["grads"].append({n: _full(p.grad) for n, p in params.items()})
        record["adamw_errors"].append({n: _full(opt.state[params[n]][ERROR_KEY]) for n in ADAMW if ERROR_KEY in opt.state.get(params[n], {})})
        record["q"].append({})
        record["input"].append({})
        opt.step()
        record["adamw_grads"].append({n: _full(params[n].grad) for n in ADAMW})  # the replicas' average, as AdamW used it
        opt.zero_grad()
        record["params"].append({n: _full(p) for n, p in model.named_parameters()})
        record["momenta"].append(_owner_momenta(opt))
        record["shared"].append(_owner_momenta(opt, SHARED_MOMENTUM_KEY) if settings["demo_shared_momentum"] else {})
        record["factors"].append(_owner_momenta(opt, LEFT_FACTOR_KEY) if settings.get("demo_compressor") == "low_rank" else {})
        record["metrics"].append(dict(opt.last_step_metrics))
    engines = opt.engines
    record["owned"] = [opt.muon_params[engines[s].units[u].param].name for s, u in opt.owner_blocks]
    record["owned_shapes"] = [engines[s].units[u].shape for s, u in opt.owner_blocks]
    record["adamw_local_numel"] = sum(p.to_local().numel() for n, p in model.named_parameters() if n in ADAMW)
    record["adamw_local_shapes"] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if n in ADAMW}
    record["replica"], record["shard"] = replica, shard
    return record


def _by_replica(results, replicas):
    """Per replica, its shard-0 rank's record, with the momenta and q its ranks own merged."""
    out = []
    for r in range(replicas):
        ranks = [x for x in results if x["replica"] == r]
        first = next(x for x in ranks if x["shard"] == 0)
        merged = {key: [{n: m for x in ranks for n, m in x[key][s].items()} for s in range(len(first[key]))] for key in ("momenta", "q", "shared", "input", "factors")}
        out.append({**first, **merged})
    return out


# ---------------------------------------------------------------- the comparison with the reference

# Newton–Schulz's gain on a perturbation, first order: Keller's quintic p keeps singular values
# in [0, 1.2] after the first of its 5 iterations and max |p'| < 4 there (p'(0) = 3.44,
# p'(1.2) = 3.88); the derivative of X -> p(X) multiplies a perturbation's components by
# divided differences of p or by p(σ)/σ <= 3.44, so each iteration grows it at most 4x in the
# Frobenius norm. The normalization X0 = q/|q|_F at most doubles the relative input perturbation.
NS_GAIN = 2 * 4**5
U = U32


def _check_against_reference(rep, replicas, steps, what, settings=SETTINGS):
    """Every step, ReferenceDeMoMuon takes one step from the titan run's own state before it
    (parameters, every replica's momenta) with the gradients the run used, and the run's result
    must match it. Teacher-forced like test_demo's per-step test, so each bound covers one step's
    rounding and nothing accumulates:

    * momenta and q, elementwise: test_demo's rigorous fp32 bounds (both sides' errors from the
      exact values of one step: transforms, α·decode, the replicas' average); the shared momentum
      and the Nesterov input from q's bound and their own roundings (derived where checked);
    * parameters, Frobenius norm, first order in the NS input's measured difference Δq:
      |ΔW| <= lr·scale·(NS_GAIN·|Δq|/|q|·|U| + 4·e_NS) + 2u·|(|W| + lr·scale·|U|)|, e_NS = the
      reference's own NS rounding (its fp32 U against float64 NS of the same q); the titan side
      runs the same kernels on the same shape in another batch, so its rounding is taken as at
      most 3x that (4 = both sides); the last term is both sides' decay and update roundings;
    * AdamW parameters: torch's AdamW (fused, as the run) on the replicas' average gradient,
      elementwise on the same inputs: at most the last bit of p after each of its two roundings.

    Returns per step the largest fraction of an allowance used (momenta/q, parameters)."""
    s, beta, chunk, topk, alpha = settings, settings["momentum"], settings["demo_chunk"], settings["demo_topk"], settings["demo_alpha"]
    shared = settings["demo_shared_momentum"]
    used = []
    for step in range(steps):
        before = rep[0]["initial"] if step == 0 else rep[0]["params"][step - 1]
        grads = [rep[r]["grads"][step] for r in range(replicas)]
        muon = ReferenceDeMoMuon(replicas, s["lr"], s["weight_decay"], beta, chunk, topk, alpha, shared_momentum=shared, nesterov=s["nesterov"])
        if step > 0:
            muon.momenta = [{n: rep[r]["momenta"][step - 1][n].clone() for n in MUON} for r in range(replicas)]
            muon.shared = {n: rep[0]["shared"][step - 1][n].clone() for n in MUON} if shared else {}
        shared_before = {n: muon.shared.get(n, torch.zeros_like(before[n])).double().abs() for n in MUON}
        old = [{n: muon.momenta[r].get(n, torch.zeros_like(before[n])).clone() for n in MUON} for r in range(replicas)]
        accumulated = [{n: old[r][n] * beta + grads[r][n] for n in MUON} for r in range(replicas)]  # as both round it
        params = {n: before[n].clone() for n in MUON}
        muon.step(params, [{n: g[n] for n in MUON} for g in grads])
        worst = [0.0, 0.0]
        for n in MUON:
            bounds = [_transform_bounds(accumulated[r][n], chunk, U) for r in range(replicas)]
            for r, (_, _, v, w, c) in enumerate(bounds):
                a = accumulated[r][n].double()
                m_bound = alpha * 2 * (v + c * w) + 2 * U * (a.abs() + 2 * alpha * w)
                diff = (rep[r]["momenta"][step][n].double() - muon.momenta[r][n].double()).abs()
                assert (diff <= m_bound).all(), f"{what} step {step} momentum of {n} in replica {r}: {(diff / m_bound).max():.3g} of the bound"
                worst[0] = max(worst[0], (diff / m_bound).max().item())
            q_bound = sum(2 * (v + (c + (replicas + 1) * U) * w) for _, _, v, w, c in bounds) / replicas
            q, q_ref = rep[0]["q"][step][n], muon.last_q[n]
            assert torch.equal(q, rep[1]["q"][step][n]), f"{what} step {step}: q of {n} differs between replicas"
            diff = (q.double() - q_ref.double()).abs()
            assert (diff <= q_bound).all(), f"{what} step {step} q of {n}: {(diff / q_bound).max():.3g} of the bound"
            worst[0] = max(worst[0], (diff / q_bound).max().item())
            # Shared momentum S' = βS + (1 − β)q from the same S (teacher-forced) and q within q_bound:
            # (1 − β)·q_bound, plus each side's own roundings of S' (titan: S + w(q − S), lerp; the
            # reference: βS + (1 − β)q), ≤ 4 roundings of magnitudes ≤ |S| + |q| each, w and β
            # rounded to fp32 included: 8u(|S| + |q|) for both. The Nesterov input (1 − β)q + βS'
            # likewise: (1 − β)·q_bound + β·S_bound + 8u(|S'| + |q|).
            in_bound = q_bound
            if shared:
                q_abs = q_ref.double().abs() + q_bound
                s_bound = (1 - beta) * q_bound + 8 * U * (shared_before[n] + q_abs)
                s_ref = muon.shared[n].double()
                for r in range(replicas):
                    diff = (rep[r]["shared"][step][n].double() - s_ref).abs()
                    assert (diff <= s_bound).all(), f"{what} step {step} shared momentum of {n} in replica {r}: {(diff / s_bound).max():.3g} of the bound"
                worst[0] = max(worst[0], (diff / s_bound).max().item())
                in_bound = (1 - beta) * q_bound + beta * s_bound + 8 * U * (s_ref.abs() + s_bound + q_abs) if s["nesterov"] else s_bound
            ns_in, ns_in_ref = rep[0]["input"][step][n], muon.last_input[n]
            assert torch.equal(ns_in, rep[1]["input"][step][n]), f"{what} step {step}: the NS input of {n} differs between replicas"
            diff = (ns_in.double() - ns_in_ref.double()).abs()
            assert (diff <= in_bound).all(), f"{what} step {step} NS input of {n}: {(diff / in_bound).max():.3g} of the bound"
            worst[0] = max(worst[0], (diff / in_bound).max().item())
            u32, u64 = orthogonalize(ns_in_ref, 5), orthogonalize(ns_in_ref.double(), 5, dtype=torch.float64)
            lr_scale = s["lr"] * update_scale(None, *q.shape)
            rounding = 2 * U * (before[n].double().abs() + lr_scale * u32.double().abs()).norm().item()
            allowed = lr_scale * (NS_GAIN * (ns_in - ns_in_ref).norm().item() / ns_in_ref.norm().item() * u32.norm().item()
                                  + 4 * (u32.double() - u64).norm().item()) + rounding  # fmt: skip
            diff = (rep[0]["params"][step][n] - params[n]).norm().item()
            assert diff <= allowed, f"{what} step {step} {n}: {diff:.3g} > {allowed:.3g}"
            worst[1] = max(worst[1], diff / allowed)
        used.append(worst)
    check_adamw(rep, replicas, steps, what)
    return used


def check_adamw(rep, replicas, steps, what, averages=None):
    """AdamW: free-running on the replicas' average gradient (`averages[step][name]`: the ones to
    use instead, checked elsewhere), elementwise (see _check_against_reference)."""
    adamw_params = {n: rep[0]["initial"][n].clone().requires_grad_() for n in ADAMW}
    adamw = torch.optim.AdamW(list(adamw_params.values()), fused=True, **ADAMW_SETTINGS)
    for step in range(steps):
        for n, p in adamw_params.items():  # summed in replica order, as the all-reduce does
            p.grad = sum(rep[r]["grads"][step][n] for r in range(replicas)) / replicas if averages is None else averages[step][n].clone()
        adamw.step()
        for n, p in adamw_params.items():
            bound = (step + 1) * 2 * FP32_ULP * p.detach().abs().max().item()
            diff = (rep[0]["params"][step][n] - p.detach()).abs().max().item()
            assert diff <= bound, f"{what} step {step} {n}: {diff:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def two_by_two():
    """Every rank's record of a 4-step run on R = 2 replicas × S = 2 shards."""
    return run_distributed(_demo_run, 4, 2, 2, 4)


def test_replicas_stay_bit_identical_and_follow_the_reference(two_by_two):
    """R = 2 replicas × S = 2 shards, 4 steps, each replica its own batches: every replica holds the
    same bits of every parameter, each keeps its own momentum, and every step matches
    ReferenceDeMoMuon (AdamW: torch's AdamW on the replicas' average gradient) within the
    bounds of _check_against_reference (measured: momenta and q use < 1 % of their rigorous
    bounds, parameters < 10 % of their first-order allowance)."""
    rep = _by_replica(two_by_two, 2)
    for step in range(4):
        for n in rep[0]["params"][step]:
            assert torch.equal(rep[0]["params"][step][n], rep[1]["params"][step][n]), (step, n)
        for n in MUON:
            assert not torch.equal(rep[0]["momenta"][step][n], rep[1]["momenta"][step][n])
            assert torch.equal(rep[0]["shared"][step][n], rep[1]["shared"][step][n])  # the same in every replica
    _check_against_reference(rep, 2, 4, "R=2 S=2")


def test_layout_independence_one_vs_two_shards(two_by_two):
    """R = 2 × S = 1 equals R = 2 × S = 2. Fed the same gradients (S = 2's, after checking its own
    agree up to summation order), both follow the reference step by step, and they agree with
    each other: the owners run the same whole-matrix math on the same bits in both layouts
    (here even the same batches: w1 and w3 meet on one owner in both), so the momenta and q are
    bit-identical; parameters are updated on row shards of different sizes, where vectorized and
    scalar loops may round the decay and the update differently: the last bit of p after each
    of those two roundings a step (as test_optimizer_distributed allows AdamW)."""
    rep2 = _by_replica(two_by_two, 2)
    fed = [[rep2[r]["grads"][step] for r in range(2)] for step in range(4)]
    rep1 = _by_replica(run_distributed(_demo_run, 2, 2, 1, 4, fed), 2)
    _check_against_reference(rep1, 2, 4, "R=2 S=1")
    for step in range(4):
        for n in MUON:
            assert torch.equal(rep1[0]["q"][step][n], rep2[0]["q"][step][n]), (step, n)
            assert torch.equal(rep1[0]["input"][step][n], rep2[0]["input"][step][n]), (step, n)
            assert torch.equal(rep1[0]["shared"][step][n], rep2[0]["shared"][step][n]), (step, n)
            for r in range(2):
                assert torch.equal(rep1[r]["momenta"][step][n], rep2[r]["momenta"][step][n]), (step, n, r)
        for n, p in rep2[0]["params"][step].items():
            bound = (step + 1) * 2 * FP32_ULP * p.abs().max().item()
            assert (rep1[0]["params"][step][n] - p).abs().max().item() <= bound, (step, n)


def test_published_demo_follows_the_reference():
    """DeMo as published (demo_shared_momentum=False, α 0.2, no Nesterov) on R = 2 × S = 1: Newton–
    Schulz gets the replicas' average itself, and every step matches ReferenceDeMoMuon without
    the shared momentum within the same bounds; no shared momentum state exists."""
    rep = _by_replica(run_distributed(_demo_run, 2, 2, 1, 3, None, PUBLISHED), 2)
    _check_against_reference(rep, 2, 3, "published R=2 S=1", PUBLISHED)
    assert all(not shared for r in rep for shared in r["shared"])


def test_bytes_metrics(two_by_two):
    """demo/bytes_sent is what each owner's all-gathers sent, (R − 1) × the payloads of the
    matrices it owns (demo.payload_bytes); demo/bytes_dense is a ring all-reduce of the same
    matrices' fp32 gradients; their ratio is 2N/(R·b). demo/adamw_bytes_sent: the AdamW
    gradients' dense average. Every step sends the same."""
    chunk, topk, replicas = SETTINGS["demo_chunk"], SETTINGS["demo_topk"], 2
    owners = 0
    for record in two_by_two:
        payload = sum(demo.payload_bytes(rows, cols, chunk, topk) for rows, cols in record["owned_shapes"])
        dense = sum(demo.dense_bytes(rows, cols) for rows, cols in record["owned_shapes"])
        owners += bool(payload)
        for metrics in record["metrics"]:
            assert metrics["demo/bytes_sent"] == demo.allgather_bytes_sent(payload, replicas) == (replicas - 1) * payload
            assert metrics["demo/bytes_dense"] == demo.allreduce_bytes_sent(dense, replicas) == dense
            if payload:
                assert metrics["demo/bytes_dense"] / metrics["demo/bytes_sent"] == pytest.approx(2 * dense / (replicas * payload))
            assert metrics["demo/adamw_bytes_sent"] == demo.allreduce_bytes_sent(4 * record["adamw_local_numel"], replicas)
    assert owners == 4  # 130×130 on one rank of each replica, the two 100×70 on the other
    # 130×130 at s = 64, k = 8: 4 full chunks × 8 + 2 × 1 + 2 × 1 + 1 = 37 pairs of 6 bytes.
    assert demo.payload_bytes(130, 130, chunk, topk) == 37 * 6


# ---------------------------------------------------------------- options and failures


def _matrix_groups():
    w = nn.Parameter(torch.randn(8, 8))
    return [{"params": [w]}]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(demo=True), "replicate_group"),
        (dict(demo=True, demo_chunk=0), "demo_chunk"),
        (dict(demo=True, demo_topk=64 * 64 + 1), "demo_topk"),
        (dict(demo=True, demo_alpha=1.5), "demo_alpha"),
        (dict(demo=True, demo_compressor="svd"), "demo_compressor"),
        (dict(demo=True, demo_compressor="low_rank", demo_rank=0), "demo_rank"),
        (dict(demo="yes"), "demo must be True or False"),
        (dict(replicate_group=object()), "replicate_group is only used with demo=True"),
    ],
)
def test_bad_options_name_the_option(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Muon(_matrix_groups(), nesterov=False, **kwargs)


def _option_errors(rank, world):
    """Errors that need a replicate group (2 replicas of 1 rank): each names its option, and
    parameters that differ between replicas are refused."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_replicate",))
    group = mesh.get_group("dp_replicate")
    errors = {}
    for label, kwargs in {
        "nesterov": dict(nesterov=True, demo_shared_momentum=False),
        "demo_shared_momentum": dict(demo_shared_momentum="yes"),
        "momentum_dtype": dict(nesterov=False, momentum_dtype="bf16"),
        "overlap": dict(nesterov=False, overlap=True),
    }.items():
        try:
            Muon(_matrix_groups(), momentum=0.99, demo=True, replicate_group=group, **kwargs)
        except ValueError as error:
            errors[label] = str(error)
    torch.manual_seed(rank)  # a different matrix in each replica
    try:
        Muon(_matrix_groups(), momentum=0.99, nesterov=False, demo=True, replicate_group=group)
    except ValueError as error:
        errors["identical"] = str(error)
    return errors


def test_options_that_need_replicas_are_checked():
    for errors in run_distributed(_option_errors, 2, timeout=120):
        assert "nesterov=True with demo=True needs demo_shared_momentum=True" in errors["nesterov"]
        assert "demo_shared_momentum must be True or False" in errors["demo_shared_momentum"]
        assert "momentum_dtype='fp32'" in errors["momentum_dtype"]
        assert "overlap" in errors["overlap"]
        assert "bit-identical in every replica" in errors["identical"]


def _failing_run(rank, world, failure, settings=SETTINGS):
    """One step on 2 replicas × 2 shards where replica 1 misbehaves: a non-finite gradient
    (nonfinite_grads="skip"), an error in one owner's DeMo step ("owner": before any collective
    across replicas) or, with the low-rank compressor, in its QR ("basis": between its two
    all-reduces; "owner and basis": the first on one owner, the second on the other). Returns what each rank saw and whether its parameters and its whole DeMo
    state stayed as they were."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    replica, shard = mesh.get_coordinate()
    model = Net()
    fully_shard(model, mesh=mesh["dp_shard"])
    opt = Muon(_groups(model), **settings, demo=True, replicate_group=mesh.get_group("dp_replicate"), nonfinite_grads="skip")
    x, y = _batch(0, replica)
    ((model(x.chunk(2)[shard]) - y.chunk(2)[shard]) ** 2).mean().backward()
    opt.step()  # a good step first, so that momenta are not zero
    opt.zero_grad()
    ((model(x.chunk(2)[shard]) - y.chunk(2)[shard]) ** 2).mean().backward()
    before = {n: _full(p) for n, p in model.named_parameters()}
    keys = opt.storage.tensor_keys  # the own momentum, the shared one, the low-rank warm start
    state = {key: _owner_momenta(opt, key) for key in keys}
    adamw_state = {n: {k: _full(v) for k, v in opt.state[p].items()} for n, p in model.named_parameters() if n in ADAMW}
    if replica == 1 and failure == "nonfinite":
        model.w2.grad.to_local()[0, 0] = float("nan")
    if replica == 1 and (shard == 1 and failure == "owner" or shard == 0 and failure == "owner and basis"):
        original = opt.replicas.round_inputs

        def broken(s, r, engine, batches, *args):
            if batches:
                raise RuntimeError("injected failure")
            return original(s, r, engine, batches, *args)

        opt.replicas.round_inputs = broken
    if replica == 1 and shard == 1 and failure in ("basis", "owner and basis"):
        from titan_muon.demo import low_rank

        def broken_basis(right):
            raise RuntimeError("injected failure")

        low_rank.orthonormal_basis = broken_basis
    outcome = "stepped"
    try:
        opt.step()
        if opt.last_step_metrics["muon/skipped_steps"]:
            outcome = "skipped"
    except RuntimeError as error:
        outcome = f"raised: {error}"
    unchanged = all(torch.equal(before[n], _full(p)) for n, p in model.named_parameters())
    unchanged = unchanged and all(torch.equal(m, _owner_momenta(opt, key)[n]) for key in keys for n, m in state[key].items())
    unchanged = unchanged and all(torch.equal(v, _full(opt.state[p][k])) for n, p in model.named_parameters() if n in ADAMW for k, v in adamw_state[n].items())
    return outcome, unchanged


@pytest.mark.parametrize("failure", ["nonfinite", "owner"])
def test_one_replica_failing_stops_every_replica(failure):
    """A NaN gradient in one replica skips the step in both; an error on one owner raises on
    every rank of every replica (its counterpart's all-gather is still matched, so nothing
    hangs) and nothing changes anywhere."""
    for outcome, unchanged in run_distributed(_failing_run, 4, failure, timeout=180):
        if failure == "nonfinite":
            assert outcome == "skipped"
        else:
            assert outcome.startswith("raised:") and "no parameter or optimizer state was changed" in outcome
        assert unchanged


# ---------------------------------------------------------------- checkpoints


def _checkpoint_run(rank, world, replicas, shards, path, save, fed=None, settings=SETTINGS):
    """save: 3 steps, a DCP checkpoint, a 4th step (its gradients returned, per replica).
    load: other weights, the checkpoint loaded over them, the 4th step on `fed` gradients."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("dp_replicate", "dp_shard"))
    replica, shard = mesh.get_coordinate()
    model = Net()
    if not save:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)  # the load must overwrite these
    fully_shard(model, mesh=mesh["dp_shard"])
    opt = Muon(_groups(model), **settings, demo=True, replicate_group=mesh.get_group("dp_replicate"))

    def backward(step):
        x, y = _batch(step, replica)
        ((model(x.chunk(shards)[shard]) - y.chunk(shards)[shard]) ** 2).mean().backward()

    if save:
        for step in range(3):
            backward(step)
            opt.step()
            opt.zero_grad()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        except BaseException as error:  # DCP's CheckpointException is a BaseException; returned to the test
            return {"error": f"{type(error).__name__}: {error}"}
    momenta, shared = _owner_momenta(opt), _owner_momenta(opt, SHARED_MOMENTUM_KEY)
    factors = _owner_momenta(opt, LEFT_FACTOR_KEY) if settings.get("demo_compressor") == "low_rank" else {}
    adamw_errors = {n: _full(opt.state[p][ERROR_KEY]) for n, p in model.named_parameters() if ERROR_KEY in opt.state.get(p, {})}
    backward(3)
    params = dict(model.named_parameters())
    if fed is not None:
        for n, p in params.items():
            p.grad.to_local().copy_(distribute_tensor(fed[replica][n], p.grad.device_mesh, p.grad.placements, src_data_rank=None).to_local())
    grads = {n: _full(p.grad) for n, p in params.items()}
    opt.step()
    return {"replica": replica, "shard": shard, "momenta": momenta, "shared": shared, "factors": factors, "adamw_errors": adamw_errors, "grads": grads,
            "params": {n: _full(p) for n, p in model.named_parameters()}}  # fmt: skip


def test_checkpoint_keeps_every_replicas_momentum(tmp_path):
    """Each replica's momentum is saved as its own slice (not deduplicated as replicated state):
    loaded on the same layout the next step is bit for bit the straight run's; on R = 2 × S = 1
    the momenta are the same bits and the next step the same up to the last bits of the shard
    updates (as in test_layout_independence_one_vs_two_shards); on another number of replicas
    the load is refused: DCP itself stops at the momenta's leading dimension, the replica count
    (torchtitan's resume check names it first, titan_muon/torchtitan/checkpoint.py)."""
    path = str(tmp_path / "demo_checkpoint")
    straight = run_distributed(_checkpoint_run, 4, 2, 2, path, True)
    fed = [next(r["grads"] for r in straight if r["replica"] == k) for k in range(2)]
    for world, shards in ((4, 2), (2, 1)):
        loaded = run_distributed(_checkpoint_run, world, 2, shards, path, False, fed)
        for k in range(2):
            before = {n: m for r in straight if r["replica"] == k for n, m in r["momenta"].items()}
            after = {n: m for r in loaded if r["replica"] == k for n, m in r["momenta"].items()}
            assert sorted(after) == sorted(before) == sorted(MUON)
            for n in MUON:
                assert torch.equal(after[n], before[n]), (world, k, n)
            shared_before = {n: m for r in straight if r["replica"] == k for n, m in r["shared"].items()}
            shared_after = {n: m for r in loaded if r["replica"] == k for n, m in r["shared"].items()}
            for n in MUON:  # saved once (the same in every replica), resharded like the weights
                assert shared_before[n].abs().sum() > 0 and torch.equal(shared_after[n], shared_before[n]), (world, k, n)
        expected = straight[0]["params"]
        for n, p in loaded[0]["params"].items():
            if shards == 2:
                assert torch.equal(p, expected[n]), n
            else:
                assert (p - expected[n]).abs().max() <= 2 * FP32_ULP * expected[n].abs().max(), n
    assert not torch.equal(straight[0]["momenta"]["w2"], next(r for r in straight if r["replica"] == 1)["momenta"]["w2"])
    for result in run_distributed(_checkpoint_run, 4, 4, 1, path, False, None):
        assert "Size mismatch between saved torch.Size([2, " in result["error"] and "momentum_buffer" in result["error"], result
