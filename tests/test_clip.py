"""MuonClip / QK-clip on torchtitan 0.2.2's own llama3 (GQA, MHA) and deepseek_v3 (MLA) modules.

The reference is brute force: capture what each ``inner_attention`` receives, build the full
(B, H, L, L) logit matrix with K/V heads repeated (SDPA's enable_gqa), mask it with an explicit
lower-triangular matrix, and check that softmax(logits) @ V reproduces the module's output (so
the scale, mask and head grouping of the reference are the ones the model really uses).
"""

import math

import pytest
import torch
from torch import nn
from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer

from titan_muon import Muon, build_param_groups
from titan_muon.attention.clip import QKClip, apply_qk_clip, build_qk_clips
from titan_muon.attention.layers import find_attention_layers
from titan_muon.attention.logits import MaxLogitRecorder, block_max_logits, block_rows

VOCAB, SEQ = 64, 12


# ---------------------------------------------------------------- models and the reference


def llama(n_heads=9, n_kv_heads=3, head_dim=4, n_layers=2, seed=0):
    args = TransformerModelArgs(
        dim=n_heads * head_dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        vocab_size=VOCAB, max_seq_len=2 * SEQ, multiple_of=16,
    )
    return _init(Transformer(args), seed)


def mla(q_lora_rank=0, n_layers=2, seed=0, n_heads=3):
    # max_seq_len > original_seq_len switches on YaRN's mscale, so softmax_scale != 1/sqrt(d).
    args = DeepSeekV3ModelArgs(
        vocab_size=VOCAB, dim=32, inter_dim=48, moe_inter_dim=16, n_layers=n_layers, n_dense_layers=n_layers,
        n_heads=n_heads, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=5, max_seq_len=2 * SEQ, original_seq_len=SEQ,
    )
    return _init(DeepSeekV3Model(args), seed)


MODELS = {"gqa": llama, "mha": lambda seed=0: llama(n_heads=4, n_kv_heads=None, seed=seed), "mla": mla, "mla_lora": lambda seed=0: mla(8, seed=seed)}


def _init(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
        for name, p in model.named_parameters():
            if p.dim() == 2 and "attention" in name:
                p.normal_(0, 0.4)  # large enough that logits reach a few units
    return model


def tokens(seed=0, batch=2):
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(100 + seed))


def reference_logits(q, k, v, kwargs, out):
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, dim=1), v.double().repeat_interleave(rep, dim=1)
    scale = kwargs.get("scale") or q.shape[-1] ** -0.5
    logits = torch.einsum("bhid,bhjd->bhij", q.double(), k) * scale
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    logits = logits.masked_fill(~allowed, -math.inf)
    # The module runs in fp32, this in fp64 from its own q, k, v: logits up to ~40 carry fp32
    # rounding of ~40·2^-24 ≈ 2.4e-6, which softmax turns into relative errors of that size.
    torch.testing.assert_close(torch.softmax(logits, dim=-1) @ v, out.double(), atol=1e-5, rtol=1e-4)
    return logits


class Capture:
    """Per attention layer: the module's inputs of the last forward and its full masked logits."""

    def __init__(self, model):
        self.layers = find_attention_layers(model)
        self.inputs, self.logits, self._handles = {}, {}, []
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.module.register_forward_pre_hook(self._save_input(i)))
            self._handles.append(layer.module.inner_attention.register_forward_hook(self._save_logits(i), with_kwargs=True))

    def _save_input(self, i):
        return lambda module, args: self.inputs.__setitem__(i, tuple(a.detach() if torch.is_tensor(a) else a for a in args))

    def _save_logits(self, i):
        return lambda module, args, kwargs, out: self.logits.__setitem__(i, reference_logits(*args, kwargs, out.detach()))

    def head_max(self):
        return torch.stack([self.logits[i].amax(dim=(0, 2, 3)) for i in range(len(self.layers))])

    def rerun_layers(self):
        """Each attention layer again on the inputs it saw last: logits as the weights are now."""
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                layer.module(*self.inputs[i])
        return {i: self.logits[i].clone() for i in self.logits}

    def remove(self):
        for h in self._handles:
            h.remove()


