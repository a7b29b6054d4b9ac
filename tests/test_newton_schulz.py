import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from reference import reference_ns
from titan_muon import newton_schulz
from titan_muon.newton_schulz import (
    GRAM_MAX_RUN,
    GRAM_MIN_ASPECT,
    GRAM_MIN_SIDE,
    NS_ALGORITHMS,
    coefficient_schedule,
    gram_iterations,
    gram_segments,
    newton_schulz_flops,
    orthogonalize,
    resolve_algorithm,
)


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (64, 64), (3, 256)])
def test_matches_plain_quintic(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(orthogonalize(g), reference_ns(g), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["keller", "polar_express"])
def test_singular_values_move_towards_one(method):
    g = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) @ torch.diag(torch.logspace(-2, 0, 128))
    s = torch.linalg.svdvals(orthogonalize(g, method=method))
    assert s.max() < 1.25 and s.min() > 0.3, s


def test_polar_express_is_tighter_than_keller():
    g = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    spread = {m: torch.linalg.svdvals(orthogonalize(g, method=m)) for m in ("keller", "polar_express")}
    assert (spread["polar_express"] - 1).abs().max() < (spread["keller"] - 1).abs().max()


def test_batched_equals_one_by_one_and_orientation_is_kept():
    batch = torch.randn(3, 80, 24, generator=torch.Generator().manual_seed(3))
    out = orthogonalize(batch)
    assert out.shape == batch.shape
    for k in range(3):
        torch.testing.assert_close(out[k], orthogonalize(batch[k]), rtol=1e-5, atol=1e-6)


