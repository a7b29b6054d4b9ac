"""Standard vs Gram Newton–Schulz: time per shape side by side, and accuracy against an SVD.

Speed: each repeat times both algorithms back to back on the same input (order alternating),
so the machine's drift hits both; the table gives medians and the per-shape time ratio next to
the FLOP ratio (newton_schulz_flops). Accuracy: orthogonality error ‖O Oᵀ − I‖₂ (short side),
distance to the exact polar factor U Vᵀ, and distance to U f(S) Vᵀ, the same 5-step polynomial
applied to the exact singular values (float64 SVD): what each algorithm should compute, so the
last column is pure rounding error.

    python scripts/bench_newton_schulz.py                  # speed + accuracy, writes docs/newton_schulz.md
    python scripts/bench_newton_schulz.py --sweep          # aspect-ratio sweep for resolve_algorithm
    python scripts/bench_newton_schulz.py --no-accuracy --repeats 3 --no-write   # quick look
    python scripts/bench_newton_schulz.py --restarts --restart-dtypes fp16   # run splits in fp16

Writes the sections "## Speed" and "## Accuracy" of docs/newton_schulz.md unless --no-write.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from titan_muon.algorithm.newton_schulz import coefficient_schedule, gram_iterations, newton_schulz_flops, orthogonalize
from titan_muon.buffers import FreshBuffers

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Transformer shapes scaled down 4x per side: attention 4096² -> 1024², GQA k/v 1024x4096 -> 256x1024,
# MLP 4096x14336 -> 1024x3584; then a batch of 4 of each (what a bucket of equal shapes runs).
SPEED_SHAPES = "1024x1024,256x1024,1024x3584,4x1024x1024,4x256x1024,4x1024x3584"
SWEEP_SHAPES = "256x256,256x384,256x512,256x640,256x768,256x1024,512x512,512x768,512x1024,512x1280,512x1536,512x2048,32x128,64x256,128x512"
# Accuracy on smaller stand-ins (a float64 SVD per matrix): square, 1024x4096-like, 4096x14336-like.
ACCURACY_SHAPES = "256x256,256x1024,512x1792"


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split("x"))


def time_pair(matrix: torch.Tensor, dtype: torch.dtype, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each algorithm, interleaved: standard, gram, gram, standard, ..."""
    times: dict[str, list[float]] = {"standard": [], "gram": []}
    for algorithm in times:  # warm-up
        orthogonalize(matrix, dtype=dtype, algorithm=algorithm)
    for r in range(repeats):
        for algorithm in ("standard", "gram") if r % 2 == 0 else ("gram", "standard"):
            started = time.perf_counter()
            orthogonalize(matrix, dtype=dtype, algorithm=algorithm)
            times[algorithm].append(time.perf_counter() - started)
    return times


def speed_rows(shapes: list[tuple[int, ...]], dtype_name: str, repeats: int) -> list[str]:
    rows = []
    for shape in shapes:
        matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        times = time_pair(matrix, DTYPES[dtype_name], repeats)
        std, gram = statistics.median(times["standard"]), statistics.median(times["gram"])
        flops = {a: newton_schulz_flops(shape[-2], shape[-1], 5, a) for a in times}
        label = "x".join(map(str, shape))
        rows.append(
            f"| {label} | {dtype_name} | {1e3 * std:.1f} | {1e3 * gram:.1f} | **{gram / std:.2f}** | {flops['gram'] / flops['standard']:.2f} |"
        )
        print(rows[-1], flush=True)
    return rows


