"""Split a model's parameters into a Muon group and an AdamW group by the role each one plays.

Every parameter gets a role from its (cleaned) FQN, its shape and, when a module is given,
the type of the module that owns it:

===============  =====  ==================================================================
role             group  what it is
===============  =====  ==================================================================
hidden matrix    Muon   2-D ``weight`` of a linear map between hidden states: attention
                        ``wq``/``wk``/``wv``/``wo``, torchtitan 0.3.0's fused
                        ``qkv_linear.wqkv``, MLA's ``wq_a``/``wkv_b``..., feed-forward and
                        shared-expert ``w1``/``w2``/``w3``, MTP's ``eh_proj``
expert stack     Muon   3-D ``[experts, out, in]`` stack, one matrix per routed expert, owned
                        by a module whose name ends in ``experts``: 0.2.2 ``moe.experts.w1``,
                        0.3.0 ``moe.routed_experts.inner_experts.w1_EFD``, Hugging Face
                        ``mlp.experts.down_proj``; each expert is orthogonalized on its own
embedding      AdamW    token, position and patch embeddings (a lookup table, not a map)
output head    AdamW    ``output`` / ``lm_head``: a classifier over the vocabulary
router gate    AdamW    MoE routers (``moe.router.gate``, Hugging Face ``mlp.gate``) and
                        other ``gate`` modules: classifiers over experts, or scalar gates
norm           AdamW    norm weights
bias           AdamW    biases, including 2-D stacks of expert biases
convolution    AdamW    convolution kernels ``[out, in / groups, kernel...]``
vector         AdamW    any other 0-D or 1-D tensor (attention sinks, ``A_log``...)
===============  =====  ==================================================================

``adamw_patterns`` / ``muon_patterns`` (fnmatch on the cleaned FQN, AdamW first) override the
roles. A tensor of 2 or more dimensions that no rule fits is *unclassified*: a 3-D tensor
outside an experts module, a bare 2-D ``nn.Parameter`` with a name not in
:data:`HIDDEN_MATRIX_NAMES` (``wq``, ``w1``, ``q_proj``...). Guessing its group is
how a new model layout trains its experts with the wrong optimizer without anyone noticing, so
:func:`build_param_groups` raises, naming them, unless told ``unclassified="adamw"``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from typing import Literal

import torch
from torch import nn

logger = logging.getLogger(__name__)

MUON, ADAMW = "Muon", "AdamW"
ROLE_GROUPS = {
    "hidden matrix": MUON,
    "expert stack": MUON,
    "muon_patterns": MUON,
    "embedding": ADAMW,
    "output head": ADAMW,
    "router gate": ADAMW,
    "norm": ADAMW,
    "bias": ADAMW,
    "convolution": ADAMW,
    "vector": ADAMW,
    "adamw_patterns": ADAMW,
}
UNCLASSIFIED = "unclassified"

# FQN components of embeddings in torchtitan and Hugging Face models (besides names containing "embed").
EMBEDDING_MODULE_NAMES = frozenset({"tok_embeddings", "embed_tokens", "embeddings", "embedding", "wte", "wpe"})
# Names of the module that owns the output head's weight.
OUTPUT_HEAD_MODULE_NAMES = frozenset({"output", "lm_head"})
# FQN components that mark MoE routers and gates: torchtitan's ``moe.router.gate``, Hugging Face's ``mlp.gate``.
ROUTER_MODULE_NAMES = frozenset({"router", "gate"})
# Hidden matrices held as bare 2-D parameters rather than as a linear layer's ``weight``.
HIDDEN_MATRIX_NAMES = frozenset({
    "wq", "wk", "wv", "wo", "wqkv", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1", "w2", "w3", "eh_proj",
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj",
})  # fmt: skip
# Grouped expert weights live in a module named like torchtitan's ``experts`` / ``inner_experts``.
EXPERTS_MODULE_SUFFIX = "experts"
NORM_MODULE_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
# Wrappers that insert themselves into FQNs without changing what a parameter is.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def clean_fqn(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def classify(
    name: str,
    param: torch.Tensor,
    owner: nn.Module | None = None,
    adamw_patterns: Iterable[str] = (),
    muon_patterns: Iterable[str] = (),
) -> str:
    """The role of parameter `name` (a key of :data:`ROLE_GROUPS`, or ``"unclassified"``).

    `owner` is the module holding the parameter, when known; its type settles embeddings,
    norms and convolutions whatever they are called.
    """
    fqn = clean_fqn(name)
    if any(fnmatchcase(fqn, pattern) for pattern in adamw_patterns):
        return "adamw_patterns"
    if any(fnmatchcase(fqn, pattern) for pattern in muon_patterns):
        return "muon_patterns"
    *modules, leaf = fqn.split(".")
    owner_name = modules[-1] if modules else ""
    if "norm" in fqn.lower() or isinstance(owner, NORM_MODULE_TYPES):
        return "norm"
    if leaf == "bias" or "bias" in leaf.lower().split("_"):
        return "bias"
    if param.ndim < 2:
        return "vector"
    if _is_embedding(modules, leaf, owner):
        return "embedding"
    if owner_name in OUTPUT_HEAD_MODULE_NAMES:
        return "output head"
    if any(part in ROUTER_MODULE_NAMES for part in modules):
        return "router gate"
    if param.ndim == 3 and owner_name.endswith(EXPERTS_MODULE_SUFFIX):
        return "expert stack"
    if isinstance(owner, nn.modules.conv._ConvNd) or (param.ndim >= 3 and leaf == "weight" and "conv" in owner_name.lower()):
        return "convolution"
    if param.ndim == 2 and (leaf == "weight" or leaf in HIDDEN_MATRIX_NAMES):
        return "hidden matrix"
    return UNCLASSIFIED


def _is_embedding(modules: Sequence[str], leaf: str, owner: nn.Module | None) -> bool:
    if isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) or any(part in EMBEDDING_MODULE_NAMES for part in modules):
        return True
    # "embed" only in the parameter's own name or its module's (pos_embed, patch_embed.weight): a
    # whole sub-network named, say, text_embedder still has hidden matrices.
    owner_name = modules[-1] if modules else ""
    return "embed" in leaf.lower() or "embed" in owner_name.lower()


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
    unclassified: Literal["raise", "adamw"] = "raise",
) -> list[dict]:
    """Param groups for :class:`titan_muon.Muon`: ``[muon_group, adamw_group]`` (empty ones dropped).

    Roles are assigned as the module docstring says; pass the model itself (rather than its
    ``named_parameters()``) so module types can settle embeddings, norms and convolutions.
    ``unclassified``: "raise" (default) fails on parameters no rule fits, naming them;
    "adamw" puts them in AdamW and logs a warning naming them. The assignment is logged
    (``logging.INFO``) as one table of parameter patterns, group, role and shape.

    Settings left as None fall back to the optimizer's defaults. Parameters that do not
    require gradients are left out. A parameter forced into Muon by `muon_patterns` must
    still be 2-D or a 3-D stack of matrices (the optimizer says so, naming it).
    """
    if unclassified not in ("raise", "adamw"):
        raise ValueError(f'titan_muon build_param_groups: unclassified={unclassified!r}; expected "raise" or "adamw"')
    adamw_patterns, muon_patterns = tuple(adamw_patterns), tuple(muon_patterns)
    roles = [
        (name, param, classify(name, param, owner, adamw_patterns, muon_patterns))
        for name, param, owner in _parameters_with_owners(named_parameters)
        if param.requires_grad
    ]
    _check_unclassified(roles, unclassified)
    muon = {"params": [], "param_names": [], "use_muon": True, "matrix_stacks": True}  # 3-D Muon parameters are experts
    adamw = {"params": [], "param_names": [], "use_muon": False}
    for name, param, role in roles:
        group = muon if ROLE_GROUPS.get(role) == MUON else adamw
        group["params"].append(param)
        group["param_names"].append(name)
    for group, settings in (
        (muon, {"lr": muon_lr, "weight_decay": muon_weight_decay}),
        (adamw, {"lr": adamw_lr, "betas": adamw_betas, "eps": adamw_eps, "weight_decay": adamw_weight_decay}),
    ):
        group.update({key: value for key, value in settings.items() if value is not None})
    logger.info("titan_muon build_param_groups: %s, %s\n%s", _totals(MUON, muon), _totals(ADAMW, adamw), role_table(roles))
    return [group for group in (muon, adamw) if group["params"]]


def _totals(label: str, group: dict) -> str:
    return f"{label} {len(group['params'])} tensors ({sum(p.numel() for p in group['params']):,} elements)"


def _parameters_with_owners(source: nn.Module | Iterable[tuple[str, torch.Tensor]]):
    """(name, parameter, owning module or None) for a module or a named-parameter iterable."""
    if not isinstance(source, nn.Module):
        return [(name, param, None) for name, param in source]
    modules = dict(source.named_modules())
    return [(name, param, modules.get(name.rpartition(".")[0])) for name, param in source.named_parameters()]


def _check_unclassified(roles: list[tuple[str, torch.Tensor, str]], policy: str) -> None:
    unknown = [(name, param, role) for name, param, role in roles if role == UNCLASSIFIED]
    if not unknown:
        return
    listing = "\n".join(f"  {pattern} {shape} x{count}" for pattern, shape, _, count in _summarize(unknown))
    if policy == "adamw":
        logger.warning(
            "titan_muon build_param_groups: no rule says whether these parameters are hidden matrices, so they go to "
            "AdamW as unclassified=\"adamw\" asks. Check that this is right for them:\n%s",
            listing,
        )
        return
    raise ValueError(
        "titan_muon build_param_groups: cannot tell whether these parameters are hidden matrices (Muon) or not (AdamW):\n"
        f"{listing}\n"
        "Rules: a 2-D `weight` (or a bare 2-D wq, w1, q_proj...) is a linear map (Muon) unless it is an embedding, output head, router or norm; a 3-D "
        "tensor is a stack of expert matrices (Muon) only when its module's name ends in 'experts'. Place them with "
        "muon_patterns / adamw_patterns (fnmatch on the FQN), or opt out with unclassified=\"adamw\" to send every "
        "unclassified parameter to AdamW with a warning (torchtitan: [optimizer] unclassified_params = \"adamw\")."
    )


def fqn_pattern(name: str) -> str:
    """The FQN with layer indices as ``*``: one pattern for the same parameter of every layer."""
    return ".".join("*" if part.isdigit() else part for part in clean_fqn(name).split("."))


def _summarize(roles: Iterable[tuple[str, torch.Tensor, str]]) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(pattern, shape, role, count) rows in model order; a pattern of one parameter is its name."""
    rows: dict[tuple[str, tuple[int, ...], str], list[str]] = {}
    for name, param, role in roles:
        rows.setdefault((fqn_pattern(name), tuple(param.shape), role), []).append(name)
    return [(pattern if len(names) > 1 else names[0], shape, role, len(names)) for (pattern, shape, role), names in rows.items()]


def role_table(roles: Iterable[tuple[str, torch.Tensor, str]]) -> str:
    """One line per (pattern, shape, role): group, role, shape, count and parameter pattern."""
    lines = [("group", "role", "shape", "count", "parameter")]
    for pattern, shape, role, count in _summarize(roles):
        group = ROLE_GROUPS.get(role, ADAMW)  # unclassified ones reach the table only when sent to AdamW
        lines.append((group, role, "x".join(map(str, shape)) or "scalar", str(count), pattern))
    widths = [max(len(line[column]) for line in lines) for column in range(4)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[4] for line in lines)