def test_bf16_compute_dtype_is_close_to_fp32():
    g = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    diff = (orthogonalize(g, dtype=torch.bfloat16).float() - orthogonalize(g)).abs().max()
    assert orthogonalize(g, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert 0 < diff < 0.05


def test_zero_matrix_stays_zero():
    assert orthogonalize(torch.zeros(8, 16)).abs().max() == 0


def test_schedule_and_flops():
    assert coefficient_schedule("keller", 3) == [(3.4445, -4.7750, 2.0315)] * 3
    pe = coefficient_schedule("polar_express", 7)
    assert len(pe) == 7 and pe[5] == pe[6] == pe[4]
    assert coefficient_schedule((1.5, -0.5, 0.0), 2) == [(1.5, -0.5, 0.0)] * 2
    with pytest.raises(ValueError, match="unknown Newton-Schulz method"):
        coefficient_schedule("cubic", 5)
    assert newton_schulz_flops(10, 30, 1) == newton_schulz_flops(30, 10, 1) == 4 * 100 * 30 + 2 * 1000



# ---- Gram Newton–Schulz ------------------------------------------------------------------


def low_rank(rows, cols, seed):
    """Gradient-like: 4 dominant directions (singular values 1 .. 0.1) plus Gaussian noise at 1e-3."""
    gen = torch.Generator().manual_seed(seed)
    u, v = torch.randn(rows, 4, generator=gen), torch.randn(4, cols, generator=gen)
    return (u * torch.logspace(0, -1, 4)) @ v / (rows * cols) ** 0.25 + 1e-3 * torch.randn(rows, cols, generator=gen)


def exact_targets(g, method, steps=5):
    """(U Vᵀ, U f(S) Vᵀ) in float64 from an SVD: f is the NS polynomial composed over the steps,
    applied to the singular values scaled as orthogonalize scales them (Frobenius norm, and
    Polar Express's published 1.01 safety factor)."""
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    s = s / torch.linalg.vector_norm(s) / (1.01 if method == "polar_express" else 1.0)
    for a, b, c in coefficient_schedule(method, steps):
        s = a * s + b * s**3 + c * s**5
    return u @ vh, (u * s) @ vh


def spectral(t):
    return torch.linalg.matrix_norm(t.double(), 2).item()


def orthogonality_error(o):
    o = o.double()
    short = o @ o.mT if o.size(0) <= o.size(1) else o.mT @ o
    return spectral(short - torch.eye(short.size(0), dtype=torch.float64))


def rounding_envelope(method, dtype, steps=5):
    """A priori bound on ‖O − U f(S) Vᵀ‖₂ from rounding alone. A relative error eps made before
    step j (t = 0: rounding the scaled input) grows by at most a_j = p_j'(0) per later step:
    the small singular values, where the polynomials are steepest, carry the largest growth.
    Each step rounds at most 4 products whose errors reach the output (gram: square of the
    Gram matrix, accumulated polynomial, two halves of the Gram update; standard: 3)."""
    growth, total = 1.0, 1.0
    for a, _, _ in reversed(coefficient_schedule(method, steps)):
        growth *= abs(a)
        total += growth
    return 4 * torch.finfo(dtype).eps * total


def metrics_within(gram, std, polar, slack):
    """‖O Oᵀ − I‖₂ and ‖O − U Vᵀ‖₂ are Lipschitz in O with constants ‖O‖ + ‖O'‖ ≤ 2.5 and 1, so
    gram's may exceed standard's by at most those times ‖O_gram − O_std‖ ≤ slack."""
    assert orthogonality_error(gram) <= orthogonality_error(std) + 2.5 * slack
    assert spectral(gram.double() - polar) <= spectral(std.double() - polar) + slack


def sample_matrix(shape, kind, seed):
    if kind == "gaussian":
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return low_rank(*shape, seed)


# Square, 1024x4096-like and 4096x14336-like scaled down (aspect 4 and 3.5), and tall.
ACCURACY_SHAPES = [(96, 96), (64, 256), (64, 224), (224, 64)]


@pytest.fixture(params=["whole", "split"])
def symmetric_products(request, monkeypatch):
    """Run each accuracy test twice: symmetric products as one GEMM, and as three blocks (the
    split used from SYMMETRIC_SPLIT_MIN rows on, forced here on these small shapes)."""
    if request.param == "split":
        monkeypatch.setattr(newton_schulz, "SYMMETRIC_SPLIT_MIN", 16)
    return request.param


@pytest.mark.parametrize("method", ["keller", "polar_express"])
@pytest.mark.parametrize("kind", ["gaussian", "low_rank"])
def test_gram_is_within_the_fp32_rounding_envelope(method, kind, symmetric_products):
    """In fp32 both algorithms stay inside the same a priori rounding envelope around the float64
    U f(S) Vᵀ (measured: 10x to 100x inside it), so their orthogonality errors and distances to
    U Vᵀ agree to within the Lipschitz constants times twice the envelope."""
    envelope = rounding_envelope(method, torch.float32)
    for i, shape in enumerate(ACCURACY_SHAPES):
        g = sample_matrix(shape, kind, 10 + i)
        polar, target = exact_targets(g, method)
        std, gram = (orthogonalize(g, 5, method, algorithm=a) for a in ("standard", "gram"))
        assert spectral(std.double() - target) <= envelope, shape
        assert spectral(gram.double() - target) <= envelope, shape
        metrics_within(gram, std, polar, 2 * envelope)


# bf16: the a priori envelope is ~10 (vacuous), so gram is compared with standard's measured error,
# where "auto" can pick gram (aspect >= 2: 64x128 and up) and on low-rank (gradient-like) inputs of any shape.
BF16_CASES = [(s, "gaussian") for s in [(64, 128), *ACCURACY_SHAPES[1:]]] + [(s, "low_rank") for s in ACCURACY_SHAPES]


@pytest.mark.parametrize("method", ["keller", "polar_express"])
def test_gram_is_as_accurate_as_standard_in_bf16(method, symmetric_products):
    """Bound: gram's rounding error ≤ 2.5x standard's (+ 4 eps), standard's measured on the same
    input, which carries its conditioning. Budget: for 5 steps gram rounds 20 products to
    standard's 15, and its accumulated polynomial is rounded at the scale of its largest
    eigenvalue (up to a³ over a 3-step run), not of the output; measured worst 2.2x (Polar
    Express, Gaussian). Square Gaussian matrices are the exception (6-12x, docs/newton_schulz.md):
    a continuum of tiny singular values keeps that range large in the last run."""
    eps = torch.finfo(torch.bfloat16).eps
    for i, (shape, kind) in enumerate(BF16_CASES):
        g = sample_matrix(shape, kind, 10 + i)
        polar, target = exact_targets(g, method)
        std, gram = (orthogonalize(g, 5, method, torch.bfloat16, algorithm=a) for a in ("standard", "gram"))
        assert gram.dtype == torch.bfloat16 and gram.shape == g.shape
        rounding_std, rounding_gram = spectral(std.double() - target), spectral(gram.double() - target)
        assert rounding_gram <= 2.5 * rounding_std + 4 * eps, (shape, kind, rounding_gram, rounding_std)
        metrics_within(gram, std, polar, rounding_gram + rounding_std)


def test_the_bf16_bound_catches_gram_without_restarts():
    """One 5-step run (no restart) lets bf16 rounding in the Gram matrix's small eigenvalues grow by
    a² per step; the bound above must reject it, or it proves nothing."""
    g = low_rank(64, 224, 0)
    _, target = exact_targets(g, "keller")
    unrestarted = gram_iterations((g / g.norm()).bfloat16(), coefficient_schedule("keller", 5), (5,))
    standard = orthogonalize(g, 5, "keller", torch.bfloat16)
    assert spectral(unrestarted.double() - target) > 2.5 * spectral(standard.double() - target) + 4 * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (3, 40, 140), (2, 140, 40)])
