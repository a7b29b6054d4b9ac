"""block_max_logits against a dense reference, its memory bound, and activation recompute.

* Exactness: the dense reference builds the full (B, Hq, L, L) logits in fp64 (K heads
  repeated, explicit causal mask) from the same q, k, in the strides torchtitan hands over
  (GQA, MQA, MHA, MLA's nope + rope concat), for lengths that no block size divides. The
  tolerance is derived from fp32 accumulation; bf16 inputs are also checked against a bf16
  dense reference (same GEMM rounding: fp32 accumulation, one rounding to bf16).
* Memory: every CPU allocation made during the call, as torch's profiler records it from the
  allocator (so a copy a kernel makes for itself is seen too): the peak is the logits buffer
  (<= the budget) plus small derived terms, and no allocation comes near q or k.
* Activation recompute (torch.utils.checkpoint in both modes, torchtitan's full AC and
  per-op SAC) records each forward once and leaves gradients untouched.
* torchtitan 0.3.0's inner attentions take (B, L, H, D): the recorder reads them through
  transposed views of the very same memory (no copy) and equals the fp64 dense reference;
  masks come as ``attention_masks``. (tests/test_torchtitan030.py checks it on 0.3.0's own
  llama3 and deepseek_v3 attention against their softmax's input.)
"""

import math
from types import SimpleNamespace

import pytest
import torch
from live_bytes import allocator_peak
from test_clip import MODELS, tokens
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.nn.attention.flex_attention import (
    AuxOutput,
    AuxRequest,
    create_block_mask,
    flex_attention,
)
from torch.utils import _pytree as pytree
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.attention import FlexAttentionWrapper
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list
from torchtitan_layouts import V030Attention, V030InnerAttention

from titan_muon.attention import logits as attention_logits
from titan_muon.attention.logits import (
    ACCELERATOR_BLOCK_BYTES,
    CPU_BLOCK_BYTES,
    FlexKernelTap,
    InputLayout,
    MaxLogitRecorder,
    block_budget,
    block_max_logits,
    block_rows,
    default_block_bytes,
    first_local_head,
    in_backward,
    input_layout,
)
from titan_muon.torchtitan.qk_clip import build_model_part_qk_clips

U32 = 2.0**-24  # fp32 unit roundoff
U16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)