# ---------------------------------------------------------------- recording


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("block_bytes", [37 * 4, 1 << 26])  # one query row a block; all rows in one block (capped at q + k bytes)
def test_recorded_max_equals_brute_force(kind, block_bytes):
    model = MODELS[kind]()
    recorder = MaxLogitRecorder.attach(model, block_bytes=block_bytes)
    capture = Capture(model)
    maxima = []
    for micro_batch in range(2):  # running max over the micro-batches of a step
        with torch.no_grad():
            model(tokens(micro_batch))
        maxima.append(capture.head_max())
    expected = torch.maximum(*maxima).float()
    # fp32 dot products of a head's q and k (<= 12 terms, logits up to ~40) vs fp64: ~1e-6.
    torch.testing.assert_close(recorder.max_logits, expected, atol=1e-5, rtol=1e-5)

    model.eval()  # validation forwards do not count
    recorder.reset()
    model(tokens(5))
    assert torch.isneginf(recorder.max_logits).all()


def test_block_max_with_a_document_mask_and_gqa():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 6, 10, 4, generator=g), torch.randn(2, 2, 10, 4, generator=g)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    got = block_max_logits(q, k, 0.7, mask_mod=document_causal, block_bytes=50 * 4)
    full = 0.7 * q @ k.repeat_interleave(3, dim=1).transpose(-1, -2)
    b, i, j = torch.meshgrid(torch.arange(2), torch.arange(10), torch.arange(10), indexing="ij")
    allowed = document_causal(b, None, i, j)[:, None]
    expected = full.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(got, expected)  # fp32 dot products of 4 terms either way (maybe summed in another order)


@pytest.mark.parametrize("rows_per_block", [1, 5, 12])  # 5: blocks of 5, 5 and 2 query rows
@pytest.mark.parametrize("causal", [True, False])
def test_block_max_equals_the_dense_max(rows_per_block, causal):
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 6, 12, 4, generator=g), torch.randn(2, 2, 12, 4, generator=g)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # torchtitan's (B, L, H, D) memory order
    block_bytes = 2 * 12 * 4 * rows_per_block if rows_per_block < 12 else 1 << 30  # fp32 logits of 2 KV heads × 12 keys a row
    assert block_rows(q, k, block_bytes) == rows_per_block
    got = block_max_logits(q, k, 0.7, is_causal=causal, block_bytes=block_bytes)
    full = 0.7 * q.double() @ k.double().repeat_interleave(3, dim=1).transpose(-1, -2)
    if causal:
        full = full.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(got, full.amax(dim=(0, 2, 3)).float(), rtol=1e-6, atol=1e-6)  # fp32 dot products of 4 terms


def test_max_logit_is_signed():
    x = torch.rand(1, 2, 6, 4) + 0.1
    got = block_max_logits(x, -x, 0.5, block_bytes=7 * 4)  # every logit negative
    expected = (-0.5 * x @ x.transpose(-1, -2)).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -math.inf)
    assert (got < 0).all()
    torch.testing.assert_close(got, expected.amax(dim=(0, 2, 3)))  # fp32 dot products of 4 terms either way


def test_recording_needs_no_full_logit_matrix():
    q, k = torch.randn(2, 4, 256, 8), torch.randn(2, 4, 256, 8)
    expected = block_max_logits(q, k, block_bytes=1 << 32)
    # 16 query rows a block; the same fp32 dot products of 8 terms, maybe blocked otherwise by the GEMM
    assert block_rows(q, k, 4 * 256 * 4 * 16) == 16
    torch.testing.assert_close(block_max_logits(q, k, block_bytes=4 * 256 * 4 * 16), expected)


# ---------------------------------------------------------------- clipping


def boost(model, kind, boosted=None):
    """Make some heads (for GQA: all of KV group 0 and one head of group 1) clearly the largest;
    returns their (layer, head) mask. A tau between them and the rest exercises every rule."""
    layers = find_attention_layers(model)
    if boosted is None:
        boosted = [0, 1, 2, 3] if kind == "gqa" else [1]  # GQA: heads 0-2 are KV group 0
    with torch.no_grad():
        for layer in layers:
            wq = layer.module.wq_b if kind == "mla_lora" else layer.module.wq
            rows = wq.weight.shape[0] // layer.n_heads
            for h in boosted:
                wq.weight[h * rows : (h + 1) * rows] *= 4
    mask = torch.zeros(len(layers), layers[0].n_heads, dtype=torch.bool)
    mask[:, boosted] = True
    return mask


def tau_between(s, boosted):
    low, high = s[~boosted].max().item(), s[boosted].min().item()
    assert low < high, (s, boosted)
    return (low + high) / 2


