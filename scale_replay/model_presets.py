"""Muon parameter shapes and torchtitan layouts of the models the scale tools talk about.

Llama-3 8B / 70B / 405B, DeepSeek-V3 671B and Kimi-K2 1T, as ``build_param_groups`` sees them in
torchtitan 0.2.2 (``torchtitan_muon_params`` builds the real models on ``meta`` to check), and the
ways torchtitan lays them out on W ranks (FSDP, HSDP, FSDP + EP). Pure data and layout geometry:
used by ``scripts/simulate_scale.py`` and by the plan's balance tests (``tests/test_plan.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from titan_muon.algorithm.newton_schulz import newton_schulz_flops
from titan_muon.attention.split import row_block_ranges
from titan_muon.base.layout import RankGrid, Sharding, sharding_of
from titan_muon.exchange.plan import Unit

NS_STEPS = 5
GPUS_PER_NODE = 8
MUON_PATTERNS = ("*.moe.experts.*",)  # routed experts: (experts, out, in), one Muon matrix per expert
ADAMW_PATTERNS = ("*.moe.router.*",)  # the router gate is 2-D but a classifier: AdamW


# ------------------------------------------------------------------ model presets


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per preset
class Model:
    """The Muon parameters of a model, in ``named_parameters()`` order, and its attention head blocks."""

    name: str
    params: tuple[tuple[str, tuple[int, ...]], ...]
    head_rows: dict[str, int] = field(default_factory=dict)  # Split: FQN -> rows per head block
    dim: int = 0  # hidden size and vocabulary: the AdamW parameters beside the matrices
    vocab: int = 0

    @property
    def matrices(self) -> int:
        return sum(shape[0] if len(shape) == 3 else 1 for _, shape in self.params)

    @property
    def elements(self) -> int:
        return sum(math.prod(shape) for _, shape in self.params)


def llama3(name: str, dim: int, layers: int, heads: int, kv_heads: int, ffn: int) -> Model:
    """torchtitan llama3: wq, wk, wv, wo, w1, w2, w3 per layer (ffn from multiple_of / ffn_dim_multiplier)."""
    head_dim = dim // heads
    params, head_rows = [], {}
    for i in range(layers):
        p = f"layers.{i}."
        attention = {"wq": (heads * head_dim, dim), "wk": (kv_heads * head_dim, dim), "wv": (kv_heads * head_dim, dim)}
        for key, shape in attention.items():
            params.append((f"{p}attention.{key}.weight", shape))
            head_rows[f"{p}attention.{key}.weight"] = head_dim
        params.append((f"{p}attention.wo.weight", (dim, heads * head_dim)))
        params += [(f"{p}feed_forward.w1.weight", (ffn, dim)), (f"{p}feed_forward.w2.weight", (dim, ffn))]
        params.append((f"{p}feed_forward.w3.weight", (ffn, dim)))
    return Model(name, tuple(params), head_rows, dim=dim, vocab=128256)


def qwen3_moe() -> Model:
    """Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, hidden 2048, 32 query and 4 KV heads
    of 128, 128 routed experts of 768 in every layer, no shared expert; laid out as torchtitan's MoE."""
    dim, heads, kv_heads, head_dim, experts, inter = 2048, 32, 4, 128, 128, 768
    params, head_rows = [], {}
    for i in range(48):
        p = f"layers.{i}."
        for key, rows in (("wq", heads * head_dim), ("wk", kv_heads * head_dim), ("wv", kv_heads * head_dim)):
            params.append((f"{p}attention.{key}.weight", (rows, dim)))
            head_rows[f"{p}attention.{key}.weight"] = head_dim
        params.append((f"{p}attention.wo.weight", (dim, heads * head_dim)))
        params += [(f"{p}moe.experts.w1", (experts, inter, dim)), (f"{p}moe.experts.w2", (experts, dim, inter))]
        params.append((f"{p}moe.experts.w3", (experts, inter, dim)))
    return Model("Qwen3-30B-A3B", tuple(params), head_rows, dim=dim, vocab=151936)


