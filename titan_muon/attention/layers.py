"""The attention layers of a torchtitan model, found once for Muon Split, QK-clip and max-logit recording.

A module is an attention layer when it has an ``inner_attention`` child module: the SDPA,
FlexAttention or varlen wrapper torchtitan hands q, k and v to (llama3, llama4, qwen3,
gpt_oss, deepseek_v3; torchtitan 0.2.2 and 0.3.0 alike). Its projections then say which kind
it is:

* ``"mla"``: ``wkv_b`` and ``qk_nope_head_dim`` (deepseek_v3): queries from ``wq``, or ``wq_b``
  with a query LoRA (``q_lora_rank`` > 0); ``wkv_b`` holds each head's k_nope and v rows.
* ``"fused_wqkv"``: torchtitan 0.3.0's ``qkv_linear.wqkv`` (:mod:`titan_muon.attention.fused_qkv` knows
  where its q, k and v rows are), grouped-query or not.
* ``"gqa"`` / ``"mha"``: separate ``wq``, ``wk``, ``wv`` (0.3.0: inside ``qkv_linear``), with
  ``n_kv_heads`` < ``n_heads`` or equal.

Each layer found is described by an :class:`AttentionLayer`: its kind, head counts and
dimensions, and the names of its projections, checked against their weights' row counts.
A module with an ``inner_attention`` but none of these projections is an error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from titan_muon.attention.fused_qkv import FusedQKVLayout, fused_qkv_layout
from titan_muon.param_groups import clean_fqn

ATTENTION_KINDS = ("mha", "gqa", "mla", "fused_wqkv")


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module, and how its heads map onto the rows of its projections.

    ``path`` is the module's name as ``named_modules`` gives it (wrapper prefixes of activation
    checkpointing, ``torch.compile`` and FSDP1 included: what its parameters' FQNs start with);
    ``name`` the same without wrapper prefixes (for logs and metrics). Projections are named
    relative to the module (``"wq"``, ``"wq_b"``, ``"wkv_b"``, ``"qkv_linear.wqkv"``); for MLA
    and the fused wqkv one projection plays two or three roles.
    """

    path: str
    name: str
    module: nn.Module
    kind: str
    n_heads: int
    n_kv_heads: int  # MLA: one key head per query head
    qk_head_dim: int  # the length of a q·k dot product (MLA: nope + rope)
    v_head_dim: int
    query_projection_name: str
    key_projection_name: str
    value_projection_name: str
    qk_nope_head_dim: int = 0  # MLA only
    qk_rope_head_dim: int = 0  # MLA only
    has_qk_norm: bool = False

    @property
    def heads_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def fused_layout(self) -> FusedQKVLayout | None:
        """The row layout of the fused wqkv (kind ``"fused_wqkv"``), else None."""
        if self.kind != "fused_wqkv":
            return None
        return FusedQKVLayout(self.n_heads, self.n_kv_heads, self.qk_head_dim)

    def projection(self, relative_name: str) -> nn.Linear:
        return self.module.get_submodule(relative_name)

    @property
    def query_projection(self) -> nn.Linear:
        return self.projection(self.query_projection_name)

    @property
    def key_projection(self) -> nn.Linear:
        return self.projection(self.key_projection_name)

    @property
    def value_projection(self) -> nn.Linear:
        return self.projection(self.value_projection_name)

    def projection_names(self) -> list[str]:
        """The distinct projections holding q, k or v rows, in that order."""
        names = [self.query_projection_name, self.key_projection_name, self.value_projection_name]
        return list(dict.fromkeys(names))

    def weight_fqn(self, relative_name: str) -> str:
        """The FQN of a projection's weight in the model the layer was found in."""
        prefix = f"{self.path}." if self.path else ""
        return f"{prefix}{relative_name}.weight"


def is_attention_module(module: nn.Module) -> bool:
    return isinstance(getattr(module, "inner_attention", None), nn.Module)


