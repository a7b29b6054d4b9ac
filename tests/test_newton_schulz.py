import functools
import math

import pytest
import torch
from reference import reference_ns
from torch.utils.flop_counter import FlopCounterMode

from titan_muon.algorithm import newton_schulz
from titan_muon.algorithm.newton_schulz import (
    FP16_PEAK_LIMIT,
    GRAM_MAX_RUN,
    GRAM_MIN_ASPECT,
    GRAM_MIN_SIDE,
    GRAM_ACCELERATOR_SHAPES,
    NS_ALGORITHMS,
    SYMMETRIC_KERNEL_MIN,
    NSPrecision,
    coefficient_schedule,
    gram_iterations,
    gram_segments,
    half_precision_peak,
    newton_schulz_flops,
    orthogonalize,
    resolve_algorithm,
    workspace_bytes,
)
from titan_muon.algorithm.newton_schulz import Pieces
from titan_muon.algorithm.orthogonalizer import Orthogonalizer
from titan_muon.buffers import ALIGNMENT, Arena, FreshBuffers
from titan_muon.settings import auto_comm_dtype, resolve_ns_precision

HALF = torch.float16


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (64, 64), (3, 256)])
def test_matches_plain_quintic(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    # The polynomial fused into addmm vs evaluated term by term: fp32 rounding (~1e-7) of
    # entries <= 1.2, times NS's gain on a full-rank random matrix (~20).
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
        # Equal on CPU (one 2-D GEMM per matrix either way); a batched GEMM may block its sums
        # otherwise (GPU): fp32 rounding times NS's gain, as above.
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


def metrics_within(gram, std, polar, slack):
    """‖O Oᵀ − I‖₂ and ‖O − U Vᵀ‖₂ are Lipschitz in O with constants ‖O‖ + ‖O'‖ ≤ 2.5 and 1, so
    gram's may exceed standard's by at most those times ‖O_gram − O_std‖ ≤ slack."""
    assert orthogonality_error(gram) <= orthogonality_error(std) + 2.5 * slack
    assert spectral(gram.double() - polar) <= spectral(std.double() - polar) + slack


def sample_matrix(shape, kind, seed):
    if kind == "gaussian":
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return low_rank(*shape, seed)


def rounds_like_standard(gram, std, target, dtype):
    """Gram's rounding error against standard's on the same input, which carries the input's
    conditioning (an a priori bound is ~10 in bf16, vacuous).

    Frobenius norm (all singular directions): ≤ 2x. Over 5 steps gram rounds 20 products to
    standard's 15 (1.15x in quadrature, 1.33x added up), and its accumulated Q is rounded at the
    scale of its largest eigenvalue, not of the output; 2x allows for that. Measured ≤ 1.7x
    (bf16, Polar Express, Gaussian; 1.0-1.15x on low-rank inputs). Spectral norm (the worst
    single direction, which can carry more than the average): ≤ 3x, measured ≤ 2.3x. Both
    + 4 eps, for inputs that standard happens to round exactly."""
    eps = torch.finfo(dtype).eps
    gram_error, std_error = gram.double() - target, std.double() - target
    frobenius_ok = bool(gram_error.norm() <= 2 * std_error.norm() + 4 * eps)
    return frobenius_ok and spectral(gram_error) <= 3 * spectral(std_error) + 4 * eps


@pytest.fixture(params=["whole", "split"])
def symmetric_products(request, monkeypatch):
    """Run each accuracy test twice: symmetric products as one GEMM, and as three blocks (the
    split used from SYMMETRIC_SPLIT_MIN rows on, forced here on these small shapes)."""
    if request.param == "split":
        monkeypatch.setattr(newton_schulz, "SYMMETRIC_SPLIT_MIN", 16)
    return request.param


# Square, 1024x4096-like and 4096x14336-like scaled down (aspect 4 and 3.5), aspect 2, tall:
# Gaussian where "auto" can pick gram (aspect >= 2), low-rank (gradient-like) at every shape.
ACCURACY_CASES = [(s, "gaussian") for s in [(64, 128), (64, 256), (64, 224), (224, 64)]]
ACCURACY_CASES += [(s, "low_rank") for s in [(96, 96), (64, 256), (64, 224), (224, 64)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("method", ["keller", "polar_express"])
def test_gram_is_as_accurate_as_standard(dtype, method, symmetric_products):
    """Rounding error (distance to U f(S) Vᵀ, the float64 SVD with the same polynomial) like
    standard's, hence the brief's measures (orthogonality, distance to U Vᵀ) as good up to it."""
    for i, (shape, kind) in enumerate(ACCURACY_CASES):
        g = sample_matrix(shape, kind, 10 + i)
        polar, target = exact_targets(g, method)
        std, gram = (orthogonalize(g, 5, method, dtype, algorithm=a) for a in ("standard", "gram"))
        assert gram.dtype == dtype and gram.shape == g.shape
        assert rounds_like_standard(gram, std, target, dtype), (shape, kind)
        metrics_within(gram, std, polar, spectral(gram.double() - target) + spectral(std.double() - target))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_square_gaussian_is_the_documented_exception(dtype):
    """A square Gaussian matrix has singular values down to ~0: in the last 3-step run Q spans
    1 .. a³ while most directions have converged, and Q's rounding lands on those. Gram's rounding
    error is then 6-15x standard's (docs/newton_schulz.md, Limitations). Asserted: worse but
    bounded (≤ 20x), and "auto" never picks gram on square matrices."""
    g = sample_matrix((96, 96), "gaussian", 10)
    _, target = exact_targets(g, "keller")
    std, gram = (orthogonalize(g, 5, "keller", dtype, algorithm=a) for a in ("standard", "gram"))
    assert spectral(gram.double() - target) <= 20 * spectral(std.double() - target)
    assert resolve_algorithm(96, 96, dtype, "cpu") == resolve_algorithm(4096, 4096, dtype, "cuda") == "standard"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_bound_catches_gram_without_restarts(dtype):
    """One 5-step run (no restart) lets rounding in the Gram matrix's small eigenvalues grow by a²
    per step, in fp16 as in bf16 (measured: 30-40x standard's error); the bound above must reject
    it, or it proves nothing."""
    g = low_rank(64, 224, 0)
    _, target = exact_targets(g, "keller")
    x = (g / g.norm()).to(dtype)
    unrestarted = gram_iterations(x, coefficient_schedule("keller", 5), (5,), torch.empty_like(x), FreshBuffers(x.device))
    assert not rounds_like_standard(unrestarted, orthogonalize(g, 5, "keller", dtype), target, dtype)


@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (3, 40, 140), (2, 140, 40)])
@pytest.mark.parametrize("method", ["keller", "polar_express", (2.0, -1.5, 0.5)])
def test_gram_rounds_like_standard_on_batches_and_any_coefficients(shape, method):
    """Batches, tall and wide, every coefficient schedule (fp32): each matrix as above."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    std, gram = orthogonalize(g, 5, method), orthogonalize(g, 5, method, algorithm="gram")
    assert gram.shape == g.shape
    for k in range(g.size(0) if g.ndim == 3 else 1):
        one = g[k] if g.ndim == 3 else g
        _, target = exact_targets(one, method)
        pick = (lambda t: t[k]) if g.ndim == 3 else (lambda t: t)
        assert rounds_like_standard(pick(gram), pick(std), target, torch.float32), k


@pytest.mark.parametrize("algorithm", NS_ALGORITHMS)
@pytest.mark.parametrize("shape", [(3, 64, 256), (3, 256, 64), (64, 256), (256, 64)])
def test_every_algorithm_runs_on_meta(algorithm, shape):
    """Shapes only: no host reads, no data-dependent branches (meta tensors have no values)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = orthogonalize(torch.empty(*shape, device="meta"), algorithm=algorithm, dtype=dtype)
        assert out.shape == shape and out.device.type == "meta" and out.dtype == dtype


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (3, 64, 224), (96, 96), (601, 1500), (2, 1024, 512)])
@pytest.mark.parametrize("steps", [1, 3, 5, 7])
def test_flops_match_counted_matmuls(shape, steps):
    """newton_schulz_flops equals what torch's FlopCounterMode counts in the actual run (on meta:
    no values), with and without the symmetric block split (odd sides included)."""
    for algorithm, dtype in [("standard", torch.float32), ("gram", torch.float32), ("gram", HALF)]:
        with FlopCounterMode(display=False) as counter:
            orthogonalize(torch.empty(*shape, device="meta"), steps, algorithm=algorithm, dtype=dtype)
        batch = shape[0] if len(shape) == 3 else 1
        assert counter.get_total_flops() == batch * newton_schulz_flops(*shape[-2:], steps, algorithm, dtype, "meta"), algorithm


