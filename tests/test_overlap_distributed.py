"""Sending buckets during backward changes nothing: overlap on == overlap off, with clipping and accumulation."""

import pytest
import torch

from distributed import run_distributed
from test_optimizer_distributed import _batches, _loss, fsdp_model
from titan_muon import Muon, build_param_groups


def _train(rank, world, overlap, clip, micro_batches, tamper, steps=3):
    model = fsdp_model(world)
    opt = Muon(build_param_groups(model, adamw_lr=3e-3), lr=0.02, adjust_lr_fn="match_rms_adamw",
               bucket_size_mb=0.002, overlap=overlap)  # fmt: skip
    sent_in_backward = []
    for s in range(steps):
        for m in range(micro_batches):
            tokens = _batches(10 * s + m).chunk(world)[rank]
            (_loss(model, tokens) / micro_batches).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        if tamper:  # a per-parameter change after the hooks fired: the early sends are stale
            model.layers[1].w1.weight.grad.to_local().mul_(3.0)
        opt.step()
        opt.zero_grad()
        sent_in_backward.append(opt.last_step_metrics.get("muon/buckets_sent_in_backward", 0.0))
    return {"params": {n: p.full_tensor() for n, p in model.named_parameters()}, "sent_in_backward": sent_in_backward,
            "buckets": len(opt.plan.buckets)}  # fmt: skip


@pytest.mark.parametrize(
    "world,clip,micro_batches,tamper",
    [(2, True, 2, False), (3, False, 1, False), (2, True, 1, True)],
    ids=["clip+accumulation", "uneven-3-ranks", "tampered-gradient-falls-back"],
)
def test_overlap_equals_no_overlap(world, clip, micro_batches, tamper):
    plain = run_distributed(_train, world, False, clip, micro_batches, tamper)
    overlapped = run_distributed(_train, world, True, clip, micro_batches, tamper)
    for a, b in zip(plain, overlapped):
        for name, tensor in a["params"].items():
            assert (b["params"][name] - tensor).abs().max().item() <= 1e-5, name
    for result in overlapped:
        if tamper:
            assert result["sent_in_backward"] == [0.0] * 3  # fell back to the plain path, every step
        else:
            assert result["sent_in_backward"] == [float(result["buckets"])] * 3
