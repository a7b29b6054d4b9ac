"""Newton–Schulz orthogonalization: push every singular value of a matrix towards 1.

Each iteration applies the odd quintic p(X) = a·X + b·(X Xᵀ)X + c·(X Xᵀ)²X. Keller Jordan's
coefficients use one (a, b, c) for every step; Polar Express (Amsel et al., 2025) uses a
different minimax-optimal tuple per step and reaches tighter singular values in the same
number of matmuls.

Two algorithms evaluate the same polynomial: "standard" iterates on X itself; "gram" iterates on
the m×m Gram matrix X Xᵀ of the short side and applies the accumulated polynomial to X once per
run of at most 3 steps (Dao AI Lab's Gram Newton–Schulz idea), fewer FLOPs when X is far from
square. docs/newton_schulz.md has the FLOP counts, restarts, accuracy and timings.

Inputs are a single matrix (m, n) or a batch (k, m, n) of equal shapes. Tall matrices are
transposed so the Gram matrix X Xᵀ is the small side; results are returned in the input's
orientation and in the compute dtype. Nothing reads tensor values on the host: it runs on any
device, `meta` included.

Compute dtypes: fp32, bf16, and fp16 — 3 more mantissa bits than bf16, which Gram NS needs
(docs/newton_schulz.md, "Half-precision Gram NS"); fp16's narrow range is safe because X is
scaled before it is rounded to fp16 and every intermediate stays far below fp16's maximum
(half_precision_peak).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from titan_muon.buffers import Buffers, FreshBuffers, cut_bytes

KELLER_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# The 5-step Polar Express set as modded-nanogpt ships it (after Amsel, Persson, Musco, Gower,
# "The Polar Express", arXiv:2505.16932): the paper's method, not its Algorithm 1's own table or
# safety margin. POLAR_EXPRESS_SAFETY widens the initial scaling instead (_normalized).
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.01

NS_METHODS = ("keller", "polar_express")
NS_ALGORITHMS = ("standard", "gram", "auto")
# Where "auto" may pick Gram NS: bf16's 8 mantissa bits are too few for the squared conditioning
# of X Xᵀ (resolve_algorithm); fp16's 11 are enough (docs/newton_schulz.md).
GRAM_DTYPES = (torch.float32, torch.float16)
# The largest magnitude half_precision_peak allows in an fp16 run: fp16's maximum (65504) over a
# margin of 64 for rounding errors and for peaks between the sampled singular values.
FP16_PEAK_LIMIT = torch.finfo(torch.float16).max / 64

# Gram Newton–Schulz: the longest run of steps between restarts (gram_segments), and where
# "auto" picks it (resolve_algorithm; measured in docs/newton_schulz.md).
GRAM_MAX_RUN = 3
# In fp16 the last run must be short too: a 3-step last run (2 + 3) left 14x standard fp16's
# rounding error, up to 1.9x standard bf16's, on inputs whose column scales span 1e4-1e6; runs of
# at most 2, longest first (2 + 2 + 1), stay within standard fp16's everywhere measured
# (docs/newton_schulz.md, "Half-precision Gram NS").
HALF_GRAM_MAX_RUN = 2
GRAM_MIN_ASPECT = 2.5
GRAM_MIN_SIDE = 128
# On GPUs (and on meta, which stands in for them) Gram NS's extra, smaller GEMMs and element-wise
# passes cost more than its saved FLOPs until the short side is large: (short side, aspect) from
# which "auto" picks it there. Measured on an H100 (scripts/ns_gram_crossover.py,
# docs/newton_schulz.md, 2026-11-27), fp16 Gram against bf16 standard NS, batches of 1 and 8
# alike: 0.72-0.93x the time from a short side of 2048 at aspect 2.5-5, 0.76-0.95x at 1536 from
# aspect 3.5 (1.07-1.13x at 2.5); at 1024 0.77-0.92x in batches of 8 but 1.6-1.7x alone.
GRAM_ACCELERATOR_SHAPES = ((2048, 2.5), (1536, 3.5))
# From this many rows on, a product known to be symmetric is computed as three half-size blocks
# (upper triangle of a 2x2 block split) and mirrored: 3/4 of the multiply-adds (torch exposes no
# SYRK/SYMM). Measured on CPU, whole NS: 0.91x the time at 512 rows, 0.93x at 384, a wash at 256.
# On an H100 the split pays from 3072 rows in batches of 8 (0.88 vs 0.95 of standard NS's time)
# and costs up to 1.7x below 2048 (three small GEMMs and a mirror copy instead of one GEMM).
SYMMETRIC_SPLIT_MIN = 512
SYMMETRIC_SPLIT_MIN_ACCELERATOR = 3072


def on_accelerator(device_type: str) -> bool:
    """Whether "auto" choices on this device type are a GPU's: CUDA, and ``meta``, where the meta
    suite and the step traces (scale_replay/step_trace.py) stand in for a GPU; anything else chooses
    as the CPU does. settings.on_accelerator asks the same of a device."""
    return device_type in ("cuda", "meta")


def symmetric_split_min(device_type: str) -> int:
    """Rows from which a symmetric product is split into three blocks on this device type."""
    return SYMMETRIC_SPLIT_MIN_ACCELERATOR if on_accelerator(device_type) else SYMMETRIC_SPLIT_MIN


def coefficient_schedule(method: str | tuple[float, float, float], steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) tuple used at each of `steps` iterations; `method` may be a fixed (a, b, c)."""
    if not isinstance(method, str):
        if len(method) != 3 or not all(isinstance(v, (int, float)) for v in method):
            raise ValueError(f"Newton-Schulz coefficients must be a method name or (a, b, c), got {method!r}")
        return [tuple(float(v) for v in method)] * steps
    if method == "keller":
        return [KELLER_COEFFICIENTS] * steps
    if method == "polar_express":
        # Past its tabulated steps Polar Express keeps its last (most conservative) tuple.
        tail = [POLAR_EXPRESS_COEFFICIENTS[-1]] * max(0, steps - len(POLAR_EXPRESS_COEFFICIENTS))
        return list(POLAR_EXPRESS_COEFFICIENTS[:steps]) + tail
    raise ValueError(f"unknown Newton-Schulz method {method!r}; expected one of {NS_METHODS}")


