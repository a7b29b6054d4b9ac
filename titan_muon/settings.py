"""Muon's settings: names, defaults and the checks that refuse bad ones before anything changes."""

from __future__ import annotations

import os
import warnings

import torch

from titan_muon.algorithm import newton_schulz
from titan_muon.algorithm.newton_schulz import NS_ALGORITHMS, NS_METHODS, NSPrecision, coefficient_schedule
from titan_muon.algorithm.update import ADJUST_LR_FNS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Newton–Schulz may also run in fp16 (it scales its input first); the wire may not: unscaled
# gradients and updates can leave fp16's range.
NS_DTYPES = {**DTYPES, "fp16": torch.float16}
NS_DTYPE_CHOICES = (*NS_DTYPES, "auto")
# The keys of a Muon param group (torch's loader adds others, which state_dict() must not grow).
GROUP_KEYS = ("params", "param_names", "lr", "weight_decay", "momentum", "nesterov", "ns_steps", "adjust_lr_fn",
              "ns_coefficients", "ns_algorithm", "ns_eps", "betas", "eps", "use_muon", "matrix_stacks")  # fmt: skip
DTYPE_CHOICES = (*DTYPES, "auto")
NONFINITE_POLICIES = ("raise", "skip")
ADAMW_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")  # the names of TorchTitan's optimizer.implementation
# Per-rank MiB for the exchange buffers of the rounds in flight (plan.py, exchange.py).
DEFAULT_EXCHANGE_MEMORY_MB = 2048.0
DEFAULT_NS_EPS = 1e-7  # torch.optim.Muon's
# What one element of a matrix costs its owner during a round, in bytes per byte of the wire
# dtype plus fixed fp32 parts: received pieces and the return buffer (2 × wire), the assembled
# fp32 matrix and its scaled fp32 result (8), Newton–Schulz input, iterate and polynomial in the
# NS dtype (3 × NS itemsize).
OWNER_FIXED_BYTES = 8.0


def on_accelerator(device: torch.device) -> bool:
    """Whether "auto" settings choose for an accelerator: on CUDA, and on ``meta``, where the
    meta-device suite and the step traces (scale_replay/step_trace.py) stand in for a GPU and must see
    what it runs; elsewhere (CPU) they choose for a CPU."""
    return newton_schulz.on_accelerator(device.type)


def compile_elementwise(setting: bool | None, device: torch.device) -> bool:
    """``compile_elementwise``: None compiles on accelerators only (update.py); True / False force it."""
    return on_accelerator(device) if setting is None else bool(setting)


def keeps_reservation(setting: bool | None, device: torch.device) -> bool:
    """``keep_reservation``: None keeps a streaming step's reservation between steps off
    accelerators only (reservation.py); True / False force it."""
    return not on_accelerator(device) if setting is None else setting


def optional_flag(value, key: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"titan_muon.Muon: {key} must be True, False or None, got {value!r}")
    return value


def resolve_dtype(name: str, key: str, device: torch.device) -> torch.dtype:
    if name not in DTYPE_CHOICES:
        raise ValueError(f"titan_muon.Muon: {key}={name!r} is not supported; expected one of {DTYPE_CHOICES}")
    if name == "auto":  # bf16 where tensor cores make it fast, fp32 (exact) elsewhere
        return torch.bfloat16 if on_accelerator(device) else torch.float32
    return DTYPES[name]


def resolve_ns_precision(name: str, device: torch.device) -> NSPrecision:
    """The NS compute dtypes of an ``ns_dtype`` setting. "auto": on CUDA, standard NS in bf16
    (tensor cores) and Gram NS in fp16 (bf16 is too coarse for it, docs/newton_schulz.md);
    elsewhere fp32 (exact; half-precision matmuls are slow on CPUs)."""
    if name not in NS_DTYPE_CHOICES:
        raise ValueError(f"titan_muon.Muon: ns_dtype={name!r} is not supported; expected one of {NS_DTYPE_CHOICES}")
    if name == "auto":
        return NSPrecision(torch.bfloat16, torch.float16) if on_accelerator(device) else NSPrecision(torch.float32, torch.float32)
    return NSPrecision(NS_DTYPES[name], NS_DTYPES[name])


