#!/usr/bin/env python
"""DeMo quality benchmark (issue 27): full-sync Muon, AdamW and DeMo-Muon, lr-swept, several seeds.

    PYTHONPATH=. python scripts/bench_demo.py                    # the whole benchmark (resumable)
    PYTHONPATH=. python scripts/bench_demo.py --analyse-only     # table, JSON and figure from the runs

Every arm trains the same small Llama-3-style model (torchtitan 0.2.2's ``llama3`` Transformer,
``--model bench``: dim 128, 4 layers, 4 query / 2 key-value heads, 1.31 M parameters) on the
offline Python-stdlib corpus with the same total batch per step (16 × 128 tokens), the same
schedule (warmup 20 steps, then linear decay to 0: torchtitan's) and, per seed, the same initial
weights and the same batches:

* ``muon``: titan_muon.Muon as in train_configs/llama3_gqa_muon.toml (momentum 0.95, Nesterov,
  5 Keller Newton–Schulz steps, per-head split of the attention projections, weight decay 0.1,
  AdamW 0.9/0.95 on embeddings, head and norms at ``adamw_lr``); full sync.
* ``adamw``: torch's AdamW as in train_configs/llama3_gqa_adamw.toml (0.9/0.95, wd 0.1); full sync.
* ``demo``: the same Muon with ``demo=True``, the DCT compressor and its defaults (chunk 64, top-k 8,
  α 1, the shared Nesterov momentum) and ``demo_adamw="dense"`` (the AdamW tensors' gradients
  all-reduced densely: the one switch before sign compression became its default), R replicas,
  each one process holding the whole model (1 shard per replica) and its own 16/R sequences of
  every batch, ``replicate_group`` = the R processes (gloo). Each replica's gradient is its own
  mean and is clipped on its own (as the torchtitan integration does); the optimizer averages
  only what DeMo sends.
* ``demo_lowrank``: the same with ``demo_compressor="low_rank"`` (rank 4).
* ``demo_sign``, ``demo_lowrank_sign`` (not in the default ``--arms``): today's one switch, the
  AdamW tensors sign-compressed. An arm whose ``requires`` keyword titan_muon.Muon lacks is skipped
  with a note. Adding a variant is one entry of ``ARMS``.

Full sync is run as one process on the whole batch: data parallelism over R replicas that
average their equal-size batches' mean gradients is the same gradient (up to the summation
order), so the full-sync result does not depend on R (``run --sync-processes R`` runs it as R
gloo processes that all-reduce gradients; tests/test_bench_demo.py checks the two agree).

Learning rates: each arm's lr (Muon: the matrices' lr and the AdamW groups' lr together) is
swept over multipliers of the shipped config's (``--lr-mults``, default 0.5, 1, 2) at seed 0, and
extended by ×2 steps while the best is at an edge (``--max-extend``). The best is chosen by the
final loss on a **validation** slice (files of the corpus set apart for it, ``--val-tokens``,
evaluated every ``--val-every`` steps for the curves); then ``--seeds`` seeds run at the best lr,
and the **held-out** loss (other files, ``--test-tokens``, evaluated once at the end) is what the
table reports. Parity: mean held-out loss of an arm ≤ full-sync Muon's + max(2σ, 0.02), σ the
pooled sample standard deviation over seeds of the two arms.

Corpus split (by SHA-1 of the file's path, as titan_muon.torchtitan.data does): key % 20 ∈ {0, 1}
held-out (key % 20 = 0 are torchtitan's python_stdlib_validation files), = 2 validation, the rest
training. A 2048-token byte-level BPE is trained on the training files only (``--tokenizer bpe``).

Bytes across replicas per step (docs/demo.md "Bytes", ring model), summed over the R replicas:
DeMo: every rank's logged ``demo/bytes_sent`` + ``demo/adamw_bytes_sent``; full sync:
R · 2(R − 1)/R · 4N = 8(R − 1)N (the fp32 gradient all-reduce of all N parameters).

Every run writes ``runs/<id>.json`` (and a log) under ``--out-dir``; an existing result is reused,
so an interrupted benchmark continues where it stopped. The summary goes to ``--json``
(docs/demo_quality.json) and the figure to ``--png`` (docs/demo_quality.png).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

SPLIT_ONE_IN = 20
TEST_KEYS, VAL_KEYS = (0, 1), (2,)
MAX_NORM = 1.0
WARMUP = 20


@dataclass(frozen=True)
class Arm:
    """One optimizer setup. ``base_lr`` / ``base_adamw_lr`` are the shipped configs' (×1 of the sweep)."""

    label: str
    optimizer: str  # "muon" or "adamw"
    sync: str  # "full" (gradients averaged over all replicas) or "demo"
    base_lr: float
    base_adamw_lr: float | None = None  # Muon's AdamW groups (embeddings, head, norms)
    demo_options: dict = field(default_factory=dict)
    requires: str | None = None  # a titan_muon.Muon keyword the arm needs; skipped when absent
    color: str = "black"


