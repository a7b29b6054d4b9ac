"""QK-clip on 2 gloo ranks with FSDP2 ``fully_shard``: the same clip as one process.

Head rows straddle the shard boundary on purpose: GQA wq has 36 rows (head 4 = rows 16..20,
split 18/18), wk 12 rows (KV head 1 = rows 4..8, split 6/6); MLA wq 36 rows (head 1 = rows
12..24) and wkv_b 39 rows, split unevenly 20/19.
"""

import pytest
import torch
import torch.distributed as dist
from common import FP32_ULP, adamw_names, assert_within, feed_adamw_gradients, whole_gradients
from distributed import run_distributed
from test_clip import MODELS, Capture, boost, check_clipped_logits, tokens
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_muon import Muon, build_param_groups
from titan_muon.attention.clip import QKClip

WORLD, BATCH, STEPS = 2, 4, 2
# (training tau, final tau): both between the boosted heads' logits and the rest's at that point.
TAU = {"gqa": (30.0, 30.0), "mla": (40.0, 30.0)}


def _loss(model, batch):
    # Equal local batches: FSDP2's mean over ranks of the local means is the global mean.
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def _full(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def _train_then_clip(model, qk_clip, capture, batch, final_tau, rank, world, blocks=(), adamw_grads=None):
    """Muon steps with the clip after each; then record + clip (no step) and re-measure each layer's logits.

    The W-rank run returns the AdamW gradients it reduced; the one-process run is given them
    (`adamw_grads`, see common.feed_adamw_gradients).
    """
    optimizer = Muon(build_param_groups(model, adamw_lr=3e-3), lr=0.05, adjust_lr_fn="match_rms_adamw")
    step_metrics, reduced = [], []
    for step in range(STEPS):
        _loss(model, tokens(10 + step, BATCH).chunk(world)[rank]).backward()
        if adamw_grads is None:
            reduced.append(whole_gradients(model, adamw_names(optimizer)))
        else:
            feed_adamw_gradients(model, optimizer, adamw_grads[step], f"step {step}")
        optimizer.step()
        optimizer.zero_grad()
        step_metrics.append(dict(qk_clip.reduce_and_clip(optimizer)))
    trained_params = _full(model)

    qk_clip.tau = final_tau
    with torch.no_grad():
        model(batch.chunk(world)[rank])
    before, s_local = dict(capture.logits), capture.head_max()
    clip_metrics = dict(qk_clip.reduce_and_clip(lr=1.0))
    for block in blocks:
        block.unshard()
    after = capture.rerun_layers()
    for block in blocks:
        block.reshard()
    return dict(step_metrics=step_metrics, trained_params=trained_params, before=before, after=after, s_local=s_local,
                clip_metrics=clip_metrics, clipped_params=_full(model), adamw_grads=reduced, adamw=adamw_names(optimizer))


def _rank(rank, world, kind):
    model = MODELS[kind]()
    boost(model, kind)
    mesh = init_device_mesh("cpu", (world,))
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    train_tau, tau = TAU[kind]
    qk_clip = QKClip(model, tau=train_tau, group=dist.group.WORLD)
    return _train_then_clip(model, qk_clip, Capture(model), tokens(0, BATCH), tau, rank, world, blocks)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_fsdp2_clip_equals_one_process(kind):
    results = run_distributed(_rank, WORLD, kind, timeout=600)
    model = MODELS[kind]()
    boost(model, kind)
    train_tau, tau = TAU[kind]
    expected = _train_then_clip(model, QKClip(model, tau=train_tau), Capture(model), tokens(0, BATCH), tau, 0, 1,
                                adamw_grads=results[0]["adamw_grads"])  # fmt: skip
    s = expected["s_local"]
    clipped = s > tau
    assert 0 < clipped.sum() < clipped.numel(), s

    # Max logits (up to ~40) come from weights that differ by ~1e-6 of their size (measured;
    # bound below) and are rounded by 2^-24 relative: 1e-5 relative bounds them; the training
    # steps' metrics (maxima of each step, clipped-head counts) get 1e-4.
    for got, want in zip(results[0]["step_metrics"], expected["step_metrics"]):
        assert got == pytest.approx(want, rel=1e-4)
    assert any(m["qk_clip/heads_clipped"] for m in expected["step_metrics"]), "the training steps should clip"
    # One MAX all-reduce makes the per-rank maxima the global (one-process) maxima.
    torch.testing.assert_close(torch.maximum(results[0]["s_local"], results[1]["s_local"]), s, rtol=1e-5, atol=1e-5)
    for rank, result in enumerate(results):
        assert result["clip_metrics"] == pytest.approx(expected["clip_metrics"], rel=1e-5)
        check_clipped_logits(result["before"], result["after"], s, tau, clipped)
        for key in ("trained_params", "clipped_params"):
            for name, p in expected[key].items():
                if name in expected["adamw"]:
                    # The same gradients, elementwise: the last bit of p after each of its two
                    # roundings a step (weight decay, update).
                    bound = STEPS * 2 * FP32_ULP * p.abs().max().item()
                else:
                    # Muon: gradients summed in another order (<= ~1e-5 relative: softmax of
                    # logits near 40) feed Newton-Schulz; each of 2 steps moves a matrix by <=
                    # lr·0.2·sqrt(96)·1.2 ≈ 0.12, so ~1e-6 (measured); 5e-5 leaves room for NS's
                    # larger gain on nearly rank-deficient inputs (docs/reliability.md). The clip
                    # then rescales weights up to ~6 by factors known to ~1e-6. A wrong update
                    # or clip moves them by >= 1e-3.
                    bound = 5e-5
                assert_within(result[key][name], p, bound, f"rank {rank} {key} {name}")