def attention_inputs(kind, batch, length, dtype=torch.float32, seed=0):
    """q, k as torchtitan's attention modules hand them to inner_attention: (B, L, H, D) memory
    transposed to (B, H, L, D); MLA: q = [q_nope, q_rope], k = [k_nope, shared k_rope expanded]."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if kind == "mla":  # 4 heads of 24 + 8 (DeepSeek-V3: 128 + 64)
        heads, nope, rope = 4, 24, 8
        q = torch.cat([randn(batch, length, heads, nope), randn(batch, length, heads, rope)], dim=-1)
        k = torch.cat([randn(batch, length, heads, nope), randn(batch, length, 1, rope).expand(-1, -1, heads, -1)], dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2)
    q_heads, kv_heads, dim = {"gqa": (6, 2, 16), "mqa": (4, 1, 8), "mha": (3, 3, 12)}[kind]
    return randn(batch, length, q_heads, dim).transpose(1, 2), randn(batch, length, kv_heads, dim).transpose(1, 2)


def dense_max(q, k, scale, causal, dtype=torch.float64):
    """Per-Q-head max of the full masked logits, computed in ``dtype``; and for the error bound,
    the largest sum of |q_d k_d| over the unmasked pairs of each head."""
    rep = q.shape[1] // k.shape[1]
    q, k = q.to(dtype), k.to(dtype).repeat_interleave(rep, dim=1)
    logits = q @ k.transpose(-1, -2)
    magnitude = q.double().abs() @ k.double().abs().transpose(-1, -2)
    if causal:
        upper = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
        logits, magnitude = logits.masked_fill(upper, -math.inf), magnitude.masked_fill(upper, 0)
    return logits.amax(dim=(0, 2, 3)).double() * scale, magnitude.amax(dim=(0, 2, 3)) * scale


def gamma(n, u):
    return n * u / (1 - n * u)


@pytest.mark.parametrize("kind", ["gqa", "mqa", "mha", "mla"])
@pytest.mark.parametrize("length, rows", [(37, 1), (101, 7), (101, 16), (64, None)])  # None: as many as allowed
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("per_head", [False, True], ids=["batched", "per_head"])
def test_fp32_equals_the_fp64_dense_max(kind, length, rows, causal, per_head, monkeypatch):
    monkeypatch.setattr(attention_logits, "_per_head_matmul", lambda q: per_head)  # both matmul paths
    q, k = attention_inputs(kind, 2, length)
    block_bytes = 1 << 30 if rows is None else k.shape[1] * length * 4 * rows  # 1 GiB: capped at q + k bytes
    if rows is not None:
        assert block_rows(q, k, block_bytes) == rows  # blocks of `rows` queries: 101 = 14 * 7 + 3 = 6 * 16 + 5
    got = block_max_logits(q, k, 0.3, is_causal=causal, block_bytes=block_bytes)
    expected, magnitude = dense_max(q, k, 0.3, causal)
    # fp32 dot products of D terms (any summation order): |error| <= gamma_D * sum |q_d k_d|;
    # then the scale, rounded to fp32, times the fp32 max: two more roundings of the value.
    bound = gamma(q.shape[-1], U32) * magnitude + 3 * U32 * expected.abs()
    assert ((got.double() - expected).abs() <= bound).all(), (got, expected, bound)


@pytest.mark.parametrize("kind", ["gqa", "mqa", "mla"])
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_equals_the_bf16_dense_max(kind, causal):
    q, k = attention_inputs(kind, 2, 101, torch.bfloat16, seed=1)
    block_bytes = k.shape[1] * 101 * 2 * 7  # 7 query rows a block
    got = block_max_logits(q, k, 0.3, is_causal=causal, block_bytes=block_bytes)
    # The dense reference computed the same way: bf16 matmul (fp32 accumulation, one rounding to
    # bf16), max in bf16, widened, times the scale. The two fp32 accumulations of the same D
    # exact products may differ in order by <= 2 gamma_D sum|q k|, far below one bf16 ulp, so the
    # bf16 roundings differ by at most one ulp (<= 2^-7 |value|); bit-equal on the machines
    # measured (docs/muonclip.md).
    same_way = dense_max(q, k, 1.0, causal, dtype=torch.bfloat16)[0].float() * 0.3
    torch.testing.assert_close(got, same_way, rtol=2.0**-7, atol=0)
    # Against the exact (fp64) max S: each logit is its fp32 accumulation (off by <= gamma_D A,
    # A = max sum|q k|) rounded to bf16; rounding is monotone, so the max of the rounded logits is
    # the rounding of a value within gamma_D A of S: off by <= gamma_D A + 2^-8 (|S| + gamma_D A).
    exact, magnitude = dense_max(q, k, 0.3, causal)
    bound = gamma(q.shape[-1], U32) * magnitude * (1 + U16) + U16 * exact.abs() + 3 * U32 * exact.abs()
    assert ((got.double() - exact).abs() <= bound * (1 + 1e-9)).all(), (got, exact, bound)


def test_a_document_mask_mod_and_every_logit_masked():
    q, k = attention_inputs("gqa", 2, 50, seed=2)
    docs = torch.tensor([[0] * 20 + [1] * 30, [0] * 49 + [1]])

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx) & (h != 5)  # head 5 sees nothing

    got = block_max_logits(q, k, 0.3, mask_mod=document_causal, block_bytes=2 * 50 * 6 * 7)  # 7 rows a block
    rep = 3
    full = 0.3 * q.double() @ k.double().repeat_interleave(rep, dim=1).transpose(-1, -2)
    b, h, i, j = torch.meshgrid(torch.arange(2), torch.arange(6), torch.arange(50), torch.arange(50), indexing="ij")
    expected = full.masked_fill(~document_causal(b, h, i, j), -math.inf).amax(dim=(0, 2, 3))
    assert torch.isneginf(got[5])
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)  # 16-term fp32 dot products


# ---------------------------------------------------------------- memory


def test_block_budget():
    q, k = torch.empty(1, 32, 8192, 128, dtype=torch.bfloat16), torch.empty(1, 8, 8192, 128, dtype=torch.bfloat16)
    assert block_budget(q, k) == CPU_BLOCK_BYTES and block_rows(q, k) == CPU_BLOCK_BYTES // (8 * 8192 * 2) == 32
    on_cuda = ACCELERATOR_BLOCK_BYTES // (8 * 8192 * 2)  # Llama-3-8B at 8192: 512 query rows a block
    assert default_block_bytes("cuda") == ACCELERATOR_BLOCK_BYTES and on_cuda == 512
    assert block_rows(q.to("meta"), k.to("meta")) == on_cuda
    q, k = attention_inputs("gqa", 2, 600)
    qk_bytes = (q.numel() + k.numel()) * 4
    assert block_budget(q, k) == qk_bytes < CPU_BLOCK_BYTES
    assert block_budget(q, k, 1 << 40) == qk_bytes  # never more than q and k themselves
    assert block_rows(q, k, 1 << 16) == (1 << 16) // (2 * 600 * 4)  # (KV heads, rows, keys) fp32 logits
    small_q, small_k = attention_inputs("mha", 1, 40)
    assert block_budget(small_q, small_k) == (small_q.numel() + small_k.numel()) * 4
    assert block_rows(small_q, small_k) == min(40, block_budget(small_q, small_k) // (3 * 40 * 4))
    # The causal diagonal mask (rows^2 bools) stays within 1/16 of the budget: MQA, short keys.
    q1, k1 = torch.empty(1, 4, 1000, 64), torch.empty(1, 1, 1000, 64)
    assert (1 << 20) // (1 * 1000 * 4) == 262 and block_rows(q1, k1, 1 << 20) == math.isqrt((1 << 20) // 16) == 256


def gemm_workspace(q, k, rows, per_head):
    """What one of the call's matmuls allocates for itself beyond its output (oneDNN's bf16 GEMM
    takes a scratchpad that grows with the rows; MKL's fp32 batched GEMM none): measured here on
    the same shapes, since it is the library's and not the recorder's."""
    out = torch.empty(k.shape[1], rows, k.shape[2], dtype=q.dtype)
    block, keys = q[0, :: q.shape[1] // k.shape[1], :rows], k[0].transpose(1, 2)
    if per_head:
        zero = torch.zeros((), dtype=q.dtype)
        return allocator_peak(lambda: torch.addmm(zero, block[0], keys[0], beta=0, out=out[0]))[0]
    return allocator_peak(lambda: torch.bmm(block, keys, out=out))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("masking", ["causal", "none", "mask_mod"])
def test_peak_memory_is_the_block_budget(dtype, kind, masking):
    q, k = attention_inputs(kind, 2, 600, dtype)
    q_bytes, k_bytes = q.numel() * q.element_size(), k.numel() * k.element_size()
    budget = 32 << 10
    mask_mod = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) if masking == "mask_mod" else None
    rows = block_rows(q, k, budget, masked=mask_mod is not None)
    blocks = math.ceil(600 / rows)
    assert blocks > 1 and budget < min(q_bytes, k_bytes) / 2

    peak, largest, _ = allocator_peak(lambda: block_max_logits(q, k, is_causal=masking == "causal", mask_mod=mask_mod, block_bytes=budget))

    logits = k.shape[1] * rows * 600 * q.element_size()
    masks = 2 * k.shape[1] * rows * 600 if mask_mod is not None else 0  # the mask and its negation
    diagonal = rows * rows if masking == "causal" else 0  # the (rows, rows) bool upper triangle
    maxima = blocks * q.shape[0] * q.shape[1] * q.element_size()  # one max per (block, sequence, Q head)
    assert logits + masks <= budget
    per_head = dtype != torch.float32
    slack = diagonal + maxima + gemm_workspace(q, k, rows, per_head) + 1024  # + a few scalars and (heads,) vectors
    assert peak <= logits + masks + slack, (peak, logits, masks, slack)
    assert largest <= max(logits, masks // 2) < min(q_bytes, k_bytes) / 2  # nothing the size of q or k


# ---------------------------------------------------------------- activation recompute


def checkpointed(kind, how):
    model = MODELS[kind]()
    if how in ("reentrant", "non_reentrant"):
        impl = CheckpointImpl.REENTRANT if how == "reentrant" else CheckpointImpl.NO_REENTRANT
        for name, layer in list(model.layers.named_children()):
            model.layers.register_module(name, checkpoint_wrapper(layer, checkpoint_impl=impl))
    else:  # torchtitan's own wrapping: full AC, or per-op SAC with llama3's save list
        config = ActivationCheckpoint(mode="full") if how == "full" else ActivationCheckpoint(mode="selective", selective_ac_option="op")
        apply_ac(model, config, op_sac_save_list=_op_sac_save_list)
    return model


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("how", ["reentrant", "non_reentrant", "full", "op"])
def test_activation_recompute_records_once(kind, how, monkeypatch):
    reference, model = MODELS[kind](), checkpointed(kind, how)  # same seed: same weights
    recorders = {name: MaxLogitRecorder.attach(m) for name, m in (("reference", reference), ("checkpointed", model))}
    calls = {"hook": 0, "recorded": 0}
    record = attention_logits.block_max_logits

    def counted(*args, **kwargs):
        calls["recorded"] += 1
        return record(*args, **kwargs)

    monkeypatch.setattr(attention_logits, "block_max_logits", counted)
    for layer in model.layers.values():
        attention = layer.get_submodule("_checkpoint_wrapped_module.attention") if hasattr(layer, "_checkpoint_wrapped_module") else layer.attention
        attention.inner_attention.register_forward_pre_hook(lambda *_: calls.__setitem__("hook", calls["hook"] + 1))

    for micro_batch in range(2):
        model(tokens(micro_batch)).float().logsumexp(-1).mean().backward()
    layers = len(model.layers)
    assert calls["hook"] == 2 * 2 * layers  # every attention ran twice per micro-batch: forward and recompute
    assert calls["recorded"] == 2 * layers  # and was recorded once

    for micro_batch in range(2):
        reference(tokens(micro_batch)).float().logsumexp(-1).mean().backward()
    assert torch.equal(recorders["checkpointed"].max_logits, recorders["reference"].max_logits)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_in_backward_only_inside_backward():
    seen = []
    x = torch.ones(2, requires_grad=True)

    def fn(x):
        seen.append(in_backward())
        return x.exp()

    assert not in_backward()
    for reentrant in (True, False):
        seen.clear()
        torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=reentrant).sum().backward()
        assert seen == [False, True], reentrant


# ---------------------------------------------------------------- torchtitan 0.3.0: (batch, seq, heads, head_dim)


def v030_attention(kind, fused):
    """A 0.3.0 GQAttention stand-in with the head counts of ``attention_inputs(kind)``; its inner attention
    has 0.3.0's signature (q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale, enable_gqa, is_causal)."""
    q_heads, kv_heads, dim = {"gqa": (6, 2, 16), "mqa": (4, 1, 8), "mha": (3, 3, 12), "mla": (4, 4, 32)}[kind]
    return V030Attention(dim=8, n_heads=q_heads, n_kv_heads=kv_heads, head_dim=dim, fused=fused)


