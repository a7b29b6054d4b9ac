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

Weights may be FSDP2 DTensors sharded ``Shard(0)``: every rank scales the rows it holds,
whatever head they belong to, from a per-row factor vector. No communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_muon.attention_logits import DEFAULT_CHUNK_ELEMENTS, MaxLogitRecorder
from titan_muon.plan import shard_rows

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass
class AttentionLayer:
    """One attention module and how its heads map onto projection rows."""

    name: str
    module: nn.Module
    kind: str  # "gqa" (covers MHA) or "mla"
    n_heads: int

    def row_factors(self, gamma: Tensor, alpha: float) -> list[tuple[nn.Linear, Tensor]]:
        """(projection, factor per global output row) pairs that scale head h's logits by gamma[h]."""
        m = self.module
        if self.kind == "mla":
            nope, rope, v = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
            q = torch.cat([gamma[:, None].pow(alpha).expand(-1, nope), gamma[:, None].expand(-1, rope)], dim=1)
            kv = torch.cat([gamma[:, None].pow(1 - alpha).expand(-1, nope), torch.ones(self.n_heads, v, dtype=gamma.dtype)], dim=1)
            wq = m.wq if m.q_lora_rank == 0 else m.wq_b
            return [(wq, q.reshape(-1)), (m.wkv_b, kv.reshape(-1))]
        groups = gamma.view(m.n_kv_heads, -1)  # (kv heads, q heads per kv head), SDPA enable_gqa order
        whole_group_clipped = (groups < 1).all(dim=1)
        k = torch.where(whole_group_clipped, groups.amax(dim=1).pow(1 - alpha), torch.ones_like(whole_group_clipped, dtype=gamma.dtype))
        q = groups / k[:, None]
        return [(m.wq, q.reshape(-1).repeat_interleave(m.head_dim)), (m.wk, k.repeat_interleave(m.head_dim))]


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def find_attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """TorchTitan attention modules of `model`, in model order.

    GQA/MHA: modules with ``inner_attention``, ``wq``, ``wk``, ``n_heads``, ``n_kv_heads``,
    ``head_dim`` (llama3, llama4, qwen3 without qk-norm). MLA: ``wkv_b`` and ``wq`` or ``wq_b``
    (deepseek_v3). Raises on qk-norm, where rescaling the weights cannot change the logits.
    """
    layers = []
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "inner_attention", None), nn.Module):
            continue
        name = _clean_name(name)
        if hasattr(module, "wkv_b"):
            wq = module.wq if module.q_lora_rank == 0 else module.wq_b
            _check_rows(name, wq, module.n_heads * (module.qk_nope_head_dim + module.qk_rope_head_dim))
            _check_rows(name, module.wkv_b, module.n_heads * (module.qk_nope_head_dim + module.v_head_dim))
            layers.append(AttentionLayer(name, module, "mla", int(module.n_heads)))
        elif hasattr(module, "wq") and hasattr(module, "wk"):
            if getattr(module, "q_norm", None) is not None or getattr(module, "k_norm", None) is not None:
                raise ValueError(
                    f"QK-clip: attention {name!r} normalizes q and k per head (qk-norm), which cancels any rescaling "
                    "of W_q / W_k, so QK-clip cannot bound its logits. qk-norm already keeps logits bounded: "
                    "disable qk_clip for this model, or build it without qk_norm."
                )
            _check_rows(name, module.wq, module.n_heads * module.head_dim)
            _check_rows(name, module.wk, module.n_kv_heads * module.head_dim)
            layers.append(AttentionLayer(name, module, "gqa", int(module.n_heads)))
        else:
            raise ValueError(f"QK-clip: attention {name!r} ({type(module).__name__}) is neither GQA (wq, wk) nor MLA (wkv_b)")
    if not layers:
        raise ValueError(f"QK-clip: no attention module with an `inner_attention` child in {type(model).__name__}")
    return layers


def _check_rows(name: str, linear: nn.Linear, expected: int) -> None:
    if linear.weight.shape[0] != expected:
        raise ValueError(f"QK-clip: {name} has {linear.weight.shape[0]} projection rows, expected {expected} (tensor parallel is not supported)")


def _local_rows(t: Tensor) -> tuple[Tensor, int, int]:
    """The tensor's local rows and their global range [start, end)."""
    if not isinstance(t, DTensor):
        return t, 0, t.shape[0]
    start, end = 0, t.shape[0]
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard or placement.dim != 0 or (start, end) != (0, t.shape[0]):
            raise NotImplementedError(f"QK-clip: weights must be replicated or Shard(0) on one mesh dimension, got {t.placements}")
        mesh = t.device_mesh
        start, end = shard_rows(t.shape[0], mesh.size(mesh_dim))[mesh.get_local_rank(mesh_dim)]
    local = t.to_local()
    if local.shape[0] != end - start:
        raise RuntimeError(f"QK-clip: local shard has {local.shape[0]} rows, expected rows [{start}, {end}) of {t.shape[0]}")
    return local, start, end


