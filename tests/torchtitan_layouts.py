"""Small stand-ins for torchtitan models: parameter names, shapes and the attributes titan_muon reads.

``v030_*`` follow torchtitan 0.3.0 as read in its wheel (models/common/attention.py, moe.py,
decoder.py, deepseek_v3/mtp.py); 0.3.0 is not installed here. ``v022_*`` follow the installed
0.2.2. Nothing here runs a forward but 0.3.0's inner attention (what max-logit recording hooks):
the tests only need what parameter classification, Split and QK-clip look at.
"""

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)


class Router(nn.Module):
    def __init__(self, dim, experts):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)


# ---------------------------------------------------------------- torchtitan 0.2.2


class V022Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, head_dim, bias=False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.inner_attention = nn.Identity()  # 0.2.2's take (batch, heads, seq, head_dim)


class V022GroupedExperts(nn.Module):
    def __init__(self, dim, hidden, experts):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))


class V022MoE(nn.Module):
    def __init__(self, dim, hidden, experts):
        super().__init__()
        self.experts = V022GroupedExperts(dim, hidden, experts)
        self.router = Router(dim, experts)
        self.shared_experts = FeedForward(dim, hidden)
        self.register_buffer("expert_bias", torch.zeros(experts))


class V022Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, head_dim, moe):
        super().__init__()
        self.attention = V022Attention(dim, heads, kv_heads, head_dim)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        if moe:
            self.moe = V022MoE(dim, 2 * dim, experts=4)
        else:
            self.feed_forward = FeedForward(dim, 3 * dim)


class V022Model(nn.Module):
    """llama3 (first layer dense) and llama4-style MoE layers: ``output``, ``moe.experts.w1``."""

    def __init__(self, dim=16, heads=4, kv_heads=2, layers=3, vocab=50):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): V022Block(dim, heads, kv_heads, dim // heads, moe=i > 0) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)


# ---------------------------------------------------------------- torchtitan 0.3.0


class V030InnerAttention(nn.Module):
    """0.3.0's ScaledDotProductAttention: inputs named by layout, (batch, seq, heads, head_dim), transposed
    to (batch, heads, seq, head_dim) for SDPA and back. (FlexAttention, also taking ``attention_masks``, a
    BlockMask, has the same signature; here a mask's ``mask_mod`` is ignored by the output.)"""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True):
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        causal = is_causal and attention_masks is None
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


class V030FusedQKVLinear(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, head_dim, bias=False):
        super().__init__()
        self.head_dim, self.heads_per_kv = head_dim, n_heads // n_kv_heads
        self.r_dim = self.heads_per_kv + 2
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim, bias=bias)


class V030QKVLinear(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, head_dim, bias=False):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)


class V030Attention(nn.Module):
    """0.3.0's GQAttention: projections in ``qkv_linear`` (llama3 fuses them: ``fuse_qkv=True``)."""

    def __init__(self, dim, n_heads, n_kv_heads, head_dim, fused=True, bias=False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        qkv = V030FusedQKVLinear if fused else V030QKVLinear
        self.qkv_linear = qkv(dim, n_heads, n_kv_heads, head_dim, bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.inner_attention = V030InnerAttention()
        self.q_norm = self.k_norm = None


class V030GroupedExperts(nn.Module):
    def __init__(self, dim, hidden, experts):
        super().__init__()
        self.num_experts = experts
        self.w1_EFD = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2_EDF = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3_EFD = nn.Parameter(torch.empty(experts, hidden, dim))


class V030RoutedExperts(nn.Module):
    def __init__(self, dim, hidden, experts):
        super().__init__()
        self.inner_experts = V030GroupedExperts(dim, hidden, experts)
        self.token_dispatcher = nn.Module()  # parameterless in 0.3.0


class V030MoE(nn.Module):
    def __init__(self, dim, hidden, experts):
        super().__init__()
        self.routed_experts = V030RoutedExperts(dim, hidden, experts)
        self.router = Router(dim, experts)
        self.shared_experts = FeedForward(dim, hidden)
        self.register_buffer("expert_bias_E", torch.zeros(experts))


class V030Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, head_dim, moe):
        super().__init__()
        self.attention = V030Attention(dim, heads, kv_heads, head_dim)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        if moe:
            self.moe = V030MoE(dim, 2 * dim, experts=4)
        else:
            self.feed_forward = FeedForward(dim, 3 * dim)


class V030MTPBlock(V030Block):
    """deepseek_v3's multi-token prediction block: eh_proj(cat(enorm(embedding), hnorm(hidden)))."""

    def __init__(self, dim, heads, kv_heads, head_dim):
        super().__init__(dim, heads, kv_heads, head_dim, moe=True)
        self.enorm, self.hnorm, self.mtp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)


class V030Model(nn.Module):
    """0.3.0 decoder: fused wqkv, ``moe.routed_experts.inner_experts.w1_EFD``, ``lm_head``, MTP layers."""

    def __init__(self, dim=16, heads=4, kv_heads=2, layers=3, vocab=50):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): V030Block(dim, heads, kv_heads, dim // heads, moe=i > 0) for i in range(layers)})
        self.mtp_layers = nn.ModuleList([V030MTPBlock(dim, heads, kv_heads, dim // heads)])
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
