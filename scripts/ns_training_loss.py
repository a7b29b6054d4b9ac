"""Training loss with fp16 Gram NS (what ns_dtype / ns_algorithm "auto" run on CUDA) against fp32 NS.

One process, a small character-level causal transformer on the Python standard library's source,
the same seed, initialization and batches for every variant; only the Newton–Schulz arithmetic
differs:

- fp32 standard: ns_dtype="fp32", ns_algorithm="standard" (the exact reference);
- CUDA auto: the precision "auto" resolves to on CUDA, NSPrecision(bf16, fp16), set on the CPU:
  fp16 Gram NS where the shape rule picks Gram (the 128 × 512 MLP matrices), standard bf16 NS
  elsewhere (the 128 × 128 attention matrices);
- bf16 standard: ns_dtype="bf16", ns_algorithm="standard" (the CUDA default before fp16 Gram).

    python scripts/ns_training_loss.py --steps 100
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from titan_muon import Muon, build_param_groups  # noqa: E402
from titan_muon.algorithm.newton_schulz import NSPrecision  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(batch, length, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, length, dim)
        x = x + self.wo(attended)
        return x + self.w2(F.gelu(self.w1(self.mlp_norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, heads: int = 4, hidden: int = 512):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def corpus(limit_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's *.py files, in sorted order (the same on every run)."""
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit_bytes]), dtype=torch.uint8).long()


def train(variant: str, text: torch.Tensor, args) -> list[float]:
    torch.manual_seed(0)
    model = TinyLM()
    groups = build_param_groups(model, unclassified="adamw")
    ns = {"fp32 standard": ("fp32", "standard"), "CUDA auto": ("auto", "auto"), "bf16 standard": ("bf16", "standard")}[variant]
    opt = Muon(groups, lr=args.lr, adjust_lr_fn="match_rms_adamw", ns_dtype=ns[0], ns_algorithm=ns[1])
    if variant == "CUDA auto":
        opt.newton_schulz.ns_precision = NSPrecision(torch.bfloat16, torch.float16)
    batches = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        starts = torch.randint(0, text.numel() - args.length - 1, (args.batch,), generator=batches)
        window = torch.stack([text[s : s + args.length + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for group in opt.param_groups:  # linear warmup, then cosine decay
            group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    text = corpus(4_000_000)
    runs, seconds = {}, {}
    for variant in ("fp32 standard", "CUDA auto", "bf16 standard"):
        started = time.time()
        runs[variant] = train(variant, text, args)
        seconds[variant] = time.time() - started
    reference = runs["fp32 standard"]
    print(f"Command: `{' '.join(['python scripts/ns_training_loss.py', *sys.argv[1:]])}`")
    print()
    print(f"| NS variant | loss at step {args.steps} | mean loss, last {args.window} steps | vs fp32, same steps | largest per-step difference from fp32 | time s |")
    print("|---|---|---|---|---|---|")
    for variant, losses in runs.items():
        mean = statistics.mean(losses[-args.window :])
        gap = mean - statistics.mean(reference[-args.window :])
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        print(f"| {variant} | {losses[-1]:.5f} | {mean:.5f} | {gap:+.5f} | {worst:.5f} | {seconds[variant]:.0f} |")


if __name__ == "__main__":
    main()