DENSE_ADAMW = {"demo_adamw": "dense"}  # the AdamW tensors' gradients all-reduced densely (the only way before sign)
ARMS = {
    "muon": Arm("Muon, full sync", "muon", "full", 0.02, 0.003, color="tab:orange"),
    "adamw": Arm("AdamW, full sync", "adamw", "full", 0.003, color="tab:blue"),
    "demo": Arm("DeMo-DCT (k 8, α 1, shared momentum; AdamW dense)", "muon", "demo", 0.02, 0.003,
                {"demo_compressor": "dct", **DENSE_ADAMW}, requires="demo_adamw", color="tab:green"),
    "demo_lowrank": Arm("DeMo low-rank (rank 4, α 1, shared momentum; AdamW dense)", "muon", "demo", 0.02, 0.003,
                        {"demo_compressor": "low_rank", **DENSE_ADAMW}, requires="demo_compressor", color="tab:purple"),
    # the one switch since sign-compressed AdamW became the default (not in the default --arms: not run yet)
    "demo_sign": Arm("DeMo-DCT, one switch (k 8; AdamW sign)", "muon", "demo", 0.02, 0.003,
                     requires="demo_adamw", color="tab:olive"),
    "demo_lowrank_sign": Arm("DeMo low-rank (rank 4; AdamW sign)", "muon", "demo", 0.02, 0.003,
                             {"demo_compressor": "low_rank"}, requires="demo_adamw", color="tab:brown"),
    # bytes against quality: rank 16 sends 4x rank 4's (not in the default --arms)
    "demo_lowrank_r16": Arm("DeMo low-rank (rank 16; AdamW dense)", "muon", "demo", 0.02, 0.003,
                            {"demo_compressor": "low_rank", "demo_rank": 16, **DENSE_ADAMW}, requires="demo_compressor",
                            color="tab:pink"),
}  # fmt: skip


@dataclass(frozen=True)
class ModelPreset:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    multiple_of: int
    seq_len: int
    batch: int  # sequences per step, all replicas together


MODELS = {
    "bench": ModelPreset(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=128, seq_len=128, batch=16),
    # the shipped llama3_gqa_*.toml's debugmodel_gqa as scripts/train.sh runs it (2 ranks x 4 sequences of 256)
    "config": ModelPreset(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, multiple_of=256, seq_len=256, batch=8),
    "tiny": ModelPreset(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64, seq_len=32, batch=8),  # tests
}


def arm_available(arm: Arm) -> bool:
    if arm.requires is None:
        return True
    from titan_muon import Muon

    return arm.requires in inspect.signature(Muon.__init__).parameters


# ---------------------------------------------------------------------------------------- data


def corpus_files() -> dict[str, list[str]]:
    """Texts of the stdlib's ``*.py`` files by split, in a fixed order (by the path's SHA-1 key)."""
    from titan_muon.torchtitan.data import _SKIPPED_DIRS, STDLIB_DIR, _file_key

    keyed = []
    for directory, subdirectories, names in os.walk(STDLIB_DIR):
        subdirectories[:] = sorted(d for d in subdirectories if d not in _SKIPPED_DIRS)
        for name in names:
            path = Path(directory, name)
            if path.suffix == ".py":
                keyed.append((_file_key(path.relative_to(STDLIB_DIR).as_posix()), path))
    keyed.sort()
    splits: dict[str, list[str]] = {"train": [], "validation": [], "test": []}
    for key, path in keyed:
        bucket = key % SPLIT_ONE_IN
        split = "test" if bucket in TEST_KEYS else "validation" if bucket in VAL_KEYS else "train"
        splits[split].append(path.read_bytes().decode("utf-8", errors="replace"))
    return splits


def prepare_data(out_dir: Path, tokenizer: str) -> Path:
    """Token streams of the three splits (each file followed by EOS), cached under out_dir."""
    import torch

    path = out_dir / "data" / f"{tokenizer}.pt"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    splits = corpus_files()
    if tokenizer == "bytes":  # for tests: no tokenizer to train
        eos, vocab = 256, 257
        encode = None
    elif tokenizer == "bpe":
        from tokenizers import Tokenizer

        from titan_muon.torchtitan.data import EOS, save_tokenizer, train_bpe_tokenizer

        directory = out_dir / "data" / "bpe_2048"
        if not (directory / "tokenizer.json").exists():
            save_tokenizer(train_bpe_tokenizer(splits["train"], 2048), str(directory))
        bpe = Tokenizer.from_file(str(directory / "tokenizer.json"))
        eos, vocab = bpe.token_to_id(EOS), 2048
        encode = lambda text: bpe.encode(text).ids  # one file at a time, in order
    else:
        raise ValueError(f"--tokenizer {tokenizer!r}: bpe or bytes")
    streams = {}
    for split, texts in splits.items():
        if encode is None:  # bytes: each file's UTF-8, then EOS
            end = torch.tensor([eos], dtype=torch.int16)
            pieces = [torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int16) for text in texts if text]
            streams[split] = torch.cat([x for piece in pieces for x in (piece, end)])
            continue
        ids: list[int] = []
        for text in texts:
            ids += encode(text)
            ids.append(eos)
        streams[split] = torch.tensor(ids, dtype=torch.int16)
    staging = path.with_suffix(".tmp")
    torch.save({"vocab": vocab, "eos": eos, "files": {k: len(v) for k, v in splits.items()}, **streams}, staging)
    os.replace(staging, path)
    return path


