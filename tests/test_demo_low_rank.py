"""titan_muon.demo.low_rank (DeMo's low-rank compressor, issue 27) against the independent reference
ReferenceLowRankDeMoMuon (tests/demo_reference.py).

Bounds, u = 2^-24 (fp32 unit roundoff), γ_j = j·u/(1 − j·u), Frobenius norms unless said otherwise.
One teacher-forced step of one m×n matrix, k = min(rank, m, n), R replicas, compared with the
exact step (the reference in float64 on the same fp32 inputs; its own rounding, ~1e-16
relative, is far below every allowance):

* A_r = β·M_r + g_r in fp32 is within D_r = u·(2|β·M_r| + |A_r|) elementwise of the exact value
  (β rounded to fp32, the product, the sum);
* Q̄ = (1/R)·Σ A_rᵀP: each product within γ_m·|A_r|ᵀ|P| (plus D_r carried through, |D_r|ᵀ|P|), the
  replica sum within γ_{R−1}·Σ|Q_r|, the division u·|Q̄|; e1 = the Frobenius norm of that sum;
* Q̂ = QR(Q̄): first order, a perturbation dA of A = QR (R's diagonal positive) moves Q by
  dQ with QᵀdQ skew (= lower(X) − lower(X)ᵀ for X = QᵀdA·R⁻¹, so |QᵀdQ| ≤ √2·|X|) and
  (I − QQᵀ)dQ = (I − QQᵀ)dA·R⁻¹: |dQ| ≤ √3·|dA|/σ_k(A). The kernel's own rounding is taken
  as at most 4x what the same fp32 QR does on the exact Q̄ rounded to fp32, measured (e_QR), as
  test_demo_distributed takes Newton–Schulz's. Column signs are a convention (LAPACK's R may
  have a negative diagonal, Gram–Schmidt's has not), so the run's Q̂ and P̄ are compared after
  multiplying their columns by ±1; q = P̄Q̂ᵀ = ĀQ̂Q̂ᵀ does not depend on them;
* P̄ = (1/R)·Σ A_r Q̂: |Ā|₂·|ΔQ̂| plus the products' γ_n·|A_r||Q̂|, D_r·|Q̂| and the sum's roundings;
* q = P̄Q̂ᵀ: |ΔP̄|·|Q̂|₂ + |P̄|₂·|ΔQ̂| + γ_k·| |P̄||Q̂|ᵀ |;
* M_r' = A_r − α·q: |D_r| + α·|Δq| + u·| |A_r| + 2α|q| | (α's rounding, the product, the difference).

Measured: the fp32 errors use ≲ 1 % of these allowances; mutations (α off by 0.1 %, one replica
left out of an average, 1/R off by 1e-3, the warm start not kept) each fail.
"""

from __future__ import annotations

import math

import pytest
import torch
from demo_reference import ReferenceLowRankDeMoMuon, least_squares_problem, reference_start

from titan_muon.algorithm.newton_schulz import orthogonalize
from titan_muon.algorithm.update import update_scale
from titan_muon.demo import dct as demo
from titan_muon.demo import low_rank

U32 = 2.0**-24
U64 = 2.0**-53
SHAPES = [(100, 70), (64, 200), (130, 130), (100, 70), (3, 40)]  # two 100×70: one batch; 3×40: k = 3 < rank


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _gamma(j: int, u: float = U32) -> float:
    return j * u / (1 - j * u)


# ------------------------------------------------------------------ the pieces


def test_settings_name_the_option():
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="demo_rank"):
            low_rank.validate_rank(bad)
    low_rank.validate_rank(1)
    assert low_rank.effective_rank(3, 40, 4) == 3 and low_rank.effective_rank(100, 2, 4) == 2 and low_rank.effective_rank(100, 70, 4) == 4
    with pytest.raises(ValueError, match="batch of floating-point"):
        low_rank.right_projection(torch.zeros(4, 4), torch.zeros(4, 2))


def test_starting_factor_and_warm_start():
    """A zero warm start (a fresh state) becomes the fixed start, drawn as the reference draws it;
    any other factor is kept as it is, per matrix of a batch."""
    start = low_rank.starting_factor(100, 4)
    assert torch.equal(start, reference_start(100, 4))
    kept = torch.randn(100, 4, generator=_gen(1))
    out = low_rank.warm_start(torch.stack([torch.zeros(100, 4), kept]))
    assert torch.equal(out[0], start) and torch.equal(out[1], kept)


