"""Optimizer-step benchmark on transformer-shaped matrices, CPU/gloo, measured side by side.

Rows: titan_muon at each world size (fp32 NS with the default ns_algorithm="auto", i.e. Gram NS
on the MLP and k/v matrices; fp32 standard NS only; bf16 NS), a gather-everything distributed Muon (every rank
all-gathers every matrix and runs all Newton-Schulz work itself), torch.optim.Muon in one
process, and torch.optim.AdamW on the same FSDP-style shards. Every rank runs with the same
number of threads, so W=2 vs W=1 compares the same per-rank compute.

    python scripts/bench_optimizer.py                       # 8 layers, d=1024, ffn 2816, GQA 4 KV heads
    python scripts/bench_optimizer.py --layers 2 --steps 2  # quick look
    python scripts/bench_optimizer.py --variants fp32,fp32-standard --torch-muon-steps 0   # CPUs without fast bf16

Writes a markdown table to docs/performance.md (section "Optimizer step") unless --no-write.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan_muon import Muon
from titan_muon.algorithm.newton_schulz import newton_schulz_flops, orthogonalize, resolve_algorithm
from titan_muon.algorithm.update import Elementwise, commit_scale, update_scale
from titan_muon.exchange.plan import shard_rows

ROOT = Path(__file__).resolve().parents[1]


def transformer_shapes(layers: int, dim: int, ffn: int, heads: int, kv_heads: int) -> dict[str, tuple[int, ...]]:
    kv_dim = dim // heads * kv_heads
    shapes = {}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "attention.wq": (dim, dim), p + "attention.wk": (kv_dim, dim), p + "attention.wv": (kv_dim, dim)}
        shapes |= {p + "attention.wo": (dim, dim), p + "ffn.w1": (ffn, dim), p + "ffn.w3": (ffn, dim), p + "ffn.w2": (dim, ffn)}
        shapes |= {p + "attention_norm": (dim,), p + "ffn_norm": (dim,)}
    return shapes


def make_module(shapes, mesh) -> nn.Module:
    module = nn.Module()
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        full = torch.randn(*shape, generator=gen) * 0.02
        tensor = full if mesh is None else distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(name.replace(".", "_"), nn.Parameter(tensor))
    return module


def set_grads(module, mesh, step):
    gen = torch.Generator().manual_seed(step)
    for p in module.parameters():
        full = torch.randn(p.shape, generator=gen)
        p.grad = full if mesh is None else distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)


class GatherEverythingMuon:
    """What gathering under dim-0 sharding amounts to: every rank all-gathers and orthogonalizes every matrix."""

    def __init__(self, params, lr=0.02, weight_decay=0.1, momentum=0.95, ns_dtype=torch.float32):
        self.params, self.lr, self.wd, self.mu, self.ns_dtype = params, lr, weight_decay, momentum, ns_dtype
        self.momentum = [torch.zeros_like(p.to_local()) for p in params]
        self.bytes_sent = 0
        self.elementwise = Elementwise(compiled=False)

    @torch.no_grad()
    def step(self):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.bytes_sent = 0
        for p, buf in zip(self.params, self.momentum):
            local = torch.empty_like(buf)
            self.elementwise.nesterov_inputs_into([local], [p.grad.to_local()], [buf], self.mu, True)
            self.elementwise.momentum_updates_([buf], [p.grad.to_local()], self.mu)
            rows, cols = p.shape
            chunk = -(-rows // world)
            padded = torch.zeros(chunk, cols)
            padded[: local.shape[0]] = local
            gathered = torch.empty(chunk * world, cols)
            dist.all_gather_into_tensor(gathered, padded)
            self.bytes_sent += (world - 1) * padded.numel() * 4
            full = torch.cat([gathered[r * chunk : r * chunk + (e - s)] for r, (s, e) in enumerate(shard_rows(rows, world))])
            ortho = orthogonalize(full, dtype=self.ns_dtype, algorithm="auto").float() * update_scale("match_rms_adamw", rows, cols) * commit_scale(self.wd)
            start, end = shard_rows(rows, world)[rank]
            self.elementwise.decay_and_step_([p.to_local()], [ortho[start:end]], self.lr, self.wd)


def _timed_steps(opt, module, mesh, steps, warmup):
    times = []
    for s in range(warmup + steps):
        set_grads(module, mesh, s)
        if mesh is not None:
            dist.barrier()
        started = time.perf_counter()
        opt.step()
        if s >= warmup:
            times.append(time.perf_counter() - started)
    return times


def _gloo_rank(rank, world, port, fn, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.save(fn(rank, world, args), Path(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def cpu_name() -> str:
    """The CPU's model name, for the machine line of a benchmark's report."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []  # Linux only
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor() or "?")