def windows(stream, seq_len: int, limit: int | None = None):
    """Non-overlapping (seq_len + 1)-token windows, stride seq_len (inputs and shifted labels)."""
    count = (len(stream) - 1) // seq_len
    if limit is not None:
        if limit > count:
            raise ValueError(f"{limit} windows of {seq_len} tokens asked, the split holds {count}")
        count = limit
    import torch

    index = (seq_len * torch.arange(count))[:, None] + torch.arange(seq_len + 1)
    return stream[index].long()


# ------------------------------------------------------------------------------- one process


def build_model(preset: ModelPreset, vocab: int, seed: int):
    import torch
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    args = TransformerModelArgs(dim=preset.dim, n_layers=preset.n_layers, n_heads=preset.n_heads, n_kv_heads=preset.n_kv_heads,
                                vocab_size=vocab, multiple_of=preset.multiple_of, rope_theta=500000, max_seq_len=preset.seq_len)  # fmt: skip
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def lr_factor(step_index: int, steps: int) -> float:
    """torchtitan 0.2.2's linear warmup then linear decay (decay_ratio unset, min_lr_factor 0),
    for the optimizer step with 0-based index ``step_index`` (LambdaLR's epoch)."""
    if step_index < WARMUP:
        return (step_index + 1) / WARMUP
    return 1 - (step_index + 1 - WARMUP) / (steps - WARMUP)


def build_optimizer(arm: Arm, model, lr_mult: float, replicate_group):
    import torch

    lr = arm.base_lr * lr_mult
    if arm.optimizer == "adamw":  # torchtitan's: every parameter, one group
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    from titan_muon import Muon, build_param_groups
    from titan_muon.attention.split import attention_row_blocks

    groups = build_param_groups(model, adamw_lr=arm.base_adamw_lr * lr_mult)
    muon_names = {name for group in groups if group["use_muon"] for name in group["param_names"]}
    blocks = {name: rows for name, rows in attention_row_blocks(model, "head").items() if name in muon_names}
    demo = dict(demo=True, replicate_group=replicate_group, **arm.demo_options) if arm.sync == "demo" else {}
    return Muon(groups, lr=lr, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, ns_coefficients="keller",
                adjust_lr_fn="original", adamw_betas=(0.9, 0.95), adamw_eps=1e-8, row_blocks=blocks, **demo)  # fmt: skip