def check_clipped_logits(before, after, s, tau, clipped):
    """Clipped heads: every logit times tau / S, so all <= tau. Others: unchanged.

    Clipped: the rescaled weights are rounded once (2^-24) and the logits recomputed from them
    in fp32 (logits up to ~40, rounding ~1e-7 relative): 1e-5. Unclipped: their weight rows are
    untouched and a GEMM's output entry depends only on its own row and column, so the same
    inputs give the same logits (1e-6 relative leaves room for a library that blocks otherwise).
    """
    for i in before:
        for h in range(s.shape[1]):
            if clipped[i, h]:
                torch.testing.assert_close(after[i][:, h], before[i][:, h] * (tau / s[i, h]), rtol=1e-5, atol=1e-5 * tau)
                assert after[i][:, h].max() <= tau * (1 + 1e-4)
            else:
                torch.testing.assert_close(after[i][:, h], before[i][:, h], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_clip_bounds_clipped_heads_and_keeps_the_others(kind):
    model = MODELS[kind]()
    batch = tokens(0, batch=3)
    boosted = boost(model, kind)
    capture = Capture(model)
    with torch.no_grad():
        model(batch)
    tau = tau_between(capture.head_max(), boosted)
    qk_clip = QKClip(model, tau=tau, alpha=0.5, block_bytes=64 * 4)
    before_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model(batch)
    before, s = capture.rerun_layers(), capture.head_max()
    metrics = qk_clip.reduce_and_clip(lr=1.0)
    assert metrics["qk_clip/heads_clipped"] == int(boosted.sum())
    assert metrics["qk_clip/max_logit"] == pytest.approx(s.max().item(), rel=1e-5)  # fp32 recording vs fp64 reference
    check_clipped_logits(before, capture.rerun_layers(), s, tau, boosted)

    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before_weights[n])}
    if kind == "gqa":  # KV group 0 is fully clipped: K takes a share; group 1 has unclipped heads: K untouched
        wk = dict(model.named_parameters())["layers.0.attention.wk.weight"]
        assert not torch.equal(wk[:4], before_weights["layers.0.attention.wk.weight"][:4])
        assert torch.equal(wk[4:], before_weights["layers.0.attention.wk.weight"][4:])
    allowed = {"mla": ("wq", "wkv_b"), "mla_lora": ("wq_b", "wkv_b")}.get(kind, ("wq", "wk"))
    assert changed and all(n.split(".")[-2] in allowed for n in changed), changed
    if kind.startswith("mla"):  # V rows of wkv_b (5 per head after 8 k_nope rows) untouched
        for n in changed:
            if "wkv_b" in n:
                v_rows = torch.cat([torch.arange(13 * h + 8, 13 * h + 13) for h in range(3)])
                assert torch.equal(dict(model.named_parameters())[n][v_rows], before_weights[n][v_rows])


@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_mha_rule_splits_gamma_by_alpha(alpha):
    model = llama(n_heads=2, n_kv_heads=None, n_layers=1)
    attention = find_attention_layers(model)[0].module
    wq, wk = attention.wq.weight.detach().clone(), attention.wk.weight.detach().clone()
    apply_qk_clip(find_attention_layers(model), torch.tensor([[8.0, 1.0]]), tau=2.0, alpha=alpha)
    gamma = 2.0 / 8.0
    # one fp32 multiplication by a factor computed in another order: default fp32 tolerance
    torch.testing.assert_close(attention.wq.weight[:4], wq[:4] * gamma**alpha)
    torch.testing.assert_close(attention.wk.weight[:4], wk[:4] * gamma ** (1 - alpha))
    assert torch.equal(attention.wq.weight[4:], wq[4:]) and torch.equal(attention.wk.weight[4:], wk[4:])


def test_gqa_group_split_never_grows_a_query_head():
    model = llama(n_heads=4, n_kv_heads=1, n_layers=1)
    attention = find_attention_layers(model)[0].module
    wq, wk = attention.wq.weight.detach().clone(), attention.wk.weight.detach().clone()
    s = torch.tensor([[4.0, 40.0, 2.0, 8.0]])  # all over tau=1: K takes gamma_max^(1/2) = (1/2)^(1/2)
    apply_qk_clip(find_attention_layers(model), s, tau=1.0)
    k = 0.5**0.5
    torch.testing.assert_close(attention.wk.weight, wk * k)
    for h, gamma in enumerate((1 / s[0]).tolist()):
        factor = gamma / k
        assert gamma <= factor <= gamma**0.5 + 1e-12
        torch.testing.assert_close(attention.wq.weight[4 * h : 4 * h + 4], wq[4 * h : 4 * h + 4] * factor)


