"""Newton–Schulz variants against the float64 polar factor on a stress set of inputs.

Variants: fp16 Gram NS as it runs (gram_segments: runs 2 + 2 + 1), fp16 Gram NS with a single
restart after the second step (runs 2 + 3, Dao AI Lab's and DeepSpeed's choice), standard bf16
NS, bf16 Gram NS (runs 2 + 3), fp32 Gram NS, and standard fp32 NS. Inputs, per shape: Gaussian; Gaussian with
column scales spanning 1e4 and 1e6 (what broke bf16 Gram NS); ill-conditioned (singular values
spanning 1e6, geometric); rank-deficient (exact rank m/16); gradient-like (4 dominant directions
plus 1e-3 noise). Shapes: Llama-3 8B projections (MLP scaled down 8x and 4x per side, GQA k/v at
its real 1024 × 4096, square attention) and a DeepSeek-V3 MoE expert scaled down 8x (tall).

Per cell: σ_max of the result (> ~1.2 means rounding has pushed singular values out), the
relative Frobenius distance ‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F to the polar factor (U Vᵀ over the
numerically non-zero singular values: a rank-deficient input's null space has no polar factor),
and the relative rounding error ‖O − U f(S) Vᵀ‖_F / ‖U f(S) Vᵀ‖_F, where U f(S) Vᵀ is the same
5-step polynomial applied in float64 to the exact singular values (what every variant should
compute; the polar distance is dominated by the method, this by the arithmetic).

    python scripts/ns_accuracy.py              # full table (a few minutes on 2 CPU cores)
    python scripts/ns_accuracy.py --quick      # two shapes, three inputs
    python scripts/ns_accuracy.py --device cuda --full-size --time   # GPU (scripts/gpu_check.sh)

--full-size runs the real Llama-3 8B (4096 × 14336, 4096 × 4096, 1024 × 4096) and DeepSeek-V3
(7168 × 2048) matrices; --time adds the median time of fp16 Gram NS and standard bf16 NS per
shape (CUDA events on a GPU), and says whether the optional symmetric GEMM kernel was found.

CPU note: torch's CPU fp16 matmul accumulates in fp32 and rounds the result once (checked in
docs/newton_schulz.md), as GPU tensor cores do, so the fp16 numbers here represent a GPU's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_newton_schulz import gram_with_runs, machine  # noqa: E402
from titan_muon.algorithm.newton_schulz import coefficient_schedule, orthogonalize  # noqa: E402

VARIANTS = {  # label: (dtype, algorithm, or Gram NS's runs between restarts)
    "fp16 gram": (torch.float16, "gram"),
    "fp16 gram 2+3": (torch.float16, (2, 3)),
    "bf16 standard": (torch.bfloat16, "standard"),
    "bf16 gram": (torch.bfloat16, "gram"),
    "fp32 gram": (torch.float32, "gram"),
    "fp32 standard": (torch.float32, "standard"),
}
ALL_INPUTS = ("gaussian", "colscale-1e4", "colscale-1e6", "ill-conditioned", "rank-deficient", "gradient-like")
# (label, rows, cols, inputs): Llama-3 8B and DeepSeek-V3 matrices, most scaled down 8x per side
# (CPU fp16 GEMMs run at ~5 GFLOP/s); the MLP at 1024 x 2816 and GQA k/v at its real 1024 x 4096
# on the input that broke bf16 Gram NS.
CASES = [
    ("MLP (4096x11264 / 8)", 512, 1408, ALL_INPUTS),
    ("MLP (4096x11264 / 4)", 1024, 2816, ("colscale-1e6",)),
    ("GQA k/v (Llama-3 8B)", 1024, 4096, ("colscale-1e6",)),
    ("attention q/o (4096² / 8)", 512, 512, ("gaussian", "colscale-1e6")),
    ("MoE expert (DeepSeek-V3 7168x2048 / 8)", 896, 256, ("gaussian", "colscale-1e6", "rank-deficient", "gradient-like")),
]
FULL_SIZE_CASES = [  # two inputs each: a GPU check has about a minute for this
    ("Llama-3 8B MLP", 4096, 14336, ("gaussian", "colscale-1e6")),
    ("Llama-3 8B attention q/o", 4096, 4096, ("gaussian", "colscale-1e6")),
    ("Llama-3 8B GQA k/v", 1024, 4096, ("gaussian", "colscale-1e6")),
    ("DeepSeek-V3 MoE expert", 7168, 2048, ("gaussian", "colscale-1e6")),
]
QUICK_CASES = [("MLP (4096x11264 / 8)", 512, 1408, ("gaussian", "colscale-1e6", "rank-deficient")),
               ("MoE expert (/ 8)", 896, 256, ("gaussian", "colscale-1e6", "rank-deficient"))]  # fmt: skip


def stress_input(kind: str, rows: int, cols: int, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator(device).manual_seed(seed)
    gaussian = lambda r, c: torch.randn(r, c, generator=gen, dtype=torch.float64, device=device)
    short = min(rows, cols)
    if kind == "gaussian":
        return gaussian(rows, cols)
    if kind.startswith("colscale-"):
        span = float(kind.split("-", 1)[1])
        scales = torch.logspace(0, -torch.log10(torch.tensor(span)).item(), cols, dtype=torch.float64, device=device)
        return gaussian(rows, cols) * scales[torch.randperm(cols, generator=gen, device=device)]
    if kind == "ill-conditioned":
        u, _ = torch.linalg.qr(gaussian(rows, short))
        v, _ = torch.linalg.qr(gaussian(cols, short))
        return (u * torch.logspace(0, -6, short, dtype=torch.float64, device=device)) @ v.mT
    if kind == "rank-deficient":
        rank = max(1, short // 16)
        return gaussian(rows, rank) @ gaussian(rank, cols)
    if kind == "gradient-like":
        u, v = gaussian(rows, 4), gaussian(4, cols)
        return (u * torch.logspace(0, -1, 4, dtype=torch.float64, device=device)) @ v / (rows * cols) ** 0.25 + 1e-3 * gaussian(rows, cols)
    raise ValueError(kind)


def targets(matrix: torch.Tensor, method: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(U Vᵀ over the non-zero singular values, U f(S) Vᵀ) in float64."""
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    nonzero = s > s[0] * max(matrix.shape) * torch.finfo(torch.float64).eps
    polar = (u[:, nonzero]) @ vh[nonzero]
    scaled = s / torch.linalg.vector_norm(s) / (1.01 if method == "polar_express" else 1.0)
    for a, b, c in coefficient_schedule(method, steps):
        scaled = a * scaled + b * scaled**3 + c * scaled**5
    return polar, (u * scaled) @ vh