def auto_comm_dtype(ns_precision: NSPrecision) -> torch.dtype:
    """comm_dtype="auto": fp32 with fp32 NS, else bf16 (fp16 NS included: the wire carries
    unscaled matrices, which need bf16's range)."""
    return torch.float32 if ns_precision.standard == torch.float32 else torch.bfloat16


def owner_bytes_per_element(comm_dtype: torch.dtype, ns_dtype: torch.dtype | NSPrecision) -> float:
    itemsize = max(d.itemsize for d in ns_dtype) if isinstance(ns_dtype, NSPrecision) else ns_dtype.itemsize
    return 2 * comm_dtype.itemsize + OWNER_FIXED_BYTES + 3 * itemsize


def exchange_memory(exchange_memory_mb: float | None, bucket_size_mb: float | None, rounds_in_flight: int | None,
                    buckets_in_flight: int | None) -> tuple[float, int]:  # fmt: skip
    """(exchange_memory_mb, rounds_in_flight) from the current and the deprecated names."""
    if bucket_size_mb is not None:
        if exchange_memory_mb is not None:
            raise ValueError("titan_muon.Muon: pass exchange_memory_mb, not also the deprecated bucket_size_mb")
        warnings.warn(
            "titan_muon.Muon: bucket_size_mb is deprecated (it was fp32 MiB of whole matrices shared by all ranks); "
            "use exchange_memory_mb, the per-rank MiB of the exchange buffers in flight. "
            f"bucket_size_mb={bucket_size_mb} is read as exchange_memory_mb={bucket_size_mb}.",
            DeprecationWarning,
            stacklevel=3,
        )
        exchange_memory_mb = bucket_size_mb
    if buckets_in_flight is not None:
        if rounds_in_flight is not None:
            raise ValueError("titan_muon.Muon: pass rounds_in_flight, not also the deprecated buckets_in_flight")
        warnings.warn(
            "titan_muon.Muon: buckets_in_flight is deprecated; use rounds_in_flight (same meaning for rounds).",
            DeprecationWarning,
            stacklevel=3,
        )
        rounds_in_flight = buckets_in_flight
    exchange_memory_mb = DEFAULT_EXCHANGE_MEMORY_MB if exchange_memory_mb is None else exchange_memory_mb
    rounds_in_flight = 2 if rounds_in_flight is None else rounds_in_flight
    if not exchange_memory_mb > 0:
        raise ValueError(f"titan_muon.Muon: exchange_memory_mb must be > 0 (or None for the default), got {exchange_memory_mb}")
    if not (isinstance(rounds_in_flight, int) and rounds_in_flight >= 1):
        raise ValueError(f"titan_muon.Muon: rounds_in_flight must be an integer >= 1, got {rounds_in_flight!r}")
    return float(exchange_memory_mb), rounds_in_flight


COMMIT_MODES = ("auto", "atomic", "streaming")


def commit_plan(commit: str, reservable: bool) -> tuple[bool, bool]:
    """(streams, reserves) for a ``commit`` setting: whether steps write each round as it returns,
    and whether they first reserve every buffer they use (exchange/reservation.py). A step can
    reserve when its momentum is fp32 on the shards (no overlap, no DeMo: nothing is decoded or
    staged as rounds go), on a rank with Muon matrices, stepping one model part (several parts per
    rank agree before the first writes, and a later part's reservation would come after that:
    verdict.decided_for_several_parts); a pipeline stage's reservation rides its verdict over the
    pipeline: `reservable`. "auto" streams exactly then."""
    streams = commit == "streaming" or (commit == "auto" and reservable)
    return streams, streams and reservable


def check_options(ns_dtype: str, comm_dtype: str, nonfinite_grads: str, adamw_implementation: str, commit: str = "auto") -> None:
    resolve_ns_precision(ns_dtype, torch.device("cpu"))
    if commit not in COMMIT_MODES:
        raise ValueError(f"titan_muon.Muon: commit={commit!r}; expected one of {COMMIT_MODES}")
    if comm_dtype not in DTYPE_CHOICES:
        resolve_dtype(comm_dtype, "comm_dtype", torch.device("cpu"))
    if nonfinite_grads not in NONFINITE_POLICIES:
        raise ValueError(f"titan_muon.Muon: nonfinite_grads={nonfinite_grads!r}; expected one of {NONFINITE_POLICIES}")
    if adamw_implementation not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(
            f"titan_muon.Muon: adamw_implementation={adamw_implementation!r}; expected one of {ADAMW_IMPLEMENTATIONS}"
        )


