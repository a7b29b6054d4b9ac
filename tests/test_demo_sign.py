"""titan_muon.demo.sign (sign-compressed AdamW gradients, issue 27) against reference_sign_step
(tests/demo_reference.py). u = 2^-24; a row's fp32 mean of |x| over c columns is within
γ_c·s of the exact s (c − 1 additions and the division); s·(±1) is exact."""

from __future__ import annotations

import pytest
import torch
from demo_reference import reference_sign_step

from titan_muon.demo import sign

U32 = 2.0**-24


def _gamma(j: int) -> float:
    return j * U32 / (1 - j * U32)


@pytest.mark.parametrize("shape", [(7, 13), (70, 3), (1, 1), (4, 2, 5)])
def test_compress_decode_against_reference(shape):
    """Bits (any numel, the last byte padded), signs with 0 and −0 sent as +1, scales the rows'
    mean |x|; the new error x − s·sign is the reference's within |Δs| + u·(|e'| + |Δs|)."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    g.view(-1)[0] = 0.0
    g.view(-1)[-1] = -0.0
    error = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.1
    error.view(-1)[0] = error.view(-1)[-1] = 0.0
    x = sign.rows_of(error + g)
    scales, bits = sign.compress(x)
    assert bits.dtype == torch.uint8 and bits.numel() == sign.bits_bytes(x.numel()) and scales.dtype == torch.float32
    exact, new_errors, (ref_scales,) = reference_sign_step([error], [g])
    d_scales = _gamma(x.shape[1]) * ref_scales
    assert ((scales.double() - ref_scales).abs() <= d_scales).all()
    decoded = sign.decode(scales, bits, tuple(x.shape))
    assert torch.equal(decoded, torch.where(x >= 0, scales[:, None], -scales[:, None]))  # x = ±0 sends +s
    assert ((decoded.double() - sign.rows_of(exact)).abs() <= d_scales[:, None]).all()
    new_error = (x - decoded).double()
    bound = d_scales[:, None] + U32 * (sign.rows_of(new_errors[0]).abs() + d_scales[:, None])
    assert ((new_error - sign.rows_of(new_errors[0])).abs() <= bound).all()


def test_average_of_replicas():
    """(1/R)·Σ_r s_r·sign_r in replica order: within Σ_r|Δs_r|/R + γ_R·mean_r s_r of the reference."""
    replicas, shape = 3, (20, 9)
    grads = [torch.randn(*shape, generator=torch.Generator().manual_seed(10 + r)) for r in range(replicas)]
    errors = [torch.zeros(shape) for _ in range(replicas)]
    payloads = [sign.compress(g) for g in grads]
    average = sign.average_decoded([p[0] for p in payloads], [p[1] for p in payloads], shape)
    exact, _, scales = reference_sign_step(errors, grads)
    bound = sum(_gamma(shape[1]) * s[:, None] for s in scales) / replicas + _gamma(replicas) * sum(s[:, None] for s in scales) / replicas
    assert ((average.double() - exact).abs() <= bound).all()
    with pytest.raises(ValueError, match="one .scales, bits. pair per replica"):
        sign.average_decoded([], [], shape)


def test_bytes_and_which_tensors():
    # the debug model's embedding (2048 × 256): 8,192 bytes of scales + 65,536 of bits, 28.4× below fp32
    assert sign.payload_bytes(2048, 256) == 4 * 2048 + 2048 * 256 // 8 == 73_728
    assert sign.payload_bytes(3, 3) == 12 + 2
    assert sign.compressed((2048, 256)) and sign.compressed((2, 3, 4))
    assert not sign.compressed((256,)) and not sign.compressed((0, 5))
    with pytest.raises(ValueError, match="fp32 .rows, cols. matrix"):
        sign.compress(torch.zeros(4, 4, dtype=torch.bfloat16))
