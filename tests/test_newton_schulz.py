import pytest
import torch

from reference import reference_ns
from titan_muon.newton_schulz import coefficient_schedule, newton_schulz_flops, orthogonalize


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (64, 64), (3, 256)])
def test_matches_plain_quintic(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    # The polynomial fused into addmm vs evaluated term by term: fp32 rounding (~1e-7) of
    # entries <= 1.2, times NS's gain on a full-rank random matrix (~20).
    torch.testing.assert_close(orthogonalize(g), reference_ns(g), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["keller", "polar_express"])
def test_singular_values_move_towards_one(method):
    g = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) @ torch.diag(torch.logspace(-2, 0, 128))
    s = torch.linalg.svdvals(orthogonalize(g, method=method))
    assert s.max() < 1.25 and s.min() > 0.3, s


def test_polar_express_is_tighter_than_keller():
    g = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    spread = {m: torch.linalg.svdvals(orthogonalize(g, method=m)) for m in ("keller", "polar_express")}
    assert (spread["polar_express"] - 1).abs().max() < (spread["keller"] - 1).abs().max()


def test_batched_equals_one_by_one_and_orientation_is_kept():
    batch = torch.randn(3, 80, 24, generator=torch.Generator().manual_seed(3))
    out = orthogonalize(batch)
    assert out.shape == batch.shape
    for k in range(3):
        # Equal on CPU (one 2-D GEMM per matrix either way); a batched GEMM may block its sums
        # otherwise (GPU): fp32 rounding times NS's gain, as above.
        torch.testing.assert_close(out[k], orthogonalize(batch[k]), rtol=1e-5, atol=1e-6)


def test_bf16_compute_dtype_is_close_to_fp32():
    g = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    diff = (orthogonalize(g, dtype=torch.bfloat16).float() - orthogonalize(g)).abs().max()
    assert orthogonalize(g, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert 0 < diff < 0.05


def test_zero_matrix_stays_zero():
    assert orthogonalize(torch.zeros(8, 16)).abs().max() == 0


def test_schedule_and_flops():
    assert coefficient_schedule("keller", 3) == [(3.4445, -4.7750, 2.0315)] * 3
    pe = coefficient_schedule("polar_express", 7)
    assert len(pe) == 7 and pe[5] == pe[6] == pe[4]
    assert coefficient_schedule((1.5, -0.5, 0.0), 2) == [(1.5, -0.5, 0.0)] * 2
    with pytest.raises(ValueError, match="unknown Newton-Schulz method"):
        coefficient_schedule("cubic", 5)
    assert newton_schulz_flops(10, 30, 1) == newton_schulz_flops(30, 10, 1) == 4 * 100 * 30 + 2 * 1000