def run_variant(matrix: torch.Tensor, steps: int, method: str, dtype: torch.dtype, algorithm: str | tuple[int, ...]) -> torch.Tensor:
    if isinstance(algorithm, tuple):
        assert sum(algorithm) == steps
        return gram_with_runs(matrix, method, dtype, algorithm)
    return orthogonalize(matrix, steps, method, dtype, algorithm=algorithm)


def targets_from_gram(matrix: torch.Tensor, method: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same two targets without an SVD of the whole matrix (a GPU's fp64 SVD of 4096 × 14336 is
    slow): U f(S) Vᵀ is standard NS run in float64 (f(σ)/σ is a polynomial in σ², so NS computes
    it exactly up to float64 rounding), and U Vᵀ = (X Xᵀ)^(-1/2) X from an eigendecomposition of
    the short side's Gram matrix, over eigenvalues above 1e-13 of the largest: directions with σ
    below ~3e-7 σ_max count as null space, which no 5-step NS moves anyway (σ grows ≤ 485x)."""
    wide = matrix if matrix.size(0) <= matrix.size(1) else matrix.mT
    eigenvalues, vectors = torch.linalg.eigh(wide @ wide.mT)
    keep = eigenvalues > eigenvalues[-1] * 1e-13
    basis = vectors[:, keep]
    polar = (basis * eigenvalues[keep].rsqrt()) @ (basis.mT @ wide)
    polynomial = orthogonalize(wide, steps, method, torch.float64, algorithm="standard")
    return (polar, polynomial) if wide is matrix else (polar.mT, polynomial.mT)


def measure(out: torch.Tensor, polar: torch.Tensor, polynomial: torch.Tensor) -> tuple[float, float, float]:
    if not out.isfinite().all():
        return float("nan"), float("nan"), float("nan")
    o = out.double()
    short = o @ o.mT if o.size(0) <= o.size(1) else o.mT @ o
    # fp32 eigenvalues on a GPU (float64 eigh of 4096² takes seconds there): σ_max to ~1e-6
    short = short.float() if short.is_cuda else short
    sigma_max = torch.linalg.eigvalsh(short)[-1].clamp(min=0).sqrt().item()
    relative = lambda t, ref: ((t - ref).norm() / ref.norm()).item()
    return sigma_max, relative(o, polar), relative(o, polynomial)


def median_seconds(run, device: str, repeats: int) -> float:
    """Median wall time of `run()`; CUDA events on a GPU (no host sync inside the timed calls)."""
    run()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--methods", default="keller,polar_express")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full-size", action="store_true", help="the real Llama-3 8B and DeepSeek-V3 shapes (for a GPU)")
    parser.add_argument("--time", action="store_true", help="also time fp16 Gram against standard bf16 per shape")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--targets", choices=("svd", "gram"), help="how the float64 targets are computed (default: svd on CPU, gram on CUDA)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    target_route = args.targets or ("gram" if args.device == "cuda" else "svd")
    print(f"Command: `{' '.join(['python scripts/ns_accuracy.py', *sys.argv[1:]])}`  ")
    if args.device == "cuda":
        from titan_muon.algorithm.newton_schulz import symmetric_gemm_kernel

        kernel = symmetric_gemm_kernel("cuda", torch.cuda.current_device()) is not None
        print(f"Machine: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"{time.strftime('%Y-%m-%d')}; gram-newton-schulz symmetric GEMM kernel {'used' if kernel else 'not found'}.")  # fmt: skip
    else:
        print(f"Machine: {machine()}.")
    print()
    cases = FULL_SIZE_CASES if args.full_size else QUICK_CASES if args.quick else CASES
    if args.time:  # first, so that a time-boxed GPU run keeps it
        print(f"Median of {args.repeats} calls, 5 Polar Express steps, one matrix (ms):")
        print()
        print("| shape | fp16 gram | fp16 gram 2+3 | bf16 standard | bf16 gram | fp16 gram / bf16 standard |")
        print("|---|---|---|---|---|---|")
        for label, rows, cols, _ in cases:
            probe = torch.randn(rows, cols, device=args.device)
            ms = {name: 1e3 * median_seconds(lambda d=VARIANTS[name][0], a=VARIANTS[name][1]: run_variant(probe, args.steps, "polar_express", d, a),
                                             args.device, args.repeats)
                  for name in ("fp16 gram", "fp16 gram 2+3", "bf16 standard", "bf16 gram")}  # fmt: skip
            print(f"| {label} {rows}x{cols} | {ms['fp16 gram']:.2f} | {ms['fp16 gram 2+3']:.2f} | {ms['bf16 standard']:.2f} | {ms['bf16 gram']:.2f} | "
                  f"**{ms['fp16 gram'] / ms['bf16 standard']:.2f}** |", flush=True)  # fmt: skip
        print()
    print("Each cell: σ_max / ‖O − U Vᵀ‖_F rel. / ‖O − U f(S) Vᵀ‖_F rel. (rounding); **bold**: fp16 Gram's rounding error is at most standard bf16's.")
    print(f"float64 targets from {'an SVD' if target_route == 'svd' else 'float64 NS and the eigendecomposition of X Xᵀ (targets_from_gram)'}.")
    print()
    print("| shape | input | coefficients | " + " | ".join(VARIANTS) + " |")
    print("|---|---|---|" + "---|" * len(VARIANTS))
    worst_ratio = 0.0
    for label, rows, cols, inputs in cases:
        for i, kind in enumerate(inputs):
            matrix = stress_input(kind, rows, cols, seed=i, device=args.device)
            for method in args.methods.split(","):
                polar, polynomial = (targets if target_route == "svd" else targets_from_gram)(matrix, method, args.steps)
                cells = {}
                for name, (dtype, algorithm) in VARIANTS.items():
                    cells[name] = measure(run_variant(matrix.float(), args.steps, method, dtype, algorithm), polar, polynomial)
                ratio = cells["fp16 gram"][2] / cells["bf16 standard"][2]
                worst_ratio = max(worst_ratio, ratio)
                text = [f"{s:.3f} / {p:.3g} / {r:.2g}" for s, p, r in cells.values()]
                if ratio <= 1:
                    text[0] = f"**{text[0]}**"
                print(f"| {label} {rows}x{cols} | {kind} | {method} | " + " | ".join(text) + " |", flush=True)
    print()
    print(f"fp16 Gram / standard bf16 rounding error: at most {worst_ratio:.2f}.")
    print()
    print(f"Wall time {time.time() - started:.0f} s.")


if __name__ == "__main__":
    main()
