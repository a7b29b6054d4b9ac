"""Muon Split: orthogonalize row blocks of a matrix (attention heads) instead of the whole matrix.

A stacked projection such as W_q (n_heads·head_dim × dim) is n_heads matrices, one per head;
GLM-4.5/GLM-5 orthogonalize each head's block on its own. A block is a unit of its own for the
ownership plan, so a head whose rows straddle two FSDP shards is assembled on its owner like
any whole matrix, and each block's update is scaled by its own shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase

from titan_muon.attention.layers import find_attention_layers
from titan_muon.param_groups import clean_fqn

RowBlocks = int | Sequence[int]


def row_block_ranges(rows: int, pattern: RowBlocks, name: str = "parameter") -> list[tuple[int, int]]:
    """[start, end) of each block when `pattern` (block sizes, repeated) tiles `rows` exactly.

    An int is one block size (per-head split); a sequence is a repeating group of sizes, e.g.
    (q_nope_dim, q_rope_dim) for the finer MLA split.
    """
    sizes = [pattern] if isinstance(pattern, int) else list(pattern)
    if not sizes or any(not isinstance(s, int) or s <= 0 for s in sizes):
        raise ValueError(f"titan_muon split: row blocks of {name!r} must be positive integers, got {pattern!r}")
    period = sum(sizes)
    if rows % period:
        raise ValueError(f"titan_muon split: {name!r} has {rows} rows, not a multiple of its row-block pattern {sizes} (sum {period})")
    ranges, start = [], 0
    while start < rows:
        for size in sizes:
            ranges.append((start, start + size))
            start += size
    return ranges


def match_row_blocks(names: Sequence[str], row_blocks: Mapping[str, RowBlocks]) -> dict[str, RowBlocks]:
    """Resolve fnmatch patterns on FQNs to each matched parameter's pattern; the first match wins.

    A pattern that matches none of `names` is an error: a typo must not silently disable Split.
    """
    resolved: dict[str, RowBlocks] = {}
    for pattern, blocks in row_blocks.items():
        matched = [n for n in names if fnmatchcase(clean_fqn(n), pattern) or n == pattern]
        if not matched:
            raise ValueError(f"titan_muon split: pattern {pattern!r} matches no Muon parameter")
        for name in matched:
            resolved.setdefault(name, blocks)
    return resolved


SPLIT_MODES = ("none", "head", "fine")


def attention_row_blocks(model, mode: str = "head", *, missing_ok: bool = False) -> dict[str, RowBlocks]:
    """Row blocks of the attention projections of torchtitan's llama3 (GQA) and deepseek_v3 (MLA).

    "head": GQA wq per Q head, wk / wv per KV head (torchtitan 0.3.0: ``qkv_linear.wq/wk/wv``,
    or the fused ``qkv_linear.wqkv`` per q, k and v head); MLA wq (or wq_b) per head as
    [q_nope + q_rope] and wkv_b per head as [k_nope + v].
    "fine" (GLM-5): MLA heads split further into q_nope | q_rope and k_nope | v.
    "none": no split. Attention modules are found by :func:`titan_muon.attention.layers.find_attention_layers`.
    A model without them is an error, unless ``missing_ok`` (a pipeline stage's model part
    may hold only the embeddings, or the norm and output head).
    """
    if mode not in SPLIT_MODES:
        raise ValueError(f"titan_muon split: mode={mode!r}; expected one of {SPLIT_MODES}")
    if mode == "none":
        return {}
    blocks: dict[str, RowBlocks] = {}
    for layer in find_attention_layers(model):
        if layer.kind == "mla":
            nope, rope, v = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
            blocks[layer.weight_fqn(layer.query_projection_name)] = (nope, rope) if mode == "fine" else nope + rope
            blocks[layer.weight_fqn(layer.key_projection_name)] = (nope, v) if mode == "fine" else nope + v
        else:  # GQA / MHA: one block per q, k and v head; the fused wqkv's every head_dim rows are one such head
            for projection in layer.projection_names():
                blocks[layer.weight_fqn(projection)] = layer.qk_head_dim
    if not blocks and not missing_ok:
        raise ValueError("titan_muon split: no torchtitan llama3 / deepseek_v3 attention module found in the model")
    return blocks
