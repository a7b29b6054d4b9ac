"""Muon momentum storage: fp32, bf16 or fp8 state tensors that follow the parameter's rows.

Every state tensor of a parameter is created with the parameter's placement (``Shard(0)``
under FSDP2, rows split like ``torch.chunk``), so DCP can reshard a checkpoint along dim 0
to any world size. The optimizer works on an fp32 copy of the local rows each step::

    storage = momentum_storage("fp8")
    state.update(storage.create(param))     # once, on every rank
    m = storage.load(state)                 # fp32 local rows (for "fp32": the buffer itself)
    nesterov = momentum_step(grad, m, momentum, nesterov)
    storage.store(state, m, stream=index)   # every rank, every step, even with 0 local rows

Momentum held whole (or as a block of rows) by one rank as plain tensors uses
``storage.create_block(rows, cols, device)`` and ``store(..., first_row=...)``.

fp8 keeps e4m3fn codes (stored as uint8) and one power-of-two scale per row and block of
``block_cols`` columns (stored as an int8 exponent). Neither the codes nor the scales ever
mix rows, and the stochastic-rounding noise of an element is a hash of (step, stream, global
row, column), so a row's state is the same whatever rank holds it: the math never depends
on the layout. Everything is tensor ops on the momentum's device, a fixed number per call,
with no host reads. See docs/fp8_momentum.md.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from titan_muon.base.dtensor import local_shard
from titan_muon.base.layout import Box, local_block

MOMENTUM_DTYPES = ("fp32", "bf16", "fp8")
ROUNDINGS = ("nearest", "stochastic")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value: 1.75 * 2**8
NONFINITE_EXP = 127  # scale exponent marking a block that held Inf/NaN (finite blocks use <= 120)


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
        """Zero state for ``param``: a 2-D matrix or a 3-D stack of matrices (MoE experts), plain
        or a DTensor whose placements give each rank one block (FSDP, TP, EP; see layout.py)."""
        _check_param(param)
        return self._zeros(param.shape[-1], lambda cols, dtype: _like_param(param, cols, dtype, self.state_columns))

    def create_block(self, rows: int, cols: int, device: torch.device | str) -> dict[str, Tensor]:
        """Zero state of plain tensors for a (rows, cols) block of rows held by one rank.

        Store into it with ``first_row`` = the block's first global row: it then rounds
        exactly like the same rows held anywhere else.
        """
        if not all(isinstance(n, int) and n >= 0 for n in (rows, cols)):
            raise ValueError(f"momentum block shape must be two non-negative ints, got ({rows!r}, {cols!r})")
        return self._zeros(cols, lambda c, dtype: torch.zeros(rows, c, dtype=dtype, device=device))

    @property
    def tensor_keys(self) -> tuple[str, ...]:
        """The keys laid out like the parameter; the others are per-parameter 0-dim counters."""
        return tuple(k for k, v in self.create_block(1, 1, "meta").items() if v.ndim > 0)

    def placeholders(self, device: torch.device | str) -> dict[str, Tensor]:
        """The state of a parameter whose momentum its owner holds (overlap): the counters as
        :meth:`create` makes them and a 0-dim stand-in on `device` for each tensor, so that
        every key stays in ``optimizer.state``, where torch's DCP loader looks for them."""
        tensors = self.tensor_keys
        zeros = self.create_block(0, 0, device)
        return {k: torch.zeros((), dtype=torch.int64, device=device) if k in tensors else v for k, v in zeros.items()}

    def load(self, state: dict) -> Tensor:
        """The momentum of the local rows as an fp32 tensor (rows, cols) to update in place."""
        raise NotImplementedError

    def store(self, state: dict, momentum: Tensor, stream: int = 0, *, first_row: int | None = None) -> None:
        """Write the fp32 local rows back, rounding to the stored dtype.

        ``stream`` tells parameters apart for stochastic rounding: pass the parameter's index
        in the optimizer (the same on every rank and after a resume). ``first_row`` is the
        global index of the first local row: None derives it from a DTensor state (0 for plain
        tensors); pass it for a plain block that holds rows [first_row, first_row + rows).
        """
        raise NotImplementedError

    def bytes_per_element(self, rows: int, cols: int) -> float:
        """Optimizer-state bytes per parameter element of a (rows, cols) matrix."""
        raise NotImplementedError

    def _zeros(self, cols: int, zeros_with_rows) -> dict[str, Tensor]:
        """The state dict; ``zeros_with_rows(cols, dtype)`` makes a zero tensor with the rows."""
        raise NotImplementedError

    def state_columns(self, width: int, cols: int, col_range: tuple[int, int]) -> tuple[int, int]:
        """Columns [start, stop) of a state tensor `width` wide that a rank holds when its
        parameter block spans columns `col_range` of `cols`: the parameter's own by default."""
        if width != cols:
            raise ValueError(f"state of width {width} for a parameter of {cols} columns")
        return col_range


