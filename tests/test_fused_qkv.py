"""torchtitan 0.3.0's fused ``qkv_linear.wqkv``: Split and QK-clip equal their separate-wq/wk/wv results.

The references are independent of titan_muon.attention.fused_qkv: separate wq / wk / wv go through the
existing Split and QK-clip, and their results are interleaved into wqkv's row order by
:func:`interleave` below, written from torchtitan 0.3.0's FusedQKVLinear (per KV group g: its
query heads, then key head g, then value head g).
"""

import pytest
import torch
from torch import nn
from torchtitan_layouts import V022Attention, V030Attention

from titan_muon import Muon
from titan_muon.attention.clip import QKClip, apply_qk_clip
from titan_muon.attention.fused_qkv import FusedQKVLayout
from titan_muon.attention.layers import find_attention_layers, query_projection
from titan_muon.attention.split import attention_row_blocks

DIM, HEADS, KV_HEADS, HEAD_DIM = 16, 6, 2, 4  # 3 query heads per KV head


def interleave(wq, wk, wv, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    """wqkv's rows, head by head: for each KV group, its query heads' rows, its key head's, its value head's."""
    heads_per_kv = wq.shape[0] // head_dim // n_kv_heads

    def head(w, index):
        return w[index * head_dim : (index + 1) * head_dim]

    rows = []
    for group in range(n_kv_heads):
        rows += [head(wq, group * heads_per_kv + j) for j in range(heads_per_kv)]
        rows += [head(wk, group), head(wv, group)]
    return torch.cat(rows)


def attention_pair(bias=False, seed=0):
    """A 0.2.2-style attention with separate wq/wk/wv and a 0.3.0 one whose wqkv holds the same weights."""
    torch.manual_seed(seed)
    separate = V022Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, bias=bias)
    fused = V030Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, fused=True, bias=bias)
    with torch.no_grad():
        fused.qkv_linear.wqkv.weight.copy_(interleave(separate.wq.weight, separate.wk.weight, separate.wv.weight))
        if bias:
            fused.qkv_linear.wqkv.bias.copy_(interleave(separate.wq.bias, separate.wk.bias, separate.wv.bias))
    return separate, fused


def separate_as_fused(separate, param="weight"):
    return interleave(*(getattr(getattr(separate, p), param).detach() for p in ("wq", "wk", "wv")))