def deepseek_v3(
    name: str, *, dim: int, inter: int, moe_inter: int, layers: int, dense_layers: int, heads: int,
    experts: int, shared: int, q_lora: int, kv_lora: int, nope: int, rope: int, v: int,
) -> Model:  # fmt: skip
    """torchtitan deepseek_v3: MLA (wq_a, wq_b, wkv_a, wkv_b, wo), then a dense MLP or routed
    experts (3-D) and a shared-expert MLP; the router gate goes to AdamW."""
    params, head_rows = [], {}
    for i in range(layers):
        p = f"layers.{i}."
        params += [(f"{p}attention.wq_a.weight", (q_lora, dim)), (f"{p}attention.wq_b.weight", (heads * (nope + rope), q_lora))]
        params += [(f"{p}attention.wkv_a.weight", (kv_lora + rope, dim)), (f"{p}attention.wkv_b.weight", (heads * (nope + v), kv_lora))]
        params.append((f"{p}attention.wo.weight", (dim, heads * v)))
        head_rows[f"{p}attention.wq_b.weight"] = nope + rope
        head_rows[f"{p}attention.wkv_b.weight"] = nope + v
        if i < dense_layers:
            mlp, hidden = f"{p}feed_forward.", inter
        else:
            params += [(f"{p}moe.experts.w1", (experts, moe_inter, dim)), (f"{p}moe.experts.w2", (experts, dim, moe_inter))]
            params.append((f"{p}moe.experts.w3", (experts, moe_inter, dim)))
            mlp, hidden = f"{p}moe.shared_experts.", shared * moe_inter
        params += [(f"{mlp}w1.weight", (hidden, dim)), (f"{mlp}w2.weight", (dim, hidden)), (f"{mlp}w3.weight", (hidden, dim))]
    return Model(name, tuple(params), head_rows, dim=dim, vocab=163840 if experts == 384 else 129280)


def _presets() -> dict[str, Model]:
    mla = {"dim": 7168, "inter": 18432, "moe_inter": 2048, "layers": 61, "shared": 1, "q_lora": 1536, "kv_lora": 512, "nope": 128, "rope": 64, "v": 128}
    return {
        # torchtitan 0.2.2 llama3_args (ffn: 14336 / 28672 / 53248 from multiple_of and ffn_dim_multiplier)
        "Llama-3 8B": llama3("Llama-3 8B", 4096, 32, 32, 8, 14336),
        "Llama-3 70B": llama3("Llama-3 70B", 8192, 80, 64, 8, 28672),
        "Llama-3 405B": llama3("Llama-3 405B", 16384, 126, 128, 8, 53248),
        # torchtitan 0.2.2 deepseekv3_args["671B"]
        "DeepSeek-V3 671B": deepseek_v3("DeepSeek-V3 671B", dense_layers=3, heads=128, experts=256, **mla),
        # moonshotai/Kimi-K2 config.json: DeepSeek-V3 with 384 experts, 64 heads, first_k_dense_replace = 1
        "Kimi-K2 1T": deepseek_v3("Kimi-K2 1T", dense_layers=1, heads=64, experts=384, **mla),
    }


PRESETS = _presets()