def test_orthonormal_basis_is_deterministic_and_batch_independent():
    """The same input gives the same bits (every replica computes its Q̂ from the same Q̄), and a
    batch gives each matrix the bits it would get alone; a rank-deficient Q̄ still gets k
    orthonormal columns (|Q̂ᵀQ̂ − I| within the k-term dot products' γ_n·|Q̂|ᵀ|Q̂| plus, from the
    Householder kernel, a few n·u: checked against 4·n·u, ≥ 2x what fp32 LAPACK shows here)."""
    q = torch.randn(3, 130, 4, generator=_gen(2))
    q[2, :, 3] = q[2, :, 0]  # rank 3
    basis = low_rank.orthonormal_basis(q)
    assert torch.equal(basis, low_rank.orthonormal_basis(q.clone()))
    for i in range(3):
        assert torch.equal(basis[i], low_rank.orthonormal_basis(q[i : i + 1])[0])
    gram = basis.transpose(-2, -1).double() @ basis.double()
    assert (gram - torch.eye(4, dtype=torch.float64)).abs().max() <= 4 * 130 * U32


def test_full_rank_sends_the_matrix():
    """k = min(m, n): Q̂ is square and orthogonal, so q = A·Q̂Q̂ᵀ is A itself up to rounding:
    elementwise |A|·|Q̂Q̂ᵀ − I| (measured on the computed Q̂) + 2γ_n·|A||Q̂||Q̂|ᵀ (two products)."""
    a = torch.randn(1, 100, 7, generator=_gen(3))
    factors = low_rank.warm_start(torch.zeros(1, 100, 7))
    basis = low_rank.orthonormal_basis(low_rank.right_projection(a, factors))
    q = low_rank.decode(low_rank.left_projection(a, basis), basis)
    b = basis[0].double()
    eye = torch.eye(7, dtype=torch.float64)
    bound = a[0].double().abs() @ (b @ b.T - eye).abs() + 2 * _gamma(7) * a[0].double().abs() @ b.abs() @ b.abs().T
    assert ((q[0].double() - a[0].double()).abs() <= bound).all()


def test_bytes():
    # (m + n)·k fp32 elements per step: a 4096² matrix at k = 4 sends 131,072 bytes per all-reduce pair.
    assert low_rank.payload_bytes(4096, 4096, 4) == 4 * 8192 * 4 == 131_072
    assert low_rank.payload_bytes(3, 40, 4) == 4 * 43 * 3  # k = min(rank, m, n)
    dense = demo.dense_bytes(4096, 4096)
    for replicas in (2, 8, 64):  # both ring all-reduces: the ratio N/((m + n)·k) whatever R
        ratio = demo.allreduce_bytes_sent(dense, replicas) / demo.allreduce_bytes_sent(low_rank.payload_bytes(4096, 4096, 4), replicas)
        assert ratio == pytest.approx(512.0)


# ------------------------------------------------------------------ the pipeline


