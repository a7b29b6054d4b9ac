"""Digest of the weights and optimizer state after N steps of each shipped Muon config (CPU, fp32).

A change that only moves or reshapes code must leave these bit for bit as they were: run this
at the old commit and at the new one on the same machine and compare the two outputs.

    python scripts/weights_digest.py --steps 5 --out /tmp/after.json
    diff /tmp/before.json /tmp/after.json

Each config trains on 2 CPU ranks under torchrun with torchtitan's deterministic mode and saves a
checkpoint at its last step; every tensor of that checkpoint (model and optimizer, the sharded
ones whole) is hashed. About 1 minute per config on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

from titan_muon.torchtitan.harness import REPO_ROOT, read_checkpoint, run_training

CONFIGS = ["train_configs/llama3_gqa_muon.toml", "train_configs/mla_muon.toml", "train_configs/moe_mla_muon.toml"]


def digest(path: str) -> dict[str, str]:
    out = {}
    for key, value in sorted(read_checkpoint(path).items()):
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous().cpu().reshape(-1)
            out[key] = f"{t.dtype}{list(value.shape)}:" + hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--configs", nargs="*", default=CONFIGS)
    parser.add_argument("--out", default="-", help="JSON file, or - for stdout")
    args = parser.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as scratch:
        for config in args.configs:
            dump = Path(scratch) / Path(config).stem
            flags = [
                "--training.steps", str(args.steps), "--debug.deterministic", "--debug.seed", "0",
                "--checkpoint.enable", "--checkpoint.interval", str(args.steps), "--checkpoint.no-last-save-model-only",
                "--job.dump_folder", str(dump), "--metrics.log_freq", "1",
            ]  # fmt: skip
            run_training(str(REPO_ROOT / config), flags, nproc=2, timeout=1200)
            result[config] = digest(str(dump / "checkpoint" / f"step-{args.steps}"))
            print(f"{config}: {len(result[config])} tensors", file=sys.stderr)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