def evaluate(model, data, rank: int, world: int, batch: int = 32) -> float:
    """Mean cross-entropy per token over ``data`` (windows), the rows shared out over the ranks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    total = torch.zeros(2, dtype=torch.float64)
    mine = data[rank::world]
    model.eval()
    with torch.no_grad():
        for start in range(0, len(mine), batch):
            rows = mine[start : start + batch]
            logits = model(rows[:, :-1])
            total[0] += F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum").double()
            total[1] += rows[:, 1:].numel()
    model.train()
    if world > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1])


def worker(args) -> None:
    """One rank of a run: replica ``rank`` of ``world`` (DeMo), or one of ``world`` data-parallel
    processes (full sync), or the only process."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{args.rendezvous}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=30))  # fmt: skip
    arm, preset = ARMS[args.arm], MODELS[args.model]
    data = torch.load(args.data)
    train = windows(data["train"], preset.seq_len)
    val = windows(data["validation"], preset.seq_len, args.val_tokens // preset.seq_len)
    test = windows(data["test"], preset.seq_len, args.test_tokens // preset.seq_len)
    batches_needed = args.steps * preset.batch
    if batches_needed > len(train):
        raise ValueError(f"{args.steps} steps × {preset.batch} sequences need {batches_needed} windows; training holds {len(train)}")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))[:batches_needed]

    model = build_model(preset, data["vocab"], args.seed)
    params = list(model.parameters())
    optimizer = build_optimizer(arm, model, args.lr_mult, dist.group.WORLD if arm.sync == "demo" else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i, args.steps))
    per_rank = preset.batch // world
    if per_rank * world != preset.batch:
        raise ValueError(f"{preset.batch} sequences per step do not split over {world} processes")

    losses, curve, demo_bytes = [], {}, None
    started = time.time()
    curve[0] = evaluate(model, val, rank, world)
    for step in range(1, args.steps + 1):
        rows = train[order[(step - 1) * preset.batch : step * preset.batch]][rank * per_rank : (rank + 1) * per_rank]
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())
        loss.backward()
        if arm.sync == "full" and world > 1:  # plain data parallel: average the gradients, then clip
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)  # DeMo: each replica its own gradient (as torchtitan)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
        if arm.sync == "demo" and step in (1, args.steps):
            metrics = optimizer.last_step_metrics
            sent = (metrics["demo/bytes_sent"], metrics["demo/adamw_bytes_sent"], metrics["demo/bytes_dense"])
            if demo_bytes is not None and sent != demo_bytes:
                raise RuntimeError(f"DeMo bytes changed between steps: {demo_bytes} then {sent}")
            demo_bytes = sent
        if step % args.val_every == 0 or step == args.steps:
            curve[step] = evaluate(model, val, rank, world)
            if rank == 0:
                print(f"step {step}: train {statistics.mean(losses[-args.val_every:]):.4f} validation {curve[step]:.4f} "
                      f"({time.time() - started:.0f} s)", flush=True)  # fmt: skip
    test_loss = evaluate(model, test, rank, world)
    seconds = time.time() - started

    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, {"losses": losses, "demo_bytes": demo_bytes})
    else:
        gathered = [{"losses": losses, "demo_bytes": demo_bytes}]
    if rank == 0:
        n_params = sum(p.numel() for p in params)
        result = {
            "arm": args.arm, "replicas": args.replicas, "processes": world, "lr_mult": args.lr_mult, "seed": args.seed,
            "lr": arm.base_lr * args.lr_mult,
            "adamw_lr": arm.base_adamw_lr * args.lr_mult if arm.base_adamw_lr is not None else None,
            "steps": args.steps, "model": args.model, "params": n_params,
            "muon_params": sum(p.numel() for g in optimizer.param_groups if g.get("use_muon") for p in g["params"]),
            "tokens_per_step": preset.batch * preset.seq_len, "val_tokens": val[:, 1:].numel(), "test_tokens": test[:, 1:].numel(),
            "train_loss": [statistics.mean(g["losses"][i] for g in gathered) for i in range(args.steps)],
            "validation": {str(k): v for k, v in curve.items()}, "final_validation": curve[args.steps], "test": test_loss,
            "seconds": seconds,
        }  # fmt: skip
        if arm.sync == "demo":
            result["demo_settings"] = repr(optimizer.demo)  # the defaults the one switch took in this checkout
            result["bytes_by_rank"] = [g["demo_bytes"] for g in gathered]
            result["bytes_muon"] = sum(g["demo_bytes"][0] for g in gathered)
            result["bytes_adamw"] = sum(g["demo_bytes"][1] for g in gathered)
            result["bytes_dense_muon"] = sum(g["demo_bytes"][2] for g in gathered)
        staging = Path(args.out).with_suffix(".tmp")
        staging.write_text(json.dumps(result))
        os.replace(staging, args.out)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run_one(arm: str, replicas: int, lr_mult: float, seed: int, out: Path, args, processes: int | None = None) -> None:
    """One training run as ``processes`` ranks (DeMo: one per replica; full sync: 1 unless asked)."""
    data = prepare_data(Path(args.out_dir), args.tokenizer)
    world = replicas if ARMS[arm].sync == "demo" else (processes or 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = Path(tmp) / "rendezvous"
        common = ["--arm", arm, "--replicas", str(replicas), "--lr-mult", repr(lr_mult), "--seed", str(seed),
                  "--steps", str(args.steps), "--model", args.model, "--data", str(data), "--val-tokens", str(args.val_tokens),
                  "--test-tokens", str(args.test_tokens), "--val-every", str(args.val_every), "--out", str(out),
                  "--world", str(world), "--rendezvous", str(rendezvous)]  # fmt: skip
        log = out.with_suffix(".log").open("w")
        procs = [subprocess.Popen([sys.executable, __file__, "worker", "--rank", str(r), *common], env=env, stdout=log,
                                  stderr=subprocess.STDOUT) for r in range(world)]  # fmt: skip
        failed = None
        while any(p.poll() is None for p in procs):
            failed = failed or next((p for p in procs if p.poll() not in (None, 0)), None)
            if failed is not None:
                for p in procs:  # the others would wait in a collective
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.5)
        log.close()
        codes = [p.returncode for p in procs]
        if any(codes):
            tail = out.with_suffix(".log").read_text()[-4000:]
            raise RuntimeError(f"{out.name}: exit codes {codes}\n{tail}")