def test_gram_flop_ratios():
    """Without the split (m < SYMMETRIC_SPLIT_MIN): 8m²n + 28m³ vs 20m²n + 10m³ for 5 steps, equal at
    n = 1.5m. With it all but Q X and the 3 products into Q cost 3/4: 7m²n + 22.5m³."""
    ratio = lambda m, n: newton_schulz_flops(m, n, 5, "gram") / newton_schulz_flops(m, n, 5)
    assert ratio(256, 256) == pytest.approx(36 / 30) and ratio(256, 384) == pytest.approx(1.0) and ratio(256, 1024) == pytest.approx(60 / 90)
    assert ratio(1024, 1024) == pytest.approx(29.5 / 30) and ratio(1024, 3584) == pytest.approx((7 * 3.5 + 22.5) / 80)
    with pytest.raises(ValueError, match="resolved algorithm"):
        newton_schulz_flops(64, 64, 5, "auto")


def test_gram_segments():
    for steps in range(12):
        runs = gram_segments(steps)
        assert sum(runs) == steps and all(1 <= r <= GRAM_MAX_RUN for r in runs) and list(runs) == sorted(runs)
        assert len(runs) == math.ceil(steps / GRAM_MAX_RUN)
    assert gram_segments(5) == gram_segments(5, torch.bfloat16) == (2, 3)
    for steps in range(12):  # fp16: runs of at most 2, longest first (the last run short)
        runs = gram_segments(steps, HALF)
        assert sum(runs) == steps and all(1 <= r <= 2 for r in runs) and list(runs) == sorted(runs, reverse=True)
        assert len(runs) == math.ceil(steps / 2)
    assert gram_segments(5, HALF) == (2, 2, 1)