def describe_attention(module: nn.Module, path: str = "") -> AttentionLayer:
    """The :class:`AttentionLayer` of one attention module; raises, naming it, if its layout is unknown
    or its projections do not have the rows its head counts say."""
    name = clean_fqn(path)
    label = name or type(module).__name__
    if hasattr(module, "wkv_b") and hasattr(module, "qk_nope_head_dim"):
        layer = _describe_mla(module, path, name)
    elif fused_qkv_layout(module) is not None:
        layer = _describe_grouped(module, path, name, "fused_wqkv", "qkv_linear.wqkv", "qkv_linear.wqkv", "qkv_linear.wqkv")
    else:
        owner = "qkv_linear." if isinstance(getattr(module, "qkv_linear", None), nn.Module) else ""
        names = [f"{owner}{p}" for p in ("wq", "wk", "wv")]
        if not all(_has_linear(module, n) for n in names) or not hasattr(module, "n_heads"):
            raise ValueError(
                f"attention {label!r} ({type(module).__name__}) is none of the layouts titan_muon reads: grouped-query "
                "or multi-head (wq, wk, wv, or torchtitan 0.3.0's qkv_linear), fused (qkv_linear.wqkv) or MLA (wkv_b)"
            )
        n_kv_heads = int(getattr(module, "n_kv_heads", None) or module.n_heads)
        kind = "mha" if n_kv_heads == int(module.n_heads) else "gqa"
        layer = _describe_grouped(module, path, name, kind, *names)
    _check_rows(layer)
    return layer


def _describe_mla(module: nn.Module, path: str, name: str) -> AttentionLayer:
    nope, rope = int(module.qk_nope_head_dim), int(module.qk_rope_head_dim)
    query = "wq_b" if getattr(module, "q_lora_rank", 0) else "wq"
    heads = int(module.n_heads)
    return AttentionLayer(
        path, name, module, "mla", heads, heads, nope + rope, int(module.v_head_dim), query, "wkv_b", "wkv_b",
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, has_qk_norm=False,
    )  # fmt: skip


def _describe_grouped(module: nn.Module, path: str, name: str, kind: str, query: str, key: str, value: str) -> AttentionLayer:
    heads = int(module.n_heads)
    n_kv_heads = int(getattr(module, "n_kv_heads", None) or heads)
    if n_kv_heads <= 0 or heads % n_kv_heads:
        raise ValueError(f"attention {name!r}: {heads} query heads are not a multiple of {n_kv_heads} key/value heads")
    head_dim = int(module.head_dim)
    qk_norm = getattr(module, "q_norm", None) is not None or getattr(module, "k_norm", None) is not None
    return AttentionLayer(path, name, module, kind, heads, n_kv_heads, head_dim, head_dim, query, key, value, has_qk_norm=qk_norm)


def _has_linear(module: nn.Module, relative_name: str) -> bool:
    try:
        return isinstance(module.get_submodule(relative_name), nn.Module)
    except AttributeError:
        return False


def _check_rows(layer: AttentionLayer) -> None:
    if layer.kind == "mla":
        expected = {
            layer.query_projection_name: layer.n_heads * layer.qk_head_dim,
            "wkv_b": layer.n_heads * (layer.qk_nope_head_dim + layer.v_head_dim),
        }
    elif layer.kind == "fused_wqkv":
        expected = {layer.query_projection_name: layer.fused_layout.rows}
    else:
        kv_rows = layer.n_kv_heads * layer.qk_head_dim
        expected = {layer.query_projection_name: layer.n_heads * layer.qk_head_dim, layer.key_projection_name: kv_rows}
        expected[layer.value_projection_name] = kv_rows
    for relative_name, rows in expected.items():
        held = layer.projection(relative_name).weight.shape[0]  # a DTensor's shape is the global one
        if held != rows:
            raise ValueError(
                f"attention {layer.name!r} ({layer.kind}): {relative_name} has {held} rows, expected {rows} "
                f"({layer.n_heads} query heads, {layer.n_kv_heads} key/value heads)"
            )


def find_attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """Every attention layer of ``model`` (modules with an ``inner_attention`` child), in model order.

    torchtitan keys ``model.layers`` by the global layer id, so a pipeline stage's names
    (``layers.7.attention``) are the whole model's. A model without attention gives [].
    """
    return [describe_attention(module, path) for path, module in model.named_modules() if is_attention_module(module)]


def query_projection(attention: nn.Module) -> nn.Linear:
    """The linear layer whose output rows are the query heads, and only them: ``wq`` (``wq_b`` with
    MLA's query LoRA; torchtitan 0.3.0: ``qkv_linear.wq``). The fused ``qkv_linear.wqkv`` has none:
    its query rows are interleaved with key and value rows."""
    layer = describe_attention(attention)
    if layer.kind == "fused_wqkv":
        raise ValueError(
            f"{type(attention).__name__} fuses q, k and v into qkv_linear.wqkv, whose query rows are interleaved "
            "with key and value rows per KV group: use titan_muon.attention.fused_qkv.fused_qkv_layout for their positions"
        )
    return layer.query_projection