# ------------------------------------------------------------------------------------ the plan


def run_id(arm: str, replicas: int, lr_mult: float, seed: int) -> str:
    return f"{arm}_R{replicas}_lr{lr_mult:g}_s{seed}"


_SKIPPED: set[str] = set()


def configurations(args) -> list[tuple[str, int]]:
    """(arm, R): full-sync arms once (R = 1, independent of R), DeMo arms at every R."""
    configs = []
    for arm in args.arms.split(","):
        if not arm_available(ARMS[arm]):
            if arm not in _SKIPPED:
                _SKIPPED.add(arm)
                print(f"{arm}: skipped, titan_muon.Muon has no {ARMS[arm].requires!r} keyword in this checkout", flush=True)
            continue
        if ARMS[arm].sync == "full":
            configs.append((arm, 1))
        else:
            configs += [(arm, int(r)) for r in per_arm(args.arm_replicas, arm, args.replicas).split(",")]
    return configs


def per_arm(option: str, arm: str, default: str) -> str:
    """The value ``option`` ("arm=value;arm=value") gives ``arm``, else ``default``."""
    for entry in filter(None, option.split(";")):
        name, _, value = entry.partition("=")
        if name.strip() == arm:
            return value
    return default


def load(args, arm: str, replicas: int, lr_mult: float, seed: int) -> dict | None:
    path = Path(args.out_dir) / "runs" / f"{run_id(arm, replicas, lr_mult, seed)}.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    if result["steps"] != args.steps or result["model"] != args.model:
        raise RuntimeError(f"{path}: a run of {result['steps']} steps / model {result['model']}; use another --out-dir")
    return result


def arm_lr_mults(args, arm: str, replicas: int) -> str:
    """The sweep's multipliers: ``--arm-lr-mults`` for "arm@R" or "arm", else ``--lr-mults``."""
    return per_arm(args.arm_lr_mults, f"{arm}@{replicas}", per_arm(args.arm_lr_mults, arm, args.lr_mults))


def sweep_state(args, arm: str, replicas: int) -> tuple[list[tuple[float, int]], float | None]:
    """(runs still needed, best lr multiplier or None while the sweep is incomplete)."""
    mults = sorted(float(m) for m in arm_lr_mults(args, arm, replicas).split(","))
    for _ in range(args.max_extend + 1):
        missing = [(m, 0) for m in mults if load(args, arm, replicas, m, 0) is None]
        if missing:
            return missing, None
        scores = {m: load(args, arm, replicas, m, 0)["final_validation"] for m in mults}
        best = min(scores, key=lambda m: (not math.isfinite(scores[m]), scores[m]))
        if len(mults) < 3 or best not in (mults[0], mults[-1]):
            break
        mults.append(best / 2 if best == mults[0] else best * 2)  # the best at an edge is not a best yet
        mults.sort()
    else:
        best = min(scores, key=lambda m: (not math.isfinite(scores[m]), scores[m]))
    missing = [(best, s) for s in range(1, arm_seeds(args, arm, replicas)) if load(args, arm, replicas, best, s) is None]
    return missing, best


def arm_seeds(args, arm: str, replicas: int) -> int:
    """Seeds at the best lr: ``--arm-seeds`` for "arm@R" or "arm", else ``--seeds``."""
    return int(per_arm(args.arm_seeds, f"{arm}@{replicas}", per_arm(args.arm_seeds, arm, str(args.seeds))))


def run_plan(args) -> None:
    """Run whatever is missing, ``--jobs`` processes at a time, until every sweep and seed is done."""
    prepare_data(Path(args.out_dir), args.tokenizer)
    running: dict[str, tuple[subprocess.Popen, int]] = {}
    failures = 0
    while True:
        pending = []
        for arm, replicas in configurations(args):
            missing, _ = sweep_state(args, arm, replicas)
            pending += [(arm, replicas, m, s) for m, s in missing if run_id(arm, replicas, m, s) not in running]
        for key, (proc, _) in list(running.items()):
            if proc.poll() is not None:
                del running[key]
                failures += proc.returncode != 0
                print(f"{time.strftime('%H:%M:%S')} {key} done (exit {proc.returncode})", flush=True)
        if failures:
            sys.exit(f"a run failed: see the logs under {args.out_dir}/runs")
        if not pending and not running:
            return
        pending.sort(key=lambda job: -(job[1] if ARMS[job[0]].sync == "demo" else 1))  # the widest first
        busy = sum(width for _, width in running.values())
        for arm, replicas, m, s in pending:
            width = replicas if ARMS[arm].sync == "demo" else 1
            if busy and busy + width > args.jobs:
                continue
            key = run_id(arm, replicas, m, s)
            command = [sys.executable, __file__, "run", "--arm", arm, "--replicas", str(replicas), "--lr-mult", repr(m),
                       "--seed", str(s), *passthrough(args)]  # fmt: skip
            running[key] = (subprocess.Popen(command), width)
            busy += width
            print(f"{time.strftime('%H:%M:%S')} started {key} ({width} process{'es' if width > 1 else ''})", flush=True)
        time.sleep(args.poll)


