"""What max-logit recording costs under context parallel (CP), per rank, on CPU / gloo.

W gloo ranks (default 2) each hold their head-tail slice of one attention layer's q and k
(batch 1, 16 query heads, 4 KV heads of 64, fp32, whole sequence ``--seq``). Timed, per rank,
best of N interleaved runs, CPU time after a barrier (``time.process_time``):

* ``gather``: the keys' all-gather alone (``ContextParallelSequence.gather_keys``);
* ``cp record``: the recording under CP (``context_parallel_max_logits``: gather, then each
  query chunk against the keys it may see);
* ``local only``: ``block_max_logits`` of the rank's own q and k (what a CP-unaware recorder
  would do: cheaper, and wrong);
* ``cp1 record``: the whole sequence in one process (CP 1), on every rank at once;
* ``cp attention``: SDPA of the rank's queries over all keys and values with the causal mask as
  a bool matrix (the arithmetic of one rank's ring attention, not torch's kernel, which has no
  CPU implementation); ``cp1 attention``: causal SDPA on the whole sequence.

Bytes: what one rank sends and receives per layer and forward, and the extra buffers it holds
(the sequence-major local copy and the gathered keys) on top of the logits blocks.

    python scripts/measure_qk_clip_context_parallel.py [--world 2] [--seq 4096] [--repeats 5]
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from titan_muon.attention.logits import (
    ContextParallelSequence,
    block_max_logits,
    context_parallel_max_logits,
    gathered_key_positions,
    sharded_sequence_positions,
)

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM = 1, 16, 4, 64


def timed(fn, group) -> float:
    """CPU time of this process (all its threads, gloo's included): on a CPU shared with other
    jobs, wall clock measures their load as much as ours. Waiting in a collective costs none."""
    dist.barrier(group)
    start = time.process_time()
    fn()
    return 1e3 * (time.process_time() - start)


def rank_main(rank: int, world: int, port: int, seq: int, repeats: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cp = ContextParallelSequence(None, "headtail")
    g = torch.Generator().manual_seed(0)
    q_full = torch.randn(BATCH, Q_HEADS, seq, HEAD_DIM, generator=g)
    k_full = torch.randn(BATCH, KV_HEADS, seq, HEAD_DIM, generator=g)
    v_full = torch.randn(BATCH, KV_HEADS, seq, HEAD_DIM, generator=g)
    local_len = seq // world
    mine = sharded_sequence_positions("headtail", world, local_len)[rank * local_len : (rank + 1) * local_len]
    q, k, v = q_full[:, :, mine], k_full[:, :, mine], v_full[:, :, mine]
    allowed = gathered_key_positions("headtail", world, local_len)[None, :] <= mine[:, None]

    def cp_attention():
        keys, values = cp.gather_keys(k), cp.gather_keys(v)
        F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=True)

    fns = {
        "gather": lambda: cp.gather_keys(k),
        "cp record": lambda: context_parallel_max_logits(cp, q, k),
        "local only": lambda: block_max_logits(q, k),
        "cp1 record": lambda: block_max_logits(q_full, k_full),
        "cp attention": cp_attention,
        "cp1 attention": lambda: F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=True, enable_gqa=True),
    }
    # The recorded maxima are those of the whole sequence (the MAX all-reduce over ranks follows).
    recorded = context_parallel_max_logits(cp, q, k)
    dist.all_reduce(recorded, op=dist.ReduceOp.MAX)
    torch.testing.assert_close(recorded, block_max_logits(q_full, k_full))
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], timed(fn, None))
    out[rank] = best
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.seq % (2 * args.world):
        parser.error(f"--seq {args.seq} must be a multiple of 2 x --world (head-tail chunks)")
    with mp.Manager() as manager:
        out = manager.dict()
        port = 29500 + os.getpid() % 1000
        mp.spawn(rank_main, (args.world, port, args.seq, args.repeats, out), nprocs=args.world)
        results = dict(out)
    element = 4  # fp32
    local_keys = BATCH * KV_HEADS * (args.seq // args.world) * HEAD_DIM * element
    print(f"W = {args.world}, sequence {args.seq}, batch {BATCH}, {Q_HEADS} query / {KV_HEADS} KV heads of {HEAD_DIM}, fp32, 1 thread per rank")
    ranks = " | ".join(f"rank {r}" for r in sorted(results))
    print(f"| per rank, CPU ms (best of {args.repeats}) | {ranks} |")
    print("|---|" + "---|" * len(results))
    for name in results[0]:
        print(f"| {name} | " + " | ".join(f"{results[r][name]:.1f}" for r in sorted(results)) + " |")
    print(
        f"keys per rank and layer: sends {local_keys / 2**20:.2f} MiB, receives {(args.world - 1) * local_keys / 2**20:.2f} MiB; "
        f"holds {local_keys / 2**20:.2f} MiB (sequence-major copy) + {args.world * local_keys / 2**20:.2f} MiB (gathered keys) "
        "while it records"
    )


if __name__ == "__main__":
    main()