def _scale_rows(linear: nn.Linear, factors: Tensor) -> None:
    for t in (linear.weight, linear.bias):  # a bias is part of q (or k) too
        if t is None:
            continue
        local, start, end = _local_rows(t)
        mine = factors[start:end]
        if bool((mine != 1).any()):
            local.mul_(mine.to(device=local.device, dtype=local.dtype).view(-1, *[1] * (local.dim() - 1)))


def apply_qk_clip(layers: list[AttentionLayer], max_logits: Tensor, tau: float = 100.0, alpha: float = 0.5) -> Tensor:
    """Clip every (layer, head) with tau < max_logits[layer, head] < inf; returns the clipped mask.

    ``max_logits`` is (layers, >= heads): the data-parallel max, identical on every rank.
    Heads with S <= tau, S <= 0, NaN or inf are left alone (inf would zero the weights).
    """
    _check_hyperparameters(tau, alpha)
    if max_logits.shape[0] != len(layers):
        raise ValueError(f"apply_qk_clip: max_logits has {max_logits.shape[0]} rows for {len(layers)} attention layers")
    s = max_logits.detach().to("cpu", torch.float64)
    clipped = torch.isfinite(s) & (s > tau)
    gamma = torch.where(clipped, tau / s, torch.ones_like(s))
    with torch.no_grad():
        for i, layer in enumerate(layers):
            if clipped[i, : layer.n_heads].any():
                for linear, factors in layer.row_factors(gamma[i, : layer.n_heads], alpha):
                    _scale_rows(linear, factors)
    return clipped


def _check_hyperparameters(tau: float, alpha: float) -> None:
    if not (tau > 0 and math.isfinite(tau)):
        raise ValueError(f"QK-clip: tau must be a positive finite number, got {tau}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"QK-clip: alpha must lie in [0, 1], got {alpha}")


class QKClip:
    """Records max logits during forward and clips after each optimizer step.

    Usage, once per training step::

        qk_clip = QKClip(model, tau=100.0, alpha=0.5, group=dp_group)   # after fully_shard
        ... forward / backward over the micro-batches ...
        optimizer.step()
        metrics = qk_clip.reduce_and_clip(optimizer)    # one MAX all-reduce, clip, reset

    Only forwards in training mode record (validation under ``model.eval()`` does not).
    ``group`` is the data-parallel process group (HSDP: replicate × shard); None = the world.
    """

    def __init__(
        self,
        model: nn.Module,
        tau: float = 100.0,
        alpha: float = 0.5,
        group: dist.ProcessGroup | None = None,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    ):
        _check_hyperparameters(tau, alpha)
        self.tau, self.alpha, self.group = float(tau), float(alpha), group
        self.layers = find_attention_layers(model)
        self.recorder = MaxLogitRecorder([layer.module for layer in self.layers], chunk_elements)
        self._device = next(self.layers[0].module.parameters()).device

    def reduce_and_clip(self, optimizer: torch.optim.Optimizer | None = None, *, lr: float | None = None) -> dict[str, float]:
        """All-reduce the step's max logits, clip, reset. Call on every rank right after optimizer.step().

        The step's learning rate comes from ``lr`` or the optimizer's largest group lr; a step at
        lr == 0 (torch DCP creating optimizer state) never clips.
        """
        max_logits = self.recorder.all_reduce(self.group, self._device)
        if lr is None and optimizer is not None:
            lr = max(float(group["lr"]) for group in optimizer.param_groups)
        if lr == 0:
            clipped = torch.zeros(max_logits.shape, dtype=torch.bool)
        else:
            clipped = apply_qk_clip(self.layers, max_logits, self.tau, self.alpha)
        per_layer = max_logits.amax(dim=1).tolist()
        metrics = {f"qk_clip/max_logit/{layer.name}": value for layer, value in zip(self.layers, per_layer)}
        metrics["qk_clip/max_logit"] = max(per_layer)
        metrics["qk_clip/heads_clipped"] = int(clipped.sum())
        metrics["qk_clip/nonfinite_heads"] = int((max_logits == math.inf).sum())
        self.reset()
        return metrics

    def reset(self) -> None:
        self.recorder.reset()

    def remove(self) -> None:
        """Detach the recording hooks."""
        self.recorder.remove()