@pytest.mark.parametrize("method", ["keller", "polar_express", (2.0, -1.5, 0.5)])
def test_gram_matches_standard_in_fp32(shape, method):
    """Batches, tall and wide, every coefficient schedule: both lie within the rounding envelope of
    the same U f(S) Vᵀ, so no entry differs by more than twice the envelope."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    atol = 2 * rounding_envelope(method, torch.float32)
    torch.testing.assert_close(orthogonalize(g, 5, method, algorithm="gram"), orthogonalize(g, 5, method), rtol=0, atol=atol)


@pytest.mark.parametrize("algorithm", NS_ALGORITHMS)
@pytest.mark.parametrize("shape", [(3, 64, 256), (3, 256, 64), (64, 256), (256, 64)])
def test_every_algorithm_runs_on_meta(algorithm, shape):
    """Shapes only: no host reads, no data-dependent branches (meta tensors have no values)."""
    for dtype in (torch.float32, torch.bfloat16):
        out = orthogonalize(torch.empty(*shape, device="meta"), algorithm=algorithm, dtype=dtype)
        assert out.shape == shape and out.device.type == "meta" and out.dtype == dtype


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (3, 64, 224), (96, 96), (601, 1500), (2, 1024, 512)])
@pytest.mark.parametrize("steps", [1, 3, 5, 7])
def test_flops_match_counted_matmuls(shape, steps):
    """newton_schulz_flops equals what torch's FlopCounterMode counts in the actual run (on meta:
    no values), with and without the symmetric block split (odd sides included)."""
    for algorithm in ("standard", "gram"):
        with FlopCounterMode(display=False) as counter:
            orthogonalize(torch.empty(*shape, device="meta"), steps, algorithm=algorithm)
        batch = shape[0] if len(shape) == 3 else 1
        assert counter.get_total_flops() == batch * newton_schulz_flops(*shape[-2:], steps, algorithm), algorithm


def test_gram_flop_ratios():
    """Without the split (m < SYMMETRIC_SPLIT_MIN): 8m²n + 28m³ vs 20m²n + 10m³ for 5 steps, equal at
    n = 1.5m. With it the symmetric products cost 3/4: 7m²n + 21m³."""
    ratio = lambda m, n: newton_schulz_flops(m, n, 5, "gram") / newton_schulz_flops(m, n, 5)
    assert ratio(256, 256) == pytest.approx(36 / 30) and ratio(256, 384) == pytest.approx(1.0) and ratio(256, 1024) == pytest.approx(60 / 90)
    assert ratio(1024, 1024) == pytest.approx(28 / 30) and ratio(1024, 3584) == pytest.approx((7 * 3.5 + 21) / 80)
    with pytest.raises(ValueError, match="resolved algorithm"):
        newton_schulz_flops(64, 64, 5, "auto")


def test_gram_segments():
    for steps in range(12):
        runs = gram_segments(steps)
        assert sum(runs) == steps and all(1 <= r <= GRAM_MAX_RUN for r in runs) and list(runs) == sorted(runs)
        assert len(runs) == math.ceil(steps / GRAM_MAX_RUN)
    assert gram_segments(5) == (2, 3)


def test_resolve_algorithm():
    mlp, attention = (1024, 3584), (1024, 1024)
    assert resolve_algorithm(*mlp, torch.float32, "cpu") == resolve_algorithm(*mlp[::-1], torch.float32, "cpu") == "gram"
    assert resolve_algorithm(*mlp, torch.bfloat16, "cuda") == "gram"
    assert resolve_algorithm(*attention, torch.float32, "cpu") == resolve_algorithm(*attention, torch.bfloat16, "cuda") == "standard"
    assert resolve_algorithm(*mlp, torch.bfloat16, "cpu") == resolve_algorithm(*mlp, torch.float32, "meta") == "gram"
    assert resolve_algorithm(GRAM_MIN_SIDE - 1, 8 * GRAM_MIN_SIDE, torch.float32, "cpu") == "standard"
    side = 256
    assert resolve_algorithm(side, math.ceil(GRAM_MIN_ASPECT * side), torch.float32, "cpu") == "gram"
    assert resolve_algorithm(side, math.ceil(GRAM_MIN_ASPECT * side) - 1, torch.float32, "cpu") == "standard"


def test_auto_runs_the_resolved_algorithm():
    for shape in [(64, 256), (96, 96), (2, 256, 64)]:
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(6))
        chosen = resolve_algorithm(*shape[-2:], torch.float32, "cpu")
        assert torch.equal(orthogonalize(g, algorithm="auto"), orthogonalize(g, algorithm=chosen))
    with pytest.raises(ValueError, match="unknown Newton-Schulz algorithm"):
        orthogonalize(torch.ones(4, 8), algorithm="fast")


def test_gram_zero_matrix_stays_zero():
    assert orthogonalize(torch.zeros(2, 8, 32), algorithm="gram").abs().max() == 0
