"""End-to-end training step on torchtitan's llama3 model under FSDP2, CPU/gloo, W ranks.

Every mode runs in the same processes, one after another, on the same batches, so the
ratios compare like with like on a shared, noisy machine:

    adamw              torch.optim.AdamW on the FSDP2 shards (torchtitan's default optimizer)
    muon               titan_muon.Muon, all Muon traffic inside step()
    muon+overlap       outbound traffic started from gradient hooks during backward
    muon+fp8           FP8 momentum (row-scaled e4m3, stochastic rounding)
    muon+overlap+fp8

    python scripts/bench_training.py --flavor debug          # torchtitan llama3 debugmodel with 4 KV heads
    python scripts/bench_training.py --flavor 100m --steps 3

Writes the table to docs/performance.md (section "Training step, <flavor>") unless --no-write.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_optimizer import ROOT, run_on_ranks, write_section  # noqa: E402

from titan_muon import Muon, build_param_groups  # noqa: E402
from titan_muon.update import local_shard  # noqa: E402

FLAVORS = {
    # torchtitan's llama3 "debugmodel", with GQA.
    "debug": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=2048),
    # About 100M parameters (85M in matrices + 25M embedding/head).
    "100m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=16384),
}
MODES = ("adamw", "muon", "muon+overlap", "muon+fp8", "muon+overlap+fp8")


def build(flavor: str, mesh, seq_len: int):
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(**FLAVORS[flavor], max_seq_len=seq_len))
    with torch.no_grad():
        model.init_weights()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def optimizer_for(mode: str, model, ns_dtype: str):
    if mode == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    kwargs = dict(lr=3e-4, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype, overlap="overlap" in mode)
    if "fp8" in mode:
        kwargs["momentum_dtype"] = "fp8"
    return Muon(build_param_groups(model), **kwargs)


def state_bytes(opt) -> int:
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = local_shard(value)
                total += local.numel() * local.element_size()
    return total


def _rank_main(rank, world, args):
    mesh = init_device_mesh("cpu", (world,))
    vocab = FLAVORS[args.flavor]["vocab_size"]
    results = {}
    for mode in args.modes.split(","):
        model = build(args.flavor, mesh, args.seq)
        opt = optimizer_for(mode, model, args.ns_dtype)
        timings = []
        for step in range(args.warmup + args.steps):
            gen = torch.Generator().manual_seed(step * world + rank)
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.accum):
                tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / args.accum
                loss.backward()
            backward_done = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            opt.zero_grad()
            done = time.perf_counter()
            if step >= args.warmup:
                metrics = getattr(opt, "last_step_metrics", {})
                timings.append(dict(
                    step=done - started, fwd_bwd=backward_done - started, opt=done - backward_done,
                    ns=metrics.get("muon/ns_time_ms", 0.0) / 1e3,
                    bytes_step=metrics.get("muon/bytes_sent", 0.0),
                    bytes_backward=metrics.get("muon/bytes_sent_in_backward", 0.0),
                ))  # fmt: skip
        params = sum(p.to_local().numel() for p in model.parameters())
        results[mode] = dict(timings=timings, state_bytes=state_bytes(opt), local_params=params, loss=loss.item() * args.accum)
        del model, opt
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", choices=tuple(FLAVORS), default="debug")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--ns-dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    per_rank = run_on_ranks(_rank_main, args.world, args)

    def median(mode, key, reduce=max):  # a step lasts as long as its slowest rank
        return statistics.median(reduce(r[mode]["timings"][i][key] for r in per_rank) for i in range(args.steps))

    modes = list(per_rank[0])
    base = median("adamw", "step") if "adamw" in modes else None
    tokens = args.world * args.batch * args.seq * args.accum
    lines = [
        "| mode | step ms | vs AdamW | fwd+bwd ms | after-backward ms | NS ms (share of step) | Muon bytes/rank: in backward / in step | optimizer state B/param |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        step, ns = median(mode, "step"), median(mode, "ns")
        sent_bwd, sent_step = median(mode, "bytes_backward"), median(mode, "bytes_step")
        state = max(r[mode]["state_bytes"] / r[mode]["local_params"] for r in per_rank)
        ratio = f"{step / base:.2f}x" if base else "-"
        comm = f"{sent_bwd / 2**20:.1f} / {sent_step / 2**20:.1f} MiB" if mode != "adamw" else "-"
        lines.append(
            f"| {mode} | {1e3 * step:.0f} | {ratio} | {1e3 * median(mode, 'fwd_bwd'):.0f} | {1e3 * median(mode, 'opt'):.0f} "
            f"| {1e3 * ns:.0f} ({100 * ns / step:.0f} %) | {comm} | {state:.2f} |"
        )
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    command = "python scripts/bench_training.py " + " ".join(sys.argv[1:])
    report = "\n".join([
        f"## Training step, {args.flavor} (scripts/bench_training.py)",
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, W={args.world}, {args.threads} thread(s) per rank; "
        f"llama3 {FLAVORS[args.flavor]}, {tokens} tokens per step, NS in {args.ns_dtype}, grad-norm clipping on; "
        f"median of {args.steps} steps after {args.warmup} warm-up; {time.strftime('%Y-%m-%d')}.",
        "",
        *lines,
        "",
        "\"after-backward\" is clipping plus `optimizer.step()`. Optimizer state counts every state tensor "
        "(AdamW groups included) per local parameter element.",
        "",
    ])  # fmt: skip
    print(report)
    if not args.no_write:
        write_section(ROOT / "docs" / "performance.md", f"## Training step, {args.flavor}", report)


if __name__ == "__main__":
    main()