def gram_segments(steps: int, dtype: torch.dtype = torch.float32) -> tuple[int, ...]:
    """How Gram Newton–Schulz splits `steps` into runs that each start from a fresh Gram matrix.

    A run of L steps updates its Gram matrix L − 1 times, and each update multiplies the rounding
    error of its smallest eigenvalues by about a², so runs stay at most GRAM_MAX_RUN = 3 steps
    long (4-step runs blow up in bf16). Shorter runs come first: Polar Express's first step has
    a² = 66.5, and a 3-step first run (two updates after it) blew up on low-rank bf16 inputs.
    Measured in docs/newton_schulz.md (Restarts). fp32 and bf16: 5 steps → 2 + 3.

    fp16: runs of at most HALF_GRAM_MAX_RUN = 2, longest first: 5 steps → 2 + 2 + 1. A run's
    accumulated Q spans 1 … Π a over it, and its rounding, at eps·Π a, lands on the directions
    that have already converged; in the last run most have, and 3 steps there (Π a = 41) cost
    fp16 its advantage on inputs with a continuum of small singular values (column scales
    spanning 1e4–1e6). Measured in docs/newton_schulz.md (Half-precision Gram NS).
    """
    if dtype == torch.float16:
        count = -(-steps // HALF_GRAM_MAX_RUN)
        short, extra = divmod(steps, count) if count else (0, 0)
        return (short + 1,) * extra + (short,) * (count - extra)
    count = -(-steps // GRAM_MAX_RUN)
    short, extra = divmod(steps, count) if count else (0, 0)
    return (short,) * (count - extra) + (short + 1,) * extra


def newton_schulz_flops(rows: int, cols: int, steps: int, algorithm: str = "standard", dtype: torch.dtype = torch.float32,
                        device_type: str = "cpu") -> int:  # fmt: skip
    """Matmul FLOPs of `steps` iterations on one (rows, cols) matrix, m = min side, n = max side,
    in compute dtype `dtype` (which sets Gram NS's runs: gram_segments) on `device_type` (which
    sets where the symmetric products split: symmetric_split_min).

    standard: 4m²n + 2m³ per step (X Xᵀ, its square, and the product with X).
    gram: per run of L steps, 4m²n (X Xᵀ, then Q X) plus 2m³·(4L − 3) (per step one square of the
    Gram matrix, L − 1 products into Q, 2(L − 1) halves of Gram updates); from
    symmetric_split_min(device_type) rows on, the symmetric ones (X Xᵀ, squares, Gram updates)
    cost 3/4 of that.
    """
    m, n = min(rows, cols), max(rows, cols)
    if algorithm == "standard":
        return steps * (4 * m * m * n + 2 * m * m * m)
    if algorithm == "gram":
        split = symmetric_split_min(device_type)
        square, gram_matrix, apply = _symmetric_flops(m, m, split), _symmetric_flops(m, n, split), 2 * m * m * n
        return sum(gram_matrix + apply + (3 * length - 2) * square + (length - 1) * 2 * m**3 for length in gram_segments(steps, dtype))
    raise ValueError(f"newton_schulz_flops needs a resolved algorithm ('standard' or 'gram'), got {algorithm!r}")


def resolve_algorithm(rows: int, cols: int, dtype: torch.dtype, device_type: str) -> str:
    """What algorithm="auto" runs on a (rows, cols) matrix in `dtype`: "gram" where it is both
    faster and as accurate — in fp32 or fp16, on CPU when the long side is at least GRAM_MIN_ASPECT
    times the short one and the short side at least GRAM_MIN_SIDE, on GPUs and meta for the
    shapes of GRAM_ACCELERATOR_SHAPES (both measured: docs/newton_schulz.md) — and "standard"
    otherwise.

    Never Gram in bf16: the Gram matrix squares the condition number, and in bf16 its error
    grows with the short side. On inputs whose column scales span 1e4–1e6, bf16 Gram NS let the
    largest singular value reach 1.139 / 1.165 (Keller / Polar Express) where standard bf16 NS
    stays at 1.137 / 1.142 at 512 x 1792 (this CPU, 2026-11-24), and 1.39 / 1.53 against 1.20 /
    1.14 at 2048-wide inputs (the review of issue 19). fp16 Gram NS (3 more mantissa bits) stays
    within standard bf16 NS's error on the stress set of scripts/ns_accuracy.py.
    """
    short, long = min(rows, cols), max(rows, cols)
    if dtype not in GRAM_DTYPES:
        return "standard"
    rules = GRAM_ACCELERATOR_SHAPES if on_accelerator(device_type) else ((GRAM_MIN_SIDE, GRAM_MIN_ASPECT),)
    return "gram" if any(short >= side and long >= aspect * short for side, aspect in rules) else "standard"


class NSPrecision(NamedTuple):
    """The compute dtypes behind one ``ns_dtype`` setting: `standard` for standard NS, `gram` for
    Gram NS. ns_dtype="auto" on CUDA is NSPrecision(bf16, fp16): fp16 Gram NS where "auto" picks
    Gram, standard bf16 NS elsewhere; a single dtype d is NSPrecision(d, d)."""

    standard: torch.dtype
    gram: torch.dtype

    def resolve(self, rows: int, cols: int, algorithm: str, device_type: str) -> tuple[str, torch.dtype]:
        """(algorithm, compute dtype) for a (rows, cols) matrix; `algorithm` may be "auto"."""
        if algorithm == "auto":
            algorithm = resolve_algorithm(rows, cols, self.gram, device_type)
        return algorithm, self.gram if algorithm == "gram" else self.standard


def half_precision_peak(method: str | tuple[float, float, float], steps: int, algorithm: str) -> float:
    """The largest magnitude any stored intermediate of `algorithm` can reach, for every input.

    After scaling, X's singular values σ lie in [0, 1]. Every stored intermediate is X or a
    polynomial in G = X Xᵀ (G, G², B, Q, H, the updated G), so in exact arithmetic its entries are
    bounded by its spectral norm, the largest |value| of that polynomial over X's σ. This follows
    each σ of a grid on [0, 1] through the iteration (restarts included) and returns the largest
    such value. GEMMs accumulate in fp32 (tensor cores, and torch on CPU), so only these stored
    results must fit fp16; FP16_PEAK_LIMIT keeps a margin for rounding and for the grid.
    Keller and Polar Express peak at Q's eigenvalues near σ = 0, the product of a run's a's (12
    and 33 with fp16's 2-step runs; 990 for Polar Express in one unrestarted run) — far below
    fp16's 65504.
    """
    return _half_precision_peak(method if isinstance(method, str) else tuple(float(v) for v in method), steps, algorithm)


@functools.lru_cache(maxsize=64)
def _half_precision_peak(method: str | tuple[float, ...], steps: int, algorithm: str) -> float:
    schedule = coefficient_schedule(method, steps)
    sigma = torch.linspace(0, 1, 4097, dtype=torch.float64)
    peak = 1.0
    if algorithm == "standard":
        for a, b, c in schedule:
            lam = sigma**2
            poly = b * lam + c * lam**2  # B's eigenvalues; X's are σ
            sigma = a * sigma + poly * sigma
            peak = max(peak, lam.abs().max().item(), (lam**2).max().item(), poly.abs().max().item(), sigma.abs().max().item())
        return peak
    start = 0
    for length in gram_segments(steps, torch.float16):
        lam, accumulated = sigma**2, torch.ones_like(sigma)
        for a, b, c in schedule[start : start + length]:
            poly = b * lam + c * lam**2
            factor = a + poly  # P's eigenvalues
            accumulated = accumulated * factor
            half = lam * factor
            peak = max(peak, lam.abs().max().item(), (lam**2).max().item(), poly.abs().max().item(),
                       accumulated.abs().max().item(), half.abs().max().item())  # fmt: skip
            lam = half * factor
        sigma = accumulated * sigma
        peak = max(peak, sigma.abs().max().item())
        start += length
    return peak


# ---- optional symmetric GEMM kernels (gram-newton-schulz / quack-kernels, Hopper and Blackwell)

# Below this many rows a symmetric product stays a torch GEMM: the kernels' tile is 256 × 256
# (the gram-newton-schulz package makes the same cut).
SYMMETRIC_KERNEL_MIN = 257
SYMMETRIC_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
SYMMETRIC_KERNEL_ARCHS = (9, 10)  # compute capability majors: Hopper, Blackwell


def _import_symmetric_gemm() -> Callable | None:
    """quack's ``gemm_symmetric(A, B, C=None, alpha=1.0, beta=1.0) -> alpha·A@B + beta·C`` (one
    triangle computed, mirrored), as installed with the ``gram-newton-schulz`` package; None if
    either is missing or fails to import."""
    try:
        import gram_newton_schulz  # noqa: F401  (the package this path is written and tested against)
        from quack.gemm_interface import gemm_symmetric
    except Exception:  # ImportError, or a CUDA/CUTLASS DSL set-up error raised at import
        return None
    return gemm_symmetric


@functools.lru_cache(maxsize=None)
def symmetric_gemm_kernel(device_type: str, device_index: int | None) -> Callable | None:
    """The optional symmetric GEMM for a device, detected once per device: on a CUDA device of
    compute capability 9.x or 10.x where gram-newton-schulz is importable; None elsewhere (the
    CPU and meta paths never import anything). Reads no tensor values."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    major, _ = torch.cuda.get_device_capability(device_index)
    if major not in SYMMETRIC_KERNEL_ARCHS:
        return None
    return _import_symmetric_gemm()


def _kernel_for(m1: Tensor) -> Callable | None:
    if m1.dtype not in SYMMETRIC_KERNEL_DTYPES or m1.size(-2) < SYMMETRIC_KERNEL_MIN:
        return None
    return symmetric_gemm_kernel(m1.device.type, m1.device.index)


def _addmm(bias: Tensor, m1: Tensor, m2: Tensor, beta: float, alpha: float, out: Tensor) -> Tensor:
    """out = beta·bias + alpha·(m1 @ m2); `out` may be `bias` itself."""
    if bias.ndim == 3:
        return torch.baddbmm(bias, m1, m2, beta=beta, alpha=alpha, out=out)
    return torch.addmm(bias, m1, m2, beta=beta, alpha=alpha, out=out)


def _symmetric_addmm(bias: Tensor | None, m1: Tensor, m2: Tensor, out: Tensor, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """beta·bias + alpha·(m1 @ m2), or m1 @ m2 without bias, into `out`, for a product known to be
    symmetric: the optional symmetric kernel where there is one (symmetric_gemm_kernel; it returns
    a tensor of its own), else torch GEMMs."""
    kernel = _kernel_for(m1)
    if kernel is not None:
        return kernel(m1, m2, C=bias, alpha=float(alpha), beta=float(beta) if bias is not None else 1.0)
    size = m1.size(-2)
    if size < symmetric_split_min(m1.device.type):
        return torch.matmul(m1, m2, out=out) if bias is None else _addmm(bias, m1, m2, beta, alpha, out)
    h = size // 2

    # The three blocks are written in place into `out` (GEMMs take an output with a leading
    # dimension), and only the mirrored quarter is copied: no concatenation pass over the matrix.
    def block(rows: slice, cols: slice) -> None:
        a, b, target = m1[..., rows, :], m2[..., :, cols], out[..., rows, cols]
        if bias is None:
            torch.matmul(a, b, out=target)
        else:
            _addmm(bias[..., rows, cols], a, b, beta, alpha, target)

    top, bottom = slice(None, h), slice(h, None)
    for rows, cols in ((top, top), (top, bottom), (bottom, bottom)):
        block(rows, cols)
    out[..., bottom, top].copy_(out[..., top, bottom].mT)
    return out


def _symmetric_flops(rows: int, inner: int, split_min: int) -> int:
    """FLOPs of _symmetric_addmm for a (rows, inner) @ (inner, rows) product."""
    if rows < split_min:
        return 2 * rows * rows * inner
    h, rest = rows // 2, rows - rows // 2
    return 2 * inner * (h * h + h * rest + rest * rest)


def _plus_identity(matrix: Tensor, scale: float, diagonal32: Tensor) -> Tensor:
    """matrix + scale·I in place, added in fp32 (in `diagonal32`) and rounded once: on CPU, bf16 + a
    Python float first rounds the float to bf16 (3.4445 -> 3.4375), a systematic error in the
    polynomial's constant term."""
    diagonal = matrix.diagonal(dim1=-2, dim2=-1)
    diagonal.copy_(diagonal32.copy_(diagonal).add_(scale))
    return matrix


def _short_side_first(x: Tensor) -> Tensor:
    """X as an (m, n) view, m ≤ n: a tall matrix's transpose (no copy)."""
    return x.mT if x.size(-2) > x.size(-1) else x


def _times_x(poly: Tensor, x: Tensor, a: float, alpha: float, out: Tensor) -> Tensor:
    """out = alpha·(a·X + poly·X), X = _short_side_first(x), written in x's own orientation: for a
    tall x, the transpose a·Xᵀ + Xᵀ·polyᵀ, so every iterate stays contiguous as the input is.
    a = 0: alpha·poly·X alone (Gram NS's Q X; `out`'s old contents are not read)."""
    left, right = _factors(poly, x)
    if a == 0.0:
        return _addmm(out, left, right, 0.0, alpha, out)
    return _addmm(x, left, right, a * alpha, alpha, out)


def _factors(poly: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """poly·X's factors in x's own orientation: (x, polyᵀ) for a tall x, else (poly, x)."""
    return (x, poly.mT) if x.size(-2) > x.size(-1) else (poly, x)


# A matrix's result given as rectangles of it: ((row start, row end), (column start, column end),
# a tensor of that shape to write them into), covering it once.
Blocks = Sequence[tuple[tuple[int, int], tuple[int, int], Tensor]]


class Pieces(NamedTuple):
    """One (rows, cols) matrix given by its rectangles, each in a tensor of its own (the pieces of a
    receive buffer), read where they lie: orthogonalize() takes the norm piece by piece and scales
    each piece into its iterate, so the matrix is never assembled."""

    shape: tuple[int, int]
    blocks: Blocks

    ndim = 2

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0][2].dtype

    @property
    def device(self) -> torch.device:
        return self.blocks[0][2].device

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def _times_x_into(blocks: Blocks, poly: Tensor, x: Tensor, a: float, alpha: float) -> None:
    """_times_x written rectangle by rectangle into `blocks` (one 2-D x): each rectangle is its
    rows of the left factor times its columns of the right one, a GEMM of its own."""
    left, right = _factors(poly, x)
    for (r0, r1), (c0, c1), target in blocks:
        bias = x[r0:r1, c0:c1] if a != 0.0 else target
        torch.addmm(bias, left[r0:r1], right[:, c0:c1], beta=a * alpha, alpha=alpha, out=target)


def _last_product(poly: Tensor, x: Tensor, a: float, alpha: float, spare: Tensor, into: Blocks | None) -> Tensor | None:
    if into is None:
        return _times_x(poly, x, a, alpha, spare)
    _times_x_into(into, poly, x, a, alpha)
    return None


def standard_iterations(x: Tensor, schedule: list[tuple[float, float, float]], spare: Tensor, buffers: Buffers,
                        scale: float = 1.0, into: Blocks | None = None) -> Tensor | None:  # fmt: skip
    """X ← a·X + (b·G + c·G²)·X with G = X Xᵀ (X the short side first), once per (a, b, c). The
    iterates alternate between `x` and `spare` (both in the input's orientation, both
    overwritten); the last, scaled by `scale`, is returned: in `spare` for an odd number of steps;
    or written into `into` (then None is returned)."""
    w = _short_side_first(x)
    square = (*w.shape[:-1], w.size(-2))
    gram, poly = buffers.take(square, x.dtype), buffers.take(square, x.dtype)
    for i, (a, b, c) in enumerate(schedule):
        w = _short_side_first(x)
        torch.matmul(w, w.mT, out=gram)
        _addmm(gram, gram, gram, b, c, poly)
        if i + 1 == len(schedule):
            return _last_product(poly, x, a, scale, spare, into)
        x, spare = _times_x(poly, x, a, 1.0, spare), x
    return x


def gram_iterations(x: Tensor, schedule: list[tuple[float, float, float]], segments: tuple[int, ...], spare: Tensor,
                    buffers: Buffers, scale: float = 1.0, into: Blocks | None = None) -> Tensor | None:  # fmt: skip
    """The same polynomial as standard_iterations, iterated on the small m×m Gram matrix.

    With P = a·I + B, B = b·G + c·G², one step is X ← P X and G ← P G P (P commutes with G).
    Within a run X stays put: Q ← P Q accumulates the steps and X ← Q X is applied once at the
    run's end, where the next run recomputes G = X Xᵀ from it (the restart). P itself is only
    formed once per run (Q = P at its first step); every other product with P is a·Y + B·Y in
    one addmm, so a bf16 P never rounds B away against the much larger a on its diagonal.
    From symmetric_split_min rows on, the symmetric products (X Xᵀ, G², and the Gram update,
    whose result is X Xᵀ of the next X) compute three of their four 2×2 blocks. Q ← P Q is not
    split: P and Q commute only up to rounding, and mirroring one triangle of their product
    breaks Q X = P (Q_prev X) (measured: 10x the rounding error on low-rank fp32 inputs).
    X ← Q X alternates between `x` and `spare` (in the input's orientation, both overwritten);
    the last, scaled by `scale`, is returned: in `spare` for an odd number of runs; or written
    into `into` (then None is returned).
    """
    m = min(x.shape[-2:])
    square = (*x.shape[:-2], m, m)
    gram, poly, half, accumulated, other = (buffers.take(square, x.dtype) for _ in range(5))
    diagonal32 = buffers.take(square[:-1], torch.float32)
    start = 0
    for run, length in enumerate(segments):
        w = _short_side_first(x)
        gram = _symmetric_addmm(None, w, w.mT, gram)
        for i, (a, b, c) in enumerate(schedule[start : start + length]):
            poly = _symmetric_addmm(gram, gram, gram, poly, beta=b, alpha=c)
            if i == 0:
                accumulated = _plus_identity(accumulated.copy_(poly), a, diagonal32)
            else:
                accumulated, other = _addmm(accumulated, poly, accumulated, a, 1.0, other), accumulated
            if i + 1 < length:
                half = _symmetric_addmm(gram, poly, gram, half, beta=a)
                gram = _symmetric_addmm(half, poly, half, gram, beta=a)
        start += length
        if run + 1 == len(segments):
            return _last_product(accumulated, x, 0.0, scale, spare, into)
        x, spare = _times_x(accumulated, x, 0.0, 1.0, spare), x
    return x


def stages_in_fp32(dtype: torch.dtype, device_type: str) -> bool:
    """Whether fp16 NS first scales its input in an fp32 copy: on CPU, where torch casts a result
    of another dtype through a temporary of its own; a GPU casts in registers (_normalized)."""
    return dtype == torch.float16 and device_type == "cpu"


def _normalized(matrix: Tensor | Pieces, x: Tensor, norm: Tensor, eps: float, safety: float, buffers: Buffers) -> None:
    """x ← matrix / max(safety·‖matrix‖_F, eps), per matrix, through `norm`: spectral norm at most
    1, which the Frobenius norm bounds.

    fp16 cannot hold every unscaled input (a momentum of 1e-8 underflows, a sum of squares
    overflows), so for fp16 NS the norm and the quotient are fp32 and the quotient is rounded
    once to fp16. On a GPU both kernels read the input as it is: the reduction accumulates a
    bf16 input in fp32 and the division rounds to fp16 as it stores (4 bytes per element moved
    for a bf16 input, where a staged copy moves 20). On CPU (stages_in_fp32) the input is first
    copied into an fp32 buffer from `buffers`, given back once rounded into `x`.

    :class:`Pieces` (in the NS dtype, not fp16): the norm of the pieces' norms, which are first
    written into `x` (its memory is free until the quotients land there), and each piece divided
    into its rectangle of `x`."""
    dtype, wide = x.dtype, norm.dtype
    if isinstance(matrix, Pieces):
        norms = x.view(-1)[: len(matrix.blocks)]
        for i, (_, _, piece) in enumerate(matrix.blocks):
            torch.linalg.vector_norm(piece, dtype=wide, out=norms[i])
        torch.linalg.vector_norm(norms, out=norm.view(()))
        if safety != 1.0:
            norm.mul_(safety)
        norm.clamp_(min=eps)
        for (r0, r1), (c0, c1), piece in matrix.blocks:
            torch.div(piece, norm, out=x[r0:r1, c0:c1])
        return
    before_staging = buffers.mark()
    if dtype == torch.float16 and not stages_in_fp32(dtype, matrix.device.type):
        source, scaled, one_kernel = matrix, x, _one_kernel
    else:  # the input as it is where it has the norm's dtype, else a copy in it (fp32, or the NS dtype)
        scaled = buffers.take(matrix.shape, wide) if wide != dtype else x
        source = matrix if matrix.dtype == wide else scaled.copy_(matrix)
        one_kernel = _as_traced
    with one_kernel(source, norm):
        torch.linalg.vector_norm(source, dim=(-2, -1), keepdim=True, dtype=wide, out=norm)
    if safety != 1.0:
        norm.mul_(safety)
    norm.clamp_(min=eps)
    with one_kernel(source, norm, scaled):
        torch.div(source, norm, out=scaled)
    if scaled is not x:
        x.copy_(scaled)
        buffers.release(before_staging)


def _as_traced(*tensors: Tensor):
    """Each op recorded as it runs (the staged path: on meta its ops are what a GPU runs)."""
    return contextlib.nullcontext()


def _one_kernel(*tensors: Tensor):
    """On ``meta`` (the step's trace, scale_replay/step_trace.py), a range the trace records as one
    kernel moving `tensors` once each: what a GPU runs, where meta's decompositions would add a
    converting copy. A no-op elsewhere."""
    if tensors[0].device.type != "meta":
        return contextlib.nullcontext()
    moved = sum(t.numel() * t.element_size() for t in tensors)
    return torch.profiler.record_function(f"titan_muon/fused:{moved}")


def _workspace_cuts(rows: int, cols: int, algorithm: str, dtype: torch.dtype, lead: tuple[int, ...],
                    spare: bool = False) -> list[tuple[tuple[int, ...], torch.dtype]]:  # fmt: skip
    """The buffers one orthogonalize() call on a (*lead, rows, cols) input takes, in order (the
    result excepted; ``spare``: the iterates' second buffer, taken when the result goes into
    blocks and no spare is given), for the input dtype that needs no fp32 staging; `_workspace_peak` adds fp16's."""
    m, n = sorted((rows, cols))
    cuts = [((*lead, 1, 1), dtype)] + [((*lead, rows, cols), dtype)] * (2 if spare else 1)
    if algorithm == "gram":
        return cuts + [((*lead, m, m), dtype)] * 5 + [((*lead, m), torch.float32)]  # + the fp32 diagonal of P = a·I + B
    return cuts + [((*lead, m, m), dtype)] * 2


def _workspace_peak(rows: int, cols: int, algorithm: str, dtype: torch.dtype, lead: tuple[int, ...], size, device_type: str,
                    spare: bool = False) -> int:  # fmt: skip
    """The most one call's buffers hold at once, each cut counted as `size(shape, dtype)`. In fp16
    the norm is fp32, and on CPU the input is first scaled in an fp32 buffer, given back once
    rounded into the fp16 iterate and before the other buffers are taken (_normalized)."""
    cuts = _workspace_cuts(rows, cols, algorithm, dtype, lead, spare)
    held = sum(size(shape, d) for shape, d in cuts)
    if dtype != torch.float16:
        return held
    (norm_shape, _), (iterate_shape, _) = cuts[:2]
    held += size(norm_shape, torch.float32) - size(norm_shape, dtype)
    if not stages_in_fp32(dtype, device_type):
        return held
    staging = size(norm_shape, torch.float32) + size(iterate_shape, dtype) + size(iterate_shape, torch.float32)
    return max(staging, held)


def workspace_bytes(batch: int, rows: int, cols: int, algorithm: str, dtype: torch.dtype, device_type: str, *,
                    reserved: bool = False, spare: bool = False) -> int:  # fmt: skip
    """Peak bytes :func:`orthogonalize` holds besides its result for a (batch, rows, cols) input in
    compute dtype `dtype` with a resolved `algorithm`. Per matrix (short side m, long side n): one
    m × n matrix in the NS dtype (the iterates alternate between it and the result; fp16 on CPU
    first scales in an fp32 copy, given back before the rest is taken), the m × m products — the Gram
    matrix and the polynomial, and for Gram NS also the half-updated Gram matrix, two accumulated
    polynomials and an fp32 diagonal — and the norm. On CPU a batch runs one matrix at a time, each writing its slice of the result.
    ``spare``: the result is written into Blocks and no spare is given: the iterates take a second m × n buffer.
    ``reserved``: each buffer counted as an Arena cuts it (buffers.cut_bytes, alignment included),
    what a reservation must hold; otherwise as allocated. Measured against storage lifetimes and an
    Arena's high water: tests/test_newton_schulz.py."""
    size = cut_bytes if reserved else (lambda shape, d: math.prod(shape) * d.itemsize)
    lead = () if device_type == "cpu" or batch == 1 else (batch,)
    return _workspace_peak(rows, cols, algorithm, dtype, lead, size, device_type, spare)


def orthogonalize(
    matrix: Tensor | Pieces,
    steps: int = 5,
    method: str | tuple[float, float, float] = "keller",
    dtype: torch.dtype = torch.float32,
    eps: float = 1e-7,
    algorithm: str = "standard",
    *,
    scale: float = 1.0,
    out: Tensor | Blocks | None = None,
    spare: Tensor | None = None,
    buffers: Buffers | None = None,
) -> Tensor | Blocks:
    """Approximate U Vᵀ of the SVD U S Vᵀ of `matrix` (or of each matrix of a batch; or of one
    matrix given as :class:`Pieces`, in `dtype`, not fp16, read where they lie).

    algorithm: "standard", "gram" (same polynomial, iterated on the Gram matrix of the short
    side: fewer FLOPs on rectangular matrices), or "auto" (resolve_algorithm).
    dtype: the compute dtype, fp32, bf16 or fp16 (fp16: scaled in fp32 first, _normalized; Gram NS restarts
    every 2 steps, gram_segments); the result is returned in it, contiguous, in the input's shape.
    scale: the result is scale·U Vᵀ, scaled by the last product itself. out: where to write it
    (contiguous; it may share `matrix`'s memory, which is read first), or the :data:`Blocks` to
    write each matrix's rectangles into (a list of them for a batch) (each its own last product, written as the
    product is made: no copy of the result); the iterates then alternate between a buffer of
    their own and `spare` (contiguous, in the input's shape and the compute dtype; it may share
    `matrix`'s memory; default: one more buffer).
    buffers: where the workspace (and a result without `out`) comes from (default: allocated);
    everything taken from it is given back before returning, except the result.
    """
    if matrix.ndim not in (2, 3):
        raise ValueError(f"orthogonalize expects a matrix or a batch of matrices, got shape {tuple(matrix.shape)}")
    if algorithm not in NS_ALGORITHMS:
        raise ValueError(f"unknown Newton-Schulz algorithm {algorithm!r}; expected one of {NS_ALGORITHMS}")
    if algorithm == "auto":
        algorithm = resolve_algorithm(matrix.size(-2), matrix.size(-1), dtype, matrix.device.type)
    if dtype == torch.float16 and (peak := half_precision_peak(method, steps, algorithm)) > FP16_PEAK_LIMIT:
        raise ValueError(
            f"orthogonalize: Newton-Schulz coefficients {method!r} over {steps} steps reach "
            f"{peak:.3g} in {algorithm} NS, beyond fp16's safe range "
            f"({FP16_PEAK_LIMIT:.3g}); use dtype torch.bfloat16 or torch.float32 (ns_dtype 'bf16' or 'fp32')"
        )
    buffers = buffers if buffers is not None else FreshBuffers(matrix.device)
    into = None if out is None or isinstance(out, Tensor) else out
    if into is not None and matrix.ndim == 3:  # one Blocks per matrix of the batch
        if len(into) != matrix.size(0) or (spare is not None and spare.shape != matrix.shape):
            raise ValueError(f"orthogonalize: a batch of {matrix.size(0)} matrices needs as many Blocks (got {len(into)}) and a spare of its shape")
        for i, one in enumerate(matrix):
            orthogonalize(one, steps, method, dtype, eps, algorithm, scale=scale, out=into[i], spare=None if spare is None else spare[i], buffers=buffers)
        return out
    if isinstance(matrix, Pieces):
        _check_blocks(matrix.blocks, matrix, dtype, "piece")
        if dtype == torch.float16:
            raise ValueError("orthogonalize: fp16 NS scales its input in fp32 and cannot read it as Pieces")
    if into is not None:
        _check_blocks(into, matrix, dtype)
        if spare is not None and (spare.shape != matrix.shape or spare.dtype != dtype or not spare.is_contiguous()):
            raise ValueError(f"orthogonalize: spare must be a contiguous {tuple(matrix.shape)} {dtype} tensor")
    elif out is None:
        out = buffers.take(matrix.shape, dtype)
    elif out.shape != matrix.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"orthogonalize: out must be a contiguous {tuple(matrix.shape)} {dtype} tensor")
    if matrix.ndim == 3 and matrix.device.type == "cpu":
        # CPU BLAS runs one GEMM at a time either way; 2-D addmm beats baddbmm by ~8 % (measured,
        # fp32, 1024-2816 sides). Batching pays on GPUs, where it saves kernel launches.
        for one, result in zip(matrix, out):
            orthogonalize(one, steps, method, dtype, eps, algorithm, scale=scale, out=result, buffers=buffers)
        return out
    mark = buffers.mark()
    # The iterates alternate between one buffer and `out`, in the input's orientation, so after an
    # odd number of products (the defaults) the last is in `out`; after an even one it is copied
    # there. `out` is written only once `matrix` has been read: it may be `matrix`'s own memory.
    # fp16's norm and quotient are fp32 (_normalized); every other dtype's are the NS dtype's
    norm = buffers.take((*matrix.shape[:-2], 1, 1), torch.promote_types(matrix.dtype, torch.float32) if dtype == torch.float16 else dtype)
    x = buffers.take(matrix.shape, dtype)
    _normalized(matrix, x, norm, eps, POLAR_EXPRESS_SAFETY if method == "polar_express" else 1.0, buffers)
    schedule = coefficient_schedule(method, steps)
    if into is None:
        spare = out
    elif spare is None:
        spare = buffers.take(matrix.shape, dtype)
    if algorithm == "gram":
        x = gram_iterations(x, schedule, gram_segments(steps, dtype), spare, buffers, scale, into)
    else:
        x = standard_iterations(x, schedule, spare, buffers, scale, into)
    if into is not None and x is not None:  # no products
        for (r0, r1), (c0, c1), target in into:
            target.copy_(x[r0:r1, c0:c1])
    elif x is not None and x is not out:  # an even number of products (or none)
        out.copy_(x)
    buffers.release(mark)
    return out


def _check_blocks(blocks: Blocks, matrix: Tensor | Pieces, dtype: torch.dtype, what: str = "block") -> None:
    """Blocks (or Pieces' blocks) are in the compute dtype, shaped as their rectangles, covering the matrix."""
    area = 0
    for (r0, r1), (c0, c1), target in blocks:
        if target.shape != (r1 - r0, c1 - c0) or target.dtype != dtype or not (0 <= r0 < r1 <= matrix.size(0) and 0 <= c0 < c1 <= matrix.size(1)):
            raise ValueError(f"orthogonalize: {what} ({r0}:{r1}, {c0}:{c1}) of a {tuple(matrix.shape)} matrix cannot be a "
                             f"{tuple(target.shape)} {target.dtype} tensor (expected {dtype})")  # fmt: skip
        area += (r1 - r0) * (c1 - c0)
    if area != matrix.numel():
        raise ValueError(f"orthogonalize: {what}s cover {area} of the {matrix.numel()} entries of a {tuple(matrix.shape)} matrix")