def record(attention, *args, **kwargs):
    """One training forward of the inner attention; the recorded (heads,) maxima."""
    recorder = MaxLogitRecorder([attention])
    attention.inner_attention(*args, **kwargs)
    return recorder.max_logits[0]


def test_input_layout_is_read_from_the_signature():
    assert input_layout(V030InnerAttention()) == InputLayout("q_BLNH", "k_BLNH", heads_dim=2)
    assert input_layout(torch.nn.Identity()) == InputLayout()  # one argument: the default, 0.2.2's names

    class V022(torch.nn.Module):
        def forward(self, q, k, v, *, scale=None):
            return q

    assert input_layout(V022()) == InputLayout("q", "k", heads_dim=1)
    # torchtitan 0.3.0's Module.parallelize (TP, EP) replaces the instance's forward by a wrapper
    parallelized = V030InnerAttention()
    parallelized.forward = lambda *args, **kwargs: V030InnerAttention.forward(parallelized, *args, **kwargs)
    assert input_layout(parallelized) == InputLayout("q_BLNH", "k_BLNH", heads_dim=2)


@pytest.mark.parametrize("kind", ["gqa", "mqa", "mha", "mla"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fused", [True, False], ids=["wqkv", "wq_wk"])
def test_sequence_major_inputs_equal_the_fp64_dense_max(kind, causal, fused, monkeypatch):
    q, k = attention_inputs(kind, 2, 101, seed=3)  # (B, H, L, D) views of (B, L, H, D) memory
    q_BLNH, k_BLNH = q.transpose(1, 2), k.transpose(1, 2)  # what 0.3.0 hands over: contiguous (B, L, H, D)
    assert q_BLNH.is_contiguous() and k_BLNH.is_contiguous()
    v_BLNH = torch.randn(k_BLNH.shape)
    seen = []

    def spy(q_seen, k_seen, *args, **kwargs):
        seen.append((q_seen, k_seen))
        return block_max_logits(q_seen, k_seen, *args, **kwargs)

    monkeypatch.setattr(attention_logits, "block_max_logits", spy)
    attention = v030_attention(kind, fused)
    scale = None if kind == "gqa" else 0.3  # None: 1/sqrt(head_dim), as SDPA
    got = record(attention, q_BLNH, k_BLNH, v_BLNH, attention_masks=None, scale=scale, enable_gqa=kind in ("gqa", "mqa"),
                 is_causal=causal)  # fmt: skip
    # Views of the same memory, in the (B, H, L, D) layout of 0.2.2 (no copy of q or k) ...
    (q_seen, k_seen), = seen
    for seen_t, given in ((q_seen, q_BLNH), (k_seen, k_BLNH)):
        assert seen_t.data_ptr() == given.data_ptr() and seen_t.shape == given.transpose(1, 2).shape
        assert seen_t.stride() == given.transpose(1, 2).stride()
    # ... so the same math as 0.2.2's: bit for bit what block_max_logits gives on the transposed views,
    scale_value = q.shape[-1] ** -0.5 if scale is None else scale
    assert torch.equal(got[: q.shape[1]], block_max_logits(q, k, scale, is_causal=causal))
    # and the max of the logits softmax sees, within fp32 accumulation error.
    expected, magnitude = dense_max(q, k, scale_value, causal)
    bound = gamma(q.shape[-1], U32) * magnitude + 3 * U32 * expected.abs()
    assert ((got[: q.shape[1]].double() - expected).abs() <= bound).all(), (got, expected, bound)


def test_sequence_major_inputs_by_keyword_with_a_block_mask():
    """0.3.0's FlexAttention gets the mask as ``attention_masks=BlockMask``: its mask_mod is what counts."""
    q, k = attention_inputs("gqa", 2, 50, seed=4)
    docs = torch.tensor([[0] * 20 + [1] * 30, [0] * 49 + [1]])

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    attention = v030_attention("gqa", fused=True)
    recorder = MaxLogitRecorder([attention])
    hook = next(iter(attention.inner_attention._forward_pre_hooks.values()))
    block_mask = SimpleNamespace(mask_mod=document_causal)  # what the recorder reads of a BlockMask
    hook(attention.inner_attention, (), dict(q_BLNH=q.transpose(1, 2), k_BLNH=k.transpose(1, 2),
                                             attention_masks=block_mask, scale=0.3, enable_gqa=True))  # fmt: skip
    full = 0.3 * q.double() @ k.double().repeat_interleave(3, dim=1).transpose(-1, -2)
    b, h, i, j = torch.meshgrid(torch.arange(2), torch.arange(6), torch.arange(50), torch.arange(50), indexing="ij")
    expected = full.masked_fill(~document_causal(b, h, i, j), -math.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(recorder.max_logits[0].double(), expected, rtol=1e-6, atol=1e-6)


def test_what_the_recording_cannot_read_is_refused():
    q = torch.randn(1, 8, 6, 16)
    k = torch.randn(1, 8, 2, 16)
    attention = v030_attention("gqa", fused=True)
    MaxLogitRecorder([attention])
    with pytest.raises(NotImplementedError, match="not VarlenMetadata"):
        varlen = type("VarlenMetadata", (), {"cu_seq_q": None})()
        attention.inner_attention(q, k, k, attention_masks=varlen)
    with pytest.raises(NotImplementedError, match="score_mod"):
        hook = next(iter(attention.inner_attention._forward_pre_hooks.values()))
        hook(attention.inner_attention, (q, k, k), {"score_mod": lambda score, b, h, i, j: score})

    class VarlenAttention(V030InnerAttention):
        pass

    attention.inner_attention = VarlenAttention()
    with pytest.raises(NotImplementedError, match="not varlen attention"):
        MaxLogitRecorder([attention])


@pytest.mark.parametrize("fused", [True, False], ids=["wqkv", "wq_wk"])
def test_tensor_parallel_heads_go_to_their_global_slots(fused, monkeypatch):
    """Under TP a rank's inner attention sees its heads only; with plain-tensor q/k their global slots come
    from the rows of the projection it holds: whole heads of wq, whole KV groups of 0.3.0's fused wqkv."""
    attention = v030_attention("gqa", fused)  # 6 query heads in 2 KV groups of 3, head_dim 16
    unit_rows = 5 * 16 if fused else 16  # a KV group of wqkv: 3 query + 1 key + 1 value heads
    held = (unit_rows, 2 * unit_rows) if fused else (3 * unit_rows, 6 * unit_rows)  # rank 1 of TP 2
    monkeypatch.setattr(attention_logits, "held_rows", lambda t, dim=0: held)
    assert first_local_head(attention, 3) == 3
    with pytest.raises(NotImplementedError, match="not whole"):
        first_local_head(attention, 2)
    q, k = attention_inputs("gqa", 1, 20, seed=5)
    rank_q, rank_k = q[:, 3:].transpose(1, 2).contiguous(), k[:, 1:].transpose(1, 2).contiguous()
    got = record(attention, rank_q, rank_k, rank_k, scale=0.3, enable_gqa=True)
    assert torch.isneginf(got[:3]).all()
    torch.testing.assert_close(got[3:], block_max_logits(q[:, 3:], k[:, 1:], 0.3), rtol=0, atol=0)


# ---------------------------------------------------------------- the fused FlexAttention path (CUDA kernels)


class V030FlexAttention(torch.nn.Module):
    """0.3.0's FlexAttention call convention: (B, L, N, H) inputs transposed for the class's compiled
    kernel, which is always asked for ``return_aux`` (lse only with an ``out_transform``) with its
    ``kernel_options``; the output transposed back."""

    _compiled_flex_attn = None  # set per test: the kernel stand-in

    def __init__(self, kernel_options=None):
        super().__init__()
        self.kernel_options = kernel_options or {}

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False, out_transform=None):
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out, aux = V030FlexAttention._compiled_flex_attn(
            q, k, v, score_mod=None, block_mask=attention_masks, scale=scale, enable_gqa=enable_gqa,
            return_aux=AuxRequest(lse=out_transform is not None), kernel_options=self.kernel_options,
        )  # fmt: skip
        out = out.transpose(1, 2)
        return out if out_transform is None else out_transform(out, aux.lse.transpose(1, 2))


def masked_scores(q, k, scale, mask_mod):
    """fp64 scale * q·k with the mask_mod's disallowed pairs at -inf: (B, Hq, Lq, Lk)."""
    rep = q.shape[1] // k.shape[1]
    scores = scale * q.double() @ k.double().repeat_interleave(rep, dim=1).transpose(-1, -2)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in scores.shape), indexing="ij")
    return scores.masked_fill(~mask_mod(b, h, i, j), -math.inf)