def test_resolve_algorithm():
    mlp, attention = (1024, 3584), (1024, 1024)
    assert resolve_algorithm(*mlp, torch.float32, "cpu") == resolve_algorithm(*mlp[::-1], torch.float32, "cpu") == "gram"
    assert resolve_algorithm(*attention, torch.float32, "cpu") == resolve_algorithm(*attention, torch.bfloat16, "cuda") == "standard"
    # never Gram in bf16, whatever the shape (its error grows with the short side: resolve_algorithm)
    for shape in (mlp, (4096, 14336), (7168, 2048)):
        assert resolve_algorithm(*shape, torch.bfloat16, "cuda") == resolve_algorithm(*shape, torch.bfloat16, "cpu") == "standard"
    # GPUs (and meta, standing in for them): Gram from a short side of 2048 at aspect 2.5, or 1536 at
    # 3.5 (measured on an H100), so Llama-3 8B's MLP, DeepSeek-V3's experts and its 1536 x 7168 query
    # down-projection, not GQA k/v (1024 x 4096) or Qwen3's experts (768 x 2048)
    assert GRAM_ACCELERATOR_SHAPES == ((2048, 2.5), (1536, 3.5))
    for shape in ((4096, 14336), (14336, 4096), (7168, 2048), (2048, 5120), (1536, 7168), (1536, 5376)):
        assert resolve_algorithm(*shape, HALF, "cuda") == resolve_algorithm(*shape, torch.float32, "meta") == "gram"
    for shape in (mlp, (1024, 4096), (768, 2048), (2047, 5118), (1536, 5375), (1535, 8192)):
        assert resolve_algorithm(*shape, HALF, "cuda") == resolve_algorithm(*shape, torch.float32, "meta") == "standard"
        assert resolve_algorithm(*shape, torch.float32, "cpu") == "gram"
    assert resolve_algorithm(4096, 4096, HALF, "cuda") == "standard"
    assert resolve_algorithm(GRAM_MIN_SIDE - 1, 8 * GRAM_MIN_SIDE, torch.float32, "cpu") == "standard"
    side = 256
    assert resolve_algorithm(side, math.ceil(GRAM_MIN_ASPECT * side), torch.float32, "cpu") == "gram"
    assert resolve_algorithm(side, math.ceil(GRAM_MIN_ASPECT * side) - 1, torch.float32, "cpu") == "standard"


def test_auto_runs_the_resolved_algorithm():
    for shape in [(128, 512), (96, 96), (2, 512, 128)]:
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(6))
        chosen = resolve_algorithm(*shape[-2:], torch.float32, "cpu")
        assert torch.equal(orthogonalize(g, algorithm="auto"), orthogonalize(g, algorithm=chosen))
    with pytest.raises(ValueError, match="unknown Newton-Schulz algorithm"):
        orthogonalize(torch.ones(4, 8), algorithm="fast")


def test_gram_zero_matrix_stays_zero():
    assert orthogonalize(torch.zeros(2, 8, 32), algorithm="gram").abs().max() == 0


# ---- Gram Newton–Schulz in fp16 ------------------------------------------------------------


HALF_CASES = [c for c in ACCURACY_CASES if c[0] != (96, 96)]  # where "auto" can pick gram


@pytest.mark.parametrize("method", ["keller", "polar_express"])
def test_fp16_gram_equals_fp32_gram_within_fp16_rounding(method):
    """fp16 and bf16 runs do the same operations with the same error gains, and in both the GEMMs
    accumulate in fp32 (CPU and tensor cores) and round only what they store. To first order the
    rounding error is therefore proportional to the unit roundoff: fp16's 2^-11 against bf16's
    2^-8, 1/8 (fp32's 2^-24 adds nothing visible). Allowed: 2/8 of bf16 Gram's distance from fp32
    Gram, the 2 for two independent realizations of random rounding. Measured: 0.09-0.14."""
    for i, (shape, kind) in enumerate(HALF_CASES):
        g = sample_matrix(shape, kind, 10 + i)
        fp32, bf16, fp16 = (orthogonalize(g, 5, method, d, algorithm="gram").double() for d in (torch.float32, torch.bfloat16, HALF))
        assert (fp16 - fp32).norm() <= 2 / 8 * (bf16 - fp32).norm(), (shape, kind)


@pytest.mark.parametrize("method", ["keller", "polar_express"])
def test_fp16_gram_is_more_accurate_than_standard_bf16(method):
    """The criterion for letting "auto" use it: fp16 Gram NS's rounding error (distance to
    U f(S) Vᵀ) is at most standard bf16 NS's. Expected ≤ 2/8 of it: ≤ 2x standard's in the same
    dtype (rounds_like_standard) times the unit-roundoff ratio 1/8. Measured: 0.10-0.22."""
    for i, (shape, kind) in enumerate(HALF_CASES):
        g = sample_matrix(shape, kind, 10 + i)
        _, target = exact_targets(g, method)
        gram16 = orthogonalize(g, 5, method, HALF, algorithm="gram").double()
        standard_bf16 = orthogonalize(g, 5, method, torch.bfloat16, algorithm="standard").double()
        assert (gram16 - target).norm() <= 2 / 8 * (standard_bf16 - target).norm(), (shape, kind)


