"""DeMo (Decoupled Momentum, seed 002) for Muon: the layout-independent math, pure tensor code.

Per step, on the owner of a whole matrix in each replica (docs/demo.md):

    M ← β·M + g                               accumulate_momentum_
    (idx, val) = top-k of DCT-II(chunks of M)  compress
    M ← M − α·decode(idx, val)                 subtract_sent_   (the buffer is the error feedback)
    ... all-gather (idx, val) across replicas (integration, not here) ...
    q = mean over replicas of decode(idx_r, val_r)   average_decoded
    S ← μ·S + (1 − μ)·q; input = (1 − μ)·q + μ·S    shared_momentum_input_  (optional, issue 27:
        a momentum over what was synchronized, the same on every replica; S alone without Nesterov)
    then Muon orthogonalizes the input (q without the shared momentum) and applies the update.

Chunks tile the WHOLE matrix in s×s blocks from the top-left corner; when rows or cols are not
multiples of s the last block row/column is narrower (edge chunks), with a DCT basis of the edge
size. Chunks of one shape form a "group" (at most 4 per matrix: full, right edge, bottom edge,
corner) and each group is transformed with one batched matmul: no Python loop per chunk.

A chunk of h×w elements keeps ceil(topk·h·w / s²) coefficients: the same density as a full chunk
(never less), at least 1, and all h·w when topk = s². The payload of a matrix therefore has a size
fixed by (rows, cols, s, topk), equal in every replica, so it all-gathers with even sizes.

Selection order: magnitude descending, ties broken by the lower flat index inside the chunk
(row-major), via a stable sort. Everything stays on the input's device; nothing reads values
on the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

DEFAULT_CHUNK = 64  # the paper's default chunk size for matrices (64×64)
DEFAULT_TOPK = 8  # paper's range k = 2–16 per 64×64 chunk; k = 8 was its 300M run (85× less traffic)
# α = 1 (the reference code's: the local buffer is pure error feedback), measured better than the
# paper's α = 0.2 once a shared momentum runs over the synchronized average (issue 27, docs/demo.md).
DEFAULT_ALPHA = 1.0
DEFAULT_SHARED_MOMENTUM = True


@dataclass(frozen=True)
class ChunkGroup:
    """Equal-shape chunks: a grid of row_chunks × col_chunks blocks of height × width elements
    starting at (row_start, col_start); each keeps `keep` coefficients."""

    row_start: int
    row_chunks: int
    height: int
    col_start: int
    col_chunks: int
    width: int
    keep: int

    @property
    def count(self) -> int:
        return self.row_chunks * self.col_chunks

    @property
    def kept(self) -> int:
        return self.count * self.keep


@dataclass(frozen=True)
class ChunkGeometry:
    rows: int
    cols: int
    chunk: int
    topk: int
    groups: tuple[ChunkGroup, ...]

    @property
    def kept(self) -> int:
        """Coefficients one matrix sends per step (the length of compress's outputs)."""
        return sum(g.kept for g in self.groups)

    @property
    def chunks(self) -> int:
        return sum(g.count for g in self.groups)


def validate_settings(chunk: int, topk: int, alpha: float | None = None, beta: float | None = None) -> None:
    """Raise ValueError naming the setting when DeMo cannot work with it."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"demo_chunk must be an integer >= 1, got {chunk!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= chunk * chunk:
        raise ValueError(f"demo_topk must be an integer in [1, demo_chunk² = {chunk * chunk}], got {topk!r}")
    if chunk * chunk > 2**31:
        raise ValueError(f"demo_chunk = {chunk} is too large: chunk indices must fit int32 (demo_chunk <= 46340)")
    if alpha is not None and not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"demo_alpha must be a number in [0, 1], got {alpha!r}")
    if beta is not None and not (isinstance(beta, (int, float)) and 0.0 <= beta < 1.0):
        raise ValueError(f"momentum (DeMo's β) must be a number in [0, 1), got {beta!r}")


@lru_cache(maxsize=None)
def chunk_geometry(rows: int, cols: int, chunk: int = DEFAULT_CHUNK, topk: int = DEFAULT_TOPK) -> ChunkGeometry:
    """How a (rows, cols) matrix is cut into chunks, group order: full chunks, right edge, bottom
    edge, corner (absent groups skipped); chunks inside a group in row-major grid order."""
    validate_settings(chunk, topk)
    if rows < 1 or cols < 1:
        raise ValueError(f"DeMo needs a non-empty matrix, got shape ({rows}, {cols})")

    def segments(length: int) -> list[tuple[int, int, int]]:  # (start, number of chunks, chunk size)
        full, edge = divmod(length, chunk)
        return ([(0, full, chunk)] if full else []) + ([(full * chunk, 1, edge)] if edge else [])

    groups = tuple(
        ChunkGroup(r0, rn, h, c0, cn, w, -(-topk * h * w // (chunk * chunk)))
        for r0, rn, h in segments(rows)
        for c0, cn, w in segments(cols)
    )
    return ChunkGeometry(rows, cols, chunk, topk, groups)


def index_dtype(chunk: int) -> torch.dtype:
    """Indices are positions inside one chunk (the chunk is implied by the position in the
    payload), so they need only chunk² values: int16 up to 181×181 chunks (the default 64×64
    has 4096), else int32. int16 halves the index bytes of int32 and quarters topk's int64."""
    return torch.int16 if chunk * chunk <= 2**15 else torch.int32


_BASES: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}