def cuda_kernel_stand_in(calls):
    """What torch 2.13's compiled flex_attention does on CUDA, on CPU: output and logsumexp from the eager
    kernel, and with ``AuxRequest(max_scores=True)`` each query's max of the scaled, masked scores in fp32
    (torch's own math reference: ``max(post_mod_scores, dim=-1)``), which the CPU kernel refuses to return."""

    def kernel(q, k, v, *, block_mask, scale=None, enable_gqa=False, return_lse=False, return_aux=None, **options):
        calls.append(return_aux)
        out, aux = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                  return_aux=AuxRequest(lse=True))  # fmt: skip
        if return_aux is None:
            return (out, aux.lse) if return_lse else out
        scale_value = q.shape[-1] ** -0.5 if scale is None else scale
        maxima = masked_scores(q, k, scale_value, block_mask.mask_mod).amax(dim=-1).float()
        return out, AuxOutput(lse=aux.lse if return_aux.lse else None, max_scores=maxima if return_aux.max_scores else None)

    return kernel


def document_causal_mask(length):
    docs = torch.tensor([[0] * 12 + [1] * (length - 12), [0] * (length - 1) + [1]])

    def mask_mod(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(mask_mod, 2, None, length, length, device="cpu")


@pytest.mark.parametrize("version", ["0.2.2", "0.3.0"])
@pytest.mark.parametrize("with_lse", [False, True])
def test_fused_flex_records_the_kernels_max_scores(version, with_lse, monkeypatch):
    """With ``fused=True`` the kernel itself returns each query's max score: the recording is its max
    over batch and queries per head, no second QKᵀ, and the wrapper's output (and logsumexp) unchanged."""
    wrapper_class = FlexAttentionWrapper if version == "0.2.2" else V030FlexAttention
    calls = []
    monkeypatch.setattr(wrapper_class, "_compiled_flex_attn", cuda_kernel_stand_in(calls))
    monkeypatch.setattr(attention_logits, "block_max_logits", lambda *a, **k: pytest.fail("unfused recording ran"))
    attention = v030_attention("gqa", fused=False)
    attention.inner_attention = wrapper_class()
    q, k = attention_inputs("gqa", 2, 40, seed=6)  # (B, H, L, D)
    v = torch.randn(k.shape)
    block_mask = document_causal_mask(40)

    def forward():
        if version == "0.2.2":
            return attention.inner_attention(q, k, v, block_mask=block_mask, scale=0.3, return_lse=with_lse, enable_gqa=True)
        transform = (lambda out, lse: (out, lse)) if with_lse else None
        inputs = (t.transpose(1, 2) for t in (q, k, v))
        return attention.inner_attention(*inputs, attention_masks=block_mask, scale=0.3, enable_gqa=True, out_transform=transform)

    unrecorded = forward()
    recorder = MaxLogitRecorder([attention], fused=True)
    assert isinstance(wrapper_class.__dict__["_compiled_flex_attn"], FlexKernelTap)
    recorded = forward()
    for got, expected in zip(pytree.tree_leaves(recorded), pytree.tree_leaves(unrecorded), strict=True):
        assert torch.equal(got, expected)
    # The kernel was asked once for max scores, with the logsumexp exactly when the wrapper wanted it.
    assert calls[-1] == AuxRequest(lse=with_lse, max_scores=True) and len(calls) == 2
    # The recording is the kernel's maxima reduced, bit for bit ...
    expected = masked_scores(q, k, 0.3, block_mask.mask_mod).amax(dim=(0, 2, 3)).float()
    assert torch.equal(recorder.max_logits[0], expected)
    # ... and the max of the logits softmax sees (the unfused recording's quantity), to fp32 rounding.
    exact, magnitude = dense_max(q, k, 0.3, causal=False)  # magnitude over all pairs bounds the masked ones
    bound = gamma(q.shape[-1], U32) * magnitude + U32 * exact.abs()
    assert ((recorder.max_logits[0].double() - masked_scores(q, k, 0.3, block_mask.mask_mod).amax(dim=(0, 2, 3))).abs()
            <= bound).all()  # fmt: skip
    # Evaluation and recompute forwards do not ask for max scores; removing restores the kernel.
    attention.inner_attention.eval()
    forward()
    assert calls[-1] in (None, AuxRequest(lse=with_lse))
    recorder.remove()
    assert wrapper_class.__dict__["_compiled_flex_attn"] is not None
    assert not isinstance(wrapper_class.__dict__["_compiled_flex_attn"], FlexKernelTap)


def test_fused_is_chosen_by_device_and_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(FlexAttentionWrapper, "_compiled_flex_attn", cuda_kernel_stand_in(calls))
    attention = v030_attention("gqa", fused=False)
    attention.inner_attention = FlexAttentionWrapper()
    q, k = attention_inputs("gqa", 2, 40, seed=7)
    block_mask = document_causal_mask(40)
    # Default (None): the fused kernel only on CUDA; on CPU the recording computes the maxima itself.
    recorder = MaxLogitRecorder([attention])
    attention.inner_attention(q, k, torch.randn(k.shape), block_mask=block_mask, scale=0.3, enable_gqa=True)
    assert calls == [None]
    torch.testing.assert_close(recorder.max_logits[0], block_max_logits(q, k, 0.3, mask_mod=block_mask.mask_mod),
                               rtol=0, atol=0)  # fmt: skip
    recorder.remove()
    # fused=True where the kernel cannot answer is refused by name; fused=False never taps.
    sdpa = v030_attention("gqa", fused=False)
    with pytest.raises(ValueError, match="fused=True .* needs FlexAttention.*V030InnerAttention"):
        MaxLogitRecorder([sdpa], fused=True)
    with pytest.raises(ValueError, match="needs FlexAttention"):  # after tapping the first layer's kernel ...
        MaxLogitRecorder([attention, sdpa], fused=True)
    assert not isinstance(FlexAttentionWrapper.__dict__["_compiled_flex_attn"], FlexKernelTap)  # ... untapped again
    flash = v030_attention("gqa", fused=False)
    flash.inner_attention = V030FlexAttention(kernel_options={"BACKEND": "FLASH"})
    with pytest.raises(ValueError, match="no FLASH backend"):
        MaxLogitRecorder([flash], fused=True)
    # The TOML key reaches the recorder through the adapter.
    config = SimpleNamespace(qk_clip_tau=100.0, qk_clip_alpha=0.5, qk_clip_recording="kernel")
    with pytest.raises(ValueError, match='qk_clip_recording = "kernel"'):
        build_model_part_qk_clips([torch.nn.ModuleDict({"attention": sdpa})], config)
    config.qk_clip_recording = "blocks"
    (clip,) = build_model_part_qk_clips([torch.nn.ModuleDict({"attention": attention})], config)
    assert clip.recorder.fused is False
    clip.remove()
    MaxLogitRecorder([attention], fused=False)
    assert not isinstance(FlexAttentionWrapper.__dict__["_compiled_flex_attn"], FlexKernelTap)


def test_a_wrapper_that_bypasses_the_kernel_is_recorded_unfused(monkeypatch):
    """A subclass calling flex_attention itself never reaches the tap: the forward hook records from the
    inputs after all, and disarms the tap so the next layer's call is not taken for this one."""
    calls = []
    monkeypatch.setattr(FlexAttentionWrapper, "_compiled_flex_attn", cuda_kernel_stand_in(calls))

    class OwnCall(FlexAttentionWrapper):
        def forward(self, q, k, v, *, block_mask=None, scale=None, return_lse=False, enable_gqa=False):
            return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)

    attention = v030_attention("gqa", fused=False)
    attention.inner_attention = OwnCall()
    recorder = MaxLogitRecorder([attention], fused=True)
    tap = FlexAttentionWrapper.__dict__["_compiled_flex_attn"]
    q, k = attention_inputs("gqa", 2, 40, seed=8)
    block_mask = document_causal_mask(40)
    attention.inner_attention(q, k, torch.randn(k.shape), block_mask=block_mask, scale=0.3, enable_gqa=True)
    assert tap.armed is None and calls == []
    torch.testing.assert_close(recorder.max_logits[0], block_max_logits(q, k, 0.3, mask_mod=block_mask.mask_mod),
                               rtol=0, atol=0)  # fmt: skip


