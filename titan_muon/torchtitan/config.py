"""The ``[optimizer]`` fields titan_muon adds to torchtitan's job config.

Load it with ``[job] custom_config_module = "titan_muon.torchtitan.config"``. torchtitan
merges this ``JobConfig`` into its own field by field, so these fields appear next to its
``name``, ``lr``, ``beta1``, ``beta2``, ``eps`` and ``weight_decay``. An unknown key in
the TOML file is rejected by torchtitan itself (naming the key); values are checked by
:func:`validate_optimizer_config`, because neither TOML parsing nor tyro checks them.
"""

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_type_hints

from titan_muon.demo import dct as demo_math
from titan_muon.demo import low_rank as demo_low_rank
from titan_muon.settings import ADAMW_IMPLEMENTATIONS

OPTIMIZER_NAMES = ("Muon", "AdamW", "Adam")


@dataclass
class Optimizer:
    """Muon's settings. ``lr`` and ``weight_decay`` are torchtitan's own fields."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    """Newton-Schulz iterations per update."""
    ns_coefficients: Literal["keller", "polar_express"] = "keller"
    """"keller" (quintic, as in the original Muon) or "polar_express"."""
    ns_algorithm: Literal["auto", "standard", "gram"] = "auto"
    """How NS evaluates its polynomial: "gram" iterates on the short side's Gram matrix (fewer
    FLOPs on rectangular matrices); "auto" uses it where it is faster and as accurate."""
    ns_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Newton-Schulz matmul precision: "auto" = on CUDA "bf16" for standard NS and "fp16" for
    Gram NS (tensor cores; Gram NS needs fp16's mantissa), "fp32" on CPU (exact; half-precision
    matmuls are slow there)."""
    comm_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """dtype of Muon's traffic between ranks: "auto" = fp32 with fp32 NS, else bf16 (bf16 traffic
    costs no accuracy that half-precision NS has not already given up; fp32 keeps W ranks
    bit-close to one process)."""
    momentum_dtype: Literal["fp32", "bf16", "fp8"] = "fp32"
    """How Muon momentum is stored: "bf16" halves it, "fp8" (row-scaled) quarters it."""
    adjust_lr_fn: Literal["original", "match_rms_adamw", "spectral_unclamped"] = "original"
    """"original": scale by sqrt(max(1, rows/cols)); "match_rms_adamw": 0.2*sqrt(max(rows, cols)),
    which lets Muon reuse an AdamW learning rate; "spectral_unclamped": sqrt(rows/cols), below 1
    for wide matrices (torchtitan 0.3.0 DistMuon's)."""
    exchange_memory_mb: float | None = None
    """Per-GPU MiB for the exchange buffers of the rounds in flight (pieces, whole matrices on
    their owners, Newton-Schulz workspace, return buffers); unset: 2048 (replayed as fast as 8192 on
    Llama-3 and Qwen3-30B-A3B at less memory; a model with a few matrices far costlier than the
    rest, as Kimi K2's dense first layer among its experts, gains ~4 % at 8192: docs/performance.md).
    A round always holds at least one matrix per owner."""
    rounds_in_flight: int = 2
    """Owner-balanced rounds whose outbound all-to-all runs ahead of the owners' Newton-Schulz."""
    bucket_size_mb: float | None = None
    """Deprecated: read as exchange_memory_mb (with a warning)."""
    buckets_in_flight: int | None = None
    """Deprecated: read as rounds_in_flight (with a warning)."""
    overlap: bool = False
    """Send each round's gradient rows to their owners during backward (FSDP2 hooks)."""
    split: Literal["none", "head", "fine"] = "none"
    """Muon Split: orthogonalize attention projections per head ("head"), or MLA heads further
    into nope | rope and k_nope | v ("fine", GLM-5); "none" orthogonalizes whole matrices."""
    qk_clip: bool = False
    """MuonClip: record each attention head's max pre-softmax logit and, after each step,
    rescale the query/key rows of heads above qk_clip_tau (see docs/muonclip.md)."""
    qk_clip_tau: float = 100.0
    qk_clip_alpha: float = 0.5
    """Share of the clip put on the query side (MHA; MLA's q_nope / k_nope)."""
    qk_clip_recording: Literal["auto", "kernel", "blocks"] = "auto"
    """Where the max logits come from: "kernel" has FlexAttention's kernel return each query's max
    score (CUDA), "blocks" recomputes QKᵀ in blocks of bounded memory, "auto" takes the kernel's
    where it can (FlexAttention on CUDA) and blocks elsewhere (docs/muonclip.md)."""
    nonfinite_grads: Literal["raise", "skip"] = "raise"
    """What to do with a NaN/inf gradient: "raise" on every rank, or "skip" the step."""
    commit: Literal["auto", "atomic", "streaming"] = "auto"
    """"streaming": each round's weights are written as its updates return, so no rank holds every
    update at once; with fp32 momentum on the shards (no overlap, no DeMo) and one model part per
    rank (pipeline stages included: their reservation rides the verdict over the pipeline) every
    buffer of the step is reserved before its first agreement, so running out of memory stops
    every rank before anything is written; another error after the first write leaves the
    weights partially updated and the optimizer refuses to step until a checkpoint is loaded.
    "atomic": nothing is written until every rank has succeeded (any error leaves weights and
    state unchanged), at the cost of holding every update. "auto": streaming where the step's
    memory is reserved, atomic elsewhere (docs/reliability.md)."""
    keep_reservation: Literal["auto", "on", "off"] = "auto"
    """Keep a streaming step's reserved memory from one step to the next instead of reserving it
    anew each step; "auto": on CPU only, where no caching allocator keeps freed memory and
    glibc would fault every page of it in again inside each step (docs/reliability.md)."""
    demo: bool = False
    """DeMo across replicas (docs/demo.md): each data_parallel_replicate replica keeps its own
    momentum and the replicas exchange only its top demo_topk DCT coefficients per demo_chunk ×
    demo_chunk chunk instead of all-reducing gradients. Needs data_parallel_replicate_degree >= 2
    and the other settings as they are (momentum, nesterov: those of the shared momentum, see
    demo_shared_momentum; momentum_dtype "fp32")."""
    demo_compressor: Literal["dct", "low_rank"] = "dct"
    """What the replicas exchange of each Muon matrix's momentum: "dct", the top demo_topk DCT
    coefficients of every demo_chunk × demo_chunk chunk (all-gathered); "low_rank", a rank-demo_rank
    projection on a warm-started basis shared by the replicas (PowerSGD-style, two all-reduces)."""
    demo_chunk: int = demo_math.DEFAULT_CHUNK
    demo_topk: int = demo_math.DEFAULT_TOPK
    demo_rank: int = demo_low_rank.DEFAULT_RANK
    """The low_rank compressor's rank k (min(k, rows, cols) per matrix)."""
    demo_adamw: Literal["sign", "dense"] = "sign"
    """How the AdamW gradients (embeddings, output head, norms) cross replicas with demo: "sign",
    each row's mean magnitude and one sign bit per element with error feedback (tensors of 2+
    dimensions; 1-D ones dense), about 1/32 of the bytes; "dense", an fp32 all-reduce."""
    demo_alpha: float = demo_math.DEFAULT_ALPHA
    """Share of what was sent that is subtracted from the replica's own buffer (error feedback);
    1 (the default): the buffer keeps only what was not sent."""
    demo_shared_momentum: bool = demo_math.DEFAULT_SHARED_MOMENTUM
    """Keep a momentum (coefficient momentum, Nesterov per nesterov) over the replicas' average,
    the same on every replica, and orthogonalize it instead of the fresh average (issue 27).
    false: DeMo as published, which needs nesterov = false."""
    hierarchical_exchange: Literal["auto", "on", "off"] = "auto"
    """Run Muon's all-to-alls within nodes, then across them along rails ((ranks per node - 1) +
    (nodes - 1) peers per rank instead of W - 1); "auto": for exchange groups of more than 256
    ranks on several nodes (docs/exchange.md, "W = 4096")."""
    ranks_per_node: int | None = None
    """Ranks of one node (consecutive global ranks); unset: torchrun's LOCAL_WORLD_SIZE."""

    adamw_lr: float | None = None
    """lr of the AdamW groups (embeddings, output head, norms); None = optimizer.lr."""
    adamw_weight_decay: float | None = None
    """None = optimizer.weight_decay. AdamW's betas and eps are optimizer.beta1/beta2/eps."""
    adamw_patterns: list[str] = field(default_factory=list)
    """Extra fnmatch patterns on parameter FQNs forced to AdamW, e.g. "layers.0.*"."""
    muon_patterns: list[str] = field(default_factory=list)
    """fnmatch patterns forced to Muon (2-D, or 3-D stacks of matrices); adamw_patterns win over these."""
    unclassified_params: Literal["raise", "adamw"] = "raise"
    """A parameter of 2+ dimensions that build_param_groups cannot place (not a linear weight, expert
    stack, embedding, head, router, norm, bias or convolution): "raise" names it and stops; "adamw"
    trains it with AdamW and logs a warning naming it."""