def run_on_ranks(fn, world: int, args) -> list:
    """fn(rank, world, args) on `world` gloo ranks with args.threads threads each; per-rank results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_gloo_rank, args=(world, port, fn, args, out_dir), nprocs=world, start_method="spawn")
        return [torch.load(Path(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


# --variants: label, ns_dtype, ns_algorithm
VARIANTS = {
    "fp32": ("titan_muon", "fp32", "auto"),
    "fp32-standard": ("titan_muon (standard NS only)", "fp32", "standard"),
    "bf16": ("titan_muon (bf16 NS)", "bf16", "auto"),
}


def _rank_main(rank, world, args):
    mesh = init_device_mesh("cpu", (world,))
    shapes = transformer_shapes(args.layers, args.dim, args.ffn, args.heads, args.kv_heads)
    results = {}

    def muon_groups(module):
        named = list(module.named_parameters())
        return [
            {"params": [(n, p) for n, p in named if p.ndim == 2]},
            {"params": [(n, p) for n, p in named if p.ndim != 2], "use_muon": False},
        ]

    for variant in args.variants.split(","):
        label, ns_dtype, algorithm = VARIANTS[variant]
        module = make_module(shapes, mesh)
        opt = Muon(muon_groups(module), lr=0.02, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype, ns_algorithm=algorithm)
        times = _timed_steps(opt, module, mesh, args.steps, args.warmup)
        m = opt.last_step_metrics

        def flops(unit, dtype=opt.ns_dtype, algorithm=algorithm):
            resolved = resolve_algorithm(unit.rows, unit.cols, dtype, "cpu") if algorithm == "auto" else algorithm
            return newton_schulz_flops(unit.rows, unit.cols, 5, resolved)

        plan = opt.engines[0].plan
        loads = [sum(flops(u) for u, o in zip(plan.units, plan.owners) if o == r) for r in range(world)]
        results[label] = dict(
            times=times, bytes_sent=m["muon/bytes_sent"], ns_gflops=m["muon/ns_flops"] / max(m["muon/ns_time_ms"], 1e-9) / 1e6,
            balance=max(loads) / (sum(loads) / world), local_bytes=sum(p.to_local().numel() * 4 for p in module.parameters() if p.ndim == 2),
        )
        del module, opt

    if world > 1:
        module = make_module(shapes, mesh)
        opt = GatherEverythingMuon([p for p in module.parameters() if p.ndim == 2])
        results["gather-everything Muon"] = dict(times=_timed_steps(opt, module, mesh, args.steps, args.warmup), bytes_sent=opt.bytes_sent, balance=float(world))
        del module, opt

    module = make_module(shapes, mesh)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    results["FSDP2-style AdamW (torch.optim.AdamW)"] = dict(times=_timed_steps(opt, module, mesh, args.steps, args.warmup), bytes_sent=0)
    return results


def run_world(world, args):
    per_rank = run_on_ranks(_rank_main, world, args)
    # The step is as slow as its slowest rank.
    merged = {}
    for label in per_rank[0]:
        steps = list(zip(*(r[label]["times"] for r in per_rank)))
        merged[label] = dict(per_rank[0][label], median_ms=1e3 * statistics.median(max(s) for s in steps))
        merged[label]["bytes_sent"] = max(r[label]["bytes_sent"] for r in per_rank)
        if "ns_gflops" in per_rank[0][label]:
            merged[label]["ns_gflops"] = min(r[label]["ns_gflops"] for r in per_rank)
    return merged


def torch_muon_one_process(args):
    torch.set_num_threads(args.threads)
    shapes = {n: s for n, s in transformer_shapes(args.layers, args.dim, args.ffn, args.heads, args.kv_heads).items() if len(s) == 2}
    module = make_module(shapes, None)
    opt = torch.optim.Muon(module.parameters(), lr=0.02, adjust_lr_fn="match_rms_adamw")
    return 1e3 * statistics.median(_timed_steps(opt, module, None, args.torch_muon_steps, 1))


def mm_gflops(args) -> float:
    torch.set_num_threads(args.threads)
    a, b = torch.randn(args.dim, args.dim), torch.randn(args.dim, args.ffn)
    a @ b
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        a @ b
        runs.append(time.perf_counter() - started)
    return 2 * args.dim * args.dim * args.ffn / statistics.median(runs) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--variants", default="fp32,fp32-standard,bf16",
                        help=f"titan_muon rows, comma-separated from {sorted(VARIANTS)}; the first is the baseline")  # fmt: skip
    parser.add_argument("--torch-muon-steps", type=int, default=1, help="0 skips torch.optim.Muon (bf16 NS: slow without AMX)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    worlds = [int(w) for w in args.worlds.split(",")]
    mm = mm_gflops(args)
    by_world = {w: run_world(w, args) for w in worlds}
    torch_muon_ms = torch_muon_one_process(args) if args.torch_muon_steps else None
    first = VARIANTS[args.variants.split(",")[0]][0]
    base = by_world[worlds[0]][first]["median_ms"]
    lines = [
        f"| optimizer | W | median step ms | vs {first} W={worlds[0]} | NS GFLOP/s (% of torch.mm) | Muon bytes sent / rank | NS load max/mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for w, rows in by_world.items():
        for label, r in rows.items():
            ns = f"{r['ns_gflops']:.0f} ({100 * r['ns_gflops'] / mm:.0f} %)" if "ns_gflops" in r else "-"
            balance = f"{r['balance']:.3f}" if "balance" in r else "-"
            lines.append(f"| {label} | {w} | {r['median_ms']:.0f} | {base / r['median_ms']:.2f}x | {ns} | {r['bytes_sent'] / 2**20:.1f} MiB | {balance} |")
    if torch_muon_ms is not None:
        lines.append(f"| torch.optim.Muon (bf16 NS, one process) | 1 | {torch_muon_ms:.0f} | {base / torch_muon_ms:.2f}x | - | 0 | - |")

    ratios = []
    if 2 in by_world:
        ours2 = by_world[2][first]["median_ms"]
        ratios.append(f"- {first} W=2 vs gather-everything W=2: **{by_world[2]['gather-everything Muon']['median_ms'] / ours2:.2f}x** faster")
        if 1 in by_world:
            ratios.append(f"- {first} W=2 vs W=1 (same threads per rank): **{by_world[1][first]['median_ms'] / ours2:.2f}x** faster")
        standard = VARIANTS["fp32-standard"][0]
        if standard in by_world[2] and first != standard:
            ratios.append(f"- {first} vs {standard}, W=2: **{by_world[2][standard]['median_ms'] / ours2:.2f}x** faster")
    ratios.append(f"- torch.mm ({args.dim}x{args.dim} @ {args.dim}x{args.ffn}, fp32, {args.threads} thread): {mm:.0f} GFLOP/s")

    cpu = cpu_name()
    command = "python scripts/bench_optimizer.py " + " ".join(sys.argv[1:])
    report = "\n".join(
        [
            "## Optimizer step (scripts/bench_optimizer.py)",
            "",
            f"Command: `{command.strip()}`  ",
            f"Machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, {args.threads} thread(s) per rank; "
            f"{args.layers} layers, d={args.dim}, ffn={args.ffn}, {args.heads} heads / {args.kv_heads} KV heads; "
            f"median of {args.steps} steps after {args.warmup} warm-up; {time.strftime('%Y-%m-%d')}.",
            "",
            *lines,
            "",
            *ratios,
            "",
        ]
    )
    print(report)
    if not args.no_write:
        write_section(ROOT / "docs" / "performance.md", "## Optimizer step", report)


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace (or append) the section starting at `heading`, keeping the rest of the file."""
    text = path.read_text() if path.exists() else "# Performance\n\nAll figures are measured by scripts in `scripts/`; each section names its command.\n\n"
    if heading in text:
        start = text.index(heading)
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + body + (text[nxt + 1 :] if nxt != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)


if __name__ == "__main__":
    main()