def test_fused_recording_traces_under_compile_fullgraph(monkeypatch):
    """torchtitan compiles each block with ``fullgraph=True``: arming the tap in the pre-hook and the
    tapped kernel call trace without a graph break (aot_eager: tracing without inductor's compile)."""
    calls = []
    monkeypatch.setattr(FlexAttentionWrapper, "_compiled_flex_attn", cuda_kernel_stand_in(calls))
    attention = v030_attention("gqa", fused=False)
    attention.inner_attention = FlexAttentionWrapper()
    recorder = MaxLogitRecorder([attention], fused=True)
    q, k = attention_inputs("gqa", 2, 40, seed=9)
    v = torch.randn(k.shape)
    block_mask = document_causal_mask(40)

    def inner(q, k, v):
        return attention.inner_attention(q, k, v, block_mask=block_mask, scale=0.3, enable_gqa=True)

    expected_out = flex_attention(q, k, v, block_mask=block_mask, scale=0.3, enable_gqa=True)
    out = torch.compile(inner, fullgraph=True, backend="aot_eager")(q, k, v)
    # aot_eager runs the same aten ops in the same order (no fusion), possibly with other strides:
    # fp32 rounding at most, as test_clip_device's compile test allows.
    torch.testing.assert_close(out, expected_out)
    assert calls == [AuxRequest(lse=False, max_scores=True)]
    # The stand-in's fp64 maxima rounded to fp32; traced, the fp64 sums may change order (~1e-16
    # relative), which can move the fp32 rounding by one ulp at most.
    expected = masked_scores(q, k, 0.3, block_mask.mask_mod).amax(dim=(0, 2, 3)).float()
    torch.testing.assert_close(recorder.max_logits[0], expected, rtol=2.0**-23, atol=0)