def passthrough(args) -> list[str]:
    return ["--steps", str(args.steps), "--model", args.model, "--tokenizer", args.tokenizer, "--out-dir", args.out_dir,
            "--val-tokens", str(args.val_tokens), "--test-tokens", str(args.test_tokens), "--val-every", str(args.val_every)]  # fmt: skip


# ------------------------------------------------------------------------------------ analysis


def full_sync_bytes(params: int, replicas: int) -> float:
    """Total over the R replicas of a ring all-reduce of every fp32 gradient: R · 2(R − 1)/R · 4N."""
    return 8.0 * (replicas - 1) * params


def summarize(args) -> dict:
    configs = configurations(args)
    replica_counts = [int(r) for r in args.replicas.split(",")]
    summary: dict = {"arms": {}}
    for arm, replicas in configs:
        missing, best = sweep_state(args, arm, replicas)
        if best is None or missing:
            raise RuntimeError(f"{arm} R={replicas}: runs missing ({missing}); run the benchmark first")
        sweep = {}
        m = best
        for path in sorted((Path(args.out_dir) / "runs").glob(f"{arm}_R{replicas}_lr*_s0.json")):
            r = json.loads(path.read_text())
            sweep[r["lr_mult"]] = {"lr": r["lr"], "adamw_lr": r["adamw_lr"], "final_validation": r["final_validation"]}
        seeds = [load(args, arm, replicas, m, s) for s in range(arm_seeds(args, arm, replicas))]
        tests = [r["test"] for r in seeds]
        first = seeds[0]
        entry = {
            "arm": arm, "label": ARMS[arm].label, "replicas": replicas, "best_lr_mult": m, "best_lr": first["lr"],
            "best_adamw_lr": first["adamw_lr"], "sweep": {f"{k:g}": v for k, v in sorted(sweep.items())},
            "seeds": list(range(len(seeds))), "test_by_seed": tests, "test_mean": statistics.mean(tests),
            "test_std": statistics.stdev(tests) if len(tests) > 1 else float("nan"),
            "validation_by_seed": [r["final_validation"] for r in seeds],
            "curve": {step: statistics.mean(r["validation"][step] for r in seeds) for step in first["validation"]},
            "params": first["params"], "muon_params": first["muon_params"],
        }  # fmt: skip
        if ARMS[arm].sync == "demo":
            entry["bytes"] = {str(replicas): first["bytes_muon"] + first["bytes_adamw"]}
            entry["bytes_muon"], entry["bytes_adamw"] = first["bytes_muon"], first["bytes_adamw"]
            entry["bytes_dense_muon"] = first["bytes_dense_muon"]
            entry["demo_settings"] = first.get("demo_settings")  # absent in runs before the field was recorded
        else:
            entry["bytes"] = {str(r): full_sync_bytes(first["params"], r) for r in replica_counts}
        summary["arms"][f"{arm}_R{replicas}"] = entry
        summary.setdefault("meta", {}).update(
            params=first["params"], muon_params=first["muon_params"], tokens_per_step=first["tokens_per_step"],
            steps=first["steps"], val_tokens=first["val_tokens"], test_tokens=first["test_tokens"], model=args.model,
        )  # fmt: skip
    meta = summary["meta"]
    meta["tokens"] = meta["steps"] * meta["tokens_per_step"]
    meta["tokens_per_param"] = meta["tokens"] / meta["params"]
    meta["preset"] = MODELS[args.model].__dict__
    meta["command"] = " ".join(["PYTHONPATH=. python scripts/bench_demo.py", *(a for a in sys.argv[1:] if a != "--analyse-only")])
    meta["date"] = datetime.date.today().isoformat()
    meta["machine"] = machine()

    arms = summary["arms"]
    if "muon_R1" in arms:
        muon = arms["muon_R1"]
        for entry in arms.values():
            if entry["arm"] == "muon":
                continue
            # an arm run with one seed has no spread of its own: its σ is taken to be Muon's
            own = entry["test_std"] if math.isfinite(entry["test_std"]) else muon["test_std"]
            sigma = math.sqrt((muon["test_std"] ** 2 + own**2) / 2)
            margin = max(2 * sigma, 0.02)
            gap = entry["test_mean"] - muon["test_mean"]
            entry.update(sigma=sigma, margin=margin, gap_to_muon=gap, parity=bool(gap <= margin))
            if ARMS[entry["arm"]].sync == "demo":
                full = full_sync_bytes(entry["params"], entry["replicas"])
                entry["bytes_ratio"] = full / entry["bytes"][str(entry["replicas"])]
        if "adamw_R1" in arms:
            summary["muon_vs_adamw"] = reach(muon, arms["adamw_R1"], meta["steps"])
    return summary