class Fp32Storage(MomentumStorage):
    name, keys = "fp32", ("momentum_buffer",)

    def _zeros(self, cols, zeros_with_rows):
        return {"momentum_buffer": zeros_with_rows(cols, torch.float32)}

    def load(self, state):
        buf = local_shard(_heal(state, "momentum_buffer", torch.float32))
        return buf  # the buffer itself: updating it in place is the store

    def store(self, state, momentum, stream=0, *, first_row=None):
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

    def _zeros(self, cols, zeros_with_rows):
        state = {"momentum_buffer": zeros_with_rows(cols, torch.bfloat16)}
        if self.rounding == "stochastic":
            state["step"] = _new_step()
        return state

    def load(self, state):
        return local_shard(_heal(state, "momentum_buffer", torch.bfloat16)).float()

    def store(self, state, momentum, stream=0, *, first_row=None):
        buf = _heal(state, "momentum_buffer", torch.bfloat16)
        _check_shape(momentum, local_shard(buf))
        if self.rounding == "nearest":
            local_shard(buf).copy_(momentum)
            return
        rows, cols = _global_ids(buf, first_row)
        state["step"] += 1
        flat = momentum.reshape(-1, momentum.shape[-1])
        noise = rounding_noise_at(state["step"], stream, rows, cols, 16)
        # low 16 bits cleared: the copy to bf16 is exact
        local_shard(buf).copy_(stochastic_round_(noise, flat, 16).view(torch.float32).view(momentum.shape))

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

    def _zeros(self, cols, zeros_with_rows):
        return {
            "momentum_fp8": zeros_with_rows(cols, torch.uint8),
            "momentum_exp": zeros_with_rows(self._blocks(cols), torch.int8),
            "step": _new_step(),
        }

    def state_columns(self, width, cols, col_range):
        if width == cols:
            return col_range
        start, stop = col_range  # exponents: one per block of block_cols columns of the whole matrix
        if start % self.block_cols or (stop % self.block_cols and stop != cols):
            raise ValueError(
                f"fp8 momentum: a rank holds columns [{start}, {stop}) of {cols}, which cut its {self.block_cols}-column "
                "scale blocks; with column (tensor-parallel row-wise) sharding every shard must start and end on a "
                "block boundary — use momentum_dtype 'bf16' or 'fp32' for this model"
            )
        return start // self.block_cols, -(-stop // self.block_cols)

    def load(self, state):
        codes = local_shard(_heal(state, "momentum_fp8", torch.uint8))
        exps = local_shard(_heal(state, "momentum_exp", torch.int8))
        flat = decode_fp8(codes.reshape(-1, codes.shape[-1]), exps.reshape(-1, exps.shape[-1]), self.block_cols)
        return flat.view(codes.shape)

    def store(self, state, momentum, stream=0, *, first_row=None):
        codes, exps_state = _heal(state, "momentum_fp8", torch.uint8), _heal(state, "momentum_exp", torch.int8)
        _check_shape(momentum, local_shard(codes))
        rows, cols = _global_ids(codes, first_row)
        state["step"] += 1
        momentum = momentum.reshape(-1, momentum.shape[-1])
        exps = scale_exponents(momentum, self.block_cols)
        inverse_scales = [s.unsqueeze(-1) for s in _split_like(pow2(-exps), momentum, self.block_cols)]
        if self.rounding == "stochastic":
            # fp32 has 23 mantissa bits, e4m3 has 3: round the 20 dropped bits stochastically.
            # Done before scaling, which is exact and moves only the exponent: the result is
            # then exact in e4m3 (except for its subnormals, which round to nearest in the cast).
            noise = rounding_noise_at(state["step"], stream, rows, cols, 20)
            scaled = stochastic_round_(noise, momentum, 20).view(torch.float32)
            for part, inverse in zip(column_blocks(scaled, self.block_cols), inverse_scales):
                part.mul_(inverse)
        else:
            scaled = torch.empty_like(momentum)
            sources, targets = column_blocks(momentum, self.block_cols), column_blocks(scaled, self.block_cols)
            for src, dst, inverse in zip(sources, targets, inverse_scales):
                torch.mul(src, inverse, out=dst)
        local_shard(codes).view(FP8).copy_(scaled.view(local_shard(codes).shape))
        local_shard(exps_state).copy_(exps.view(local_shard(exps_state).shape))

    def bytes_per_element(self, rows, cols):
        return 1.0 + self._blocks(cols) / cols + 8.0 / (rows * cols)


