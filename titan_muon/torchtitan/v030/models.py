"""Small model flavors for torchtitan 0.3.0, the same shapes as the 0.2.2 ones (specs.py).

torchtitan 0.3.0's models are trees of ``Config`` objects built by its public helpers
(``make_gqa_config``, ``make_ffn_config``, ``build_mla_moe_layers``); a flavor here is such a
tree, wrapped in the ``ModelSpec`` of torchtitan's own llama3 / deepseek_v3 (same parallelize,
pipelining, state-dict adapter and, for deepseek_v3, its MoE load-balancing hook).

* llama3: ``debugmodel_gqa`` (dim 256, 4 layers, 8 query heads / 2 key-value heads) and
  ``tiny_gqa`` (for tests); Q/K/V fused into ``attention.qkv_linear.wqkv`` as in every 0.3.0
  llama3. Any stock llama3 flavor (``debugmodel``, ``8B``, ...) is also accepted.
* deepseek_v3 (MLA): ``debugmodel_dense`` / ``tiny_dense`` (dense MLPs), ``debugmodel_moe`` /
  ``tiny_moe`` (one dense layer, then MoE: sigmoid router, top 2, one shared expert); and the
  stock flavors.

Attention is built as torchtitan's default FlexAttention; titan_muon.torchtitan.v030.cpu
swaps it for SDPA on CPU.
"""

import dataclasses
from collections.abc import Callable
from functools import partial

import torch.nn as nn
from torchtitan.models import deepseek_v3, llama3
from torchtitan.models.common import (
    ComplexRoPE,
    Embedding,
    Linear,
    RMSNorm,
    compute_ffn_hidden_dim,
)
from torchtitan.models.common.config_utils import (
    get_attention_config,
    make_ffn_config,
    make_gqa_config,
)
from torchtitan.models.common.param_init import depth_scaled_std
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.protocols.model_spec import ModelSpec

STD = 0.02
_NORM = {"weight": nn.init.ones_}


def _normal(std: float) -> dict[str, Callable]:
    return {"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}


def _by_depth(layer_id: int) -> dict[str, Callable]:
    return _normal(depth_scaled_std(STD, layer_id))


def _experts_by_depth(layer_id: int) -> dict[str, Callable]:
    deep = partial(nn.init.trunc_normal_, std=depth_scaled_std(STD, layer_id))
    return {"w1_EFD": partial(nn.init.trunc_normal_, std=STD), "w2_EDF": deep, "w3_EFD": deep}


def _ends(dim: int, vocab_size: int) -> dict:
    """Token embeddings, final norm and output head of a decoder."""
    return dict(
        dim=dim,
        vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init={"weight": partial(nn.init.normal_, std=1.0)}
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_normal(dim**-0.5)),
    )


def llama3_gqa(
    *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab_size: int = 2048, multiple_of: int = 256,
    fuse_qkv: bool = True,
) -> Llama3Model.Config:  # fmt: skip
    """A llama3 with grouped-query attention: Q/K/V fused into ``qkv_linear.wqkv`` as torchtitan 0.3.0
    builds llama3, or (``fuse_qkv=False``) separate ``qkv_linear.wq`` / ``wk`` / ``wv``."""
    head_dim = dim // n_heads
    rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=131072, theta=500000, scaling="llama")
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                wqkv_param_init=_normal(STD),
                wo_param_init=_by_depth(layer_id),
                inner_attention=get_attention_config("flex"),
                fuse_qkv=fuse_qkv,
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=dim,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=multiple_of),
                w1_param_init=_normal(STD),
                w2w3_param_init=_by_depth(layer_id),
            ),
        )
        for layer_id in range(n_layers)
    ]
    return Llama3Model.Config(**_ends(dim, vocab_size), layers=layers)


def mla(
    *, dim: int, n_layers: int, n_dense_layers: int, n_heads: int, q_lora_rank: int, kv_lora_rank: int,
    qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, inter_dim: int, moe_inter_dim: int = 0,
    num_experts: int = 0, vocab_size: int = 2048,
) -> DeepSeekV3Model.Config:  # fmt: skip
    """A DeepSeek-V3-style model: multi-head latent attention, dense MLPs in the first
    ``n_dense_layers`` layers and MoE layers (sigmoid router, top 2, one shared expert) after."""
    layers = build_mla_moe_layers(
        n_layers=n_layers,
        n_dense_layers=n_dense_layers,
        dim=dim,
        n_heads=n_heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        mscale=1.0,
        dense_hidden_dim=inter_dim,
        moe_hidden_dim=moe_inter_dim or inter_dim,
        num_experts=max(num_experts, 1),
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="sigmoid",
        router_route_norm=True,
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=_normal(STD),
        norm_init=_NORM,
        depth_init=_by_depth,
        depth_experts_init=_experts_by_depth,
        rope=ComplexRoPE.Config(dim=qk_rope_head_dim, max_seq_len=16384, theta=10000.0),
    )
    return DeepSeekV3Model.Config(**_ends(dim, vocab_size), layers=layers, mtp_layers=[])


LLAMA3_FLAVORS: dict[str, Callable[[], Llama3Model.Config]] = {
    "debugmodel_gqa": partial(llama3_gqa, dim=256, n_layers=4, n_heads=8, n_kv_heads=2),
    "tiny_gqa": partial(llama3_gqa, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64),
}

_MLA_DEBUG = dict(dim=256, n_heads=8, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                  v_head_dim=32, inter_dim=768)  # fmt: skip
_MLA_TINY = dict(dim=64, n_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16, inter_dim=128)  # fmt: skip
MLA_FLAVORS: dict[str, Callable[[], DeepSeekV3Model.Config]] = {
    "debugmodel_dense": partial(mla, **_MLA_DEBUG, n_layers=3, n_dense_layers=3),
    "tiny_dense": partial(mla, **_MLA_TINY, n_layers=2, n_dense_layers=2),
    "debugmodel_moe": partial(mla, **_MLA_DEBUG, n_layers=3, n_dense_layers=1, moe_inter_dim=192, num_experts=8),
    # 6 experts: split unevenly over 4 ranks
    "tiny_moe": partial(mla, **_MLA_TINY, n_layers=2, n_dense_layers=1, moe_inter_dim=32, num_experts=6),
}

# model names of the 0.2.2 TOML files (train specs) and torchtitan's own
FAMILIES = {
    "titan_muon_llama3": (llama3, LLAMA3_FLAVORS),
    "llama3": (llama3, LLAMA3_FLAVORS),
    "titan_muon_mla": (deepseek_v3, MLA_FLAVORS),
    "deepseek_v3": (deepseek_v3, MLA_FLAVORS),
}


def model_spec(name: str, flavor: str) -> ModelSpec:
    """torchtitan's ModelSpec of ``name`` (a family of :data:`FAMILIES`) with ``flavor``: ours
    or one of torchtitan's own."""
    if name not in FAMILIES:
        raise ValueError(f"model name {name!r} with torchtitan 0.3.0: expected one of {sorted(FAMILIES)}")
    module, ours = FAMILIES[name]
    if flavor in ours:
        # torchtitan's spec for its debugmodel gives the callables; the model tree is ours
        return dataclasses.replace(module.model_registry("debugmodel"), flavor=flavor, model=ours[flavor]())
    stock = llama3.llama3_configs if module is llama3 else deepseek_v3.deepseekv3_configs
    if flavor not in stock:
        raise ValueError(f"model flavor {flavor!r} of {name!r}: expected one of {sorted({*ours, *stock})}")
    return module.model_registry(flavor)
