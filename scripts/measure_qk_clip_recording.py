"""What max-logit recording costs, side by side with attention itself.

Default (CPU): torchtitan's llama3 ``debugmodel`` (dim 256, 6 layers, 16 heads of 16), one
thread, ``time.process_time``, best of N interleaved runs of: hooks off, hooks on. Also one
``block_max_logits`` call per block budget for (1, 16, 2048, 64), against SDPA (budgets at or
above the 16 MiB of q + k are capped there).

``--long``: one attention layer at sequence length ``--seq`` (default 8192) with the q, k, v of
Llama-3-8B (batch 1, 32 query heads, 8 KV heads of 128) or DeepSeek-V3 MLA (``--shape
deepseek_v3``: 128 heads, q/k 192 = 128 nope + 64 rope, v 128), laid out as torchtitan hands
them over: recording (``block_max_logits`` with the device's default budget) against the SDPA
forward of the same q, k, v (causal), time (best of N) and peak extra memory. On CPU memory
is every allocation the profiler sees from torch's allocator while the call runs; on CUDA it is
``max_memory_allocated`` above what was allocated before.

    python scripts/measure_qk_clip_recording.py [--repeats 5]
    python scripts/measure_qk_clip_recording.py --long [--device cuda] [--dtype bf16] [--shape deepseek_v3] [--seq 8192]
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torchtitan.models.llama3 import Transformer, llama3_args

from titan_muon.attention.clip import QKClip
from titan_muon.attention.logits import (
    CPU_BLOCK_BYTES,
    block_budget,
    block_max_logits,
    block_rows,
)

SHAPES = [(4, 256), (1, 1024), (1, 2048)]
BLOCK_BYTES = [1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26]


def cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return 1e3 * (time.process_time() - start)


def best_interleaved(fns: dict, repeats: int, timer=cpu_ms) -> dict:
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], timer(fn))
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

        def forward(record: bool, tokens=tokens):
            qk_clip.recorder.enabled = record
            with torch.no_grad():
                model(tokens)

        def forward_backward(record: bool, tokens=tokens):
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
    q, k = torch.randn(1, 16, 2048, 64, generator=g), torch.randn(1, 16, 2048, 64, generator=g)  # q + k: 16 MiB
    label = {b: f"{b >> 10} KiB, {block_rows(q, k, b)} rows" + (" (CPU default)" if b == CPU_BLOCK_BYTES else "") for b in BLOCK_BYTES}
    fns = {label[b]: (lambda b=b: block_max_logits(q, k, block_bytes=b)) for b in BLOCK_BYTES}
    fns["SDPA"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
    best = best_interleaved(fns, repeats)
    print("\nblock_max_logits (1, 16, 2048, 64), per block budget: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in best.items()))


SHAPES_LONG = {  # (query heads, KV heads, q/k head dim, v head dim; MLA: rope dims of the shared k_rope)
    "llama3_8b": {"q_heads": 32, "kv_heads": 8, "qk_dim": 128, "v_dim": 128, "rope": 0},
    "deepseek_v3": {"q_heads": 128, "kv_heads": 128, "qk_dim": 192, "v_dim": 128, "rope": 64},
}


def layer_inputs(shape: str, seq: int, device: str, dtype: torch.dtype):
    """q, k, v of one layer as torchtitan builds them: (B, L, H, D) memory seen as (B, H, L, D)."""
    s = SHAPES_LONG[shape]
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=g, device=device, dtype=dtype)

    q = randn(1, seq, s["q_heads"], s["qk_dim"])
    if s["rope"]:  # MLA: k = [k_nope, shared k_rope expanded to every head], concatenated
        nope = s["qk_dim"] - s["rope"]
        k = torch.cat([randn(1, seq, s["kv_heads"], nope), randn(1, seq, 1, s["rope"]).expand(-1, -1, s["kv_heads"], -1)], dim=-1)
    else:
        k = randn(1, seq, s["kv_heads"], s["qk_dim"])
    v = randn(1, seq, s["kv_heads"], s["v_dim"])
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def peak_extra_bytes(fn, device: str) -> int:
    """Peak bytes allocated while fn runs, above what was allocated before it."""
    if device == "cpu":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
        live = peak = 0
        for event in events:
            live += event.nbytes()
            peak = max(peak, live)
        return peak
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def seconds(fn, device: str) -> float:
    if device == "cpu":
        start = time.process_time()
        fn()
        return time.process_time() - start
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def time_and_peak_memory(fns: dict, device: str, repeats: int) -> tuple[dict, dict]:
    """Best-of-``repeats`` seconds (interleaved, after one warm-up call each: kernel selection,
    compilation, allocator) and peak extra bytes of each function."""
    for fn in fns.values():
        fn()
    best = best_interleaved(fns, repeats, timer=lambda fn: seconds(fn, device))
    return best, {name: peak_extra_bytes(fn, device) for name, fn in fns.items()}


def print_time_and_memory(best: dict, memory: dict, digits: int) -> None:
    mib = 1 << 20
    print("| | time | peak extra memory |")
    print("|---|---|---|")
    for name in best:
        print(f"| {name} | {1e3 * best[name]:.{digits}f} ms | {memory[name] / mib:.1f} MiB |")


def long_sequence(shape: str, seq: int, device: str, dtype: torch.dtype, repeats: int) -> None:
    q, k, v = layer_inputs(shape, seq, device, dtype)
    enable_gqa = q.shape[1] != k.shape[1]
    fns = {
        "recording": lambda: block_max_logits(q, k),
        "SDPA forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa),
    }
    best, memory = time_and_peak_memory(fns, device, repeats)

    mib = 1 << 20
    element = q.element_size()
    rows = block_rows(q, k)
    print(f"{shape} layer, batch 1, seq {seq}, {dtype}, {device} ({torch.cuda.get_device_name() if device != 'cpu' else 'one thread'}):")
    print(f"  q {size(q) / mib:.0f} MiB, k {size(k) / mib:.0f} MiB, v {size(v) / mib:.0f} MiB; block budget {block_budget(q, k) / mib:.0f} MiB: "
          f"{rows} query rows × {k.shape[1]} KV heads × {seq} keys ({k.shape[1] * rows * seq * element / mib:.1f} MiB), "
          f"{math.ceil(seq / rows)} blocks × {q.shape[1] // k.shape[1]} per GQA group")  # fmt: skip
    print_time_and_memory(best, memory, digits=1)
    print(f"| recording / SDPA | {best['recording'] / best['SDPA forward']:.2f}× | {memory['recording'] / memory['SDPA forward']:.2f}× |")


def flex_kernel_max_scores(shape: str, seq: int, device: str, dtype: torch.dtype, repeats: int) -> None:
    """The fused path (CUDA only): compiled FlexAttention's forward with and without
    ``AuxRequest(max_scores=True)``, against the block recording; and how far the kernel's
    maxima are from the blocks' (the same quantity, rounded differently)."""
    from torch.nn.attention.flex_attention import (
        AuxRequest,
        create_block_mask,
        flex_attention,
    )

    q, k, v = layer_inputs(shape, seq, device, dtype)
    enable_gqa = q.shape[1] != k.shape[1]
    kernel = torch.compile(flex_attention)
    causal = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq, seq, device=device)

    def flex(max_scores: bool):
        aux = AuxRequest(max_scores=True) if max_scores else None
        return kernel(q, k, v, block_mask=causal, enable_gqa=enable_gqa, return_aux=aux)

    fns = {
        "flex forward": lambda: flex(False),
        "flex forward + max scores": lambda: flex(True),
        "recording (blocks)": lambda: block_max_logits(q, k),
    }
    best, memory = time_and_peak_memory(fns, device, repeats)
    from_kernel = flex(True)[1].max_scores.amax(dim=(0, 2))
    from_blocks = block_max_logits(q, k)
    difference = ((from_kernel - from_blocks).abs().max() / from_blocks.abs().max()).item()

    print(f"{shape} layer, batch 1, seq {seq}, {dtype}, {device} ({torch.cuda.get_device_name()}), compiled FlexAttention, causal:")
    print_time_and_memory(best, memory, digits=2)
    extra = best["flex forward + max scores"] - best["flex forward"]
    print(f"| max scores' extra / blocks | {extra / best['recording (blocks)']:.2f}× | |")
    print(f"kernel max scores vs block recording: max |difference| / max |logit| = {difference:.2e}")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long", action="store_true", help="one attention layer at --seq: recording against the SDPA forward")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (--long only)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on CPU, bf16 elsewhere")
    parser.add_argument("--shape", choices=sorted(SHAPES_LONG), default="llama3_8b")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--flex", action="store_true", help="with --long on CUDA: FlexAttention's own max scores vs the blocks")
    args = parser.parse_args()
    if args.flex and not (args.long and args.device != "cpu"):
        parser.error("--flex needs --long and a CUDA --device (torch's kernel returns max scores on CUDA only)")
    if args.long:
        if args.device == "cpu":
            torch.set_num_threads(1)
        dtype = DTYPES[args.dtype or ("fp32" if args.device == "cpu" else "bf16")]
        measure = flex_kernel_max_scores if args.flex else long_sequence
        measure(args.shape, args.seq, args.device, dtype, args.repeats)
        return
    if args.device != "cpu":
        parser.error("--device applies to --long only")
    torch.set_num_threads(1)
    model_costs(args.repeats)
    block_costs(args.repeats)


if __name__ == "__main__":
    main()