# ---------------------------------------------------------------- guards


def test_nonpositive_nan_inf_and_tau_itself_never_clip():
    model = llama(n_heads=6, n_kv_heads=6, n_layers=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    s = torch.tensor([[-5.0, 0.0, math.nan, math.inf, 3.0, -math.inf]])
    clipped = apply_qk_clip(find_attention_layers(model), s, tau=3.0)
    assert not clipped.any()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    with pytest.raises(ValueError, match="tau"):
        apply_qk_clip(find_attention_layers(model), s, tau=0.0)
    with pytest.raises(ValueError, match="alpha"):
        QKClip(model, tau=1.0, alpha=1.5)


def test_nan_logits_are_reported_not_clipped():
    model = llama(n_layers=1)
    qk_clip = QKClip(model, tau=1e-3)
    with torch.no_grad():
        model.layers["0"].attention.wq.weight[:4] = math.nan  # head 0 only
        model(tokens())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = qk_clip.reduce_and_clip(lr=1.0)
    assert metrics["qk_clip/nonfinite_heads"] == 1
    assert metrics["qk_clip/heads_clipped"] == 8  # the 8 finite heads are over tau=1e-3
    wq = model.layers["0"].attention.wq.weight
    assert torch.isnan(wq[:4]).all() and torch.isfinite(wq[4:]).all()
    assert torch.equal(model.layers["0"].attention.wk.weight[:4], before["layers.0.attention.wk.weight"][:4])


def test_lr_zero_step_never_clips_and_resets():
    model = llama()
    qk_clip = QKClip(model, tau=1e-3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with torch.no_grad():
        model(tokens())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = qk_clip.reduce_and_clip(optimizer)
    assert metrics["qk_clip/heads_clipped"] == 0 and metrics["qk_clip/max_logit"] > 1e-3
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.isneginf(qk_clip.recorder.max_logits).all()
    optimizer.param_groups[0]["lr"] = 0.1
    with torch.no_grad():
        model(tokens())
    assert qk_clip.reduce_and_clip(optimizer)["qk_clip/heads_clipped"] == 18



def test_a_step_muon_skipped_never_clips():
    """nonfinite_grads="skip": the skipped step changes no weight, MuonClip's rescaling included; the next
    healthy step clips again."""
    model = llama()
    qk_clip = QKClip(model, tau=1e-3)
    optimizer = Muon(build_param_groups(model), lr=0.02, nonfinite_grads="skip")
    model(tokens()).sum().backward()
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    assert optimizer.last_step_skipped
    metrics = qk_clip.reduce_and_clip(optimizer)
    assert metrics["qk_clip/heads_clipped"] == 0 and metrics["qk_clip/max_logit"] > 1e-3
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    optimizer.zero_grad()
    model(tokens()).sum().backward()
    optimizer.step()
    assert not optimizer.last_step_skipped
    assert qk_clip.reduce_and_clip(optimizer)["qk_clip/heads_clipped"] == 18

def test_qk_norm_is_refused_with_a_reason():
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    args = Qwen3ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, hidden_dim=32, vocab_size=VOCAB, qk_norm=True, max_seq_len=SEQ)
    with pytest.raises(ValueError, match="qk-norm.*cancels"):
        QKClip(Qwen3Model(args))


def test_varlen_attention_is_refused():
    args = TransformerModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=VOCAB, max_seq_len=SEQ, attn_type="varlen")
    with pytest.raises(NotImplementedError, match="varlen"):
        QKClip(Transformer(args))


def test_a_model_part_without_attention_is_skipped_only_when_allowed():
    head = nn.Sequential(nn.LayerNorm(36), nn.Linear(36, VOCAB))  # a last pipeline stage: norm + output
    with pytest.raises(ValueError, match="no attention module"):
        build_qk_clips([llama(), head])
    clips = build_qk_clips([llama(), head], allow_parts_without_attention=True)
    assert isinstance(clips[0], QKClip) and clips[1] is None


def test_a_tensor_lr_is_read_on_the_device():
    model = llama()
    qk_clip = QKClip(model, tau=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model(tokens())
    assert dict(qk_clip.reduce_and_clip(lr=torch.tensor(0.0)))["qk_clip/heads_clipped"] == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        model(tokens())
    assert dict(qk_clip.reduce_and_clip(lr=torch.tensor(0.1)))["qk_clip/heads_clipped"] == 18