HIERARCHICAL_CHOICES = ("auto", True, False)


def check_hierarchy(hierarchical_exchange, ranks_per_node) -> None:
    if not any(hierarchical_exchange is c or (isinstance(c, str) and hierarchical_exchange == c) for c in HIERARCHICAL_CHOICES):
        raise ValueError(f"titan_muon.Muon: hierarchical_exchange={hierarchical_exchange!r}; expected 'auto', True or False")
    if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1):
        raise ValueError(f"titan_muon.Muon: ranks_per_node={ranks_per_node!r}; expected a positive integer or None")


def ranks_per_node(given: int | None, device: torch.device) -> int | None:
    """Ranks on one node: `given`, else torchrun's LOCAL_WORLD_SIZE, else the visible GPUs on
    CUDA; None (one node as far as Muon knows) otherwise."""
    if given is not None:
        return given
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) >= 1:
        return int(local)
    if device.type == "cuda":
        return torch.cuda.device_count()
    return None


def check_lr(group: dict, index: int) -> None:
    """A number or a one-element tensor (as torch.optim takes), checked without reading a value."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"titan_muon.Muon: param group {index}: lr must be a number or a one-element tensor, got a tensor of shape {tuple(lr.shape)}")
    if not isinstance(lr, (int, float, torch.Tensor)) or isinstance(lr, bool):
        raise ValueError(f"titan_muon.Muon: param group {index}: lr must be a number or a one-element tensor, got {lr!r}")


def _is_eps(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def newton_schulz_eps(eps: float | None, ns_eps: float | None) -> float:
    """Newton–Schulz's epsilon from the constructor's two names for it: ``eps`` (torch.optim.Muon's)
    and ``ns_eps``; 1e-7 (torch's default) when neither is given."""
    if eps is not None and ns_eps is not None and eps != ns_eps:
        raise ValueError(
            f"titan_muon.Muon: eps={eps!r} and ns_eps={ns_eps!r} disagree: both are Newton-Schulz's epsilon (eps is "
            "torch.optim.Muon's name for it); give one. AdamW groups' epsilon is adamw_eps."
        )
    value = DEFAULT_NS_EPS if eps is None and ns_eps is None else (ns_eps if ns_eps is not None else eps)
    if not _is_eps(value):
        raise ValueError(f"titan_muon.Muon: ns_eps must be a number >= 0 (eps, torch.optim.Muon's name for it), got {value!r}")
    return float(value)


def settle_eps(group: dict, index: int, given: dict, adamw_eps: float) -> None:
    """A group's epsilons as torch's names mean them. Muon group: 'eps' and 'ns_eps' both name
    Newton–Schulz's epsilon (torch.optim.Muon's group key is 'eps'), so either sets both, and
    different values are refused; AdamW group: 'eps' is AdamW's, ``adamw_eps`` unless given.
    `given` is the group as the caller passed it, before torch filled in the defaults."""
    if not group["use_muon"]:
        group["eps"] = given.get("eps", adamw_eps)
        return
    eps, ns_eps = given.get("eps"), given.get("ns_eps")
    if eps is not None and ns_eps is not None and eps != ns_eps:
        raise ValueError(
            f"titan_muon.Muon: param group {index}: 'eps'={eps!r} and 'ns_eps'={ns_eps!r} disagree: in a Muon group both "
            "are Newton-Schulz's epsilon ('eps' is torch.optim.Muon's name for it); give one"
        )
    group["ns_eps"] = ns_eps if ns_eps is not None else eps if eps is not None else group["ns_eps"]
    group["eps"] = group["ns_eps"]


def validate_group(group: dict, index: int) -> None:
    """Checks of a param group's settings (after :func:`settle_eps`)."""
    where = f"titan_muon.Muon: param group {index}"
    check_lr(group, index)
    if not float(group["lr"]) >= 0:
        raise ValueError(f"{where}: lr must be >= 0, got {group['lr']}")
    if not group["weight_decay"] >= 0:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {group['weight_decay']}")
    if group["use_muon"]:
        if not 0 <= group["momentum"] < 1:
            raise ValueError(f"{where}: momentum must be in [0, 1), got {group['momentum']}")
        if not (isinstance(group["ns_steps"], int) and 1 <= group["ns_steps"] < 100):
            raise ValueError(f"{where}: ns_steps must be an integer in [1, 100), got {group['ns_steps']!r}")
        if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"{where}: adjust_lr_fn={group['adjust_lr_fn']!r}; expected None or one of {ADJUST_LR_FNS}")
        coefficients = group["ns_coefficients"]
        if isinstance(coefficients, str):
            if coefficients not in NS_METHODS:
                raise ValueError(f"{where}: ns_coefficients={coefficients!r}; expected one of {NS_METHODS} or (a, b, c)")
        else:
            coefficient_schedule(coefficients, 1)
        if group["ns_algorithm"] not in NS_ALGORITHMS:
            raise ValueError(f"{where}: ns_algorithm={group['ns_algorithm']!r}; expected one of {NS_ALGORITHMS}")
        if not _is_eps(group["ns_eps"]):
            raise ValueError(f"{where}: ns_eps ('eps' in a Muon group) must be a number >= 0, got {group['ns_eps']!r}")
    else:
        beta1, beta2 = group["betas"]
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"{where}: betas must be in [0, 1), got {group['betas']}")
        if not group["eps"] > 0:
            raise ValueError(f"{where}: eps must be > 0, got {group['eps']}")


