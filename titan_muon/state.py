"""Muon momentum storage: fp32, bf16 or fp8 state tensors that follow the parameter's rows.

Every state tensor of a parameter is created with the parameter's placement (``Shard(0)``
under FSDP2, rows split like ``torch.chunk``), so DCP can reshard a checkpoint along dim 0
to any world size. The optimizer works on an fp32 copy of the local rows each step::

    storage = momentum_storage("fp8")
    state.update(storage.create(param))     # once, on every rank
    m = storage.load(state)                 # fp32 local rows (for "fp32": the buffer itself)
    nesterov = momentum_step(grad, m, momentum, nesterov)
    storage.store(state, m, stream=index)   # every rank, every step, even with 0 local rows

fp8 keeps e4m3fn codes (stored as uint8) and one power-of-two scale per row and block of
``block_cols`` columns (stored as an int8 exponent). Neither the codes nor the scales ever
mix rows, so a row's state, and its stochastic-rounding noise, are the same whatever rank
holds it: the math never depends on the layout. See docs/fp8_momentum.md.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_muon.update import local_shard

MOMENTUM_DTYPES = ("fp32", "bf16", "fp8")
ROUNDINGS = ("nearest", "stochastic")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value: 1.75 * 2**8
NOISE_ELEMENTS = 2**16  # elements per random stream: a whole number of rows, fixed by the global shape


def momentum_storage(momentum_dtype: str = "fp32", *, rounding: str | None = None, block_cols: int = 256) -> MomentumStorage:
    """The storage for ``momentum_dtype`` ("fp32", "bf16" or "fp8").

    rounding: "nearest" or "stochastic"; default "nearest" for bf16 and "stochastic" for fp8
        (measured in docs/fp8_momentum.md). Meaningless for fp32.
    block_cols: fp8 only: columns that share one scale within a row (a row shorter than
        this has one scale).
    """
    if momentum_dtype not in MOMENTUM_DTYPES:
        raise ValueError(f"momentum_dtype={momentum_dtype!r} is not supported; expected one of {MOMENTUM_DTYPES}")
    if rounding is not None and rounding not in ROUNDINGS:
        raise ValueError(f"momentum rounding={rounding!r} is not supported; expected one of {ROUNDINGS}")
    if momentum_dtype == "fp32":
        if rounding not in (None, "nearest"):
            raise ValueError(f"momentum rounding={rounding!r} has no meaning for momentum_dtype='fp32'")
        return Fp32Storage()
    if momentum_dtype == "bf16":
        return Bf16Storage(rounding or "nearest")
    if not (isinstance(block_cols, int) and block_cols >= 1):
        raise ValueError(f"fp8 momentum block_cols must be a positive integer, got {block_cols!r}")
    return Fp8Storage(rounding or "stochastic", block_cols)


class MomentumStorage:
    """How one Muon parameter's momentum lives in ``optimizer.state[param]``.

    ``keys`` are the state keys :meth:`create` makes: fixed per storage, the same on every rank.
    """

    name: str
    keys: tuple[str, ...]

    def create(self, param: Tensor) -> dict[str, Tensor]:
        """Zero state for ``param`` (a 2-D tensor, or a DTensor with Shard(0)/Replicate placements)."""
        raise NotImplementedError

    def load(self, state: dict) -> Tensor:
        """The momentum of the local rows as an fp32 tensor (rows, cols) to update in place."""
        raise NotImplementedError

    def create_block(self, rows: int, cols: int, device: torch.device) -> dict[str, Tensor]:
        """Zero state for a plain (rows, cols) block of momentum, e.g. a whole matrix held by its owner."""
        return self.create(torch.empty(rows, cols, device=device))

    def store(self, state: dict, momentum: Tensor, stream: int = 0, first_row: int | None = None) -> None:
        """Write the fp32 local rows back, rounding to the stored dtype.

        ``stream`` tells parameters apart for stochastic rounding: pass the parameter's index
        in the optimizer (the same on every rank and after a resume).
        """
        raise NotImplementedError

    def bytes_per_element(self, rows: int, cols: int) -> float:
        """Optimizer-state bytes per parameter element of a (rows, cols) matrix."""
        raise NotImplementedError


class Fp32Storage(MomentumStorage):
    name, keys = "fp32", ("momentum_buffer",)

    def create(self, param):
        _check_param(param)
        return {"momentum_buffer": _like_rows(param, param.shape[1], torch.float32)}

    def load(self, state):
        buf = local_shard(_heal(state, "momentum_buffer", torch.float32))
        return buf  # the buffer itself: updating it in place is the store

    def store(self, state, momentum, stream=0, first_row=None):
        buf = local_shard(_heal(state, "momentum_buffer", torch.float32))
        _check_shape(momentum, buf)
        if momentum is not buf:
            buf.copy_(momentum)

    def bytes_per_element(self, rows, cols):
        return 4.0


class Bf16Storage(MomentumStorage):
    name = "bf16"

    def __init__(self, rounding: str):
        self.rounding = rounding
        self.keys = ("momentum_buffer", "step") if rounding == "stochastic" else ("momentum_buffer",)

    def create(self, param):
        _check_param(param)
        state = {"momentum_buffer": _like_rows(param, param.shape[1], torch.bfloat16)}
        if self.rounding == "stochastic":
            state["step"] = torch.zeros((), dtype=torch.int64)
        return state

    def load(self, state):
        return local_shard(_heal(state, "momentum_buffer", torch.bfloat16)).float()

    def store(self, state, momentum, stream=0, first_row=None):
        buf = _heal(state, "momentum_buffer", torch.bfloat16)
        _check_shape(momentum, local_shard(buf))
        if self.rounding == "nearest":
            local_shard(buf).copy_(momentum)
            return
        state["step"] += 1
        noise = _noise(int(state["step"]), stream, buf, 16, first_row)
        local_shard(buf).copy_(_round_bits_(momentum.clone(), noise, 16))

    def bytes_per_element(self, rows, cols):
        return 2.0 + (8.0 / (rows * cols) if self.rounding == "stochastic" else 0.0)


class Fp8Storage(MomentumStorage):
    """e4m3fn codes (uint8) and a power-of-two scale per (row, block of ``block_cols`` columns).

    Scales are powers of two (int8 exponents, 1 byte per block): fp8 is a floating-point
    format, so a power-of-two scale loses no relative precision, only shifts the window, and
    scaling by it is exact. Codes are kept as uint8 and exponents as int8 so that
    ``Optimizer.load_state_dict``, which casts floating-point state to the parameter's dtype,
    leaves them alone, and so that gloo can carry them.
    """

    name = "fp8"
    keys = ("momentum_fp8", "momentum_exp", "step")

    def __init__(self, rounding: str, block_cols: int):
        self.rounding = rounding
        self.block_cols = block_cols

    def _blocks(self, cols: int) -> int:
        return -(-cols // self.block_cols)

    def create(self, param):
        _check_param(param)
        cols = param.shape[1]
        return {
            "momentum_fp8": _like_rows(param, cols, torch.uint8),
            "momentum_exp": _like_rows(param, self._blocks(cols), torch.int8),
            "step": torch.zeros((), dtype=torch.int64),
        }

    def load(self, state):
        codes, exps = local_shard(_heal(state, "momentum_fp8", torch.uint8)), local_shard(_heal(state, "momentum_exp", torch.int8))
        m = codes.view(FP8).float()
        for block, e in zip(_column_blocks(m, self.block_cols), exps.unbind(1)):
            block.mul_(_pow2(e).unsqueeze(-1))
        return m

    def store(self, state, momentum, stream=0, first_row=None):
        codes, exps_state = _heal(state, "momentum_fp8", torch.uint8), _heal(state, "momentum_exp", torch.int8)
        _check_shape(momentum, local_shard(codes))
        state["step"] += 1
        blocks = _column_blocks(momentum, self.block_cols)
        amax = torch.stack([b.abs().amax(dim=-1) for b in blocks], dim=1) if blocks else momentum.new_empty(momentum.shape[0], 0)
        exps = _scale_exponent(amax)
        scaled = torch.empty_like(momentum)
        for src, dst, e in zip(blocks, _column_blocks(scaled, self.block_cols), exps.unbind(1)):
            torch.mul(src, _pow2(-e).unsqueeze(-1), out=dst)
        if self.rounding == "stochastic":
            # fp32 has 23 mantissa bits, e4m3 has 3: round the 20 dropped bits stochastically;
            # the result is then exact in e4m3 (except for its subnormals, which round to nearest).
            _round_bits_(scaled, _noise(int(state["step"]), stream, codes, 20, first_row), 20)
        local_shard(codes).copy_(scaled.to(FP8).view(torch.uint8))
        local_shard(exps_state).copy_(exps)

    def bytes_per_element(self, rows, cols):
        return 1.0 + self._blocks(cols) / cols + 8.0 / (rows * cols)


# ----------------------------------------------------------------------------- helpers


def _check_param(param: Tensor) -> None:
    if param.ndim != 2:
        raise ValueError(f"momentum storage takes 2-D (Muon) parameters, got shape {tuple(param.shape)}")
    if isinstance(param, DTensor):
        _shard_dim(param)


def _check_shape(momentum: Tensor, local: Tensor) -> None:
    if momentum.shape != local.shape or momentum.dtype != torch.float32:
        raise ValueError(
            f"momentum to store has shape {tuple(momentum.shape)} and dtype {momentum.dtype}; "
            f"expected the local rows {tuple(local.shape)} in torch.float32"
        )


def _shard_dim(t: DTensor) -> int | None:
    """The mesh dimension over which t's rows are split (None if replicated everywhere)."""
    sharded = [d for d, p in enumerate(t.placements) if not isinstance(p, Replicate)]
    if len(sharded) > 1 or (sharded and t.placements[sharded[0]] != Shard(0)):
        raise ValueError(
            f"momentum storage supports Shard(0) on one mesh dimension with Replicate elsewhere; "
            f"got placements {t.placements}"
        )
    return sharded[0] if sharded else None