@dataclass
class JobConfig:
    optimizer: Optimizer = field(default_factory=Optimizer)


# tyro checks these choices on the command line; TOML values are checked here.
_CHOICES = {
    name: get_args(hint)
    for name, hint in get_type_hints(Optimizer).items()
    if getattr(hint, "__origin__", None) is Literal
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_optimizer_config(config: Any) -> None:
    """Raise ``ValueError`` naming the first bad ``[optimizer]`` key.

    ``config`` is torchtitan's (merged) optimizer section. Without our fields merged in
    (no custom_config_module), only ``name`` is checked.
    """

    def fail(key: str, expected: str) -> None:
        raise ValueError(f"[optimizer] {key} must be {expected}, got {getattr(config, key)!r}")

    if config.name not in OPTIMIZER_NAMES:
        fail("name", f"one of {OPTIMIZER_NAMES}")
    for key in ("lr", "eps", "weight_decay", "beta1", "beta2"):
        if not _is_number(getattr(config, key)) or getattr(config, key) < 0:
            fail(key, "a non-negative number")
    for key in ("beta1", "beta2"):
        if getattr(config, key) >= 1:
            fail(key, "in [0, 1)")
    if not hasattr(config, "momentum"):
        if config.name == "Muon":
            raise ValueError(
                '[optimizer] name = "Muon" needs titan_muon\'s config fields: set '
                '[job] custom_config_module = "titan_muon.torchtitan.config"'
            )
        return

    if not _is_number(config.momentum) or not 0 <= config.momentum < 1:
        fail("momentum", "in [0, 1)")
    if not _is_number(config.qk_clip_tau) or config.qk_clip_tau <= 0:
        fail("qk_clip_tau", "a positive number")
    if not _is_number(config.qk_clip_alpha) or not 0 <= config.qk_clip_alpha <= 1:
        fail("qk_clip_alpha", "in [0, 1]")
    for key in ("nesterov", "overlap", "qk_clip", "demo", "demo_shared_momentum"):
        if not isinstance(getattr(config, key), bool):
            fail(key, "true or false")
    if config.qk_clip and config.name != "Muon":
        raise ValueError(
            f'[optimizer] qk_clip = true needs name = "Muon", got name = {config.name!r}: MuonClip runs inside '
            'titan_muon\'s Muon optimizer container, so with another optimizer it would be silently ignored. '
            'Set qk_clip = false or name = "Muon".'
        )
    for key in ("ns_steps", "rounds_in_flight", "buckets_in_flight"):
        value = getattr(config, key)
        if key == "buckets_in_flight" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            fail(key, "a positive integer")
    # torchtitan's own `implementation` also picks the kernel of Muon's AdamW groups.
    for key, choices in (*_CHOICES.items(), ("implementation", ADAMW_IMPLEMENTATIONS)):
        if getattr(config, key) not in choices:
            fail(key, f"one of {choices}")
    if config.ranks_per_node is not None and (not isinstance(config.ranks_per_node, int) or isinstance(config.ranks_per_node, bool)
                                              or config.ranks_per_node < 1):  # fmt: skip
        fail("ranks_per_node", "a positive integer or unset")
    for key in ("exchange_memory_mb", "bucket_size_mb"):
        value = getattr(config, key)
        if value is not None and (not _is_number(value) or value <= 0):
            fail(key, "a positive number or unset")
    for old, new in (("bucket_size_mb", "exchange_memory_mb"), ("buckets_in_flight", "rounds_in_flight")):
        if getattr(config, old) is not None:
            warnings.warn(
                f"[optimizer] {old} is deprecated: use {new}. {old} = {getattr(config, old)} is read as {new} "
                f"= {getattr(config, old)}" + (" MiB per GPU (it was fp32 MiB of matrices shared by all ranks)." if old == "bucket_size_mb" else "."),
                DeprecationWarning,
                stacklevel=2,
            )
    for key in ("adamw_lr", "adamw_weight_decay"):
        value = getattr(config, key)
        if value is not None and (not _is_number(value) or value < 0):
            fail(key, "a non-negative number or unset")
    if config.demo:
        _validate_demo(config, fail)
    for key in ("adamw_patterns", "muon_patterns"):
        patterns = getattr(config, key)
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            fail(key, "a list of strings")


def _validate_demo(config: Any, fail) -> None:
    if config.name != "Muon":
        raise ValueError(f'[optimizer] demo = true needs name = "Muon", got name = {config.name!r}')
    try:
        demo_math.validate_settings(config.demo_chunk, config.demo_topk, config.demo_alpha)
        demo_low_rank.validate_rank(config.demo_rank)
    except ValueError as error:
        raise ValueError(f"[optimizer] {error}") from None
    if config.nesterov and not config.demo_shared_momentum:
        raise ValueError(
            "[optimizer] demo = true with demo_shared_momentum = false needs nesterov = false: without the shared "
            "momentum DeMo orthogonalizes the replicas' average as it is (set nesterov = false, or leave "
            "demo_shared_momentum = true: Nesterov then runs on the shared momentum)"
        )
    if config.overlap:
        raise ValueError("[optimizer] demo = true does not support overlap = true yet: set overlap = false")
    if config.momentum_dtype != "fp32":
        fail("momentum_dtype", '"fp32" with demo = true (the momentum is DeMo\'s error feedback)')