def torchtitan_muon_params(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """The Muon parameters build_param_groups picks from torchtitan 0.2.2's model, built on meta."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args
    from torchtitan.models.llama3 import Transformer, llama3_args
    from torchtitan.models.moe import MoEArgs

    from titan_muon import build_param_groups

    if name.startswith("Llama-3"):
        model_cls, args = Transformer, llama3_args[name.split()[-1]]
    else:
        model_cls, args = DeepSeekV3Model, dataclasses.replace(deepseekv3_args["671B"])
        if name.startswith("Kimi"):
            moe = MoEArgs(num_experts=384, num_shared_experts=1, top_k=8, score_func="sigmoid", route_norm=True)
            args = dataclasses.replace(args, n_heads=64, n_dense_layers=1, vocab_size=163840, moe_args=moe)
        args.moe_impl = "standard"  # set by update_from_config in a real run
    with torch.device("meta"):
        model = model_cls(args)
    groups = build_param_groups(model, adamw_patterns=ADAMW_PATTERNS, muon_patterns=MUON_PATTERNS)
    muon = next(g for g in groups if g["use_muon"])
    return [(n, tuple(p.shape)) for n, p in zip(muon["param_names"], muon["params"])]


# ------------------------------------------------------------------ layouts and units


@dataclass(frozen=True)
class Layout:
    """How torchtitan 0.2.2 lays the Muon parameters out on W ranks.

    FSDP: every parameter ``Shard(0)`` over all W ranks — routed experts too: without EP
    torchtitan shards the experts with their transformer block, on the expert dimension.
    HSDP (``shard_group``): replicas of a ``shard_group``-rank FSDP group. Muon plans over the
    ranks that shard a parameter, so each shard group runs the whole plan and the W /
    shard_group replicas repeat the same Newton–Schulz work.
    EP (``expert_parallel``): dense parameters as FSDP; routed experts ``Shard(0)`` over the
    ``ep`` mesh dimension and FSDP'd over ``efsdp`` = W / ep — FSDP2's strided ``Shard(0)``, or
    ``Shard(1)`` (rows) once efsdp · ep > experts, as torchtitan's parallelize chooses.
    """

    shard_group: int | None = None
    expert_parallel: int | None = None

    @property
    def name(self) -> str:
        if self.shard_group is not None:
            return f"HSDP {self.shard_group}"
        return "FSDP" if self.expert_parallel is None else f"FSDP+EP {self.expert_parallel}"

    def group_size(self, world: int) -> int:
        return world if self.shard_group is None else self.shard_group

    def shardings(self, model: Model, world: int) -> list[Sharding]:
        group = self.group_size(world)
        if self.shard_group is None:
            dense = ((group,), [Shard(0)], RankGrid([(g,) for g in range(group)]))
        else:
            grid = RankGrid([(0, g) for g in range(group)])  # shard group 0; the others are alike
            dense = ((world // group, group), [Replicate(), Shard(0)], grid)
        by_shape: dict[tuple[int, ...], Sharding] = {}  # shared objects make holder lookups cacheable
        for _, shape in model.params:
            if shape not in by_shape:
                mesh, placements, grid = self._experts(shape, world) if len(shape) == 3 and self.expert_parallel else dense
                by_shape[shape] = sharding_of(shape, placements, mesh, grid)
        return [by_shape[shape] for _, shape in model.params]

    def _experts(self, shape: tuple[int, ...], world: int):
        ep = self.expert_parallel
        efsdp = world // ep
        grid = RankGrid([(g // ep, g % ep) for g in range(world)])  # sparse mesh (efsdp, ep), ep innermost
        if efsdp * ep > shape[0]:
            return (efsdp, ep), [Shard(1), Shard(0)], grid
        return (efsdp, ep), [_StridedShard(0, split_factor=ep), Shard(0)], grid


@dataclass
class LaidOut:
    """A model's shardings on one layout, and the holders of its units found so far (shared by
    the schemes simulated on that layout)."""

    shardings: tuple[Sharding, ...]
    holders: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=2)
def laid_out(model: Model, world: int, layout: Layout) -> LaidOut:
    return LaidOut(tuple(layout.shardings(model, world)))


def units_of(model: Model, split_heads: bool = False) -> list[Unit]:
    """The optimizer's units: parameters in reverse order (backward's), one per matrix, or one
    per attention head block with Split."""
    units = []
    for index in reversed(range(len(model.params))):
        name, shape = model.params[index]
        matrices, rows, cols = (1, *shape) if len(shape) == 2 else shape
        block = model.head_rows.get(name, rows) if split_heads else rows
        for m in range(matrices):
            units += [Unit(index, m, start, end, cols) for start, end in row_block_ranges(rows, block, name)]
    return units


def ns_flops(unit: Unit) -> int:
    return newton_schulz_flops(unit.rows, unit.cols, NS_STEPS)


def node_of(group_rank: int) -> int:
    """Node of a group rank: FSDP ranks, and the ranks of HSDP shard group 0, are consecutive
    global ranks (torchtitan's mesh puts dp_shard innermost), 8 GPUs per node."""
    return group_rank // GPUS_PER_NODE
