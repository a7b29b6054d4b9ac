"""Record the largest pre-softmax attention logit of every (layer, query head) during forward.

TorchTitan's attention modules hand q, k, v to ``attention.inner_attention`` as
(batch, heads, seq, head_dim), after RoPE (and for MLA after the nope/rope concat), with the
softmax scale as a keyword (``scale=None`` means 1/sqrt(head_dim)). A forward pre-hook there
sees exactly what softmax sees, so nothing in torchtitan has to be forked.

The hook keeps a running max over every training forward of a step (micro-batches; activation
checkpointing's recompute is skipped: it repeats a recorded forward) without building a
(B, H, L, L) tensor or copying q or k: it walks query blocks whose logits fit a byte budget
(:func:`block_budget`), one batched matmul of strided views per block, sequence and position
in a GQA group.
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
"""Logits at once on CPU: 4 MiB (2^20 fp32 logits), the fastest size measured (docs/muonclip.md)."""
ACCELERATOR_BLOCK_BYTES = 64 << 20
"""Elsewhere (CUDA, other accelerators, meta): 64 MiB. Llama-3-8B at sequence length 8192 (8 KV
heads, bf16): 512 query rows a matmul, each matmul ~8.6 GFLOP, far above a kernel launch,
while one layer's activations there are well over 1 GiB (docs/muonclip.md)."""


def default_block_bytes(device: torch.device | str) -> int:
    return CPU_BLOCK_BYTES if torch.device(device).type == "cpu" else ACCELERATOR_BLOCK_BYTES


def block_budget(q: Tensor, k: Tensor, block_bytes: int | None = None) -> int:
    """Bytes of logits (and masks) one block may materialize: ``block_bytes`` (default
    :func:`default_block_bytes`), and never more than the bytes of ``q`` and ``k`` themselves."""
    cap = default_block_bytes(q.device) if block_bytes is None else int(block_bytes)
    return min(cap, q.numel() * q.element_size() + k.numel() * k.element_size())


def block_rows(q: Tensor, k: Tensor, block_bytes: int | None = None, *, masked: bool = False) -> int:
    """Query rows per block: one block materializes (KV heads, rows, keys) logits, plus with a
    ``mask_mod`` (``masked``) two bool grids of that shape; at least one row. Under the causal
    mask the (rows, rows) bool diagonal mask is kept to at most 1/16 of the budget."""
    budget = block_budget(q, k, block_bytes)
    kv_heads, q_len, kv_len = k.shape[1], q.shape[2], k.shape[2]
    per_row = kv_heads * max(1, kv_len) * (q.element_size() + (2 if masked else 0))
    rows = min(q_len, budget // per_row, math.isqrt(budget // 16))
    return max(1, rows)


def in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread, where a module's forward
    can only be activation checkpointing's recompute (``torch.utils.checkpoint`` re-runs the
    forward inside the backward's graph task with ``use_reentrant`` True and False alike).
    Under ``torch.compile`` the recompute is part of the compiled backward and never re-runs
    Python hooks, so a traced forward is never one."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


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
    K head g serves Q heads g*Hq/Hk ... (g+1)*Hq/Hk - 1, as SDPA's ``enable_gqa``), any strides.
    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's convention: True = attend)
    replaces the causal mask when given. A head whose every logit is masked reports -inf.

    Neither q nor k is copied: for every sequence b and every position r of a Q head in its
    group, one batched matmul over the K heads multiplies strided views of a block of queries
    and of the keys. A block's logits are at most :func:`block_budget` bytes (:func:`block_rows`).
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
    block = block_rows(q, k, block_bytes, masked=mask_mod is not None)

    # Views only: Q head g*rep + r is queries[:, g, r]; (Hk, rows, D) @ (Hk, D, keys) per (b, r).
    queries = q.detach().unflatten(1, (kv_heads, rep))  # (B, Hk, rep, Lq, D)
    keys_t = k.detach().transpose(2, 3)  # (B, Hk, D, Lk)
    # One logits buffer for the whole call: a block's (Hk, rows, keys) logits are a view of it.
    buffer = torch.empty(kv_heads * block * kv_len, dtype=q.dtype, device=q.device)
    per_head = _per_head_matmul(q)
    zero = torch.zeros((), dtype=q.dtype, device=q.device) if per_head else None
    upper = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1) if causal else None  # j > i
    blocks = range(0, q_len, block)
    # Every (block, b, r) writes its (Hk,) maxima into its own row: one kernel, one max at the end.
    maxima = torch.full((max(1, len(blocks)), batch, rep, kv_heads), -math.inf, dtype=q.dtype, device=q.device)
    for index, start in enumerate(blocks):
        end = min(q_len, start + block)
        rows = end - start
        # Causal: keys after the block are never computed; only the diagonal square needs a mask.
        keys_end = end if causal else kv_len
        logits = buffer[: kv_heads * rows * keys_end].view(kv_heads, rows, keys_end)
        for b in range(batch):
            keys = keys_t[b, :, :, :keys_end]
            for r in range(rep):
                block_queries = queries[b, :, r, start:end]
                if per_head:
                    for g in range(kv_heads):
                        torch.addmm(zero, block_queries[g], keys[g], beta=0, out=logits[g])
                else:
                    torch.bmm(block_queries, keys, out=logits)
                if causal:
                    logits[..., start:end].masked_fill_(upper[:rows, :rows], -math.inf)
                elif mask_mod is not None:
                    logits.masked_fill_(~_allowed(mask_mod, b, kv_heads, rep, r, start, end, kv_len, q.device), -math.inf)
                torch.amax(logits, dim=(1, 2), out=maxima[index, b, r])
    # max is exact in any dtype: take it in the activations' dtype, widen only the result; and
    # multiply after the max (the scale is positive): one fewer pass over the block.
    return (maxima.amax(dim=(0, 1)).float() * scale).transpose(0, 1).reshape(q_heads)


def _takes_sequence_major_inputs(inner_attention: nn.Module) -> bool:
    """torchtitan 0.3.0's inner attentions name their inputs by layout: ``q_BLNH`` (batch, seq, heads, dim)."""
    try:
        first = next(iter(inspect.signature(inner_attention.forward).parameters), "")
    except (TypeError, ValueError):  # no signature to read: a C++ or oddly wrapped forward
        return False
    return first.endswith("BLNH")


def _per_head_matmul(q: Tensor) -> bool:
    """On CPU, oneDNN's batched bf16/fp16 matmul copies strided operands (measured: the key block
    of every call, and 7x slower than per-head); its 2-D GEMM reads them in place. fp32/fp64
    batched matmuls (MKL), and CUDA's strided batched GEMM, read any unit-stride view in place."""
    return q.device.type == "cpu" and q.dtype not in (torch.float32, torch.float64)


def _allowed(mask_mod, b, kv_heads, rep, r, start, end, kv_len, device) -> Tensor:
    """mask_mod on index grids broadcast to the (Hk, rows, Lk) block of sequence b, group position r."""
    b = torch.full((1, 1, 1), b, device=device)
    h = (torch.arange(kv_heads, device=device) * rep + r).view(-1, 1, 1)
    q_idx = torch.arange(start, end, device=device).view(1, -1, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, 1, -1)
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
    def attach(cls, model: nn.Module, block_bytes: int | None = None) -> MaxLogitRecorder:
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
            # Evaluation forwards are not part of the step; activation recompute repeats a forward
            # already recorded (recording it again would double the cost, not change the max).
            if self.enabled and module.training and not in_backward():
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