def test_fp16_scales_in_fp32_before_rounding():
    """A momentum of 1e-9 underflows fp16 (smallest subnormal 6e-8) and a sum of squares of 1e4
    entries overflows it: both must orthogonalize as in fp32."""
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
    reference = orthogonalize(g, algorithm="gram")
    for scale in (1e-9, 1e4):
        out = orthogonalize(g * scale, dtype=HALF, algorithm="gram")
        assert out.dtype == HALF and torch.isfinite(out).all()
        # fp16 rounding as in the test above: well under bf16's ~0.1 Frobenius error here
        assert (out.double() - reference.double()).norm() < 0.05


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 7, 10])
def test_fp16_intermediates_stay_in_range(steps, monkeypatch):
    """half_precision_peak bounds every stored intermediate: checked against the largest entry each
    product really stores (fp32, so nothing saturates), on inputs that reach the peaks: low-rank
    (many σ near 0, where Q peaks), Gaussian, and column scales spanning 1e6. Keller and Polar
    Express stay far below FP16_PEAK_LIMIT."""
    largest = [0.0]

    def recording(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            largest[0] = max(largest[0], out.abs().max().item())
            return out
        return wrapped

    monkeypatch.setattr(newton_schulz, "_addmm", recording(newton_schulz._addmm))
    monkeypatch.setattr(newton_schulz, "_symmetric_addmm", recording(newton_schulz._symmetric_addmm))
    fp16_runs = functools.partial(gram_segments, dtype=HALF)  # fp16's restarts, in fp32 arithmetic
    monkeypatch.setattr(newton_schulz, "gram_segments", lambda steps, dtype=None: fp16_runs(steps))
    inputs = [low_rank(64, 224, 1), sample_matrix((64, 224), "gaussian", 2), torch.randn(64, 224) * torch.logspace(0, -6, 224)]
    for method in ("keller", "polar_express"):
        for algorithm in ("standard", "gram"):
            largest[0] = 0.0
            for g in inputs:
                orthogonalize(g, steps, method, algorithm=algorithm)
            peak = half_precision_peak(method, steps, algorithm)
            # the grid of 4097 σ misses a peak by at most its slope times half a grid step: < 1 %
            assert largest[0] <= 1.01 * peak <= FP16_PEAK_LIMIT, (method, algorithm, largest[0], peak)


def test_fp16_refuses_coefficients_that_could_overflow():
    wild = (400.0, -900.0, 500.0)  # Q's eigenvalues near σ = 0 reach 400³ in a 3-step run
    assert half_precision_peak(wild, 5, "gram") > FP16_PEAK_LIMIT
    with pytest.raises(ValueError, match="fp16"):
        orthogonalize(torch.randn(8, 32), 5, wild, HALF, algorithm="gram")


# The device type is a string in the rule, so the CUDA branch runs here: an Orthogonalizer built
# for torch.device("cuda") never touches the device until it is given tensors.
MLP, SQUARE, SMALL = (1024, 3584), (1024, 1024), (64, 256)
LLAMA_8B_MLP = (4096, 14336)  # Gram on GPUs too (GRAM_ACCELERATOR_SHAPES)


def _group(**overrides):
    return dict(dict(ns_algorithm="auto", ns_steps=5, ns_coefficients="keller", ns_eps=1e-7, adjust_lr_fn=None, lr=0.1, weight_decay=0.1), **overrides)


def test_auto_precision_per_device_and_shape():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto_cuda = resolve_ns_precision("auto", cuda)
    assert auto_cuda == NSPrecision(torch.bfloat16, HALF) and resolve_ns_precision("auto", cpu) == NSPrecision(torch.float32, torch.float32)
    plan = lambda setting, device, shape, **g: Orthogonalizer(lambda: [], resolve_ns_precision(setting, device), device).plan(_group(**g), *shape)
    # auto on CUDA: fp16 Gram where the shape rule picks Gram, standard bf16 elsewhere
    assert plan("auto", cuda, LLAMA_8B_MLP) == plan("auto", cuda, LLAMA_8B_MLP[::-1]) == ("gram", HALF)
    assert plan("auto", cuda, SQUARE) == plan("auto", cuda, SMALL) == plan("auto", cuda, MLP) == ("standard", torch.bfloat16)
    assert plan("auto", cuda, SQUARE, ns_algorithm="gram") == ("gram", HALF)  # forced Gram: fp16, never bf16
    assert plan("auto", cuda, MLP, ns_algorithm="standard") == ("standard", torch.bfloat16)
    # CPU keeps fp32 and today's rule
    assert plan("auto", cpu, MLP) == ("gram", torch.float32) and plan("auto", cpu, SQUARE) == ("standard", torch.float32)
    # explicit dtypes: bf16 as before (never Gram under auto), fp16 everywhere
    assert plan("bf16", cuda, MLP) == ("standard", torch.bfloat16) and plan("bf16", cuda, MLP, ns_algorithm="gram") == ("gram", torch.bfloat16)
    assert plan("fp16", cuda, LLAMA_8B_MLP) == ("gram", HALF) and plan("fp16", cuda, SQUARE) == plan("fp16", cuda, MLP) == ("standard", HALF)
    # a schedule that could overflow fp16 runs in bf16 (same width, fp32's range)
    assert plan("auto", cuda, LLAMA_8B_MLP, ns_coefficients=(400.0, -900.0, 500.0)) == ("gram", torch.bfloat16)
    # the wire: fp32 with fp32 NS, bf16 otherwise (unscaled matrices need bf16's range)
    assert [auto_comm_dtype(resolve_ns_precision(s, cuda)) for s in ("auto", "fp32", "bf16", "fp16")] == [
        torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
    with pytest.raises(ValueError, match="ns_dtype='fp8'"):
        resolve_ns_precision("fp8", cpu)


class _Work:
    ns_flops, update_numel = 0, 0

    def __init__(self, device="meta"):
        self.update_sq = torch.zeros((), device=device)


@pytest.mark.parametrize("shape", [MLP, SQUARE, (3, 256, 896), (2048, 5120), (2, 7680, 3072)])
def test_flops_match_what_the_orthogonalizer_runs_for_cuda(shape):
    """The plan balances owners on Orthogonalizer.flops and muon/ns_flops adds what each call ran:
    both must equal the FLOPs of the algorithm and dtype the CUDA rule picks, counted on meta."""
    from titan_muon.timing import StepTimer

    rows, cols = shape[-2:]
    batch = torch.empty(*((1,) + shape if len(shape) == 2 else shape), device="meta")
    ns = Orthogonalizer(lambda: [_group()], resolve_ns_precision("auto", torch.device("cuda")), torch.device("cuda"))
    work = _Work()
    with FlopCounterMode(display=False) as counter:
        out = ns(((rows, cols), 0), batch, StepTimer(torch.device("meta")), work)
    assert out.shape == batch.shape and out.device.type == "meta"
    counted = counter.get_total_flops()  # matmuls only: norms and scaling are not counted
    assert counted == work.ns_flops == batch.size(0) * ns.flops(_group(), rows, cols)
    algorithm, dtype = ns.plan(_group(), rows, cols)
    # nothing besides NS's own (the update's norm, muon/update_rms, is the commit's: commit.apply_updates)
    assert ns.workspace_bytes(((rows, cols), 0), batch.size(0)) == workspace_bytes(batch.size(0), rows, cols, algorithm, dtype, "meta")


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, HALF], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["fp32-in", "bf16-in"])
def test_workspace_bytes_are_what_is_alive(algorithm, dtype, input_dtype):
    """workspace_bytes plus the result is the peak of the storages orthogonalize() allocates,
    counted from its allocations, to the byte; reserved=True is what the same call cuts from an
    Arena (its high water), short only of the last cut's rounding up to the alignment; the Arena
    is given back whole and the results are the same bits. On square, wide, tall,
    symmetric-split (>= 512 rows) and batched inputs (a batch runs one matrix at a time on CPU)."""
    from live_bytes import LiveBytes

    orthogonalize(torch.randn(8, 8).to(input_dtype), dtype=dtype, algorithm=algorithm)  # first calls allocate caches
    for shape in [(64, 64), (128, 512), (512, 128), (300, 640), (512, 1024), (1024, 600), (3, 64, 96), (2, 600, 700)]:
        m = torch.randn(*shape).to(input_dtype)
        with LiveBytes() as live:
            fresh = orthogonalize(m, 5, "keller", dtype, algorithm=algorithm)
        batch = shape[0] if len(shape) == 3 else 1
        charged = workspace_bytes(batch, *shape[-2:], algorithm, dtype, "cpu") + fresh.numel() * fresh.element_size()
        # CPUs have no fp16 GEMM: torch's CPU kernel computes it in an fp32 buffer of its own, which
        # only exists there (GPUs multiply fp16 natively), so in fp16 the peak exceeds the charge
        if dtype == HALF:
            assert live.peak >= charged, (shape, live.peak, charged)
        else:
            assert live.peak == charged, (shape, live.peak, charged)
        arena = Arena(torch.empty(64 << 20, dtype=torch.uint8))
        cut = orthogonalize(m, 5, "keller", dtype, algorithm=algorithm, out=torch.empty_like(fresh), buffers=arena)
        reserved = workspace_bytes(batch, *shape[-2:], algorithm, dtype, "cpu", reserved=True)
        assert reserved - ALIGNMENT < arena.high_water <= reserved and arena.offset == 0, (shape, arena.high_water, reserved)
        assert torch.equal(cut, fresh)