def check_muon_param(p: torch.Tensor, name: str, group: dict) -> None:
    if not p.dtype.is_floating_point:
        raise ValueError(f"titan_muon.Muon: parameter {name!r} has dtype {p.dtype}; floating-point parameters only")
    if p.ndim == 3 and not group.get("matrix_stacks", False):
        raise ValueError(
            f"titan_muon.Muon: parameter {name!r} has shape {tuple(p.shape)}: a 3-D parameter is orthogonalized as a "
            "stack of matrices (one per index of dim 0, as MoE experts are) only in a param group with "
            "matrix_stacks=True (titan_muon.build_param_groups sets it for experts). A convolution's "
            "(out, in, kernel) weight is not such a stack: put it in a group with use_muon=False."
        )
    if p.ndim not in (2, 3) or p.numel() == 0:
        raise ValueError(
            f"titan_muon.Muon: parameter {name!r} has shape {tuple(p.shape)}; Muon groups take non-empty "
            "2-D matrices (or 3-D stacks of matrices, e.g. MoE experts) only. Put it in a group with "
            "use_muon=False (titan_muon.build_param_groups does this for embeddings, the output head, "
            "norms and biases)."
        )


def check_added_group(param_groups: list[dict], given: dict, adamw_eps: float, name_of=None) -> None:
    """The checks of the group ``add_param_group`` just appended to `param_groups` (`given`: as
    the caller passed it): its epsilons, its settings and, once the optimizer is built (`name_of`
    given), its parameters, before the layout changes."""
    group, index = param_groups[-1], len(param_groups) - 1
    settle_eps(group, index, given, adamw_eps)
    validate_group(group, index)
    if name_of is not None:
        check_group_params(group, index, name_of)


def check_group_params(group: dict, index: int, name_of) -> None:
    """The checks planning makes of a group's parameters, for a group added after construction,
    before the layout changes; `name_of(group_index, index)` names a parameter."""
    for pi, p in enumerate(group["params"]):
        if group["use_muon"]:
            check_muon_param(p, name_of(index, pi), group)
        elif not p.dtype.is_floating_point:
            raise ValueError(f"titan_muon.Muon: parameter {name_of(index, pi)!r} has dtype {p.dtype}; floating-point parameters only")


def common_device(params: list[torch.Tensor]) -> torch.device:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"titan_muon.Muon: parameters live on several devices {sorted(map(str, devices))}; use one")
    return devices.pop() if devices else torch.device("cpu")


def check_step(param_groups: list[dict], name_of) -> None:
    """What may have changed since construction (an lr schedule, the gradients), checked before
    the step changes anything; `name_of(group_index, index)` names a parameter."""
    for gi, group in enumerate(param_groups):
        check_lr(group, gi)
        for pi, p in enumerate(group["params"]):
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"titan_muon.Muon: parameter {name_of(gi, pi)!r} has a sparse gradient; Muon and its AdamW groups take dense gradients")
