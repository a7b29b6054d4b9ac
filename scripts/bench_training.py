"""End-to-end training step on torchtitan's llama3 model under FSDP2, CPU/gloo, W ranks.

Every mode runs in the same processes on the same batches, the modes taking their steps in
turn (alternating order), so the ratios compare like with like on a shared, noisy machine:

    adamw              torch.optim.AdamW on the FSDP2 shards, torch's default (for-loop) kernel
    adamw-fused        the same with fused=True, torchtitan's default implementation
    muon               titan_muon.Muon, all Muon traffic inside step(); its AdamW groups
                       (embeddings, output, norms) run fused AdamW, its default
    muon+overlap       outbound traffic started from gradient hooks during backward
    muon+fp8           FP8 momentum (row-scaled e4m3, stochastic rounding)
    muon+overlap+fp8

    python scripts/bench_training.py --flavor debug --accum 1,8        # 2 k and 16 k tokens per step
    python scripts/bench_training.py --flavor 100m --steps 3 --accum 8

By default the ranks run with glibc malloc told to keep freed memory (--malloc retain:
MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=1 TiB), as PyTorch's CUDA caching allocator does on a
GPU. With glibc's defaults (--malloc default) the heap shrinks between steps once gradient
accumulation has churned through activations, and every step's fresh exchange buffers
page-fault again inside the step (measured: ~4,400 faults per step at 16 k tokens, none at 2 k),
which charges the optimizer for the allocator rather than for its work.

"optimizer ms" is ``optimizer.step()`` alone; "beyond NS" is that minus the step's
Newton-Schulz time on the rank whose NS took longest, compared with AdamW's whole ``step()``:
the work Muon adds around NS.

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
from bench_optimizer import ROOT, cpu_name, run_on_ranks, write_section  # noqa: E402

from titan_muon import Muon, build_param_groups  # noqa: E402
from titan_muon.base.dtensor import local_shard  # noqa: E402

FLAVORS = {
    # torchtitan's llama3 "debugmodel", with GQA.
    "debug": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=2048),
    # About 100M parameters (85M in matrices + 25M embedding/head).
    "100m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=16384),
}
MALLOC_SETTINGS = {
    "retain": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)},
    "default": {},
}


def use_malloc(setting: str) -> None:
    """Give the ranks spawned from now on MALLOC_SETTINGS[setting] (glibc reads them at start-up)."""
    for name in MALLOC_SETTINGS["retain"]:
        os.environ.pop(name, None)
    os.environ.update(MALLOC_SETTINGS[setting])


MODES = ("adamw", "adamw-fused", "muon", "muon+overlap", "muon+fp8", "muon+overlap+fp8")


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
    if mode.startswith("adamw"):
        fused = mode == "adamw-fused"  # torchtitan's default optimizer.implementation
        return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    kwargs = dict(lr=3e-4, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype, overlap="overlap" in mode)
    if "fp8" in mode:
        kwargs["momentum_dtype"] = "fp8"
    return Muon(build_param_groups(model), **kwargs)


def state_bytes(opt) -> int:
    if hasattr(opt, "local_state_bytes"):
        return opt.local_state_bytes()
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = local_shard(value)
                total += local.numel() * local.element_size()
    return total


def _rank_main(rank, world, args):
    mesh = init_device_mesh("cpu", (world,))
    return {accum: _runs(rank, world, args, mesh, accum) for accum in args.accum}


def _runs(rank, world, args, mesh, accum):
    """Every mode's model and optimizer live side by side and take their steps in turn, so a
    slow spell of this shared machine hits all modes alike."""
    vocab = FLAVORS[args.flavor]["vocab_size"]
    modes = args.modes.split(",")
    runs = {}
    for mode in modes:
        model = build(args.flavor, mesh, args.seq)
        runs[mode] = dict(model=model, opt=optimizer_for(mode, model, args.ns_dtype), timings=[])
    for step in range(args.warmup + args.steps):
        for mode in modes if step % 2 == 0 else reversed(modes):
            model, opt = runs[mode]["model"], runs[mode]["opt"]
            gen = torch.Generator().manual_seed(step * world + rank)
            dist.barrier()
            started = time.perf_counter()
            for _ in range(accum):
                tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / accum
                loss.backward()
            backward_done = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            clipped = time.perf_counter()
            opt.step()
            stepped = time.perf_counter()
            opt.zero_grad()
            done = time.perf_counter()
            runs[mode]["loss"] = loss.item() * accum
            if step >= args.warmup:
                metrics = getattr(opt, "last_step_metrics", {})
                runs[mode]["timings"].append(dict(
                    step=done - started, fwd_bwd=backward_done - started, opt=stepped - clipped,
                    ns=metrics.get("muon/ns_time_ms", 0.0) / 1e3,
                    bytes_to_owners=metrics.get("muon/bytes_sent_to_owners", 0.0),
                    bytes_backward=metrics.get("muon/bytes_sent_in_backward", 0.0),
                    peak=metrics.get("muon/peak_transient_bytes", 0.0),
                ))  # fmt: skip
    results = {}
    for mode, run in runs.items():
        params = sum(p.to_local().numel() for p in run["model"].parameters())
        results[mode] = dict(timings=run["timings"], state_bytes=state_bytes(run["opt"]), local_params=params, loss=run["loss"])
    return results


def beyond_ns(runs, mode: str, steps: int) -> float:
    """Median over steps of optimizer time minus NS time on the rank whose NS took longest: the
    other ranks wait in the all-to-all for its updates, so their difference would count that
    wait (NS jitter between ranks sharing a busy machine), not work around NS."""
    per_step = []
    for i in range(steps):
        slowest = max((r[mode]["timings"][i] for r in runs), key=lambda t: t["ns"])
        per_step.append(slowest["opt"] - slowest["ns"])
    return statistics.median(per_step)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", choices=tuple(FLAVORS), default="debug")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--accum", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8],
                        help="micro-batches per step, comma-separated: one table row group per value")  # fmt: skip
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--ns-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--malloc", choices=tuple(MALLOC_SETTINGS), default="retain",
                        help="glibc malloc settings of the ranks (see above)")  # fmt: skip
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    use_malloc(args.malloc)

    per_rank = run_on_ranks(_rank_main, args.world, args)
    fused = "adamw-fused" in args.modes.split(",")
    lines = [
        "| tokens/step | mode | step ms | vs AdamW | fwd+bwd ms | optimizer ms | NS ms (share of step) | beyond NS vs AdamW's step | "
        + ("beyond NS vs fused AdamW's step | " if fused else "")
        + "Muon bytes/rank to owners: in backward / in step | peak transient MiB | state B/param |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if fused else "") + "---|---|---|",
    ]
    for accum in args.accum:
        runs = [r[accum] for r in per_rank]

        def median(mode, key, reduce=max):  # a step lasts as long as its slowest rank
            return statistics.median(reduce(r[mode]["timings"][i][key] for r in runs) for i in range(args.steps))

        modes = list(runs[0])
        base = median("adamw", "step") if "adamw" in modes else None
        base_opts = [median(m, "opt") if m in modes else None for m in ("adamw", "adamw-fused")[: 1 + fused]]
        tokens = args.world * args.batch * args.seq * accum
        for mode in modes:
            step, ns, opt = median(mode, "step"), median(mode, "ns"), median(mode, "opt")
            state = max(r[mode]["state_bytes"] / r[mode]["local_params"] for r in runs)
            ratio = f"{step / base:.2f}x" if base else "-"
            muon = not mode.startswith("adamw")
            beyond = [f"{beyond_ns(runs, mode, args.steps) / b:.2f}x" if b and muon else "-" for b in base_opts]
            comm = f"{median(mode, 'bytes_backward') / 2**20:.1f} / {median(mode, 'bytes_to_owners') / 2**20:.1f} MiB" if muon else "-"
            peak = f"{median(mode, 'peak') / 2**20:.1f}" if muon else "-"
            lines.append(
                f"| {tokens} | {mode} | {1e3 * step:.0f} | {ratio} | {1e3 * median(mode, 'fwd_bwd'):.0f} | {1e3 * opt:.0f} "
                f"| {1e3 * ns:.0f} ({100 * ns / step:.0f} %) | {' | '.join(beyond)} | {comm} | {peak} | {state:.2f} |"
            )
    cpu = cpu_name()
    command = "python scripts/bench_training.py " + " ".join(sys.argv[1:])
    report = "\n".join([
        f"## Training step, {args.flavor} (scripts/bench_training.py)",
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, W={args.world}, {args.threads} thread(s) per rank; "
        f"llama3 {FLAVORS[args.flavor]}, NS dtype {args.ns_dtype}, grad-norm clipping on, malloc {args.malloc}; "
        f"median of {args.steps} steps after {args.warmup} warm-up; {time.strftime('%Y-%m-%d')}.",
        "",
        *lines,
        "",
        "\"optimizer ms\" is `optimizer.step()` alone; \"beyond NS\" is that minus Newton-Schulz on the rank whose NS took longest "
        "(the others wait for it), against AdamW's step. "
        "Optimizer state counts every state tensor (AdamW groups included) per local parameter element.",
        "",
    ])  # fmt: skip
    print(report)
    if not args.no_write:
        write_section(ROOT / "docs" / "performance.md", f"## Training step, {args.flavor}", report)


if __name__ == "__main__":
    main()