# ---- results written into blocks (a return buffer's pieces) --------------------------------


def _cut(rows: int, cols: int, row_cuts: list[int], col_cuts: list[int], dtype=torch.float32):
    """Rectangles of a (rows, cols) matrix, each a contiguous view of one flat buffer (as a return
    buffer's pieces are), and the function that puts the buffer back together as a matrix."""
    rects = [((r0, r1), (c0, c1)) for r0, r1 in zip([0, *row_cuts], [*row_cuts, rows]) for c0, c1 in zip([0, *col_cuts], [*col_cuts, cols])]
    flat, offset, blocks = torch.empty(rows * cols, dtype=dtype), 0, []
    for (r0, r1), (c0, c1) in reversed(rects):  # not in matrix order: blocks may lie anywhere
        size = (r1 - r0) * (c1 - c0)
        blocks.append(((r0, r1), (c0, c1), flat[offset : offset + size].view(r1 - r0, c1 - c0)))
        offset += size

    def whole() -> torch.Tensor:
        out = torch.empty(rows, cols, dtype=dtype)
        for (r0, r1), (c0, c1), view in blocks:
            out[r0:r1, c0:c1] = view
        return out

    return blocks, whole


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("steps", [0, 1, 2, 5])
@pytest.mark.parametrize("shape", [(96, 224), (224, 96), (64, 64), (600, 200)])
def test_results_written_into_blocks_equal_the_whole_result(algorithm, steps, shape):
    """out=Blocks: each rectangle is its own last product (its rows of the left factor times its
    columns of the right), written where it belongs; every earlier product is the same as for a
    whole `out`, so the blocks hold the whole result up to the last GEMM's rounding: a BLAS may
    sum a dot product of k ≤ 224 terms in another order for another row or column count, fp32
    rounding of about sqrt(k)·2⁻²⁴ ≈ 1e-6 relative to entries of magnitude ≤ 1.5 (the scale)
    — hence 1e-5. Steps 0 and 2 (and Gram's even count of runs at 5) end in a copy instead.
    `spare` (here the input itself, read first) holds the iterates; the input's values are then spent."""
    rows, cols = shape
    g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(11))
    whole = orthogonalize(g, steps, "keller", algorithm=algorithm, scale=1.5)
    for row_cuts, col_cuts in [([rows // 3, rows // 2], []), ([], [cols // 4]), ([rows // 2], [cols // 3])]:
        blocks, assembled = _cut(rows, cols, row_cuts, col_cuts)
        returned = orthogonalize(g, steps, "keller", algorithm=algorithm, scale=1.5, out=blocks)
        assert returned is blocks
        torch.testing.assert_close(assembled(), whole, rtol=1e-5, atol=1e-6)
        blocks, assembled = _cut(rows, cols, row_cuts, col_cuts)
        spent = g.clone()
        orthogonalize(spent, steps, "keller", algorithm=algorithm, scale=1.5, out=blocks, spare=spent)
        torch.testing.assert_close(assembled(), whole, rtol=1e-5, atol=1e-6)
    # a batch: one Blocks per matrix
    pair = torch.stack([g, g.flip(0)])
    cuts = [_cut(rows, cols, [rows // 2], [cols // 3]) for _ in range(2)]
    orthogonalize(pair, steps, "keller", algorithm=algorithm, scale=1.5, out=[blocks for blocks, _ in cuts], spare=pair.clone())
    for (_, assembled), expected in zip(cuts, orthogonalize(pair, steps, "keller", algorithm=algorithm, scale=1.5)):
        torch.testing.assert_close(assembled(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(96, 224), (224, 96), (600, 200)])
def test_pieces_read_where_they_lie_equal_the_whole_input(algorithm, shape):
    """matrix=Pieces: the norm is the norm of the pieces' norms and each piece is scaled into its
    rectangle of the iterate; the rest is the same as for the whole matrix. The two norms differ
    by fp32 rounding of a sum taken in another order (≤ a few 2⁻²⁴ relative), which the
    contracting iteration carries to the result at about the same size — hence 1e-5 / 1e-6 as
    above. Pieces of whole rows (FSDP, EP) give the same bits wherever they lie: in a buffer of
    their own (arrived) or as views of a matrix (an input the owner made: overlap), which is what
    keeps overlap and no overlap bit for bit the same; a column piece (tensor parallel) is strided
    inside a matrix, and its norm may be summed in another order there."""
    rows, cols = shape
    g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(13))
    whole = orthogonalize(g, 5, "keller", algorithm=algorithm)
    for row_cuts, col_cuts in [([rows // 3], []), ([], [cols // 2]), ([rows // 2], [cols // 4])]:
        arrived, _ = _cut(rows, cols, row_cuts, col_cuts)
        for (r0, r1), (c0, c1), view in arrived:
            view.copy_(g[r0:r1, c0:c1])
        made = [(rows_, cols_, g[rows_[0] : rows_[1], cols_[0] : cols_[1]]) for rows_, cols_, _ in arrived]
        from_buffer = orthogonalize(Pieces(shape, arrived), 5, "keller", algorithm=algorithm)
        torch.testing.assert_close(from_buffer, whole, rtol=1e-5, atol=1e-6)
        from_views = orthogonalize(Pieces(shape, made), 5, "keller", algorithm=algorithm)
        if not col_cuts:  # contiguous in both places
            assert torch.equal(from_views, from_buffer)
        else:  # a column piece of a matrix is strided there: its norm may be summed in another order
            torch.testing.assert_close(from_views, from_buffer, rtol=1e-5, atol=1e-6)
        blocks, assembled = _cut(rows, cols, row_cuts, col_cuts)  # pieces in, blocks out: nothing whole
        orthogonalize(Pieces(shape, arrived), 5, "keller", algorithm=algorithm, out=blocks)
        torch.testing.assert_close(assembled(), whole, rtol=1e-5, atol=1e-6)


def test_blocks_are_checked_before_anything_is_written():
    g = torch.randn(32, 48)
    blocks, _ = _cut(32, 48, [16], [])
    with pytest.raises(ValueError, match="cover 768 of the 1536"):
        orthogonalize(g, out=blocks[:1])
    with pytest.raises(ValueError, match=r"block \(16:32, 0:48\) of a \(32, 48\) matrix cannot be a \(16, 48\) torch.bfloat16"):
        orthogonalize(g, out=_cut(32, 48, [16], [], torch.bfloat16)[0])
    with pytest.raises(ValueError, match="a batch of 2 matrices needs as many Blocks"):
        orthogonalize(torch.randn(2, 32, 48), out=[blocks])
    with pytest.raises(ValueError, match="spare must be a contiguous"):
        orthogonalize(g, out=blocks, spare=torch.empty(48, 32))
    with pytest.raises(ValueError, match="pieces cover 768 of the 1536"):
        orthogonalize(Pieces((32, 48), blocks[:1]))
    with pytest.raises(ValueError, match="cannot read it as Pieces"):
        orthogonalize(Pieces((32, 48), _cut(32, 48, [16], [], HALF)[0]), dtype=HALF)


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_workspace_bytes_with_blocks_are_what_is_alive(algorithm, dtype):
    """Written into blocks, orthogonalize() allocates its workspace and, without a `spare`, the
    iterates' second buffer (workspace_bytes(spare=True)); with one, just the workspace; and an
    Arena's high water is the reserved figure, as for a whole result."""
    from live_bytes import LiveBytes

    orthogonalize(torch.randn(8, 8), dtype=dtype, algorithm=algorithm)  # first calls allocate caches
    for rows, cols in [(64, 64), (128, 512), (512, 128), (300, 640)]:
        m = torch.randn(rows, cols).to(dtype)
        for given in (None, torch.empty(rows, cols, dtype=dtype)):
            blocks, _ = _cut(rows, cols, [rows // 2], [], dtype)
            with LiveBytes() as live:
                orthogonalize(m, 5, "keller", dtype, algorithm=algorithm, out=blocks, spare=given)
            charged = workspace_bytes(1, rows, cols, algorithm, dtype, "cpu", spare=given is None)
            assert live.peak == charged, (rows, cols, given is None, live.peak, charged)
            arena = Arena(torch.empty(64 << 20, dtype=torch.uint8))
            orthogonalize(m, 5, "keller", dtype, algorithm=algorithm, out=blocks, spare=given, buffers=arena)
            reserved = workspace_bytes(1, rows, cols, algorithm, dtype, "cpu", reserved=True, spare=given is None)
            assert reserved - ALIGNMENT < arena.high_water <= reserved and arena.offset == 0, (rows, cols, arena.high_water, reserved)


def test_blocks_are_written_on_cpu_in_the_wire_dtype_only():
    """Orthogonalizer.writes_blocks: on a CPU when NS computes in the dtype the results travel in;
    never on GPUs (meta stands in), where a batch's last product stays one batched GEMM. Inputs
    are read as Pieces wherever results are written into blocks, except in fp16."""
    cpu = Orthogonalizer(lambda: [_group()], resolve_ns_precision("auto", torch.device("cpu")), torch.device("cpu"))
    key = ((64, 96), 0)
    assert cpu.writes_blocks(key, torch.float32) and not cpu.writes_blocks(key, torch.bfloat16)
    assert cpu.reads_pieces(key, torch.float32) and not cpu.reads_pieces(key, torch.bfloat16)
    half = Orthogonalizer(lambda: [_group()], resolve_ns_precision("fp16", torch.device("cpu")), torch.device("cpu"))
    assert half.writes_blocks(key, HALF) and not half.reads_pieces(key, HALF)  # fp16 NS scales its input in fp32
    meta = Orthogonalizer(lambda: [_group()], resolve_ns_precision("fp32", torch.device("meta")), torch.device("meta"))
    assert not meta.writes_blocks(key, torch.float32)


# ---- optional symmetric GEMM kernels ------------------------------------------------------


def test_symmetric_kernel_detection(monkeypatch):
    """Detected once per device: only on CUDA devices of compute capability 9.x / 10.x and only
    when the package imports; the CPU path never looks."""
    stand_in = object()
    detect = newton_schulz.symmetric_gemm_kernel
    monkeypatch.setattr(newton_schulz, "_import_symmetric_gemm", lambda: stand_in)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, expected in [((9, 0), stand_in), ((10, 0), stand_in), ((8, 0), None), ((12, 0), None)]:
        detect.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, c=capability: c)
        assert detect("cuda", 0) is expected and detect("cpu", None) is None
    detect.cache_clear()
    monkeypatch.setattr(newton_schulz, "_import_symmetric_gemm", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    assert detect("cuda", 0) is None  # package missing
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: pytest.fail("detected twice"))
    assert detect("cuda", 0) is None  # cached
    detect.cache_clear()


def test_symmetric_kernel_import_is_guarded(monkeypatch):
    """The import path: None without the package (this machine), the kernel with it."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "gram_newton_schulz", None)  # as if not installed
    assert newton_schulz._import_symmetric_gemm() is None
    kernel = lambda *args, **kwargs: None
    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm_symmetric = kernel
    monkeypatch.setitem(sys.modules, "gram_newton_schulz", types.ModuleType("gram_newton_schulz"))
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", interface)
    assert newton_schulz._import_symmetric_gemm() is kernel


def test_symmetric_kernel_dispatch_with_a_stand_in(monkeypatch):
    """With a kernel present, Gram NS sends its symmetric products of ≥ SYMMETRIC_KERNEL_MIN rows
    in half precision to it, with quack's gemm_symmetric arguments (C, alpha, beta), and nothing
    else. The stand-in computes alpha·A@B + beta·C as one torch GEMM, like the unsplit torch path
    below SYMMETRIC_SPLIT_MIN, so the results are bit-equal."""
    calls = []

    def stand_in(a, b, C=None, alpha=1.0, beta=1.0):
        assert isinstance(alpha, float) and isinstance(beta, float)
        calls.append(a.shape)
        return a @ b if C is None else torch.addmm(C, a, b, beta=beta, alpha=alpha)

    rows = SYMMETRIC_KERNEL_MIN
    g = torch.randn(rows, 3 * rows, generator=torch.Generator().manual_seed(8))
    without = orthogonalize(g, 5, "polar_express", HALF, algorithm="gram")
    monkeypatch.setattr(newton_schulz, "symmetric_gemm_kernel", lambda device_type, index: stand_in)
    with_kernel = orthogonalize(g, 5, "polar_express", HALF, algorithm="gram")
    assert torch.equal(with_kernel, without)
    # per run of L steps: X Xᵀ, L squares of G, 2(L − 1) halves of Gram updates
    assert len(calls) == sum(1 + length + 2 * (length - 1) for length in gram_segments(5, HALF))
    calls.clear()
    orthogonalize(g[: rows - 1], 5, "keller", HALF, algorithm="gram")  # below the kernel's tile
    orthogonalize(g, 5, "keller", torch.float32, algorithm="gram")  # no fp32 kernel
    orthogonalize(g, 5, "keller", HALF, algorithm="standard")  # standard NS stays as it is
    assert calls == []


def test_muon_step_with_fp16_ns():
    """The optimizer end to end with ns_dtype="fp16" on one process: the 128 × 512 matrix runs
    fp16 Gram NS, the 128 × 128 one standard fp16 NS, and comm_dtype "auto" is bf16. Against the
    all-fp32 update, by the triangle inequality the change is at most what the bf16 wire alone
    does (measured here with fp32 NS) plus fp16 NS's own rounding, which the tests above bound by
    2/8 of bf16 NS's (measured here with an fp32 wire)."""
    from torch import nn

    from titan_muon import Muon

    def update(ns_dtype, comm_dtype):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(128, 512)), nn.Parameter(torch.randn(128, 128))]
        before = [p.detach().clone() for p in params]
        opt = Muon(params, lr=0.1, ns_dtype=ns_dtype, comm_dtype=comm_dtype)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        return opt, [p.detach() - b for p, b in zip(params, before)]

    opt, fp16 = update("fp16", "auto")
    assert opt.comm_dtype == torch.bfloat16
    assert [opt.newton_schulz.plan(opt.param_groups[0], *p.shape) for p in opt.param_groups[0]["params"]] == [("gram", HALF), ("standard", HALF)]
    _, exact = update("fp32", "fp32")
    _, wire_only = update("fp32", "bf16")
    _, bf16_ns_only = update("bf16", "fp32")
    for k in range(2):
        distance = lambda u: (u[k] - exact[k]).norm()
        assert distance(fp16) <= distance(wire_only) + 2 / 8 * distance(bf16_ns_only), k


def test_batches_run_in_chunks_within_the_workspace_budget():
    """Orthogonalizer.chunks: consecutive, covering, even runs whose workspace stays within
    NS_CHUNK_BYTES, one matrix at least: 8 Llama-3 8B MLP matrices in fp16 Gram NS (464 MiB each)
    one at a time (272 MiB each), 100 GQA k/v matrices in bf16 standard NS (12 MiB each) in three runs."""
    from titan_muon.algorithm.orthogonalizer import NS_CHUNK_BYTES, Orthogonalizer

    ns = Orthogonalizer(lambda: [_group()], resolve_ns_precision("auto", torch.device("cuda")), torch.device("cuda"))
    for (rows, cols), count, expected in [((14336, 4096), 8, [1] * 8), ((1024, 4096), 100, [34, 34, 32]), ((64, 256), 5, [5])]:
        chunks = ns.chunks(((rows, cols), 0), count)
        assert [c.stop - c.start for c in chunks] == expected and chunks[0].start == 0 and chunks[-1].stop == count
        assert all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
        assert all(c.stop - c.start == 1 or ns.workspace_bytes(((rows, cols), 0), c.stop - c.start) <= NS_CHUNK_BYTES for c in chunks)


# ---- fp16 NS's normalization ---------------------------------------------------------------


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["fp32-in", "bf16-in"])
def test_fp16_normalization_in_registers_gives_the_staged_bits(input_dtype, monkeypatch):
    """fp16 NS off the CPU takes the norm of the input in fp32 and rounds the fp32 quotient into
    fp16 as it stores; on CPU the input is first copied into fp32 (stages_in_fp32). Forced onto
    the CPU, the in-register form is the same arithmetic (torch's CPU casts through temporaries
    holding the same fp32 values), so the results are the same bits; a GPU's reduction may sum
    in another order (last bits of the norm: tests/test_cuda.py)."""
    gen = torch.Generator().manual_seed(7)
    for shape in [(96, 64), (3, 64, 160)]:
        m = (torch.randn(*shape, generator=gen) * 1e-6).to(input_dtype)  # below fp16's normal range unscaled
        for algorithm in ("standard", "gram"):
            staged = orthogonalize(m, 5, "keller", HALF, algorithm=algorithm)
            with monkeypatch.context() as patch:
                patch.setattr(newton_schulz, "stages_in_fp32", lambda dtype, device_type: False)
                in_registers = orthogonalize(m, 5, "keller", HALF, algorithm=algorithm)
            assert torch.equal(staged, in_registers), (shape, algorithm)


def test_fp16_normalization_on_meta_is_traced_as_two_kernels_reading_the_input_as_it_is():
    """On meta (standing in for a GPU) the fp16 input scaling is recorded as the two kernels a GPU
    runs — the fp32 norm reading the bf16 input, the division writing fp16 — with no fp32 copy of
    the matrix (the CPU's staging moved 2 + 4 + 4 + 4 + 4 + 4 + 2 = 24 bytes per element before
    the first product; now 2 + 2 + 2 = 6), and workspace_bytes charges no staging buffer."""
    from scale_replay.step_trace import trace_kernels

    rows, cols = 1024, 4096
    m = torch.empty(rows, cols, dtype=torch.bfloat16, device="meta")
    kernels = trace_kernels(lambda: orthogonalize(m, 5, "keller", HALF, algorithm="gram"))
    before_products = []
    for kernel in kernels:
        if kernel.flops:
            break
        before_products.append(kernel)
    elementwise = sum(k.bytes for k in before_products if k.name == "fused")
    assert elementwise == rows * cols * 6 + 2 * 4, before_products  # + the fp32 norm, read and written
    assert not any("_to_copy" in k.name or "copy_" in k.name for k in before_products), before_products
    assert workspace_bytes(1, rows, cols, "gram", HALF, "meta") < workspace_bytes(1, rows, cols, "gram", HALF, "cpu")