# ----------------------------------------------------------------------------- fp8 blocks


def column_blocks(x: Tensor, block_cols: int) -> list[Tensor]:
    """x (rows, cols) as at most two views (rows, blocks, width): the whole blocks, then the ragged last one."""
    rows, cols = x.shape
    whole = cols - cols % block_cols
    parts = []
    if whole:
        parts.append(x[:, :whole].unflatten(1, (whole // block_cols, block_cols)))
    if whole < cols:
        parts.append(x[:, whole:].unsqueeze(1))
    return parts


def _split_like(exps: Tensor, x: Tensor, block_cols: int) -> tuple[Tensor, ...]:
    """Per-block exponents (rows, blocks) split to match ``column_blocks(x)``."""
    return exps.split([part.shape[1] for part in column_blocks(x, block_cols)], dim=1)


def scale_exponents(x: Tensor, block_cols: int) -> Tensor:
    """int8 (rows, blocks): per block, the smallest-loss e with max|x| / 2**e <= 448.

    The block maximum lands in (224, 448]; a block holding Inf/NaN gets NONFINITE_EXP.
    """
    parts = column_blocks(x, block_cols)
    if not parts:
        return torch.zeros(x.shape[0], 0, dtype=torch.int8, device=x.device)
    amax = torch.cat([torch.maximum(p.amax(dim=-1), p.amin(dim=-1).neg_()) for p in parts], dim=1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1) (0 for 0)
    headroom = torch.where(mantissa <= FP8_MAX / 512, 9, 8)  # mantissa * 2**9 <= 448 iff mantissa <= 0.875
    e = (exponent - headroom).clamp_min_(-126)  # finite fp32 amax < 2**128: e <= 120
    finite = mantissa < 1  # frexp keeps Inf and NaN as the mantissa
    return torch.where(finite, e, NONFINITE_EXP).to(torch.int8)


def decode_fp8(codes: Tensor, exps: Tensor, block_cols: int) -> Tensor:
    """fp32 values of e4m3fn ``codes`` (uint8, rows x cols) times 2**exps per block.

    Built from the bits (torch's own fp8 cast is scalar code on CPU): sign and the 7 exponent
    and mantissa bits go to the top of an fp32 word, which then reads as the e4m3 value times
    2**-120 (e4m3 subnormals become fp32 subnormals, so this is exact for every code); one
    multiply restores 2**120 and one the block scale. A block marked NONFINITE_EXP reads NaN.
    """
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    bits = out.view(torch.int32)
    bits.copy_(codes.view(torch.int8))  # sign-extended: bits 7..31 all hold the sign
    bits.bitwise_left_shift_(20).bitwise_and_(_i32(0x87F00000))  # sign | code bits 0..6 at 20..26
    out.mul_(2.0**120)
    scale = torch.where(exps == NONFINITE_EXP, torch.nan, pow2(exps))
    for part, s in zip(column_blocks(out, block_cols), _split_like(scale, out, block_cols)):
        part.mul_(s.unsqueeze(-1))
    return out


def pow2(e: Tensor) -> Tensor:
    """2**e as float32, built from the exponent bits (exact; e in [-126, 127])."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


# ----------------------------------------------------------------------------- stochastic rounding


# lowbias32 (Chris Wellons, hash-prospector): x ^= x >> 16; x *= A; x ^= x >> 15; x *= B; x ^= x >> 16
U32 = 0xFFFFFFFF
MIX_A, MIX_B = 0x7FEB352D, 0x846CA68B - (1 << 32)  # as signed int32: tensor products wrap mod 2**32
COLUMN_SALT = 0x9E3779B9 - (1 << 32)
_LOW_HALF = 0 if sys.byteorder == "little" else 1


def stochastic_round_(noise: Tensor, x: Tensor, bits: int) -> Tensor:
    """In place on ``noise`` (int32 in [0, 2**bits)): fp32 ``x``'s bits with the low ``bits``
    mantissa bits rounded away stochastically.

    Adding uniform noise to the magnitude bits and truncating rounds up with probability
    equal to the dropped fraction, for either sign; a carry into the exponent is the correct
    next binade. Returns ``noise``, now int32 bits to view as float32.
    """
    return noise.add_(x.view(torch.int32)).bitwise_and_(-(1 << bits))


def rounding_noise(step: Tensor | int, stream: int, first_row: int, shape: tuple[int, int], bits: int, device) -> Tensor:
    """int32 (rows, cols) uniform in [0, 2**bits): a hash of (step, stream, global row, column).

    Element (i, j) of the result belongs to global row ``first_row + i``, column j; nothing
    else enters, so any split of the rows gives each row the same noise. A 32-bit seed is
    hashed from (step, stream); each row and each column gets a key hashed from its index and
    the seed (O(rows + cols) work); each element mixes row key XOR column key with two
    multiply / fold-high-half rounds, which removes the XOR structure (tests/test_state.py
    measures it). ``step`` may be a tensor on any device: it is never read on the host.
    """
    rows, cols = shape
    row_ids = torch.arange(first_row, first_row + rows, dtype=torch.int32, device=device)
    return rounding_noise_at(step, stream, row_ids, torch.arange(cols, dtype=torch.int32, device=device), bits)


def rounding_noise_at(step: Tensor | int, stream: int, row_ids: Tensor, col_ids: Tensor, bits: int) -> Tensor:
    """:func:`rounding_noise` for the rows and columns with global indices `row_ids`, `col_ids` (int32 device tensors)."""
    seed = _hash32(torch.as_tensor(step).to(torch.int32) ^ _i32(lowbias32(stream & U32)))
    # COLUMN_SALT has bit 31 set and indices are < 2**31: a row and a column never hash the same input
    keys = _hash32(torch.cat([row_ids, col_ids ^ COLUMN_SALT]) ^ seed)
    row_key, col_key = keys.split([row_ids.numel(), col_ids.numel()])
    x = torch.bitwise_xor(row_key.unsqueeze(1), col_key)  # (rows, cols)
    x.mul_(MIX_A)
    _fold_high_half_(x)
    x.mul_(MIX_B)
    _fold_high_half_(x)
    return x.bitwise_and_((1 << bits) - 1)


def lowbias32(x: int) -> int:
    """lowbias32 of a Python int in [0, 2**32)."""
    x ^= x >> 16
    x = x * MIX_A & U32
    x ^= x >> 15
    x = x * (MIX_B & U32) & U32
    return x ^ (x >> 16)


def _hash32(x: Tensor) -> Tensor:
    """lowbias32 on int32 bit patterns (logical shifts as arithmetic shift then mask)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * MIX_A
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * MIX_B
    return x ^ ((x >> 16) & 0xFFFF)


def _fold_high_half_(x: Tensor) -> None:
    """In place on int32 x: x ^= x >> 16 (logical), as an XOR of int16 halves, with no temporary."""
    halves = x.view(torch.int16).view(*x.shape, 2)
    halves[..., _LOW_HALF].bitwise_xor_(halves[..., 1 - _LOW_HALF])


def _i32(value: int) -> int:
    """An unsigned 32-bit constant as the signed int32 with the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _new_step() -> Tensor:
    """The stochastic-rounding step counter: a CPU int64 scalar, so reading it never syncs a device."""
    return torch.zeros((), dtype=torch.int64, device="cpu")


# ----------------------------------------------------------------------------- helpers


def _check_param(param: Tensor) -> None:
    if param.ndim not in (2, 3):
        raise ValueError(f"momentum storage takes 2-D (Muon) parameters or 3-D stacks of them, got shape {tuple(param.shape)}")
    if isinstance(param, DTensor):
        _block(param)


def _check_shape(momentum: Tensor, local: Tensor) -> None:
    if momentum.shape != local.shape or momentum.dtype != torch.float32:
        raise ValueError(
            f"momentum to store has shape {tuple(momentum.shape)} and dtype {momentum.dtype}; "
            f"expected the local rows {tuple(local.shape)} in torch.float32"
        )


def _block(t: DTensor) -> Box:
    """The (matrices, rows, cols) block of the stack this rank holds (layout.py)."""
    try:
        return local_block(t.shape, t.placements, t.device_mesh.mesh.shape, t.device_mesh.get_coordinate())
    except NotImplementedError as error:
        raise ValueError(f"momentum storage: {error}") from error


def _global_ids(t: Tensor, first_row: int | None) -> tuple[Tensor, Tensor]:
    """int32 device tensors: the global row of each local row (matrices flattened into rows:
    row r of matrix m is m·rows + r) and the global column of each local column."""
    local = local_shard(t)
    device = local.device
    if first_row is not None:
        if isinstance(t, DTensor):
            raise ValueError("first_row is for plain-tensor momentum blocks; a DTensor state knows its rows")
        if not (isinstance(first_row, int) and first_row >= 0):
            raise ValueError(f"first_row must be a non-negative int, got {first_row!r}")
    if not isinstance(t, DTensor):
        start = first_row or 0
        rows = torch.arange(start, start + math.prod(local.shape[:-1]), dtype=torch.int32, device=device)
        return rows, torch.arange(local.shape[-1], dtype=torch.int32, device=device)
    (m0, m1), (r0, r1), (c0, c1) = _block(t)
    per_matrix = t.shape[-2]
    rows = torch.arange(m0, m1, dtype=torch.int32, device=device).unsqueeze(1) * per_matrix
    rows = (rows + torch.arange(r0, r1, dtype=torch.int32, device=device)).reshape(-1)
    return rows, torch.arange(c0, c1, dtype=torch.int32, device=device)


def _like_param(param: Tensor, width: int, dtype: torch.dtype, local_columns) -> Tensor:
    """Zeros laid out like ``param`` (same placements), with `width` columns instead of its own.

    ``local_columns(width, cols, col_range)`` gives the state columns [start, stop) a rank
    holds when its parameter block spans columns `col_range`; DTensor's own split of `width`
    columns must agree, or DCP would put them elsewhere on another layout.
    """
    cols = param.shape[-1]
    if not isinstance(param, DTensor):
        start, stop = local_columns(width, cols, (0, cols))
        return torch.zeros(*param.shape[:-1], stop - start, dtype=dtype, device=param.device)
    start, stop = local_columns(width, cols, _block(param)[2])
    shape = (*param.shape[:-1], width)
    mesh = param.device_mesh
    if local_block(shape, param.placements, mesh.mesh.shape, mesh.get_coordinate())[2] != (start, stop):
        raise ValueError(
            f"momentum storage: state columns [{start}, {stop}) of {width} do not match the parameter's column split "
            f"{param.placements}; use momentum_dtype 'bf16' or 'fp32' for this layout"
        )
    local = torch.zeros(*local_shard(param).shape[:-1], stop - start, dtype=dtype, device=param.device)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, param.placements, run_check=False, shape=shape, stride=stride)


def _heal(state: dict, key: str, dtype: torch.dtype) -> Tensor:
    """Undo Optimizer.load_state_dict's cast of state to the param's dtype.

    It casts every state tensor except "step" to a floating-point param's dtype. Our uint8
    codes, int8 exponents and bf16 values all survive fp32, bf16 or fp16 exactly, so casting
    back restores them bit for bit (an fp32 buffer under a bf16 param is the one lossy case).
    """
    if state[key].dtype != dtype:
        state[key] = state[key].to(dtype)
    return state[key]
