"""Record the largest pre-softmax attention logit of every (layer, query head) during forward.

TorchTitan's attention modules hand q, k, v to ``attention.inner_attention`` as
(batch, heads, seq, head_dim), after RoPE (and for MLA after the nope/rope concat), with the
softmax scale as a keyword (``scale=None`` means 1/sqrt(head_dim)). A forward pre-hook there
sees exactly what softmax sees, so nothing in torchtitan has to be forked.

The hook keeps a running max over every forward of a step (micro-batches, activation
recompute: max is idempotent) without building a (B, H, L, L) tensor: it walks query blocks
whose logits fit a byte budget (:func:`default_block_bytes`), one batched matmul per block.
Under tensor parallelism a rank sees only its heads; they go to their global head slots,
found from the global rows of the query projection it holds.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from titan_muon.fused_qkv import fused_qkv_layout, projection_owner
from titan_muon.layout import local_block

CPU_BLOCK_BYTES = 4 << 20
"""Logits per query block on CPU: 4 MiB (2^20 fp32 logits), the fastest size measured (docs/muonclip.md)."""
ACCELERATOR_BLOCK_BYTES = 1 << 30
"""Elsewhere (CUDA, other accelerators, meta): 1 GiB, so a layer at sequence length 8192 takes a few blocks."""


def default_block_bytes(device: torch.device | str) -> int:
    return CPU_BLOCK_BYTES if torch.device(device).type == "cpu" else ACCELERATOR_BLOCK_BYTES


def block_max_logits(
    q: Tensor,
    k: Tensor,
    scale: float | None = None,
    *,
    is_causal: bool = True,
    mask_mod=None,
    block_bytes: int | None = None,
) -> Tensor:
    """Max over batch, queries and unmasked keys of ``scale * q·k`` for every query head, in fp32.

    q: (B, Hq, Lq, D); k: (B, Hk, Lk, D) with Hq a multiple of Hk (grouped-query attention:
    K head g serves Q heads g*Hq/Hk ... (g+1)*Hq/Hk - 1, as SDPA's ``enable_gqa``).
    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's convention: True = attend)
    replaces the causal mask when given. A head whose every logit is masked reports -inf.
    A query block holds at most ``block_bytes`` of logits (default: :func:`default_block_bytes`).
    """
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"max-logit recording: {q_heads} query heads are not a multiple of {kv_heads} key heads")
    causal = is_causal and mask_mod is None
    if causal and q_len != kv_len:
        raise ValueError(f"max-logit recording: causal attention with {q_len} queries but {kv_len} keys is not supported")
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    rep = q_heads // kv_heads
    budget = default_block_bytes(q.device) if block_bytes is None else int(block_bytes)
    block = max(1, min(q_len, budget // max(1, batch * q_heads * kv_len * q.element_size())))

    # Queries as (B*Hk, Lq, rep, D): a block of query positions is one contiguous slice, and all
    # the Q heads sharing a K head multiply it in one batched matmul (K is never repeated).
    queries = q.detach().reshape(batch, kv_heads, rep, q_len, dim).transpose(2, 3).reshape(batch * kv_heads, q_len, rep, dim).contiguous()
    keys_t = k.detach().reshape(batch * kv_heads, kv_len, dim).transpose(1, 2)  # (B*Hk, D, Lk)
    upper = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)[:, None, :] if causal else None  # (i, rep, j): j > i
    best = torch.full((kv_heads, rep), -math.inf, dtype=q.dtype, device=q.device)
    for start in range(0, q_len, block):
        end = min(q_len, start + block)
        rows = end - start
        # Causal: keys after the block are never computed; only the diagonal square needs a mask.
        keys_end = end if causal else kv_len
        logits = torch.bmm(queries[:, start:end].reshape(-1, rows * rep, dim), keys_t[..., :keys_end])
        logits = logits.view(batch, kv_heads, rows, rep, keys_end)
        if causal:
            logits[..., start:end].masked_fill_(upper[:rows, :, :rows], -math.inf)
        elif mask_mod is not None:
            logits.masked_fill_(~_allowed(mask_mod, batch, kv_heads, rep, start, end, kv_len, q.device), -math.inf)
        best = torch.maximum(best, logits.amax(dim=(0, 2, 4)))
    # max is exact in any dtype: take it in the activations' dtype, widen only the result; and
    # multiply after the max (the scale is positive): one fewer pass over the block.
    return (best.float() * scale).reshape(q_heads)


def _takes_sequence_major_inputs(inner_attention: nn.Module) -> bool:
    """torchtitan 0.3.0's inner attentions name their inputs by layout: ``q_BLNH`` (batch, seq, heads, dim)."""
    try:
        first = next(iter(inspect.signature(inner_attention.forward).parameters), "")
    except (TypeError, ValueError):  # no signature to read: a C++ or oddly wrapped forward
        return False
    return first.endswith("BLNH")


def _allowed(mask_mod, batch, kv_heads, rep, start, end, kv_len, device) -> Tensor:
    """mask_mod on index grids broadcast to the (B, Hk, rows, rep, Lk) block."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1, 1)
    h = torch.arange(kv_heads * rep, device=device).view(1, kv_heads, 1, rep, 1)
    q_idx = torch.arange(start, end, device=device).view(1, 1, -1, 1, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, 1, 1, 1, -1)
    return mask_mod(b, h, q_idx, kv_idx)


def held_rows(t: Tensor, dim: int = 0) -> tuple[int, int]:
    """Global [start, stop) of dimension ``dim`` that this rank's local tensor holds.

    One contiguous range for every placement FSDP2, HSDP, tensor parallel and FSDP2 on top of
    tensor parallel produce (titan_muon.layout computes it; other nestings raise there).
    """
    if not isinstance(t, DTensor):
        return 0, t.shape[dim]
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return 0, 0
    # Seen as a (length, 1) matrix: only the splits of `dim` move its rows.
    as_rows = [_rows_placement(p, dim) for p in t.placements]
    return local_block((t.shape[dim], 1), as_rows, tuple(t.device_mesh.shape), coordinate)[1]


def _rows_placement(placement, dim: int):
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor) if placement.dim == dim else Replicate()
    return Shard(0) if isinstance(placement, Shard) and placement.dim == dim else Replicate()


def query_projection(attention: nn.Module) -> nn.Linear:
    """The linear layer whose output rows are the query heads, and only them.

    MLA: ``wq`` (``wq_b`` with a q LoRA); GQA: ``wq`` (torchtitan 0.3.0: ``qkv_linear.wq``).
    torchtitan 0.3.0's fused ``qkv_linear.wqkv`` has no such layer: its query rows are
    interleaved with key and value rows (:mod:`titan_muon.fused_qkv` knows where they are).
    """
    if getattr(attention, "q_lora_rank", 0):
        return attention.wq_b
    if fused_qkv_layout(attention) is not None:
        raise ValueError(
            f"{type(attention).__name__} fuses q, k and v into qkv_linear.wqkv, whose query rows are interleaved "
            "with key and value rows per KV group: use titan_muon.fused_qkv.fused_qkv_layout for their positions"
        )
    return projection_owner(attention).wq


def first_local_head(attention: nn.Module, local_heads: int) -> int:
    """Global index of the first query head this rank computes (tensor parallel: not 0).

    Read from the global rows of the query projection's weight as it is during forward: a
    plain tensor (all heads), or the tensor-parallel DTensor (``Shard(0)``: a head range).
    """
    weight = query_projection(attention).weight
    rows_per_head = weight.shape[0] // int(attention.n_heads)
    start, stop = held_rows(weight)
    if start % rows_per_head or stop - start != local_heads * rows_per_head:
        raise NotImplementedError(
            f"max-logit recording: the query projection holds global rows [{start}, {stop}) "
            f"({getattr(weight, 'placements', 'not a DTensor')}), which are not the {local_heads} whole "
            f"heads of {rows_per_head} rows that attention received"
        )
    return start // rows_per_head


def parameter_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class MaxLogitRecorder:
    """Running max pre-softmax logit per (layer, query head), fed by forward pre-hooks.

    ``layers`` are attention modules with an ``inner_attention`` child and an ``n_heads``
    attribute (torchtitan's llama3/llama4/qwen3 GQA and deepseek_v3 MLA attention).
    ``max_logits`` is a (layers, max heads) fp32 tensor on the layers' parameter device,
    -inf where nothing was recorded. Nothing here reads a tensor on the host.
    """

    def __init__(self, layers: list[nn.Module], block_bytes: int | None = None):
        if not layers:
            raise ValueError("MaxLogitRecorder: no attention layers to record")
        self.layers = layers
        self.heads = [int(layer.n_heads) for layer in layers]
        self.block_bytes = block_bytes
        self.max_logits = torch.full((len(layers), max(self.heads)), -math.inf, device=parameter_device(layers[0]))
        self.enabled = True
        self._handles = []
        for index, layer in enumerate(layers):
            self._check_supported(layer)
            hook = self._hook_for(index)
            self._handles.append(layer.inner_attention.register_forward_pre_hook(hook, with_kwargs=True))

    @classmethod
    def attach(cls, model: nn.Module, block_bytes: int | None = None) -> "MaxLogitRecorder":
        from titan_muon.clip import find_attention_layers

        return cls([layer.module for layer in find_attention_layers(model)], block_bytes)

    @staticmethod
    def _check_supported(layer: nn.Module) -> None:
        if hasattr(layer, "qkv_linear") or _takes_sequence_major_inputs(layer.inner_attention):
            raise NotImplementedError(
                f"max-logit recording is not built for torchtitan 0.3.0's attention ({type(layer).__name__}): its "
                "inner attention receives q and k as (batch, seq, heads, head_dim), not the (batch, heads, seq, "
                "head_dim) this hook reads, and llama3 fuses q/k/v into qkv_linear.wqkv. The clip itself handles "
                "these layouts: with per-head max logits recorded elsewhere, call "
                "titan_muon.clip.apply_qk_clip(find_attention_layers(model), max_logits)."
            )
        attn_type = getattr(layer, "attn_type", "sdpa")
        if attn_type not in ("sdpa", "flex"):
            raise NotImplementedError(
                f"max-logit recording supports attn_type 'sdpa' and 'flex', not {attn_type!r} "
                "(varlen packs documents; its masks are not read here)"
            )

    def _hook_for(self, index: int):
        attention = self.layers[index]

        def hook(module, args, kwargs):
            if self.enabled and module.training:  # evaluation forwards are not part of the step
                q = args[0] if args else kwargs["q"]
                k = args[1] if len(args) > 1 else kwargs["k"]
                if isinstance(q, DTensor):  # heads sharded as a DTensor (dim 1): its placement says which
                    first_head = held_rows(q, 1)[0]
                    q, k = q.to_local(), k.to_local()
                else:
                    first_head = first_local_head(attention, q.shape[1])
                block_mask = kwargs.get("block_mask")
                with torch.no_grad():
                    observed = block_max_logits(
                        q,
                        k,
                        kwargs.get("scale"),
                        is_causal=kwargs.get("is_causal", True),
                        mask_mod=None if block_mask is None else block_mask.mask_mod,
                        block_bytes=self.block_bytes,
                    )
                    self._update(index, first_head, observed)
            return None

        return hook

    def _update(self, index: int, first_head: int, observed: Tensor) -> None:
        if self.max_logits.device != observed.device:  # the model moved after the recorder was built
            self.max_logits = self.max_logits.to(observed.device)
        row = self.max_logits[index, first_head : first_head + observed.numel()]
        # NaN marks the head as non-finite (+inf), so a NaN forward can never be taken for a small logit.
        row.copy_(torch.maximum(row, observed.nan_to_num(nan=math.inf)))

    def all_reduce(self, group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = None) -> Tensor:
        """MAX all-reduce of all layers together over `group` (None: the world; a sequence of
        groups: their product, one all-reduce each). A no-op without torch.distributed."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.max_logits
        for one in group if isinstance(group, Sequence) else [group]:
            if dist.get_world_size(one) > 1:
                dist.all_reduce(self.max_logits, op=dist.ReduceOp.MAX, group=one)
        return self.max_logits

    def reset(self) -> None:
        self.max_logits.fill_(-math.inf)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
