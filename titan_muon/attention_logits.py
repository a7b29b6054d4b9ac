"""Record the largest pre-softmax attention logit of every (layer, query head) during forward.

TorchTitan's attention modules hand q, k, v to ``attention.inner_attention`` as
(batch, heads, seq, head_dim), after RoPE (and for MLA after the nope/rope concat), with the
softmax scale as a keyword (``scale=None`` means 1/sqrt(head_dim)). A forward pre-hook there
sees exactly what softmax sees, so nothing in torchtitan has to be forked.

The hook keeps a running max over every forward of a step (micro-batches, activation
recompute: max is idempotent) without building a (B, H, L, L) tensor: it walks query blocks
sized to ``chunk_elements`` logits, so peak extra memory is one block.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

DEFAULT_CHUNK_ELEMENTS = 1 << 20  # logits per query block: 4 MiB in fp32 (fastest on CPU, see docs)


def block_max_logits(
    q: Tensor,
    k: Tensor,
    scale: float | None = None,
    *,
    is_causal: bool = True,
    mask_mod=None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Tensor:
    """Max over batch, queries and unmasked keys of ``scale * q·k`` for every query head, in fp32.

    q: (B, Hq, Lq, D); k: (B, Hk, Lk, D) with Hq a multiple of Hk (grouped-query attention:
    K head g serves Q heads g*Hq/Hk ... (g+1)*Hq/Hk - 1, as SDPA's ``enable_gqa``).
    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's convention: True = attend)
    replaces the causal mask when given. A head whose every logit is masked reports -inf.
    """
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"max-logit recording: {q_heads} query heads are not a multiple of {kv_heads} key heads")
    if is_causal and mask_mod is None and q_len != kv_len:
        raise ValueError(f"max-logit recording: causal attention with {q_len} queries but {kv_len} keys is not supported")
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    rep = q_heads // kv_heads
    qg = q.detach().reshape(batch, kv_heads, rep, q_len, dim)
    kt = k.detach().reshape(batch, kv_heads, 1, kv_len, dim).transpose(-1, -2)
    block = max(1, chunk_elements // max(1, batch * q_heads * kv_len))
    best = torch.full((kv_heads, rep), -math.inf, dtype=torch.float32, device=q.device)
    for start in range(0, q_len, block):
        end = min(q_len, start + block)
        q_block = qg[..., start:end, :]
        if mask_mod is None and is_causal:
            # Keys before the block are visible to every query in it; only the square on the
            # diagonal needs a mask, and keys after it are never computed.
            if start > 0:
                best = torch.maximum(best, _amax(q_block @ kt[..., :start]))
            square = q_block @ kt[..., start:end]
            best = torch.maximum(best, _amax(square.masked_fill(_upper(end - start, q.device), -math.inf)))
            continue
        logits = q_block @ kt  # (B, Hk, rep, end-start, Lk)
        if mask_mod is not None:
            b = torch.arange(batch, device=q.device).view(batch, 1, 1, 1, 1)
            h = torch.arange(q_heads, device=q.device).view(1, kv_heads, rep, 1, 1)
            q_idx = torch.arange(start, end, device=q.device).view(1, 1, 1, -1, 1)
            kv_idx = torch.arange(kv_len, device=q.device).view(1, 1, 1, 1, -1)
            logits = logits.masked_fill(~mask_mod(b, h, q_idx, kv_idx), -math.inf)
        best = torch.maximum(best, _amax(logits))
    # Multiply after the max (the scale is positive): one fewer pass over the block.
    return (best * scale).reshape(q_heads)


def _amax(logits: Tensor) -> Tensor:
    # max is exact in any dtype: take it in the activations' dtype, widen only the result.
    return logits.amax(dim=(0, 3, 4)).float()


def _upper(n: int, device: torch.device) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


class MaxLogitRecorder:
    """Running max pre-softmax logit per (layer, query head), fed by forward pre-hooks.

    ``layers`` are attention modules with an ``inner_attention`` child and an ``n_heads``
    attribute (torchtitan's llama3/llama4/qwen3 GQA and deepseek_v3 MLA attention).
    ``max_logits`` is a (layers, max heads) fp32 tensor, -inf where nothing was recorded.
    """

    def __init__(self, layers: list[nn.Module], chunk_elements: int = DEFAULT_CHUNK_ELEMENTS):
        if not layers:
            raise ValueError("MaxLogitRecorder: no attention layers to record")
        self.layers = layers
        self.heads = [int(layer.n_heads) for layer in layers]
        self.chunk_elements = int(chunk_elements)
        self.max_logits: Tensor | None = None  # allocated on the activations' device at first use
        self.enabled = True
        self._handles = []
        for index, layer in enumerate(layers):
            self._check_supported(layer)
            hook = self._hook_for(index)
            self._handles.append(layer.inner_attention.register_forward_pre_hook(hook, with_kwargs=True))

    @classmethod
    def attach(cls, model: nn.Module, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> "MaxLogitRecorder":
        from titan_muon.clip import find_attention_layers

        return cls([layer.module for layer in find_attention_layers(model)], chunk_elements)

    @staticmethod
    def _check_supported(layer: nn.Module) -> None:
        attn_type = getattr(layer, "attn_type", "sdpa")
        if attn_type not in ("sdpa", "flex"):
            raise NotImplementedError(
                f"max-logit recording supports attn_type 'sdpa' and 'flex', not {attn_type!r} "
                "(varlen packs documents; its masks are not read here)"
            )

    def _hook_for(self, index: int):
        def hook(module, args, kwargs):
            if self.enabled and module.training:  # evaluation forwards are not part of the step
                q = args[0] if args else kwargs["q"]
                k = args[1] if len(args) > 1 else kwargs["k"]
                block_mask = kwargs.get("block_mask")
                with torch.no_grad():
                    observed = block_max_logits(
                        q,
                        k,
                        kwargs.get("scale"),
                        is_causal=kwargs.get("is_causal", True),
                        mask_mod=None if block_mask is None else block_mask.mask_mod,
                        chunk_elements=self.chunk_elements,
                    )
                    self._update(index, observed)
            return None

        return hook

    def _buffer(self, device: torch.device) -> Tensor:
        if self.max_logits is None:
            self.max_logits = torch.full((len(self.heads), max(self.heads)), -math.inf, device=device)
        return self.max_logits

    def _update(self, index: int, observed: Tensor) -> None:
        row = self._buffer(observed.device)[index, : observed.numel()]
        # NaN marks the head as non-finite (+inf), so a NaN forward can never be taken for a small logit.
        row.copy_(torch.maximum(row, observed.nan_to_num(nan=math.inf)))

    def all_reduce(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> Tensor:
        """One MAX all-reduce of all layers together over `group` (no-op without torch.distributed)."""
        buffer = self._buffer(device or torch.device("cpu"))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group)
        return buffer

    def reset(self) -> None:
        if self.max_logits is not None:
            self.max_logits.fill_(-math.inf)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
