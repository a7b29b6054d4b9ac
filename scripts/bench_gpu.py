"""Single-device benchmark for a GPU: Newton-Schulz in bf16 against torch.mm, and the optimizer step.

    python scripts/bench_gpu.py                 # on CUDA (what scripts/gpu_check.sh runs)
    python scripts/bench_gpu.py --device cpu    # smoke test of the script itself

Rows, all timed with CUDA events after warm-up, medians of repeats, side by side in one run:
  * torch.mm bf16 TFLOP/s on each Newton-Schulz shape (the ceiling), and orthogonalize()'s
    TFLOP/s on batches of the same shape (its share of that ceiling);
  * titan_muon.Muon.step (element-wise passes eager and compiled; fp16 Gram NS, what ns_dtype
    "auto" runs on CUDA, and bf16 standard NS; the atomic and the streaming commit) vs
    torch.optim.AdamW.step (default and fused kernels) on the same Llama-style parameters (one
    process: no communication): step time, the NS time inside Muon's step, the rest ("beyond
    NS") against fused AdamW's whole step, and the peak memory each step allocates on top of
    what it holds. Rows print as they are measured.
Prints a markdown section for docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch

from titan_muon import Muon, orthogonalize
from titan_muon.algorithm.newton_schulz import newton_schulz_flops


def timed(fn, device, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() on `device`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def llama_shapes(dim: int, hidden: int, kv: int) -> dict[str, tuple[int, int]]:
    return {"wq": (dim, dim), "wk": (kv, dim), "wv": (kv, dim), "wo": (dim, dim), "w1": (hidden, dim), "w2": (dim, hidden), "w3": (hidden, dim)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=14336)
    parser.add_argument("--kv", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = llama_shapes(args.dim, args.hidden, args.kv)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    say = lambda line: print(line, flush=True)  # row by row: a time-boxed GPU run keeps what it measured
    say(f"### {name}, torch {torch.__version__}, {datetime.date.today()}\n")
    say(f"`python scripts/bench_gpu.py --dim {args.dim} --hidden {args.hidden} --kv {args.kv} --layers {args.layers}`\n")

    say("| shape | batch | torch.mm bf16 TFLOP/s | orthogonalize bf16 TFLOP/s | share |\n|---|---|---|---|---|")
    for shape in sorted(set(shapes.values())):
        m, n = min(shape), max(shape)
        a, b = torch.randn(m, n, device=device, dtype=torch.bfloat16), torch.randn(n, m, device=device, dtype=torch.bfloat16)
        mm_ms = timed(lambda: a @ b, device, args.repeats)
        mm_tflops = 2 * m * n * m / mm_ms / 1e9
        batch = args.layers
        x = torch.randn(batch, *shape, device=device)
        ns_ms = timed(lambda: orthogonalize(x, 5, "keller", torch.bfloat16), device, args.repeats)
        ns_tflops = batch * newton_schulz_flops(*shape, 5) / ns_ms / 1e9
        say(f"| {shape[0]}×{shape[1]} | {batch} | {mm_tflops:.0f} | {ns_tflops:.0f} | {ns_tflops / mm_tflops:.0%} |")

    def params():
        gen = torch.Generator(device=device).manual_seed(0)
        return [torch.nn.Parameter(torch.randn(*s, device=device, generator=gen) * 0.02) for _ in range(args.layers) for s in shapes.values()]

    def with_grads(ps):
        for p in ps:
            p.grad = torch.randn_like(p)
        return ps

    def peak_mib(fn) -> float:
        """Peak memory allocated during fn() above what was allocated before it (MiB; CUDA only)."""
        if device.type != "cuda":
            return float("nan")
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20

    adamw = torch.optim.AdamW(with_grads(params()), lr=1e-3)
    fused_adamw = torch.optim.AdamW(with_grads(params()), lr=1e-3, fused=device.type == "cuda")
    say("\n| optimizer step (one device) | ms | NS ms | beyond NS ms | beyond NS / fused AdamW step | peak extra MiB |\n|---|---|---|---|---|---|")
    fused_ms = None

    def row(label, step_ms, ns_ms, peak):
        beyond = step_ms - (ns_ms or 0.0)
        say(f"| {label} | {step_ms:.1f} | {'' if ns_ms is None else f'{ns_ms:.1f}'} | {beyond:.1f} | {beyond / fused_ms:.2f}× | {peak:.0f} |")

    fused_ms = timed(fused_adamw.step, device, args.repeats)
    row("torch.optim.AdamW (default kernel)", timed(adamw.step, device, args.repeats), None, peak_mib(adamw.step))
    row("torch.optim.AdamW (fused)", fused_ms, None, peak_mib(fused_adamw.step))
    del adamw, fused_adamw
    variants = [  # (label, Muon options); ns_dtype "auto": fp16 Gram NS on rectangular matrices on CUDA
        ("element-wise passes eager", dict(compile_elementwise=False)),
        ("element-wise passes compiled", dict(compile_elementwise=True)),
        ("compiled, bf16 standard NS everywhere", dict(compile_elementwise=True, ns_algorithm="standard")),
        ("compiled, streaming commit", dict(compile_elementwise=True, commit="streaming")),
    ]
    for label, options in variants:
        muon = Muon(with_grads(params()), lr=0.02, adjust_lr_fn="match_rms_adamw", **options)
        ns_times = []

        def step_and_record(muon=muon, ns_times=ns_times):
            muon.step()
            ns_times.append(muon.last_step_metrics["muon/ns_time_ms"])  # read after the step's own timing

        step_ms = timed(muon.step, device, args.repeats)
        timed(step_and_record, device, args.repeats, warmup=0)
        row(f"titan_muon.Muon, {label}", step_ms, statistics.median(ns_times), peak_mib(muon.step))
        del muon, step_and_record

if __name__ == "__main__":
    main()