def test_interleave_is_torchtitans_forward_split():
    """Our reading of 0.3.0: its forward views wqkv's output as (n_kv, heads_per_kv + 2, head_dim)
    and splits [heads_per_kv, 1, 1]; that must give back the separate projections."""
    separate, fused = attention_pair(bias=True)
    x = torch.randn(3, DIM)
    out = fused.qkv_linear.wqkv(x).view(3, KV_HEADS, HEADS // KV_HEADS + 2, HEAD_DIM)
    q, k, v = out.split([HEADS // KV_HEADS, 1, 1], dim=-2)
    torch.testing.assert_close(q.reshape(3, -1), separate.wq(x))
    torch.testing.assert_close(k.reshape(3, -1), separate.wk(x))
    torch.testing.assert_close(v.reshape(3, -1), separate.wv(x))
    assert torch.equal(FusedQKVLayout(HEADS, KV_HEADS, HEAD_DIM).fuse(separate.wq.weight, separate.wk.weight, separate.wv.weight),
                       fused.qkv_linear.wqkv.weight)  # fmt: skip


# ---------------------------------------------------------------- Split


def test_row_blocks_of_torchtitan_030_attention():
    model = nn.ModuleDict({"fused": V030Attention(DIM, HEADS, KV_HEADS, HEAD_DIM), "separate": V030Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, fused=False)})
    assert attention_row_blocks(model) == {
        "fused.qkv_linear.wqkv.weight": HEAD_DIM,
        **{f"separate.qkv_linear.{p}.weight": HEAD_DIM for p in ("wq", "wk", "wv")},
    }


def split_step(named_params, row_blocks, grads):
    opt = Muon(named_params, lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, row_blocks=row_blocks)
    for (_, p), g in zip(named_params, grads):
        p.grad = g
    opt.step()


def test_split_on_fused_wqkv_equals_split_on_separate_weights():
    separate, fused = attention_pair()
    grads = {p: torch.randn(getattr(separate, p).weight.shape) for p in ("wq", "wk", "wv")}
    split_step([(f"{p}.weight", getattr(separate, p).weight) for p in grads], attention_row_blocks(separate), list(grads.values()))
    wqkv = fused.qkv_linear.wqkv.weight
    whole = nn.Parameter(wqkv.detach().clone())
    split_step([("qkv_linear.wqkv.weight", wqkv)], attention_row_blocks(fused), [interleave(*grads.values())])
    # Exact: every head is the same 4x16 block with the same gradient on both sides, and on CPU
    # orthogonalize() runs each block of a same-shape batch as its own 2-D GEMMs, so a head's
    # update is the same fp32 operations on the same numbers whatever else shares its batch.
    assert torch.equal(wqkv.detach(), separate_as_fused(separate))
    # And Split did something: the whole (40 x 16) matrix orthogonalized at once is another update.
    split_step([("w", whole)], None, [interleave(*grads.values())])
    assert not torch.allclose(whole.detach(), wqkv.detach(), atol=1e-3)


# ---------------------------------------------------------------- QK-clip


@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_qk_clip_on_fused_wqkv_equals_qk_clip_on_separate_weights(alpha):
    separate, fused = attention_pair(bias=True)
    # Group 0 (q heads 0-2): every head over tau, so its key head takes a share too.
    # Group 1 (q heads 3-5): head 4 under tau, so only the clipped query heads shrink.
    max_logits = torch.tensor([[150.0, 300.0, 120.0, 250.0, 50.0, 101.0]])
    clipped_separate = apply_qk_clip(find_attention_layers(nn.ModuleDict({"a": separate})), max_logits, tau=100.0, alpha=alpha)
    clipped_fused = apply_qk_clip(find_attention_layers(nn.ModuleDict({"a": fused})), max_logits, tau=100.0, alpha=alpha)
    assert torch.equal(clipped_fused, clipped_separate)
    # Exact: each row is multiplied by the same fp32 factor on both sides.
    wqkv = fused.qkv_linear.wqkv
    assert torch.equal(wqkv.weight.detach(), separate_as_fused(separate))
    assert torch.equal(wqkv.bias.detach(), separate_as_fused(separate, "bias"))
    # The clip did act, on q and k rows, never on v rows.
    before, _ = attention_pair(bias=True)
    assert not torch.equal(separate.wq.weight, before.wq.weight) and not torch.equal(separate.wk.weight[:HEAD_DIM], before.wk.weight[:HEAD_DIM])
    assert torch.equal(separate.wk.weight[HEAD_DIM:], before.wk.weight[HEAD_DIM:])  # group 1's key head untouched
    rows = wqkv.weight.view(KV_HEADS, HEADS // KV_HEADS + 2, HEAD_DIM, DIM)
    assert torch.equal(rows[:, -1].reshape(-1, DIM), before.wv.weight)


def test_fused_layout_is_checked_and_query_projection_says_why_it_has_none():
    separate030 = V030Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, fused=False)
    assert query_projection(separate030) is separate030.qkv_linear.wq
    fused = V030Attention(DIM, HEADS, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="query rows are interleaved"):
        query_projection(fused)
    fused.qkv_linear.wqkv = nn.Linear(DIM, 7 * HEAD_DIM)  # a wrong layout
    with pytest.raises(ValueError, match="qkv_linear.wqkv has 28 rows, expected 40"):
        find_attention_layers(fused)


def test_max_logit_recording_takes_torchtitan_030_attention():
    """0.3.0's attentions (fused or separate q/k/v) are recorded, not refused: tests/test_attention_logits.py
    checks the values; here only that QKClip builds on both layouts and the inner attention is hooked."""
    for fused in (True, False):
        model = nn.ModuleDict({"attention": V030Attention(DIM, HEADS, KV_HEADS, HEAD_DIM, fused=fused)})
        qk_clip = QKClip(model)
        assert len(qk_clip.recorder._handles) == 1 and len(model.attention.inner_attention._forward_pre_hooks) == 1
