"""Record the largest pre-softmax attention logit of every (layer, query head) during forward.

TorchTitan's attention modules hand q, k, v to ``attention.inner_attention`` after RoPE (and
for MLA after the nope/rope concat), K heads not repeated for GQA, with the softmax scale as a
keyword (``scale=None`` means 1/sqrt(head_dim)): torchtitan 0.2.2 as (batch, heads, seq,
head_dim), 0.3.0 as (batch, seq, heads, head_dim) (``q_BLNH``: :class:`InputLayout` tells them
apart, and the recording reads the latter through transposed views, no copy). The mask is SDPA's
``is_causal``, or a FlexAttention ``BlockMask`` (0.2.2 ``block_mask=``, 0.3.0
``attention_masks=``) whose ``mask_mod`` is evaluated. A forward pre-hook there sees exactly
what softmax sees, so nothing in torchtitan has to be forked.

The hook keeps a running max over every training forward of a step (micro-batches; activation
checkpointing's recompute is skipped: it repeats a recorded forward) without building a
(B, H, L, L) tensor or copying q or k: it walks query blocks whose logits fit a byte budget
(:func:`block_budget`), one batched matmul of strided views per block, sequence and position
in a GQA group.
Under tensor parallelism a rank sees only its heads; they go to their global head slots,
found from the global rows of the query projection it holds. Under context parallelism a rank
sees only its slice of the sequence: its queries are taken against every rank's keys, gathered
and masked by global position (:class:`ContextParallelSequence`, :func:`context_parallel_max_logits`).
The layers themselves are found by :mod:`titan_muon.attention.layers`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest

from titan_muon.attention.layers import (
    AttentionLayer,
    describe_attention,
    find_attention_layers,
)
from titan_muon.base.layout import local_block

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


def block_rows(q: Tensor, k: Tensor, block_bytes: int | None = None, *, masked: bool = False, positional: bool = False) -> int:
    """Query rows per block: one block materializes (KV heads, rows, keys) logits, plus with a
    ``mask_mod`` (``masked``) two bool grids of that shape, or with causal positions
    (``positional``, context parallel) one (rows, keys) bool grid; at least one row. Under the
    causal mask the (rows, rows) bool diagonal mask is kept to at most 1/16 of the budget."""
    budget = block_budget(q, k, block_bytes)
    kv_heads, q_len, kv_len = k.shape[1], q.shape[2], k.shape[2]
    per_row = kv_heads * max(1, kv_len) * (q.element_size() + (2 if masked else 0)) + (max(1, kv_len) if positional else 0)
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
    query_positions: Tensor | None = None,
    key_positions: Tensor | None = None,
    masked_keys: tuple[int, int] | None = None,
) -> Tensor:
    """Max over batch, queries and unmasked keys of ``scale * q·k`` for every query head, in fp32.

    q: (B, Hq, Lq, D); k: (B, Hk, Lk, D) with Hq a multiple of Hk (grouped-query attention:
    K head g serves Q heads g*Hq/Hk ... (g+1)*Hq/Hk - 1, as SDPA's ``enable_gqa``), any strides.
    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's convention: True = attend)
    replaces the causal mask when given. A head whose every logit is masked reports -inf.
    ``query_positions`` (Lq,) and ``key_positions`` (Lk,), integer tensors on q's device, give
    each query's and key's position in the whole sequence when q and k are not the same
    contiguous stretch of it (context parallel: a rank's queries against every rank's keys);
    the causal mask then keeps key j for query i when ``key_positions[j] <= query_positions[i]``.
    ``masked_keys`` ``(start, stop)``: the caller knows every key outside it is visible to every
    query, so the positional mask is built and applied on those keys only.

    Neither q nor k is copied: for every sequence b and every position r of a Q head in its
    group, one batched matmul over the K heads multiplies strided views of a block of queries
    and of the keys. A block's logits are at most :func:`block_budget` bytes (:func:`block_rows`).
    """
    batch, q_heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"max-logit recording: {q_heads} query heads are not a multiple of {kv_heads} key heads")
    causal = is_causal and mask_mod is None
    positional = causal and (query_positions is not None or key_positions is not None)
    if positional:
        _check_positions(query_positions, key_positions, q_len, kv_len)
    elif causal and q_len != kv_len:
        raise ValueError(f"max-logit recording: causal attention with {q_len} queries but {kv_len} keys is not supported")
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    rep = q_heads // kv_heads
    block = block_rows(q, k, block_bytes, masked=mask_mod is not None, positional=positional)
    mask_start, mask_stop = masked_keys if masked_keys is not None else (0, kv_len)

    # Views only: Q head g*rep + r is queries[:, g, r]; (Hk, rows, D) @ (Hk, D, keys) per (b, r).
    queries = q.detach().unflatten(1, (kv_heads, rep))  # (B, Hk, rep, Lq, D)
    keys_t = k.detach().transpose(2, 3)  # (B, Hk, D, Lk)
    # One logits buffer for the whole call: a block's (Hk, rows, keys) logits are a view of it.
    buffer = torch.empty(kv_heads * block * kv_len, dtype=q.dtype, device=q.device)
    per_head = _per_head_matmul(q)
    zero = torch.zeros((), dtype=q.dtype, device=q.device) if per_head else None
    diagonal = causal and not positional
    upper = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1) if diagonal else None  # j > i
    blocks = range(0, q_len, block)
    # Every (block, b, r) writes its (Hk,) maxima into its own row: one kernel, one max at the end.
    maxima = torch.full((max(1, len(blocks)), batch, rep, kv_heads), -math.inf, dtype=q.dtype, device=q.device)
    for index, start in enumerate(blocks):
        end = min(q_len, start + block)
        rows = end - start
        # Causal: keys after the block are never computed; only the diagonal square needs a mask.
        keys_end = end if diagonal else kv_len
        logits = buffer[: kv_heads * rows * keys_end].view(kv_heads, rows, keys_end)
        # Positional causal mask: one (rows, keys) grid per block, shared by every sequence and head.
        later = key_positions[None, mask_start:mask_stop] > query_positions[start:end, None] if positional else None
        for b in range(batch):
            keys = keys_t[b, :, :, :keys_end]
            for r in range(rep):
                block_queries = queries[b, :, r, start:end]
                if per_head:
                    for g in range(kv_heads):
                        torch.addmm(zero, block_queries[g], keys[g], beta=0, out=logits[g])
                else:
                    torch.bmm(block_queries, keys, out=logits)
                if positional:
                    logits[..., mask_start:mask_stop].masked_fill_(later, -math.inf)
                elif causal:
                    logits[..., start:end].masked_fill_(upper[:rows, :rows], -math.inf)
                elif mask_mod is not None:
                    logits.masked_fill_(~_allowed(mask_mod, b, kv_heads, rep, r, start, end, kv_len, q.device), -math.inf)
                torch.amax(logits, dim=(1, 2), out=maxima[index, b, r])
    # max is exact in any dtype: take it in the activations' dtype, widen only the result; and
    # multiply after the max (the scale is positive): one fewer pass over the block.
    return (maxima.amax(dim=(0, 1)).float() * scale).transpose(0, 1).reshape(q_heads)


def _check_positions(query_positions: Tensor | None, key_positions: Tensor | None, q_len: int, kv_len: int) -> None:
    if query_positions is None or key_positions is None:
        raise ValueError("max-logit recording: query_positions and key_positions go together")
    if query_positions.shape != (q_len,) or key_positions.shape != (kv_len,):
        raise ValueError(
            f"max-logit recording: positions of shapes {tuple(query_positions.shape)} and {tuple(key_positions.shape)} "
            f"for {q_len} queries and {kv_len} keys"
        )


@dataclass(frozen=True)
class InputLayout:
    """How an inner attention takes q and k: their parameter names (for keyword calls) and the
    dimension of their heads: 1 for (batch, heads, seq, head_dim), torchtitan 0.2.2's layout,
    2 for (batch, seq, heads, head_dim), 0.3.0's (which names its inputs ``q_BLNH``, ``k_BLNH``)."""

    q_name: str = "q"
    k_name: str = "k"
    heads_dim: int = 1

    @property
    def sequence_dim(self) -> int:
        return 3 - self.heads_dim

    def head_major(self, t: Tensor) -> Tensor:
        """``t`` as (batch, heads, seq, head_dim): itself, or a transposed view of it (no copy)."""
        return t.transpose(1, 2) if self.heads_dim == 2 else t


def input_layout(inner_attention: nn.Module) -> InputLayout:
    """Read from the names of the first two parameters of the class's ``forward``: torchtitan 0.3.0's
    ``Module.parallelize`` (tensor or expert parallel) replaces the instance's ``forward`` by a
    ``(*args, **kwargs)`` wrapper that redistributes the inputs, and the hook sees them before it."""
    try:
        names = list(inspect.signature(type(inner_attention).forward).parameters)[1:3]  # after self
    except (TypeError, ValueError):  # no signature to read: a C++ or oddly wrapped forward
        names = []
    if len(names) < 2:
        return InputLayout()
    return InputLayout(*names, heads_dim=2 if all(name.endswith("BLNH") for name in names) else 1)


def masking(kwargs: dict) -> tuple[bool, object]:
    """``(is_causal, mask_mod)`` of an inner attention call's keyword arguments.

    SDPA: ``is_causal`` (default True), no mask. FlexAttention: the ``BlockMask``'s ``mask_mod``
    (torchtitan 0.2.2 passes it as ``block_mask``, 0.3.0 as ``attention_masks``). Anything that
    changes the logits in a way not read here raises: a ``score_mod``, or masks without a
    ``mask_mod`` (0.3.0's varlen ``VarlenMetadata``).
    """
    if kwargs.get("score_mod") is not None:
        raise NotImplementedError(
            "max-logit recording: the inner attention was given a score_mod, which changes the logits softmax "
            "sees in a way the recording does not reproduce"
        )
    mask = kwargs.get("block_mask")
    if mask is None:
        mask = kwargs.get("attention_masks")
    if mask is None:
        return bool(kwargs.get("is_causal", True)), None
    mask_mod = getattr(mask, "mask_mod", None)
    if mask_mod is None:
        raise NotImplementedError(
            f"max-logit recording reads FlexAttention block masks (their mask_mod), not {type(mask).__name__} "
            "(varlen attention packs documents; its boundaries are not read here)"
        )
    return False, mask_mod


CONTEXT_PARALLEL_LOAD_BALANCERS = ("headtail", "ptrr", None)


def _check_sdpa_load_balancer(load_balancer: str | None, local_len: int) -> None:
    if load_balancer not in ("headtail", None):
        raise NotImplementedError(
            f"max-logit recording: context_parallel_load_balancer = {load_balancer!r} lays the sequence out "
            "through a FlexAttention BlockMask; SDPA attention under context parallel needs 'headtail' or None"
        )
    if load_balancer == "headtail" and local_len % 2:
        raise ValueError(
            f"max-logit recording: context_parallel_load_balancer = 'headtail' gives each rank two equal chunks, "
            f"but a rank holds {local_len} tokens"
        )


def sharded_sequence_positions(load_balancer: str | None, world: int, local_len: int, device: torch.device | str = "cpu") -> Tensor:
    """(world·local_len,) global token positions of ranks 0, 1, ... of a context-parallel group in
    turn, each holding ``local_len`` tokens as ``load_balancer`` cut them (:class:`ContextParallelSequence`)."""
    _check_sdpa_load_balancer(load_balancer, local_len)
    if load_balancer is None:
        return torch.arange(world * local_len, device=device)
    chunk = local_len // 2
    ranks = torch.arange(world, device=device)[:, None]
    offsets = torch.arange(chunk, device=device)[None, :]
    head, tail = ranks * chunk + offsets, (2 * world - 1 - ranks) * chunk + offsets
    return torch.cat([head, tail], dim=1).reshape(-1)


def gathered_key_positions(load_balancer: str | None, world: int, local_len: int, device: torch.device | str = "cpu") -> Tensor:
    """(world·local_len,) global positions of the keys :meth:`ContextParallelSequence.gather_keys`
    returns, in its order: every rank's slice in rank order (no load balancer), or, head-tail,
    every rank's tail chunk (chunks 2W-1, 2W-2, ..., W) then every rank's head chunk (0, 1, ..., W-1)."""
    positions = sharded_sequence_positions(load_balancer, world, local_len, device)
    if load_balancer is None:
        return positions
    halves = positions.view(world, 2, local_len // 2)
    return torch.cat([halves[:, 1].reshape(-1), halves[:, 0].reshape(-1)])


@dataclass(frozen=True)
class CausalKeyRange:
    """A stretch of a rank's queries, ``[query_start, query_stop)``, and the contiguous stretch of
    the gathered keys, ``[key_start, key_stop)``, holding every key they may attend to causally.
    Only the keys ``[mask_start, mask_stop)`` of it (relative to ``key_start``: the queries' own
    chunk) can lie after one of those queries; every other key precedes them all."""

    query_start: int
    query_stop: int
    key_start: int
    key_stop: int
    mask_start: int
    mask_stop: int


def causal_key_ranges(load_balancer: str | None, world: int, rank: int, local_len: int) -> list[CausalKeyRange]:
    """Each stretch of ``rank``'s queries with the stretch of the gathered keys (in
    :func:`gathered_key_positions` order) it may see, so that no key after them is ever multiplied.

    Head-tail: head chunk r sees head chunks 0..r (the first r+1 of the head half, its own last);
    tail chunk 2W-1-r sees its own and the later ranks' tail chunks (earlier chunks), then the
    whole head half, which follow each other in the gathered order (its own first). Contiguous
    slices: rank r sees slices 0..r (its own last).
    """
    _check_sdpa_load_balancer(load_balancer, local_len)
    if load_balancer is None:
        return [CausalKeyRange(0, local_len, 0, (rank + 1) * local_len, rank * local_len, (rank + 1) * local_len)]
    chunk = local_len // 2
    head_half = world * chunk  # where the head chunks start in the gathered order
    return [
        CausalKeyRange(0, chunk, head_half, head_half + (rank + 1) * chunk, rank * chunk, (rank + 1) * chunk),
        CausalKeyRange(chunk, local_len, rank * chunk, 2 * head_half, 0, chunk),
    ]


@dataclass(frozen=True)
class ContextParallelSequence:
    """How context parallel cut every sequence over ``group``, as torchtitan 0.2.2 does it.

    ``load_balancer`` is torchtitan's ``[parallelism] context_parallel_load_balancer``:

    * ``"headtail"`` (its default for SDPA): the sequence is cut into 2·W equal chunks and rank r
      holds chunk r followed by chunk 2·W-1-r (so every rank gets as much of the causal triangle);
    * ``None``: rank r holds the r-th of W equal contiguous slices;
    * ``"ptrr"`` (FlexAttention only): the layout is carried by the sharded ``BlockMask``, and
      torch's context-parallel hook hands attention every rank's keys already: nothing to do here.

    Under SDPA each rank's attention sees its own queries and keys only; the recorder gathers
    every rank's keys (:meth:`gather_keys`) and, causal, takes each stretch of its queries against
    the stretch of keys before it (:func:`causal_key_ranges`), masked by global positions.
    """

    group: dist.ProcessGroup | None
    load_balancer: str | None = "headtail"

    def __post_init__(self):
        if self.load_balancer not in CONTEXT_PARALLEL_LOAD_BALANCERS:
            raise ValueError(
                f"max-logit recording: [parallelism] context_parallel_load_balancer = {self.load_balancer!r} is not one of "
                f"{CONTEXT_PARALLEL_LOAD_BALANCERS}"
            )

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def gather_keys(self, k: Tensor) -> Tensor:
        """Every rank's keys as a (B, Hk, W·L, D) view of one buffer, in :func:`gathered_key_positions`
        order. ``k`` (B, Hk, L, D) goes out sequence-major, so each rank's part lands contiguous and
        the sequence stays one strided dimension (the block matmuls read it in place). One all-gather,
        two for head-tail (the tail chunks, then the head chunks)."""
        local = k.detach().permute(2, 0, 1, 3).contiguous()  # (L, B, Hk, D)
        world, local_len = self.world_size, local.shape[0]
        gathered = local.new_empty((world * local_len, *local.shape[1:]))
        if self.load_balancer == "headtail":
            chunk = local_len // 2
            dist.all_gather_single(gathered[: world * chunk], local[chunk:], group=self.group)
            dist.all_gather_single(gathered[world * chunk :], local[:chunk], group=self.group)
        else:
            dist.all_gather_single(gathered, local, group=self.group)
        return gathered.permute(1, 2, 0, 3)


def context_parallel_max_logits(
    cp: ContextParallelSequence,
    q: Tensor,
    k: Tensor,
    scale: float | None = None,
    *,
    is_causal: bool = True,
    mask_mod=None,
    block_bytes: int | None = None,
    name: str = "attention",
) -> Tensor:
    """:func:`block_max_logits` of this rank's queries against the whole sequence's keys, under
    context parallel ``cp``; q, k as (B, H, L, D), this rank's slice of the sequence (FlexAttention:
    k already gathered by torch's context-parallel hook). ``name`` (the layer's) goes into errors.

    Every check comes before the all-gather and depends only on shapes and configuration, which
    every rank of the group shares: an error is raised on all of them, and none is left waiting.
    """
    q_len, k_len = q.shape[2], k.shape[2]
    record = partial(block_max_logits, scale=scale, block_bytes=block_bytes)
    if mask_mod is not None:  # FlexAttention: torch's CP hook already gathered the keys, the BlockMask maps positions
        if k_len != cp.world_size * q_len:
            raise NotImplementedError(
                f"max-logit recording: FlexAttention in {name!r} under context parallel got {k_len} keys for "
                f"{q_len} queries; torch's context-parallel hook should have gathered all {cp.world_size * q_len}"
            )
        return record(q, k, is_causal=False, mask_mod=mask_mod)
    if k_len != q_len:
        raise NotImplementedError(
            f"max-logit recording: SDPA in {name!r} under context parallel got {q_len} queries and {k_len} keys; "
            "expected this rank's slice of both"
        )
    if not is_causal:
        return record(q, cp.gather_keys(k), is_causal=False)
    world, rank = cp.world_size, cp.rank
    ranges = causal_key_ranges(cp.load_balancer, world, rank, q_len)
    query_positions = sharded_sequence_positions(cp.load_balancer, world, q_len, q.device)[rank * q_len : (rank + 1) * q_len]
    key_positions = gathered_key_positions(cp.load_balancer, world, q_len, q.device)
    keys = cp.gather_keys(k)
    # One call per stretch of queries (two under head-tail), each over only the keys it may see.
    maxima = [
        record(
            q[:, :, part.query_start : part.query_stop],
            keys[:, :, part.key_start : part.key_stop],
            query_positions=query_positions[part.query_start : part.query_stop],
            key_positions=key_positions[part.key_start : part.key_stop],
            masked_keys=(part.mask_start, part.mask_stop),
        )
        for part in ranges
    ]
    return torch.stack(maxima).amax(dim=0)


def _shards_dim(t: DTensor, dim: int) -> bool:
    return any(isinstance(p, (Shard, _StridedShard)) and p.dim == dim for p in t.placements)


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
    tensor parallel produce (titan_muon.base.layout computes it; other nestings raise there).
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


def as_attention_layer(attention: nn.Module | AttentionLayer) -> AttentionLayer:
    return attention if isinstance(attention, AttentionLayer) else describe_attention(attention)


def query_row_units(attention: nn.Module | AttentionLayer) -> tuple[Tensor, int, int]:
    """``(weight, rows per unit, query heads per unit)``: the weight whose rows say which query
    heads a rank computes, cut into units of whole heads. A unit is one query head of the query
    projection, or for torchtitan 0.3.0's fused ``qkv_linear.wqkv`` one KV group (its query heads,
    its key head and its value head: tensor parallel shards wqkv by whole groups)."""
    layer = as_attention_layer(attention)
    weight = layer.query_projection.weight
    if layer.kind == "fused_wqkv":
        return weight, layer.fused_layout.rows // layer.n_kv_heads, layer.heads_per_kv
    return weight, weight.shape[0] // layer.n_heads, 1


def first_local_head(attention: nn.Module | AttentionLayer, local_heads: int) -> int:
    """Global index of the first query head this rank computes (tensor parallel: not 0).

    Read from the global rows of the query projection's (or fused wqkv's) weight as it is
    during forward: a plain tensor (all heads), or the tensor-parallel DTensor (``Shard(0)``:
    a head range, a KV-group range for wqkv).
    """
    weight, unit_rows, unit_heads = query_row_units(attention)
    start, stop = held_rows(weight)
    if start % unit_rows or (stop - start) % unit_rows or (stop - start) // unit_rows * unit_heads != local_heads:
        unit = "heads" if unit_heads == 1 else f"KV groups of {unit_heads} query heads"
        raise NotImplementedError(
            f"max-logit recording: the query projection holds global rows [{start}, {stop}) "
            f"({getattr(weight, 'placements', 'not a DTensor')}), which are not whole {unit} of {unit_rows} rows "
            f"holding the {local_heads} query heads that attention received"
        )
    return start // unit_rows * unit_heads


def parameter_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def flex_max_scores_supported() -> bool:
    """Whether this torch's FlexAttention can return each query's max score (``AuxRequest.max_scores``)."""
    return "max_scores" in AuxRequest._fields


class FlexKernelTap:
    """Stands in for a torchtitan FlexAttention wrapper class's compiled ``flex_attention``.

    Both torchtitan 0.2.2's ``FlexAttentionWrapper`` and 0.3.0's ``FlexAttention`` reach the
    kernel through one class attribute, ``_compiled_flex_attn`` (``torch.compile(flex_attention)``
    with their inductor options). Standing in for it, rather than for the wrapper's forward,
    keeps everything else those wrappers do (compile options, context parallel, kernel options,
    0.3.0's layout transposes and ``out_transform``). Unarmed it passes every call through
    unchanged; armed by a recorder for one call, it asks the same kernel for
    ``AuxRequest(max_scores=True)`` as well, hands the (B, Hq, Lq) maxima to the recorder and
    returns what the wrapper asked for: the output, plus the logsumexp as the wrapper requested it
    (0.2.2 ``return_lse=``, 0.3.0 ``return_aux=``).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.armed = None  # a callable taking the max scores, for the next call only
        self.users = 0

    @classmethod
    def install(cls, wrapper_class: type) -> FlexKernelTap:
        tap = wrapper_class.__dict__.get("_compiled_flex_attn")
        if not isinstance(tap, cls):
            tap = cls(wrapper_class._compiled_flex_attn)
            wrapper_class._compiled_flex_attn = tap
        tap.users += 1
        return tap

    def uninstall(self, wrapper_class: type) -> None:
        self.users -= 1
        if self.users == 0 and wrapper_class.__dict__.get("_compiled_flex_attn") is self:
            wrapper_class._compiled_flex_attn = self.kernel

    def __call__(self, q, k, v, **kwargs):
        take, self.armed = self.armed, None
        if take is None:
            return self.kernel(q, k, v, **kwargs)
        return_lse = bool(kwargs.pop("return_lse", False))
        request = kwargs.pop("return_aux", None)
        lse = return_lse or (request is not None and request.lse)
        out, aux = self.kernel(q, k, v, return_aux=AuxRequest(lse=lse, max_scores=True), **kwargs)
        take(aux.max_scores)
        if request is not None:
            return out, AuxOutput(lse=aux.lse)
        return (out, aux.lse) if return_lse else out


def fused_kernel_class(inner_attention: nn.Module) -> type | None:
    """The torchtitan FlexAttention wrapper class of ``inner_attention`` whose compiled kernel a
    :class:`FlexKernelTap` can stand in for, or None (SDPA, varlen, a FLASH backend that cannot
    return max scores, or a torch without ``AuxRequest.max_scores``)."""
    if not flex_max_scores_supported():
        return None
    for cls in type(inner_attention).__mro__:
        if "_compiled_flex_attn" in cls.__dict__:
            options = getattr(inner_attention, "kernel_options", None) or {}
            return None if options.get("BACKEND") == "FLASH" else cls
    return None


class MaxLogitRecorder:
    """Running max pre-softmax logit per (layer, query head), fed by forward pre-hooks.

    ``layers`` are attention modules (with an ``inner_attention`` child: torchtitan's llama3,
    llama4, qwen3 GQA and deepseek_v3 MLA attention) or their :class:`AttentionLayer` descriptions
    (:func:`titan_muon.attention.layers.find_attention_layers`).
    ``max_logits`` is a (layers, max heads) fp32 tensor on the layers' parameter device,
    -inf where nothing was recorded. Nothing here reads a tensor on the host.

    ``fused``: FlexAttention layers can have the attention kernel itself return each query's
    max score (:class:`FlexKernelTap`), which costs one (B, Hq, Lq) fp32 output instead of a
    second QKᵀ. None (default): on CUDA, where torch 2.13's kernel offers it; True: wherever the
    layer's attention is FlexAttention (it raises otherwise); False: never.

    ``context_parallel``: how context parallel cut the sequence (:class:`ContextParallelSequence`);
    each rank then records its own queries against the whole sequence's keys.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module | AttentionLayer],
        block_bytes: int | None = None,
        fused: bool | None = None,
        context_parallel: ContextParallelSequence | None = None,
    ):
        if not layers:
            raise ValueError("MaxLogitRecorder: no attention layers to record")
        self.context_parallel = context_parallel
        self.attention_layers = [as_attention_layer(layer) for layer in layers]
        self.layers = [layer.module for layer in self.attention_layers]
        layers = self.layers
        self.heads = [layer.n_heads for layer in self.attention_layers]
        self.block_bytes = block_bytes
        self.fused = fused
        self.max_logits = torch.full((len(layers), max(self.heads)), -math.inf, device=parameter_device(layers[0]))
        self.enabled = True
        self._handles = []
        self._taps: list[tuple[FlexKernelTap, type]] = []
        try:
            for index, layer in enumerate(layers):
                self._check_supported(layer)
                tap = self._tap_for(layer) if fused is not False else None
                pre_hook, post_hook = self._hooks_for(index, tap)
                self._handles.append(layer.inner_attention.register_forward_pre_hook(pre_hook, with_kwargs=True))
                if post_hook is not None:
                    self._handles.append(layer.inner_attention.register_forward_hook(post_hook))
        except BaseException:
            self.remove()  # a refused layer leaves no hook or kernel tap behind
            raise

    @classmethod
    def attach(
        cls, model: nn.Module, block_bytes: int | None = None, fused: bool | None = None, context_parallel: ContextParallelSequence | None = None
    ) -> MaxLogitRecorder:
        return cls(find_attention_layers(model), block_bytes, fused, context_parallel)

    @staticmethod
    def _check_supported(layer: nn.Module) -> None:
        attn_type = getattr(layer, "attn_type", "sdpa")  # torchtitan 0.2.2
        if attn_type not in ("sdpa", "flex") or type(layer.inner_attention).__name__ == "VarlenAttention":
            raise NotImplementedError(
                f"max-logit recording supports SDPA and FlexAttention, not varlen attention ({type(layer).__name__}: "
                f"{type(layer.inner_attention).__name__}, attn_type {attn_type!r}): it packs documents, and its "
                "masks are not read here"
            )

    def _tap_for(self, layer: nn.Module) -> FlexKernelTap | None:
        kernel_class = fused_kernel_class(layer.inner_attention)
        if kernel_class is None:
            if self.fused:
                raise ValueError(
                    f"max-logit recording with fused=True (TOML qk_clip_recording = \"kernel\") needs FlexAttention whose kernel can return max scores "
                    f"(torch with AuxRequest.max_scores, no FLASH backend); {type(layer).__name__}'s inner attention "
                    f"is {type(layer.inner_attention).__name__}"
                )
            return None
        tap = FlexKernelTap.install(kernel_class)
        self._taps.append((tap, kernel_class))
        return tap

    def _hooks_for(self, index: int, tap: FlexKernelTap | None):
        attention = self.attention_layers[index]
        layout = input_layout(attention.module.inner_attention)
        pending = []  # the inputs of a fused call, until the kernel has answered

        def inputs(args, kwargs) -> tuple[Tensor, Tensor, int]:
            q = args[0] if args else kwargs[layout.q_name]
            k = args[1] if len(args) > 1 else kwargs[layout.k_name]
            if not isinstance(q, DTensor):
                return q, k, first_local_head(attention, q.shape[layout.heads_dim])
            # torch's context parallel hands SDPA DTensors sharded along the sequence; tensor
            # parallel (torchtitan 0.3.0) DTensors sharded along the heads, whose placement says which.
            if self.context_parallel is None and _shards_dim(q, layout.sequence_dim):
                raise NotImplementedError(
                    f"max-logit recording: {attention.name!r} gets q and k sharded along the sequence (context parallel), "
                    "but the recorder was built without context_parallel=ContextParallelSequence(cp group, load balancer): "
                    "it would miss every query/key pair across ranks"
                )
            local_q = q.to_local()
            if _shards_dim(q, layout.heads_dim):
                first_head = held_rows(q, layout.heads_dim)[0]
            else:
                first_head = first_local_head(attention, local_q.shape[layout.heads_dim])
            return local_q, k.to_local(), first_head

        def record_blocks(q: Tensor, k: Tensor, first_head: int, kwargs: dict) -> None:
            is_causal, mask_mod = masking(kwargs)
            q, k = layout.head_major(q), layout.head_major(k)
            with torch.no_grad():
                if self.context_parallel is not None:
                    observed = context_parallel_max_logits(
                        self.context_parallel, q, k, kwargs.get("scale"), is_causal=is_causal, mask_mod=mask_mod,
                        block_bytes=self.block_bytes, name=attention.name,
                    )  # fmt: skip
                else:
                    observed = block_max_logits(
                        q, k, kwargs.get("scale"), is_causal=is_causal, mask_mod=mask_mod, block_bytes=self.block_bytes
                    )
                self._update(index, first_head, observed)

        def pre_hook(module, args, kwargs):
            # Evaluation forwards are not part of the step; activation recompute repeats a forward
            # already recorded (recording it again would double the cost, not change the max).
            if not (self.enabled and module.training and not in_backward()):
                return
            q, k, first_head = inputs(args, kwargs)
            if tap is not None and (self.fused or q.device.type == "cuda"):
                masking(kwargs)  # what the kernel is given but the recording cannot read still raises

                def take(max_scores: Tensor) -> None:
                    pending.clear()
                    scores = max_scores.to_local() if isinstance(max_scores, DTensor) else max_scores
                    with torch.no_grad():
                        self._update(index, first_head, scores.detach().amax(dim=(0, 2)))

                pending[:] = [(q, k, first_head, kwargs)]
                tap.armed = take
            else:
                record_blocks(q, k, first_head, kwargs)

        def post_hook(module, args, output):
            # A wrapper that did not reach the kernel through the tap (a subclass calling
            # flex_attention itself): record from the inputs after all, and disarm.
            if pending:
                tap.armed = None
                record_blocks(*pending.pop())

        return pre_hook, post_hook if tap is not None else None

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
        for tap, kernel_class in self._taps:
            tap.uninstall(kernel_class)
        self._taps.clear()
