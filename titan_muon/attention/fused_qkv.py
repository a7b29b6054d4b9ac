"""The row layout of torchtitan 0.3.0's fused Q/K/V projection, ``attention.qkv_linear.wqkv``.

torchtitan 0.3.0's llama3 computes q, k and v with one linear layer (``FusedQKVLinear``). Its
output rows, viewed as ``(n_kv_heads, heads_per_kv + 2, head_dim)``, hold for each KV group g
in turn: the rows of the group's ``heads_per_kv`` query heads (query heads
``g*heads_per_kv ... (g+1)*heads_per_kv - 1``, the heads SDPA's ``enable_gqa`` pairs with KV
head g), then the rows of key head g, then those of value head g. torchtitan's forward splits
them that way (``view(..., n_kv, R, head_dim)`` then ``split([heads_per_kv, 1, 1])``), and its
checkpoint hooks convert between this and separate ``wq`` / ``wk`` / ``wv`` the same way.

Every block of ``head_dim`` rows is therefore one whole q, k or v head, which is all Muon Split
needs; QK-clip needs the layout itself to find the q and k rows of a head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class FusedQKVLayout:
    n_heads: int
    n_kv_heads: int
    head_dim: int

    def __post_init__(self):
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"fused qkv: {self.n_heads} query heads are not a multiple of {self.n_kv_heads} key/value heads")

    @property
    def heads_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def rows(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def fuse(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """wqkv's rows from wq's (n_heads·head_dim, ...), wk's and wv's (n_kv_heads·head_dim, ...) rows.

        Works for weights, biases and per-row factor vectors alike: only dimension 0 moves.
        """
        tail = q.shape[1:]
        groups = [
            q.reshape(self.n_kv_heads, self.heads_per_kv, self.head_dim, *tail),
            k.reshape(self.n_kv_heads, 1, self.head_dim, *tail),
            v.reshape(self.n_kv_heads, 1, self.head_dim, *tail),
        ]
        return torch.cat(groups, dim=1).reshape(self.rows, *tail)


def fused_qkv_layout(attention: nn.Module) -> FusedQKVLayout | None:
    """The layout of `attention`'s ``qkv_linear.wqkv``, or None when Q/K/V are not fused there."""
    qkv_linear = getattr(attention, "qkv_linear", None)
    if not isinstance(getattr(qkv_linear, "wqkv", None), nn.Module):
        return None
    return FusedQKVLayout(int(attention.n_heads), int(attention.n_kv_heads), int(attention.head_dim))


def projection_owner(attention: nn.Module) -> nn.Module:
    """The module holding the q/k/v projections: 0.3.0's ``qkv_linear``, else the attention itself."""
    qkv_linear = getattr(attention, "qkv_linear", None)
    return qkv_linear if isinstance(qkv_linear, nn.Module) else attention