def dct_basis(size: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """Orthonormal DCT-II matrix D (size × size), coefficients = D @ x, inverse x = Dᵀ @ coefficients.

    D[k, i] = sqrt(2/size) · c_k · cos(π (2i + 1) k / (2 size)), c_0 = 1/√2, c_k = 1 otherwise.
    Built once per (size, device, dtype) in float64 on the host, rounded once, then cached on the
    device. A basis matmul rather than torch.fft: at s = 64 it is 2·64 multiply-adds per element
    and side, one batched GEMM per chunk shape (tensor cores on GPUs, any size including ragged
    edges, real arithmetic, the same code for forward and inverse), where an FFT-based DCT needs
    complex intermediates, a reorder and twiddles and only wins for much larger chunks.
    """
    device = torch.device(device)
    key = (size, device, dtype)
    basis = _BASES.get(key)
    if basis is None:
        k = torch.arange(size, dtype=torch.float64, device="cpu").unsqueeze(1)
        i = torch.arange(size, dtype=torch.float64, device="cpu").unsqueeze(0)
        d = torch.cos(math.pi * (2 * i + 1) * k / (2 * size)) * math.sqrt(2.0 / size)
        d[0] *= math.sqrt(0.5)
        basis = _BASES[key] = d.to(device=device, dtype=dtype)
    return basis


def _check_batch(momentum: Tensor) -> None:
    if momentum.ndim != 3:
        raise ValueError(f"DeMo expects a batch of matrices (n, rows, cols), got shape {tuple(momentum.shape)}")
    if not momentum.is_floating_point():
        raise ValueError(f"DeMo expects floating-point momentum, got {momentum.dtype}")


def _chunks(matrices: Tensor, g: ChunkGroup) -> Tensor:
    """(n, count, height, width) copy of the group's chunks, grid row-major."""
    n = matrices.shape[0]
    block = matrices[:, g.row_start : g.row_start + g.row_chunks * g.height, g.col_start : g.col_start + g.col_chunks * g.width]
    block = block.reshape(n, g.row_chunks, g.height, g.col_chunks, g.width).transpose(2, 3)
    return block.reshape(n, g.count, g.height, g.width)


def _place(out: Tensor, chunks: Tensor, g: ChunkGroup) -> None:
    """Inverse of _chunks: write (n, count, height, width) into the group's block of out."""
    n = out.shape[0]
    block = chunks.reshape(n, g.row_chunks, g.col_chunks, g.height, g.width).transpose(2, 3)
    out[:, g.row_start : g.row_start + g.row_chunks * g.height, g.col_start : g.col_start + g.col_chunks * g.width] = block.reshape(
        n, g.row_chunks * g.height, g.col_chunks * g.width
    )


def select_topk(coefficients: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    """The `keep` largest magnitudes along the last dim: (positions int64, signed values), in
    order of magnitude descending, ties to the lower position (torch.topk leaves ties unordered
    and unspecified; a stable sort fixes them, at the cost of sorting every chunk)."""
    order = torch.argsort(coefficients.abs(), dim=-1, descending=True, stable=True)[..., :keep]
    return order, coefficients.gather(-1, order)


def compress(momentum: Tensor, chunk: int = DEFAULT_CHUNK, topk: int = DEFAULT_TOPK) -> tuple[Tensor, Tensor]:
    """Top-k DCT-II coefficients of every chunk of every matrix of a batch (n, rows, cols).

    Returns (indices, values), each (n, kept) with kept = chunk_geometry(...).kept: groups in
    geometry order, chunks in grid order, `keep` entries per chunk. indices are flat positions
    inside the chunk's (height, width) coefficient block (dtype index_dtype(chunk)); values are
    in the momentum's dtype.
    """
    _check_batch(momentum)
    n, rows, cols = momentum.shape
    geometry = chunk_geometry(rows, cols, chunk, topk)
    indices, values = [], []
    for g in geometry.groups:
        dh = dct_basis(g.height, momentum.device, momentum.dtype)
        dw = dct_basis(g.width, momentum.device, momentum.dtype)
        coefficients = (dh @ _chunks(momentum, g) @ dw.T).reshape(n, g.count, g.height * g.width)
        position, value = select_topk(coefficients, g.keep)
        indices.append(position.reshape(n, g.kept).to(index_dtype(chunk)))
        values.append(value.reshape(n, g.kept))
    return torch.cat(indices, 1), torch.cat(values, 1)


def _check_payload(indices: Tensor, values: Tensor, geometry: ChunkGeometry) -> None:
    if indices.shape != values.shape or indices.ndim != 2 or indices.shape[1] != geometry.kept:
        raise ValueError(
            f"DeMo payload of shapes {tuple(indices.shape)} / {tuple(values.shape)} does not match a "
            f"({geometry.rows}, {geometry.cols}) matrix with demo_chunk={geometry.chunk}, demo_topk={geometry.topk} "
            f"(expected (n, {geometry.kept}))"
        )


def _decode_into(out: Tensor, payloads: Sequence[tuple[Tensor, Tensor]], geometry: ChunkGeometry, scale: float) -> Tensor:
    n = out.shape[0]
    start = 0
    for g in geometry.groups:
        coefficients = out.new_zeros(n, g.count, g.height * g.width)
        for indices, values in payloads:
            # Positions are unique inside one chunk of one payload, so each scatter_add_ touches an
            # element at most once (deterministic on every device); payloads are added in list order.
            coefficients.scatter_add_(
                -1,
                indices[:, start : start + g.kept].reshape(n, g.count, g.keep).long(),
                values[:, start : start + g.kept].reshape(n, g.count, g.keep).to(out.dtype),
            )
        if scale != 1.0:
            coefficients.mul_(scale)
        dh = dct_basis(g.height, out.device, out.dtype)
        dw = dct_basis(g.width, out.device, out.dtype)
        _place(out, dh.T @ coefficients.reshape(n, g.count, g.height, g.width) @ dw, g)
        start += g.kept
    return out


def decode(indices: Tensor, values: Tensor, shape: tuple[int, int], chunk: int = DEFAULT_CHUNK, topk: int = DEFAULT_TOPK) -> Tensor:
    """Dense (n, rows, cols) matrices whose chunk DCT-II coefficients are the kept pairs (zero elsewhere)."""
    geometry = chunk_geometry(*shape, chunk, topk)
    _check_payload(indices, values, geometry)
    out = values.new_empty(indices.shape[0], *shape)
    return _decode_into(out, [(indices, values)], geometry, 1.0)


def average_decoded(
    indices: Sequence[Tensor], values: Sequence[Tensor], shape: tuple[int, int], chunk: int = DEFAULT_CHUNK, topk: int = DEFAULT_TOPK
) -> Tensor:
    """q = (1/R) Σ_r decode(indices[r], values[r]) for the R replicas' payloads.

    Summed in the coefficient domain in replica order, then one inverse DCT (decode is linear): the
    same math as decoding each and averaging, with R sparse adds instead of R dense inverses.
    Every replica runs this on the same gathered payloads in the same order, so all get the same
    bits of q (and stay bit-identical after the update).
    """
    if len(indices) != len(values) or not indices:
        raise ValueError(f"average_decoded needs one (indices, values) pair per replica, got {len(indices)} and {len(values)}")
    geometry = chunk_geometry(*shape, chunk, topk)
    for i, v in zip(indices, values):
        _check_payload(i, v, geometry)
    out = values[0].new_empty(indices[0].shape[0], *shape)
    return _decode_into(out, list(zip(indices, values)), geometry, 1.0 / len(indices))


def accumulate_momentum_(momentum: Tensor, grad: Tensor, beta: float) -> Tensor:
    """In place: M ← β·M + g. (The paper's (1−β)·g only rescales M, q and everything sent by the
    same constant, which Muon's orthogonalization removes.)"""
    return momentum.mul_(beta).add_(grad)


def subtract_sent_(momentum: Tensor, decoded: Tensor, alpha: float) -> Tensor:
    """In place: M ← M − α·decoded, the error feedback (what was not sent stays in M)."""
    return momentum.sub_(decoded, alpha=alpha)


def shared_momentum_input_(shared: Tensor, average: Tensor, mu: float, nesterov: bool) -> Tensor:
    """In place S ← μ·S + (1 − μ)·q over the replicas' average q (every replica holds the same
    S and q, so the same bits of S); returns what Newton–Schulz orthogonalizes: the Nesterov
    input (1 − μ)·q + μ·S with `nesterov`, else S itself. The same momentum and Nesterov
    formulas as Muon's on full gradients, with q in place of the gradient."""
    shared.lerp_(average, 1.0 - mu)
    return average.lerp(shared, mu) if nesterov else shared


def local_step_(
    momentum: Tensor, grad: Tensor, beta: float, chunk: int = DEFAULT_CHUNK, topk: int = DEFAULT_TOPK, alpha: float = DEFAULT_ALPHA
) -> tuple[Tensor, Tensor]:
    """One replica's part of a step on a batch of whole matrices: accumulate, compress, subtract
    α × what it sends. Returns the (indices, values) payload to all-gather across replicas."""
    validate_settings(chunk, topk, alpha, beta)
    accumulate_momentum_(momentum, grad, beta)
    indices, values = compress(momentum, chunk, topk)
    if alpha != 0:
        subtract_sent_(momentum, decode(indices, values, tuple(momentum.shape[1:]), chunk, topk), alpha)
    return indices, values


# ---------------------------------------------------------------- byte accounting


def payload_bytes(rows: int, cols: int, chunk: int = DEFAULT_CHUNK, topk: int = DEFAULT_TOPK, value_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one replica's (indices, values) for one (rows, cols) matrix per step."""
    kept = chunk_geometry(rows, cols, chunk, topk).kept
    return kept * (index_dtype(chunk).itemsize + value_dtype.itemsize)


def dense_bytes(rows: int, cols: int, grad_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the dense gradient the usual replica all-reduce would reduce."""
    return rows * cols * grad_dtype.itemsize


def allgather_bytes_sent(payload: int, replicas: int) -> int:
    """Bytes one replica sends to all-gather `payload` bytes per replica: (R − 1)·payload (ring:
    it forwards R − 1 blocks; direct: it sends its block to R − 1 peers — the same count)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return (replicas - 1) * payload


def allreduce_bytes_sent(dense: int, replicas: int) -> float:
    """Bytes one replica sends in a bandwidth-optimal (ring) all-reduce of `dense` bytes:
    reduce-scatter then all-gather, 2(R − 1)/R · dense."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return 2 * (replicas - 1) / replicas * dense
