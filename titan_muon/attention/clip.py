"""QK-clip (MuonClip, Kimi K2): after the optimizer step, shrink the query/key rows of every
attention head whose largest pre-softmax logit S exceeded tau, so that head's logits scale
by exactly gamma = tau / S.

A logit is scale * q·k with q and k linear in the weights' rows (RoPE is a rotation, linear
too), so multiplying head h's query rows by a and its key rows by b multiplies every logit of
h by a·b. The rules below pick a, b per head:

* MHA: a = gamma^alpha, b = gamma^(1-alpha).
* GQA: a K head is shared by a group of Q heads, so scaling it would also shrink the group's
  heads that stayed under tau. If any head of the group is under tau, K is left alone and each
  clipped Q head takes all of its gamma_h. If every head of the group is over tau, K takes the
  share gamma_max^(1-alpha) of the mildest clip (largest gamma) and each Q head the rest,
  gamma_h / gamma_max^(1-alpha), which lies in [gamma_h, gamma_h^alpha]: each head still gets
  exactly gamma_h, nothing grows, and with one Q head per K head this is the MHA rule.
* MLA: per head, q_nope rows * gamma^alpha, k_nope rows (in wkv_b) * gamma^(1-alpha),
  q_rope rows * gamma; the shared k_rope (in wkv_a) and the V rows are untouched.

torchtitan 0.3.0's fused ``qkv_linear.wqkv`` gets the same factors, placed on its
interleaved q and k rows (its v rows keep 1).

Weights may be DTensors sharded by FSDP2, HSDP, tensor parallel or FSDP2 on top of tensor
parallel (``Shard(0)`` / ``_StridedShard(0)``): every rank scales the rows it holds, whatever
head they belong to, from a per-global-row factor vector. No communication, and no host read:
rows of unclipped heads are multiplied by exactly 1.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from titan_muon.base.dtensor import local_shard
from titan_muon.attention.layers import AttentionLayer, find_attention_layers
from titan_muon.attention.logits import (
    ContextParallelSequence,
    MaxLogitRecorder,
    held_rows,
)

logger = logging.getLogger(__name__)

def row_factors(layer: AttentionLayer, gamma: Tensor, clipped: Tensor, alpha: float) -> list[tuple[nn.Linear, Tensor]]:
    """(projection, factor per global output row) pairs that scale head h's logits by gamma[h].

    ``gamma`` is 1 wherever ``clipped`` is False; both are (n_heads,) on the weights' device.
    """
    if layer.kind == "mla":
        nope, rope, v = layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
        q = torch.cat([gamma[:, None].pow(alpha).expand(-1, nope), gamma[:, None].expand(-1, rope)], dim=1)
        kv = torch.cat([gamma[:, None].pow(1 - alpha).expand(-1, nope), gamma.new_ones(layer.n_heads, v)], dim=1)
        return [(layer.query_projection, q.reshape(-1)), (layer.key_projection, kv.reshape(-1))]
    groups = gamma.view(layer.n_kv_heads, -1)  # (kv heads, q heads per kv head), SDPA enable_gqa order
    whole_group_clipped = clipped.view(layer.n_kv_heads, -1).all(dim=1)
    k = torch.where(whole_group_clipped, groups.amax(dim=1).pow(1 - alpha), 1.0)
    q = groups / k[:, None]
    q_rows, k_rows = q.reshape(-1).repeat_interleave(layer.qk_head_dim), k.repeat_interleave(layer.qk_head_dim)
    if layer.kind == "fused_wqkv":  # v rows keep factor 1
        return [(layer.query_projection, layer.fused_layout.fuse(q_rows, k_rows, torch.ones_like(k_rows)))]
    return [(layer.query_projection, q_rows), (layer.key_projection, k_rows)]


def qk_clip_layers(model: nn.Module, *, required: bool = True) -> list[AttentionLayer]:
    """The attention layers of `model` (:func:`titan_muon.attention.layers.find_attention_layers`) QK-clip acts on.

    Raises on qk-norm, where rescaling the weights cannot change the logits, and (if
    ``required``) when there is no attention module at all.
    """
    layers = find_attention_layers(model)
    for layer in layers:
        if layer.has_qk_norm:
            raise ValueError(
                f"QK-clip: attention {layer.name!r} normalizes q and k per head (qk-norm), which cancels any rescaling "
                "of W_q / W_k, so QK-clip cannot bound its logits. qk-norm already keeps logits bounded: "
                "disable qk_clip for this model, or build it without qk_norm."
            )
    if required and not layers:
        raise ValueError(f"QK-clip: no attention module with an `inner_attention` child in {type(model).__name__}")
    return layers


def scale_rows(t: Tensor, factors: Tensor) -> None:
    """Multiply the rows of ``t`` this rank holds by ``factors[global row]``, in place."""
    start, stop = held_rows(t)
    local = local_shard(t)
    if stop - start != local.shape[0]:
        placements = getattr(t, "placements", None)
        raise RuntimeError(f"QK-clip: local shard has {local.shape[0]} rows, expected global rows [{start}, {stop}) ({placements})")
    local.mul_(factors[start:stop].to(device=local.device, dtype=local.dtype).view(-1, *[1] * (local.dim() - 1)))


def apply_qk_clip(
    layers: list[AttentionLayer], max_logits: Tensor, tau: float = 100.0, alpha: float = 0.5, *, live: Tensor | None = None
) -> Tensor:
    """Clip every (layer, head) with tau < max_logits[layer, head] < inf; returns the clipped mask.

    ``max_logits`` is (layers, >= heads): the max over every rank holding these layers, identical on each.
    Heads with S <= tau, S <= 0, NaN or inf are left alone (inf would zero the weights).
    ``live`` (a device bool, e.g. lr != 0 for a tensor lr) switches the whole clip off.
    Everything stays on the weights' device: no host read.
    """
    _check_hyperparameters(tau, alpha)
    if max_logits.shape[0] != len(layers):
        raise ValueError(f"apply_qk_clip: max_logits has {max_logits.shape[0]} rows for {len(layers)} attention layers")
    s = max_logits.detach().float()
    clipped = torch.isfinite(s) & (s > tau)
    if live is not None:
        clipped &= live
    gamma = torch.where(clipped, tau / s, 1.0)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for linear, factors in row_factors(layer, gamma[i, : layer.n_heads], clipped[i, : layer.n_heads], alpha):
                for t in (linear.weight, linear.bias):  # a bias is part of q (or k) too
                    if t is not None:
                        scale_rows(t, factors)
    return clipped


def _check_hyperparameters(tau: float, alpha: float) -> None:
    if not (tau > 0 and math.isfinite(tau)):
        raise ValueError(f"QK-clip: tau must be a positive finite number, got {tau}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"QK-clip: alpha must lie in [0, 1], got {alpha}")


class QKClipMetrics(Mapping[str, float]):
    """A step's QK-clip metrics, kept as device tensors until read (then one device-to-host copy).

    Keys: ``qk_clip/max_logit/<layer FQN>`` (that layer's max over heads), ``qk_clip/max_logit``,
    ``qk_clip/heads_clipped``, ``qk_clip/nonfinite_heads`` (NaN/inf heads, never clipped).
    Listing the keys reads nothing; the first value read copies all values at once.
    """

    def __init__(self, layer_names: Sequence[str], layer_max: Tensor, heads_clipped: Tensor, nonfinite_heads: Tensor):
        self.layer_names = list(layer_names)
        counts = torch.stack([heads_clipped.float(), nonfinite_heads.float()])
        self._device_values = torch.cat([layer_max.float(), counts])
        self._values: dict[str, float] | None = None

    @classmethod
    def merge(cls, parts: Sequence["QKClipMetrics"]) -> "QKClipMetrics":
        """One mapping for several model parts (pipeline stages): per-layer keys of all, totals summed."""
        names = [name for part in parts for name in part.layer_names]
        layer_max = torch.cat([part._device_values[:-2] for part in parts])
        counts = torch.stack([part._device_values[-2:] for part in parts]).sum(dim=0)
        return cls(names, layer_max, counts[0], counts[1])

    def _keys(self) -> list[str]:
        per_layer = [f"qk_clip/max_logit/{name}" for name in self.layer_names]
        return [*per_layer, "qk_clip/max_logit", "qk_clip/heads_clipped", "qk_clip/nonfinite_heads"]

    def _read(self) -> dict[str, float]:
        if self._values is None:
            *per_layer, clipped, nonfinite = self._device_values.tolist()
            values = [*per_layer, max(per_layer), int(clipped), int(nonfinite)]
            self._values = dict(zip(self._keys(), values))
        return self._values

    def __getitem__(self, key: str) -> float:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self.layer_names) + 3


def read_metrics(parts: Sequence[QKClipMetrics]) -> dict[str, float]:
    """All parts' metrics as plain numbers: one device-to-host copy (call it on logging steps)."""
    return dict(QKClipMetrics.merge(parts)) if parts else {}


class QKClip:
    """Records max logits during forward and clips after each optimizer step.

    Usage, once per training step::

        qk_clip = QKClip(model, tau=100.0, alpha=0.5, group=stage_group)   # after fully_shard / TP
        ... forward / backward over the micro-batches ...
        optimizer.step()
        metrics = qk_clip.reduce_and_clip(optimizer)    # one MAX all-reduce, clip, reset

    Only forwards in training mode record (validation under ``model.eval()`` does not).
    ``group``: the ranks that hold these same layers, as one process group, a sequence of groups
    whose product they are (e.g. a pipeline stage's data-parallel and tensor-parallel mesh
    dimensions: one MAX all-reduce each), or None for the world. The step adds no host sync:
    ``metrics`` holds device tensors until read.

    Context parallel: ``context_parallel`` says how the sequence is cut over the CP group
    (:class:`~titan_muon.attention.logits.ContextParallelSequence`); each rank records its
    queries against the whole sequence's keys, and ``group`` must include the CP ranks (every
    rank of a CP group holds the same layers).
    """

    def __init__(
        self,
        model: nn.Module,
        tau: float = 100.0,
        alpha: float = 0.5,
        group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = None,
        block_bytes: int | None = None,
        fused: bool | None = None,
        context_parallel: ContextParallelSequence | None = None,
    ):
        _check_hyperparameters(tau, alpha)
        self.tau, self.alpha, self.group = float(tau), float(alpha), group
        self.layers = qk_clip_layers(model)
        self.recorder = MaxLogitRecorder(self.layers, block_bytes, fused, context_parallel)

    def reduce_and_clip(
        self, optimizer: torch.optim.Optimizer | None = None, *, lr: float | Tensor | None = None
    ) -> QKClipMetrics:
        """All-reduce the step's max logits, clip, reset. Call on every rank of the group right after optimizer.step().

        The step's learning rate comes from ``lr`` or the optimizer's largest group lr; a step at
        lr == 0 (torch DCP creating optimizer state) never clips, nor one the optimizer skipped
        (Muon's ``nonfinite_grads="skip"``: a skipped step changes no weight).
        """
        max_logits = self.recorder.all_reduce(self.group)
        skipped = getattr(optimizer, "last_step_skipped", False)
        live = False if skipped else _step_is_live(optimizer, lr, max_logits.device)
        if live is False:
            clipped = torch.zeros(max_logits.shape, dtype=torch.bool, device=max_logits.device)
        else:
            clipped = apply_qk_clip(self.layers, max_logits, self.tau, self.alpha, live=None if live is True else live)
        metrics = QKClipMetrics(
            [layer.name for layer in self.layers], max_logits.amax(dim=1), clipped.sum(), (max_logits == math.inf).sum()
        )
        self.reset()  # after the metrics' tensors were computed from the buffer
        return metrics

    def reset(self) -> None:
        self.recorder.reset()

    def remove(self) -> None:
        """Detach the recording hooks."""
        self.recorder.remove()


def _step_is_live(optimizer, lr, device: torch.device) -> bool | Tensor:
    """Whether the step's lr is nonzero: a host bool for float lrs, a device bool for tensor lrs."""
    lrs = [lr] if lr is not None else [group["lr"] for group in optimizer.param_groups] if optimizer is not None else []
    if not lrs or any(not isinstance(value, Tensor) and value != 0 for value in lrs):
        return True
    tensors = [value for value in lrs if isinstance(value, Tensor)]
    if not tensors:
        return False
    return (torch.stack([value.detach().to(device).reshape(()) for value in tensors]) != 0).any()


def build_qk_clips(
    model_parts: Sequence[nn.Module],
    tau: float = 100.0,
    alpha: float = 0.5,
    group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = None,
    *,
    block_bytes: int | None = None,
    fused: bool | None = None,
    allow_parts_without_attention: bool = False,
    context_parallel: ContextParallelSequence | None = None,
) -> list[QKClip | None]:
    """One :class:`QKClip` per model part, ``None`` for a part without attention layers.

    Pipeline parallel: ``group`` is the stage's group, and every rank of it holds the same parts,
    so a part without attention (say, a last stage of norm + output) is skipped alike on all of
    them: nothing to reduce, nothing to hang on. Without ``allow_parts_without_attention`` such a
    part raises (a model with qk_clip on and no attention is a configuration error).
    """
    clips: list[QKClip | None] = []
    for index, part in enumerate(model_parts):
        if qk_clip_layers(part, required=not allow_parts_without_attention):
            clips.append(QKClip(part, tau, alpha, group, block_bytes, fused, context_parallel))
        else:
            logger.warning("QK-clip: model part %d (%s) has no attention layer: nothing to clip in it", index, type(part).__name__)
            clips.append(None)
    return clips