class LowRankPipeline:
    """What the integration runs (demo/step.py), on one process: per shape one batch of matrices,
    per replica the accumulate and the right projection, the replicas' average (summed in replica
    order, then ÷R, as the all-reduce), the basis, the left projection, the average again, the
    decode, the error feedback and the warm start; then the shared momentum, Newton–Schulz, update."""

    def __init__(self, params, replicas, lr, wd, beta, rank, alpha, shared_momentum=True, nesterov=True):
        self.replicas, self.lr, self.wd, self.beta, self.rank, self.alpha = replicas, lr, wd, beta, rank, alpha
        self.shared_momentum, self.nesterov = shared_momentum, nesterov
        self.by_shape: dict[tuple, list[str]] = {}
        for n, p in params.items():
            self.by_shape.setdefault(tuple(p.shape), []).append(n)
        dtype = next(iter(params.values())).dtype
        self.momenta = [{s: torch.zeros(len(ns), *s, dtype=dtype) for s, ns in self.by_shape.items()} for _ in range(replicas)]
        self.shared = {s: torch.zeros(len(ns), *s, dtype=dtype) for s, ns in self.by_shape.items()}
        self.factors = {s: torch.zeros(len(ns), s[0], rank, dtype=dtype) for s, ns in self.by_shape.items()}
        self.last_q: dict[str, torch.Tensor] = {}

    def _average(self, parts):
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.div_(self.replicas)

    def step(self, params, grads):
        for shape, names in self.by_shape.items():
            k = low_rank.effective_rank(*shape, self.rank)
            factors = low_rank.warm_start(self.factors[shape][..., :k])
            accumulated = []
            for r in range(self.replicas):
                momentum = self.momenta[r][shape]
                demo.accumulate_momentum_(momentum, torch.stack([grads[r][n] for n in names]), self.beta)
                accumulated.append(momentum)
            basis = low_rank.orthonormal_basis(self._average([low_rank.right_projection(a, factors) for a in accumulated]))
            left = self._average([low_rank.left_projection(a, basis) for a in accumulated])
            q = low_rank.decode(left, basis)
            for a in accumulated:
                demo.subtract_sent_(a, q, self.alpha)
            self.factors[shape].zero_()[..., :k] = left
            ns_input = demo.shared_momentum_input_(self.shared[shape], q, self.beta, self.nesterov) if self.shared_momentum else q
            u = orthogonalize(ns_input, dtype=q.dtype)
            for i, n in enumerate(names):
                self.last_q[n] = q[i]
                params[n].mul_(1 - self.lr * self.wd).sub_(self.lr * update_scale(None, *shape) * u[i])


SETTINGS = {"lr": 0.02, "wd": 0.01, "beta": 0.95, "rank": 4, "alpha": 1.0}


def _reference(replicas, settings=SETTINGS, **kwargs):
    s = settings
    return ReferenceLowRankDeMoMuon(replicas, s["lr"], s["wd"], s["beta"], s["rank"], s["alpha"], **kwargs)


def _smallest_singular_value(x: torch.Tensor) -> float:
    return torch.linalg.svdvals(x.double())[-1].item()


@pytest.mark.parametrize("shared_momentum, nesterov", [(True, True), (False, False)])
def test_pipeline_follows_reference_trajectory_float64(shared_momentum, nesterov):
    """Free-running, 4 steps, float64, R = 3: the pipeline's parameters and the reference's.

    Allowance per step, first order (as test_demo's DCT trajectory test): the products and sums
    are within ~(2·130 + 3)·u64 relative; the QR multiplies that by √3/σ_k·|Q̄| ≤ √3·κ (κ of
    each step's Q̄, measured on the reference, ≤ 100 asserted); Newton–Schulz by 2·4⁵. Summed
    over the steps, times |ΔW| of the run: 4·263·u64·√3·κ·2·4⁵ ≈ 2e-10·κ of the parameter change
    per step. A defect (a replica left out, α, the warm start) changes it by percents."""
    replicas, steps = 3, 4
    params, grads = least_squares_problem(SHAPES, replicas, torch.float64)
    start = {n: p.clone() for n, p in params.items()}
    ref_params = {n: p.clone() for n, p in params.items()}
    s = SETTINGS
    pipeline = LowRankPipeline(params, replicas, s["lr"], s["wd"], s["beta"], s["rank"], s["alpha"], shared_momentum, nesterov)
    reference = _reference(replicas, shared_momentum=shared_momentum, nesterov=nesterov)
    kappa = 1.0
    for _ in range(steps):
        pipeline.step(params, grads(params))
        reference.step(ref_params, grads(ref_params))
        for n, right in reference.last_right.items():
            svd = torch.linalg.svdvals(right)
            kappa = max(kappa, (svd[0] / svd[-1]).item())
    allowance = steps * 4 * 263 * U64 * math.sqrt(3) * kappa * 2 * 4**5
    assert allowance < 1e-6  # far inside the first-order regime
    for n in params:
        change = (ref_params[n] - start[n]).norm()
        diff = (params[n] - ref_params[n]).norm()
        assert diff <= allowance * change, (n, (diff / change).item(), allowance)


