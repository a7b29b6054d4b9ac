"""Split a model's parameters into a Muon group and an AdamW group, the usual way.

Muon is for the hidden 2-D weight matrices. Embeddings and the output head are 2-D too but
are lookup tables / classifiers rather than linear maps between hidden states, so they go
to AdamW, together with norms, biases and everything that is not 2-D.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable

import torch
from torch import nn

# FQN components that mark embeddings and output heads in torchtitan and Hugging Face models.
ADAMW_MODULE_NAMES = frozenset({"tok_embeddings", "embed_tokens", "embeddings", "embedding", "wte", "wpe", "output", "lm_head"})
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
    parts = fqn.split(".")
    is_head_or_embedding = any(part in ADAMW_MODULE_NAMES for part in parts[:-1])
    return param.ndim == 2 and not is_head_or_embedding and "norm" not in fqn.lower()


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
    still be 2-D (the optimizer says so, naming it).
    """
    if isinstance(named_parameters, nn.Module):
        named_parameters = named_parameters.named_parameters()
    adamw_patterns, muon_patterns = tuple(adamw_patterns), tuple(muon_patterns)
    muon = {"params": [], "param_names": [], "use_muon": True}
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