def lowrank(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Gradient-like: 4 dominant directions (singular values 1 .. 0.1) plus 1e-3 Gaussian noise."""
    u = torch.randn(rows, 4, generator=generator, dtype=torch.float64)
    v = torch.randn(4, cols, generator=generator, dtype=torch.float64)
    return (u * torch.logspace(0, -1, 4, dtype=torch.float64)) @ v / (rows * cols) ** 0.25 + 1e-3 * torch.randn(
        rows, cols, generator=generator, dtype=torch.float64
    )


def exact_targets(matrix: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(U Vᵀ, U f(S) Vᵀ) in float64, f = the 5-step polynomial of `method` on S scaled as orthogonalize does."""
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    s = s / torch.linalg.vector_norm(s) / (1.01 if method == "polar_express" else 1.0)
    for a, b, c in coefficient_schedule(method, 5):
        s = a * s + b * s**3 + c * s**5
    return u @ vh, (u * s) @ vh


def errors(out: torch.Tensor, polar: torch.Tensor, polynomial: torch.Tensor) -> tuple[float, float, float]:
    o = out.double()
    short = o @ o.mT if o.size(0) <= o.size(1) else o.mT @ o
    eye = torch.eye(short.size(0), dtype=torch.float64)
    norm = lambda t: torch.linalg.matrix_norm(t, 2).item()
    return norm(short - eye), norm(o - polar), norm(o - polynomial)


def gram_with_runs(matrix: torch.Tensor, method: str, dtype: torch.dtype, runs: tuple[int, ...]) -> torch.Tensor:
    """Gram Newton–Schulz with the given run lengths instead of gram_segments' (2 + 3; fp16: 2 + 2 + 1)."""
    x = matrix.to(torch.float32 if dtype == torch.float16 else dtype)  # fp16: scaled first, as orthogonalize does
    x = (x / (torch.linalg.vector_norm(x) * (1.01 if method == "polar_express" else 1.0))).to(dtype)
    return gram_iterations(x, coefficient_schedule(method, 5), runs, torch.empty_like(x), FreshBuffers(x.device))


def accuracy_rows(shapes: list[tuple[int, ...]], dtype_names: list[str]) -> list[str]:
    """Per shape, input kind, coefficients and dtype: errors() of standard NS, Gram NS, and Gram NS
    run as one 5-step run without restart."""
    rows = []
    for shape in shapes:
        for kind in ("gaussian", "low-rank"):
            generator = torch.Generator().manual_seed(1)
            matrix = torch.randn(*shape, generator=generator, dtype=torch.float64) if kind == "gaussian" else lowrank(*shape, generator)
            for method in ("keller", "polar_express"):
                polar, polynomial = exact_targets(matrix, method)
                for dtype_name in dtype_names:
                    dtype = DTYPES[dtype_name]
                    outs = [orthogonalize(matrix.float(), 5, method, dtype, algorithm=a) for a in ("standard", "gram")]
                    outs.append(gram_with_runs(matrix.float(), method, dtype, (5,)))
                    cells = [" / ".join(f"{v:.3g}" for v in errors(o, polar, polynomial)) for o in outs]
                    label = "x".join(map(str, shape))
                    rows.append(f"| {label} | {kind} | {method} | {dtype_name} | " + " | ".join(cells) + " |")
                    print(rows[-1], flush=True)
    return rows


def restart_rows(shape: tuple[int, int], dtype_names: list[str], splits: list[tuple[int, ...]], seeds: int) -> list[str]:
    """Worst over `seeds` inputs of the rounding error ‖O − U f(S) Vᵀ‖₂, standard and gram with each split into runs."""
    rows = []
    label = "x".join(map(str, shape))
    for dtype_name in dtype_names:
        for method in ("keller", "polar_express"):
            for kind in ("gaussian", "low-rank"):
                worst = [0.0] * (len(splits) + 1)
                for seed in range(seeds):
                    generator = torch.Generator().manual_seed(seed)
                    matrix = torch.randn(*shape, generator=generator, dtype=torch.float64) if kind == "gaussian" else lowrank(*shape, generator)
                    _, polynomial = exact_targets(matrix, method)
                    dtype = DTYPES[dtype_name]
                    outs = [orthogonalize(matrix.float(), 5, method, dtype)] + [gram_with_runs(matrix.float(), method, dtype, r) for r in splits]
                    errs = [torch.linalg.matrix_norm(o.double() - polynomial, 2).item() if o.isfinite().all() else float("inf") for o in outs]
                    worst = [max(w, e) for w, e in zip(worst, errs)]
                rows.append(f"| {label} | {dtype_name} | {method} | {kind} | " + " | ".join(f"{w:.2g}" for w in worst) + " |")
                print(rows[-1], flush=True)
    return rows


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace (or append) the section starting at `heading`, keeping the rest of the file."""
    text = path.read_text() if path.exists() else "# Newton–Schulz\n"
    if f"\n{heading}\n" in text:
        start = text.index(f"\n{heading}\n") + 1
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + body + (text[nxt + 1 :] if nxt != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SPEED_SHAPES, help="comma-separated [batch x] rows x cols")
    parser.add_argument("--sweep", action="store_true", help=f"time {SWEEP_SHAPES} instead (crossover of resolve_algorithm)")
    parser.add_argument("--bf16-shapes", default="256x1024,4x256x1024", help="bf16 speed rows (CPU bf16 GEMMs can be very slow)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--accuracy-shapes", default=ACCURACY_SHAPES)
    parser.add_argument("--no-accuracy", action="store_true")
    parser.add_argument("--restarts", action="store_true", help="only the table of run splits (why gram_segments restarts where it does)")
    parser.add_argument("--restart-shapes", default="256x896,64x256,96x96")
    parser.add_argument("--restart-dtypes", default="fp32,bf16", help="fp32,bf16 writes '## Restarts'; others their own section")
    parser.add_argument("--seeds", type=int, default=4, help="inputs per cell of the --restarts table")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    command = "python scripts/bench_newton_schulz.py " + " ".join(sys.argv[1:])
    header = [f"Command: `{command.strip()}`  ", f"Machine: {machine()}.", ""]
    if args.restarts:
        splits = [(5,), (1, 4), (4, 1), (3, 2), (2, 3), (2, 2, 1)]
        dtype_names = args.restart_dtypes.split(",")
        heading = "## Restarts" if dtype_names == ["fp32", "bf16"] else f"## Restarts in {', '.join(dtype_names)}"
        table = [
            "| shape | dtype | coefficients | matrix | standard | " + " | ".join("runs " + "+".join(map(str, r)) for r in splits) + " |",
            "|---|---|---|---|---|" + "---|" * len(splits),
            *[row for shape in args.restart_shapes.split(",") for row in restart_rows(parse_shape(shape), dtype_names, splits, args.seeds)],
        ]
        note = (
            f"Worst over {args.seeds} inputs of ‖O − U f(S) Vᵀ‖₂ (rounding error alone), 5 steps; "
            "runs L1+L2+...: steps between restarts (gram_segments(5) = 2+3; in fp16 2+2+1); inf: overflowed."
        )
        body = "\n".join([heading, "", *header, note, "", *table, ""])
        print(body)
        if not args.no_write:
            write_section(ROOT / "docs" / "newton_schulz.md", heading, body)
        return
    table = ["| shape | dtype | standard ms | gram ms | gram / standard time | gram / standard FLOPs |", "|---|---|---|---|---|---|"]
    shapes = [parse_shape(s) for s in (SWEEP_SHAPES if args.sweep else args.shapes).split(",")]
    table += speed_rows(shapes, "fp32", args.repeats)
    if args.bf16_shapes and not args.sweep:
        table += speed_rows([parse_shape(s) for s in args.bf16_shapes.split(",")], "bf16", args.repeats)
    heading = "## Crossover sweep" if args.sweep else "## Speed"
    speed = "\n".join([heading, "", *header, f"Median of {args.repeats} interleaved calls per algorithm, 5 Keller steps.", "", *table, ""])
    print(speed)
    if not args.no_write:
        write_section(ROOT / "docs" / "newton_schulz.md", heading, speed)
    if args.no_accuracy or args.sweep:
        return

    table = [
        "| shape | matrix | coefficients | dtype | standard | gram | gram, no restart |",
        "|---|---|---|---|---|---|---|",
        *accuracy_rows([parse_shape(s) for s in args.accuracy_shapes.split(",")], ["fp32", "bf16"]),
    ]
    note = "Each cell: ‖O Oᵀ − I‖₂ / ‖O − U Vᵀ‖₂ / ‖O − U f(S) Vᵀ‖₂ (5 steps; the last is rounding error alone)."
    accuracy = "\n".join(["## Accuracy", "", *header, note, "", *table, ""])
    print(accuracy)
    if not args.no_write:
        write_section(ROOT / "docs" / "newton_schulz.md", "## Accuracy", accuracy)


if __name__ == "__main__":
    main()
