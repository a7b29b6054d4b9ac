"""Split a model's parameters into a Muon group and an AdamW group, the usual way.

Muon is for the hidden weight matrices: 2-D weights, and the grouped weights of MoE experts,
3-D ``[experts, out, in]`` stacks of one matrix per expert (torchtitan's
``moe.experts.w1/w2/w3``; each expert is orthogonalized on its own). Embeddings, the output
head and the MoE router (``router``, ``gate``) are 2-D too but are lookup tables /
classifiers rather than linear maps between hidden states, so they go to AdamW, together
with norms, biases and every other tensor: a 3-D tensor outside an ``experts`` module (a
convolution's ``[out, in, kernel]``, say) is not a stack of matrices the model multiplies
by, so it stays AdamW unless ``muon_patterns`` says otherwise.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable

import torch
from torch import nn

# FQN components that mark embeddings and output heads in torchtitan and Hugging Face models.
ADAMW_MODULE_NAMES = frozenset({"tok_embeddings", "embed_tokens", "embeddings", "embedding", "wte", "wpe", "output", "lm_head"})
# FQN components that mark MoE routers: torchtitan's ``moe.router.gate``, Hugging Face's ``mlp.gate``.
ROUTER_MODULE_NAMES = frozenset({"router", "gate"})
# The FQN component of grouped MoE expert weights (torchtitan's GroupedExperts, ``moe.experts.w1``).
EXPERTS_MODULE_NAME = "experts"
# Wrappers that insert themselves into FQNs without changing what a parameter is.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def clean_fqn(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def uses_muon(name: str, param: torch.Tensor, adamw_patterns: Iterable[str] = (), muon_patterns: Iterable[str] = ()) -> bool:
    """Default rule, overridable by fnmatch patterns on the (cleaned) FQN; AdamW patterns win."""
    fqn = clean_fqn(name)
    if any(fnmatchcase(fqn, pattern) for pattern in adamw_patterns):
        return False
    if any(fnmatchcase(fqn, pattern) for pattern in muon_patterns):
        return True
    modules = fqn.split(".")[:-1]
    if any(part in ADAMW_MODULE_NAMES or part in ROUTER_MODULE_NAMES for part in modules) or "norm" in fqn.lower():
        return False
    if param.ndim == 3:
        return bool(modules) and modules[-1] == EXPERTS_MODULE_NAME
    return param.ndim == 2


def build_param_groups(
    named_parameters: nn.Module | Iterable[tuple[str, torch.Tensor]],
    *,
    muon_lr: float | None = None,
    muon_weight_decay: float | None = None,
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] | None = None,
    adamw_eps: float | None = None,
    adamw_weight_decay: float | None = None,
    adamw_patterns: Iterable[str] = (),
    muon_patterns: Iterable[str] = (),
) -> list[dict]:
    """Param groups for :class:`titan_muon.Muon`: ``[muon_group, adamw_group]`` (empty ones dropped).

    Settings left as None fall back to the optimizer's defaults. Parameters that do not
    require gradients are left out. A parameter forced into Muon by `muon_patterns` must
    still be 2-D or a 3-D stack of matrices (the optimizer says so, naming it).
    """
    if isinstance(named_parameters, nn.Module):
        named_parameters = named_parameters.named_parameters()
    adamw_patterns, muon_patterns = tuple(adamw_patterns), tuple(muon_patterns)
    muon = {"params": [], "param_names": [], "use_muon": True, "matrix_stacks": True}  # 3-D Muon parameters are experts
    adamw = {"params": [], "param_names": [], "use_muon": False}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        group = muon if uses_muon(name, param, adamw_patterns, muon_patterns) else adamw
        group["params"].append(param)
        group["param_names"].append(name)
    for group, settings in (
        (muon, {"lr": muon_lr, "weight_decay": muon_weight_decay}),
        (adamw, {"lr": adamw_lr, "betas": adamw_betas, "eps": adamw_eps, "weight_decay": adamw_weight_decay}),
    ):
        group.update({key: value for key, value in settings.items() if value is not None})
    return [group for group in (muon, adamw) if group["params"]]
