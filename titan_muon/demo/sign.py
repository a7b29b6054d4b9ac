"""Sign compression with per-row scales and error feedback: DeMo's traffic for the AdamW tensors
(``demo_adamw="sign"``, issue 27). Pure tensor functions; the integration is demo/step.py.

Per step, on every rank of replica r, for each AdamW gradient of two or more dimensions (rows:
every dimension but the last; FSDP2 shards dim 0, so a rank holds whole rows), with e_r the
replica's own error-feedback buffer (fp32, laid out like the parameter):

    x = e_r + g_r                              (fp32)
    s = mean |x| over each row                 the scale that minimizes |x − s·sign(x)|₂ per row
    payload = (s, one bit per element: x ≥ 0)
    e_r ← x − s·sign(x)                        what was not sent stays for the next step
    ... all-gather the payloads across the R replicas (integration) ...
    AdamW's gradient = (1/R)·Σ_r s_r·sign(x_r), summed in replica order   average_decoded

Every replica decodes the same gathered bytes in the same order, so every replica gets the same
bits of the averaged gradient and its AdamW parameters stay bit-identical. A row is whole on the
rank that holds it, so s and the update do not depend on the shard layout. One-dimensional
tensors (norms, biases) stay dense: under FSDP2 their elements are split between ranks, so a
scale over "the row" would depend on the layout, and they are a small share of the bytes
(0.06 % of the debug model's parameters).

Bytes per tensor of rows × cols elements: 4·rows (fp32 scales) + ⌈rows·cols / 8⌉ (bits): about
1/32 of the dense fp32 gradient for wide rows (embeddings and output heads: 256+ columns).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

ADAMW_CHOICES = ("dense", "sign")
# The one switch reaches issue 27's ≥ 20× fewer bytes across replicas only with the AdamW tensors
# compressed (docs/demo.md "Compressing the AdamW tensors").
DEFAULT_ADAMW = "sign"
ERROR_KEY = "demo_error"  # the AdamW state key of the replica's own error-feedback buffer

_BIT_WEIGHTS: dict[torch.device, Tensor] = {}


def _weights(device: torch.device) -> Tensor:
    weights = _BIT_WEIGHTS.get(device)
    if weights is None:
        weights = _BIT_WEIGHTS[device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
    return weights


def rows_of(x: Tensor) -> Tensor:
    """x as (rows, last dimension)."""
    return x.reshape(-1, x.shape[-1])


def compress(x: Tensor) -> tuple[Tensor, Tensor]:
    """(scales (rows,) fp32, bits (⌈rows·cols / 8⌉,) uint8) of an fp32 (rows, cols) matrix: bit
    i % 8 of byte i // 8 is 1 where the flat element i is ≥ 0 (row-major; the last byte zero-padded)."""
    if x.ndim != 2 or x.dtype != torch.float32:
        raise ValueError(f"sign compression takes an fp32 (rows, cols) matrix, got shape {tuple(x.shape)} {x.dtype}")
    scales = x.abs().mean(dim=-1)
    positive = (x >= 0).reshape(-1).to(torch.uint8)
    padded = torch.nn.functional.pad(positive, (0, -positive.numel() % 8))
    bits = (padded.view(-1, 8) * _weights(x.device)).sum(dim=-1, dtype=torch.uint8)
    return scales, bits


def signs(bits: Tensor, numel: int) -> Tensor:
    """±1 (fp32, flat, `numel` elements) from :func:`compress`'s bits."""
    unpacked = bits[:, None].bitwise_and(_weights(bits.device)).ne(0).reshape(-1)[:numel]
    return unpacked.to(torch.float32).mul_(2).sub_(1)


def decode(scales: Tensor, bits: Tensor, shape: tuple[int, int]) -> Tensor:
    """s·sign(x) as an fp32 (rows, cols) matrix."""
    rows, cols = shape
    return signs(bits, rows * cols).view(rows, cols).mul_(scales[:, None])


def average_decoded(scales: list[Tensor], bits: list[Tensor], shape: tuple[int, int]) -> Tensor:
    """(1/R)·Σ_r decode(scales_r, bits_r), summed in replica (list) order, then ÷R."""
    if len(scales) != len(bits) or not scales:
        raise ValueError(f"average_decoded needs one (scales, bits) pair per replica, got {len(scales)} and {len(bits)}")
    total = decode(scales[0], bits[0], shape)
    for s, b in zip(scales[1:], bits[1:]):
        total += decode(s, b, shape)
    return total.div_(len(scales))


def bits_bytes(numel: int) -> int:
    return -(-numel // 8)


def payload_bytes(rows: int, cols: int) -> int:
    """Bytes of one (rows, cols) tensor's payload: fp32 scales and packed bits."""
    return 4 * rows + bits_bytes(rows * cols)


def compressed(shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this (global) shape is sign-compressed: two dimensions or more."""
    return len(shape) >= 2 and math.prod(shape) > 0
