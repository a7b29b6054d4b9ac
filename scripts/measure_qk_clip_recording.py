"""What max-logit recording costs a forward (and forward + backward) on CPU, side by side.

torchtitan's llama3 ``debugmodel`` (dim 256, 6 layers, 16 heads of 16), one thread,
``time.process_time``, best of N interleaved runs of: hooks off, hooks on. Also one
``block_max_logits`` call per block budget for (1, 16, 1024, 16), against SDPA, to check that
the CPU default block budget is still the fastest.

    python scripts/measure_qk_clip_recording.py [--repeats 5]
"""

import argparse
import time

import torch
from torchtitan.models.llama3 import Transformer, llama3_args

from titan_muon.attention_logits import CPU_BLOCK_BYTES, block_max_logits
from titan_muon.clip import QKClip

SHAPES = [(4, 256), (1, 1024), (1, 2048)]
BLOCK_BYTES = [1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26]


def cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return 1e3 * (time.process_time() - start)


def best_interleaved(fns: dict, repeats: int) -> dict:
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], cpu_ms(fn))
    return best


def model_costs(repeats: int) -> None:
    torch.manual_seed(0)
    model = Transformer(llama3_args["debugmodel"])
    with torch.no_grad():
        model.init_weights()
    qk_clip = QKClip(model)
    print("| batch × seq | forward off → on | forward + backward off → on |")
    print("|---|---|---|")
    for batch, seq in SHAPES:
        tokens = torch.randint(0, 2048, (batch, seq))

        def forward(record: bool):
            qk_clip.recorder.enabled = record
            with torch.no_grad():
                model(tokens)

        def forward_backward(record: bool):
            qk_clip.recorder.enabled = record
            model(tokens).float().logsumexp(-1).mean().backward()

        best = best_interleaved(
            {
                "f_off": lambda: forward(False), "f_on": lambda: forward(True),
                "fb_off": lambda: forward_backward(False), "fb_on": lambda: forward_backward(True),
            },
            repeats,
        )  # fmt: skip
        cells = [f"{best[off]:.0f} → {best[on]:.0f} ms (+{100 * (best[on] / best[off] - 1):.0f} %)" for off, on in (("f_off", "f_on"), ("fb_off", "fb_on"))]
        print(f"| {batch} × {seq} | {cells[0]} | {cells[1]} |")


def block_costs(repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 16, 1024, 16, generator=g), torch.randn(1, 16, 1024, 16, generator=g)
    label = {b: f"{b >> 10} KiB" + (" (CPU default)" if b == CPU_BLOCK_BYTES else "") for b in BLOCK_BYTES}
    fns = {label[b]: (lambda b=b: block_max_logits(q, k, block_bytes=b)) for b in BLOCK_BYTES}
    fns["SDPA"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
    best = best_interleaved(fns, repeats)
    print("\nblock_max_logits (1, 16, 1024, 16), per block budget: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in best.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_costs(args.repeats)
    block_costs(args.repeats)


if __name__ == "__main__":
    main()