def test_error_feedback_rules_give_the_same_parameters():
    """Subtracting the decoded average (PowerSGD's rule, the implementation's) or each replica's
    own share A_r·Q̂Q̂ᵀ leaves the same average of the replicas' buffers, and the step sees only
    that average (low_rank.py): float64, 4 steps, the parameters agree to rounding (the
    trajectory test's allowance), while the replicas' own buffers differ."""
    replicas, steps = 3, 4
    params, grads = least_squares_problem(SHAPES, replicas, torch.float64, seed=22)
    start = {n: p.clone() for n, p in params.items()}
    own_params = {n: p.clone() for n, p in params.items()}
    average, own = _reference(replicas), _reference(replicas, feedback="own")
    for _ in range(steps):
        average.step(params, grads(params))
        own.step(own_params, grads(own_params))
    for n in params:
        change = (params[n] - start[n]).norm()
        assert (params[n] - own_params[n]).norm() <= steps * 4 * 263 * U64 * math.sqrt(3) * 100 * 2 * 4**5 * change, n
        mean_average = sum(m[n] for m in average.momenta) / replicas
        mean_own = sum(m[n] for m in own.momenta) / replicas
        # the two means differ by the rounding of the R subtractions: ≤ 1e-12 of |q| (≈ 3·u64·|q| each)
        assert (mean_average - mean_own).norm() <= 1e-12 * average.last_q[n].norm(), n
        assert (average.momenta[0][n] - own.momenta[0][n]).norm() > 1e-3 * average.momenta[0][n].norm(), n