def reach(muon: dict, adamw: dict, steps: int) -> dict:
    """The step at which Muon's mean validation curve first reaches AdamW's final mean validation
    loss (linear between evaluations), as a fraction of the run."""
    target = adamw["curve"][str(steps)] if str(steps) in adamw["curve"] else adamw["curve"][steps]
    points = sorted((int(s), v) for s, v in muon["curve"].items())
    for (s0, v0), (s1, v1) in itertools.pairwise(points):
        if v1 <= target:
            step = s0 + (v0 - target) / (v0 - v1) * (s1 - s0) if v0 > target else s0
            return {"target_validation": target, "step": step, "fraction": step / steps}
    return {"target_validation": target, "step": None, "fraction": None}


def machine() -> str:
    import torch
    from bench_optimizer import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def table(summary: dict) -> str:
    rows = [
        (
            "| arm | R | lr sweep (× shipped lr: final validation loss) | best lr | seeds | held-out loss, mean ± σ "
            "| bytes across replicas per step | fewer than full sync | parity with full-sync Muon |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    replica_counts = sorted({int(r) for e in summary["arms"].values() for r in e["bytes"]})
    for entry in summary["arms"].values():
        sweep = ", ".join(f"×{k}: {v['final_validation']:.4f}" for k, v in entry["sweep"].items())
        lr = f"{entry['best_lr']:g}" + (f" (AdamW groups {entry['best_adamw_lr']:g})" if entry["best_adamw_lr"] else "")
        spread = f" ± {entry['test_std']:.4f}" if math.isfinite(entry["test_std"]) else " (one seed)"
        test = f"{entry['test_mean']:.4f}{spread}"
        if ARMS[entry["arm"]].sync == "demo":
            r = entry["replicas"]
            rows.append(f"| {entry['label']} | {r} | {sweep} | {lr} | {len(entry['seeds'])} | {test} | "
                        f"{entry['bytes'][str(r)]:,.0f} | {entry['bytes_ratio']:.1f}× | "
                        f"{'yes' if entry['parity'] else 'no'} ({entry['gap_to_muon']:+.4f} vs ≤ {entry['margin']:.4f}) |")  # fmt: skip
        else:
            traffic = " / ".join(f"{entry['bytes'][str(r)]:,.0f} (R={r})" for r in replica_counts if str(r) in entry["bytes"])
            parity = "reference" if entry["arm"] == "muon" else "-"
            if "parity" in entry:
                parity = f"{'yes' if entry['parity'] else 'no'} ({entry['gap_to_muon']:+.4f} vs ≤ {entry['margin']:.4f})"
            rows.append(f"| {entry['label']} | any | {sweep} | {lr} | {len(entry['seeds'])} | {test} | {traffic} | 1× | {parity} |")
    return "\n".join(rows)


def plot(summary: dict, png: Path) -> None:
    from plotting import pyplot

    plt = pyplot("scripts/bench_demo.py")
    from matplotlib.ticker import FixedLocator, NullLocator
    figure, (curves, sweeps, traffic) = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    styles = {1: "-", 2: "--", 4: ":"}
    for entry in summary["arms"].values():
        arm = ARMS[entry["arm"]]
        name = arm.label if arm.sync == "full" else f"{arm.label}, R = {entry['replicas']}"
        steps = sorted(int(s) for s in entry["curve"])
        curves.plot(steps, [entry["curve"][str(s)] if str(s) in entry["curve"] else entry["curve"][s] for s in steps],
                    styles.get(entry["replicas"], "-."), color=arm.color, label=f"{name}, lr ×{entry['best_lr_mult']:g}")  # fmt: skip
        mults = sorted(float(m) for m in entry["sweep"])
        sweeps.plot(mults, [entry["sweep"][f"{m:g}"]["final_validation"] for m in mults], styles.get(entry["replicas"], "-."),
                    marker="o", color=arm.color, label=name)  # fmt: skip
        by_r = entry["bytes"] if arm.sync == "full" else {str(entry["replicas"]): entry["bytes"][str(entry["replicas"])]}
        for r, b in by_r.items():
            marker = {"2": "o", "4": "s"}.get(r, "^")
            traffic.errorbar(b, entry["test_mean"], yerr=entry["test_std"], fmt=marker, color=arm.color, capsize=3,
                             label=f"{arm.label.split(' (')[0]}, R = {r}")  # fmt: skip
    meta = summary["meta"]
    low = min(min(e["curve"].values()) for e in summary["arms"].values())
    curves.set(xlabel="step", ylabel="validation loss (mean over seeds)", ylim=(low - 0.05, low + 1.2),
               title=f"{meta['params'] / 1e6:.2f} M params, {meta['tokens'] / 1e6:.2f} M tokens, best lr of each arm")  # fmt: skip
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
    sweeps.set(xscale="log", xlabel="lr multiplier of the shipped config's lr", ylabel="final validation loss (seed 0)",
               title="lr sweep")  # fmt: skip
    ticks = sorted({float(m) for e in summary["arms"].values() for m in e["sweep"]})
    sweeps.xaxis.set_major_locator(FixedLocator(ticks))
    sweeps.xaxis.set_minor_locator(NullLocator())
    sweeps.set_xticklabels([f"×{m:g}" for m in ticks])
    sweeps.grid(alpha=0.3)
    sweeps.legend(fontsize=7)
    traffic.set(xscale="log", xlabel="bytes across replicas per step (all replicas)",
                ylabel=f"held-out loss ({meta['test_tokens']:,} tokens), mean ± σ", title="quality vs traffic")  # fmt: skip
    traffic.grid(alpha=0.3)
    traffic.legend(fontsize=7)
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=110)
    print(f"wrote {png}")


# ------------------------------------------------------------------------------------ commands


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="bench", choices=["bench", "run", "worker"],
                        help="bench: the whole benchmark (default); run: one training run; worker: one rank of a run")  # fmt: skip
    parser.add_argument("--arms", default="muon,adamw,demo,demo_lowrank", help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--replicas", default="2,4", help="R for the DeMo arms (bench); the run's R (run)")
    parser.add_argument("--lr-mults", default="0.5,1,2", help="the sweep's multipliers of each arm's shipped lr")
    parser.add_argument("--arm-replicas", default="", help='per-arm R for the DeMo arms, e.g. "demo_lowrank_r16=4"')
    parser.add_argument("--arm-seeds", default="", help='per-arm seed counts, e.g. "demo_lowrank_r16=1;demo_lowrank@2=1"')
    parser.add_argument("--arm-lr-mults", default="", help='per-arm sweeps, e.g. "demo_sign=1,2;demo_lowrank_r16=2"')
    parser.add_argument("--max-extend", type=int, default=2, help="×2 steps added while the best lr is at an edge")
    parser.add_argument("--seeds", type=int, default=2, help="seeds at each arm's best lr (seed 0 is the sweep's)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--model", default="bench", choices=list(MODELS))
    parser.add_argument("--tokenizer", default="bpe", choices=["bpe", "bytes"])
    parser.add_argument("--val-tokens", type=int, default=32_768, help="validation slice (lr choice, curves)")
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--test-tokens", type=int, default=262_144, help="held-out tokens, evaluated once at the end")
    parser.add_argument("--poll", type=float, default=5.0, help="seconds between looks at the running jobs")
    parser.add_argument("--jobs", type=int, default=4, help="processes at a time (a run of R replicas counts R)")
    parser.add_argument("--out-dir", default=str(REPO / "outputs" / "bench_demo"))
    parser.add_argument("--json", default="docs/demo_quality.json")
    parser.add_argument("--png", default="docs/demo_quality.png")
    parser.add_argument("--analyse-only", action="store_true", help="summarize the runs under --out-dir, train nothing")
    # run / worker
    parser.add_argument("--arm", default="muon", choices=list(ARMS))
    parser.add_argument("--lr-mult", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-processes", type=int, default=None, help="run: a full-sync arm as this many processes")
    parser.add_argument("--out", default=None, help="run: the result file (default: runs/<id>.json under --out-dir)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--data", default=None)
    parser.add_argument("--rendezvous", default=None)
    args = parser.parse_args()

    if args.command == "worker":
        args.replicas = int(args.replicas)
        return worker(args)
    if args.command == "run":
        replicas = int(args.replicas.split(",")[0])
        out = Path(args.out) if args.out else Path(args.out_dir) / "runs" / f"{run_id(args.arm, replicas, args.lr_mult, args.seed)}.json"
        return run_one(args.arm, replicas, args.lr_mult, args.seed, out, args, processes=args.sync_processes)

    from plotting import require_matplotlib

    require_matplotlib("scripts/bench_demo.py")  # before the training, not after
    if not args.analyse_only:
        run_plan(args)
    summary = summarize(args)
    json_path, png = REPO / args.json, REPO / args.png
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, png)
    print(f"wrote {json_path}")
    print()
    print(table(summary))
    if "muon_vs_adamw" in summary and summary["muon_vs_adamw"]["fraction"] is not None:
        r = summary["muon_vs_adamw"]
        print(f"\nMuon reaches AdamW's final validation loss ({r['target_validation']:.4f}) at step {r['step']:.0f}: "
              f"{r['fraction']:.2f}× the steps (best lr each, mean curve over seeds).")  # fmt: skip


if __name__ == "__main__":
    main()