def _like_rows(param: Tensor, cols: int, dtype: torch.dtype) -> Tensor:
    """Zeros with param's rows (and row split) and `cols` columns."""
    local = torch.zeros(local_shard(param).shape[0], cols, dtype=dtype, device=param.device)
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=(param.shape[0], cols), stride=(cols, 1)
    )


def _row_offset(t: Tensor) -> int:
    """Global index of the first local row (torch.chunk split, like FSDP2)."""
    if not isinstance(t, DTensor):
        return 0
    dim = _shard_dim(t)
    if dim is None:
        return 0
    chunk = -(-t.shape[0] // t.device_mesh.size(dim))
    return min(t.device_mesh.get_local_rank(dim) * chunk, t.shape[0])


def _heal(state: dict, key: str, dtype: torch.dtype) -> Tensor:
    """Undo Optimizer.load_state_dict's cast of state to the param's dtype.

    It casts every state tensor except "step" to a floating-point param's dtype. Our uint8
    codes, int8 exponents and bf16 values all survive fp32, bf16 or fp16 exactly, so casting
    back restores them bit for bit (an fp32 buffer under a bf16 param is the one lossy case).
    """
    if state[key].dtype != dtype:
        state[key] = state[key].to(dtype)
    return state[key]


def _column_blocks(x: Tensor, block_cols: int) -> list[Tensor]:
    """Views (rows, block) of x's column blocks, the last one possibly narrower."""
    return list(x.split(block_cols, dim=1))


def _pow2(e: Tensor) -> Tensor:
    """2**e as float32, built from the exponent bits (exact; e in [-126, 127])."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _scale_exponent(amax: Tensor) -> Tensor:
    """Smallest-loss e with amax / 2**e <= 448: the block maximum lands in (224, 448]."""
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    headroom = torch.where(mantissa <= FP8_MAX / 512, 9, 8)  # mantissa * 2**9 <= 448 iff mantissa <= 0.875
    return (exponent - headroom).clamp_(-126, 127).to(torch.int8)


def _round_bits_(x: Tensor, noise: Tensor, bits: int) -> Tensor:
    """In place: stochastically round away the low `bits` mantissa bits of fp32 x (noise: int32 in [0, 2**bits)).

    Adding uniform noise to the magnitude bits and truncating rounds up with probability
    equal to the dropped fraction; a carry into the exponent is the correct next binade.
    """
    x.view(torch.int32).add_(noise).bitwise_and_(-(1 << bits))
    return x


def _noise(step: int, stream: int, like: Tensor, bits: int, first_row: int | None = None) -> Tensor:
    """Uniform int32 noise in [0, 2**bits) for the local rows of `like`, a function of global rows only.

    Global rows are grouped NOISE_ELEMENTS at a time (the group size depends only on the
    column count); each group has its own generator seeded from (step, stream, group). A shard
    draws the groups its rows touch and keeps its rows, so any row split sees the same noise.
    """
    rows, cols = local_shard(like).shape
    global_rows = like.shape[0]
    out = torch.empty(rows, cols, dtype=torch.int32)
    if rows == 0:
        return out.to(like.device)
    first = _row_offset(like) if first_row is None else first_row
    per_group = max(1, NOISE_ELEMENTS // cols)
    generator = torch.Generator()
    for group in range(first // per_group, (first + rows - 1) // per_group + 1):
        generator.manual_seed(_mix(step, stream, group))
        g0 = group * per_group
        size = (min(per_group, global_rows - g0), cols)
        noise = torch.randint(0, 1 << bits, size, dtype=torch.int32, generator=generator)
        lo, hi = max(g0, first), min(g0 + per_group, first + rows)
        out[lo - first : hi - first] = noise[lo - g0 : hi - g0]
    return out.to(like.device)


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 finalizer, chained)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h >> 1