def sign_align(run: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """`run` with each column multiplied by the sign that best matches `exact`'s column."""
    signs = torch.sign((run.double() * exact.double()).sum(dim=0))
    signs[signs == 0] = 1
    return run.double() * signs


def low_rank_allowances(old_momenta: list, factor: torch.Tensor, grads: list, exact, beta: float, alpha: float, rank: int) -> dict:
    """The Frobenius allowances of one teacher-forced fp32 step of one matrix (module docstring).

    old_momenta / grads: per replica, fp32 (m, n); factor: the fp32 warm start P (m, rank) before
    the step; exact: a ReferenceLowRankDeMoMuon that took the step in float64 from the same
    inputs (its last_* and momenta/factors hold the exact values, `name` "w")."""
    replicas = len(grads)
    m, n = grads[0].shape
    k = min(rank, m, n)
    p0 = factor[:, :k].double()
    if not p0.any():
        p0 = reference_start(m, k).double()
    accumulated = [(old.double() * beta + g.double()) for old, g in zip(old_momenta, grads)]  # exact
    d = [U32 * (2 * (beta * old.double()).abs() + a.abs()) for old, a in zip(old_momenta, accumulated)]
    right, basis, q = exact.last_right["w"], exact.last_basis["w"], exact.last_q["w"]
    left = exact.factors["w"][:, :k]
    mean = sum(accumulated) / replicas
    e_right = sum(di.T @ p0.abs() + _gamma(m) * a.abs().T @ p0.abs() + _gamma(replicas - 1) * (a.T @ p0).abs() for di, a in zip(d, accumulated)) / replicas
    e1 = (e_right + U32 * right.abs()).norm().item()
    sigma = _smallest_singular_value(right)
    assert e1 <= 1e-2 * sigma, "Q̄ too ill-conditioned for a first-order allowance"
    measured = torch.linalg.qr(right.float()).Q
    e_qr = (sign_align(measured, basis) - basis).norm().item()
    d_basis = math.sqrt(3) * e1 / sigma + 4 * e_qr
    norm_mean = torch.linalg.matrix_norm(mean, ord=2).item()
    e_left = sum((di + _gamma(n) * a.abs()) @ basis.abs() + _gamma(replicas - 1) * (a @ basis).abs() for di, a in zip(d, accumulated)) / replicas
    d_left = norm_mean * d_basis + (e_left + U32 * left.abs()).norm().item()
    d_q = d_left * (1 + d_basis) + torch.linalg.matrix_norm(left, ord=2).item() * d_basis + (_gamma(k) * left.abs() @ basis.abs().T).norm().item()
    d_momenta = [(di.norm() + alpha * d_q + (U32 * (a.abs() + 2 * alpha * q.abs())).norm()).item() for di, a in zip(d, accumulated)]
    return {"basis": d_basis, "left": d_left, "q": d_q, "momenta": d_momenta, "e_qr": e_qr}


def exact_step(old_momenta: list, factor: torch.Tensor, grads: list, shared, beta, alpha, rank, nesterov=True, lr=0.0, weight_decay=0.0,
               param=None) -> ReferenceLowRankDeMoMuon:  # fmt: skip
    """The reference's step of one matrix "w" in float64 from fp32 state (old momenta, warm start,
    the shared momentum or None without it, the parameter before the step or None: zeros, with
    lr 0 only the compressor's values matter). ``reference.params["w"]`` is the parameter after it."""
    replicas = len(grads)
    reference = ReferenceLowRankDeMoMuon(replicas, lr, weight_decay, beta, rank, alpha, shared_momentum=shared is not None, nesterov=nesterov)
    reference.momenta = [{"w": old.double().clone()} for old in old_momenta]
    reference.factors = {"w": factor.double().clone()}
    if shared is not None:
        reference.shared = {"w": shared.double().clone()}
    reference.params = {"w": torch.zeros(grads[0].shape, dtype=torch.float64) if param is None else param.double().clone()}
    reference.step(reference.params, [{"w": g.double()} for g in grads])
    return reference


def test_pipeline_matches_reference_per_step_fp32():
    """fp32, R = 3, 4 steps along the reference's trajectory, each step teacher-forced from the
    reference's state (momenta, warm start): the pipeline's q, new momenta and warm start P̄ equal
    the exact step's within the allowances of the module docstring."""
    replicas, steps, s = 3, 4, SETTINGS
    params, grads = least_squares_problem(SHAPES, replicas, torch.float32, seed=21)
    pipeline = LowRankPipeline(params, replicas, s["lr"], s["wd"], s["beta"], s["rank"], s["alpha"])
    reference = _reference(replicas)
    used = 0.0
    for _ in range(steps):
        g = grads(params)
        old = [{n: reference.momenta[r].get(n, torch.zeros_like(p)).clone() for n, p in params.items()} for r in range(replicas)]
        factors = {n: reference.factors.get(n, torch.zeros(p.shape[0], s["rank"])).clone() for n, p in params.items()}
        for shape, names in pipeline.by_shape.items():
            for i, n in enumerate(names):
                pipeline.factors[shape][i].copy_(factors[n])
                pipeline.shared[shape][i].copy_(reference.shared.get(n, torch.zeros_like(params[n])))
                for r in range(replicas):
                    pipeline.momenta[r][shape][i].copy_(old[r][n])
        ref_params = {n: p.clone() for n, p in params.items()}
        pipeline.step({n: p.clone() for n, p in params.items()}, g)
        reference.step(ref_params, g)
        for shape, names in pipeline.by_shape.items():
            for i, n in enumerate(names):
                exact = exact_step([o[n] for o in old], factors[n], [gr[n] for gr in g], None, s["beta"], s["alpha"], s["rank"])
                allow = low_rank_allowances([o[n] for o in old], factors[n], [gr[n] for gr in g], exact, s["beta"], s["alpha"], s["rank"])
                diff = (pipeline.last_q[n].double() - exact.last_q["w"]).norm().item()
                assert diff <= allow["q"], (n, diff / allow["q"])
                k = low_rank.effective_rank(*shape, s["rank"])
                left = pipeline.factors[shape][i]
                assert not left[:, k:].any()
                diff_left = (sign_align(left[:, :k], exact.factors["w"][:, :k]) - exact.factors["w"][:, :k]).norm().item()
                assert diff_left <= allow["left"], (n, diff_left / allow["left"])
                used = max(used, diff / allow["q"], diff_left / allow["left"])
                for r in range(replicas):
                    diff_m = (pipeline.momenta[r][shape][i].double() - exact.momenta[r]["w"]).norm().item()
                    assert diff_m <= allow["momenta"][r], (n, r, diff_m / allow["momenta"][r])
                    used = max(used, diff_m / allow["momenta"][r])
        params = ref_params  # both continue from the reference's parameters
    assert 0 < used < 0.1  # measured 1.5 %
