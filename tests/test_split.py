"""Muon Split: each row block (attention head) is orthogonalized on its own, scaled by its own shape."""

import math

import pytest
import torch
from distributed import run_distributed
from reference import reference_ns
from sharded_fixtures import dtensor_run, one_process_run, check_equal_to_one_process
from torch import nn

from titan_muon import Muon
from titan_muon.attention.split import match_row_blocks, row_block_ranges

ROW_BLOCKS = {"a": 10, "b": (4, 3), "e": 16}


def test_split_equals_newton_schulz_per_block():
    g = torch.Generator().manual_seed(0)
    w0, grad = torch.randn(24, 40, generator=g), torch.randn(24, 40, generator=g)
    w = nn.Parameter(w0.clone())
    opt = Muon([("layers.0.attention.wq.weight", w)], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False,
               row_blocks={"layers.*.attention.wq.weight": (6, 2)})  # fmt: skip
    w.grad = grad
    opt.step()
    expected = w0.clone()
    for start, end in row_block_ranges(24, (6, 2)):
        rows = end - start
        expected[start:end] -= 0.1 * math.sqrt(max(1, rows / 40)) * reference_ns(grad[start:end])
    # Fused vs term-by-term NS (test_newton_schulz): rounding of an update of size <= 0.12.
    torch.testing.assert_close(w.detach(), expected, rtol=1e-5, atol=1e-6)
    # And it is not the whole-matrix update.
    whole = w0 - 0.1 * reference_ns(grad)
    assert (w.detach() - whole).abs().max() > 1e-3


def test_tall_blocks_get_their_own_scale():
    w = nn.Parameter(torch.zeros(64, 8))
    opt = Muon([("w", w)], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False, row_blocks={"w": 32})
    w.grad = torch.randn(64, 8)
    opt.step()
    # Each 32x8 block is orthogonalized to singular values ~1 and scaled by sqrt(32/8) = 2.
    for block in w.detach().split(32):
        s = torch.linalg.svdvals(block)
        assert 1.4 < s.mean() < 2.6


def test_block_errors_name_the_parameter_and_pattern():
    with pytest.raises(ValueError, match=r"'w' has 30 rows, not a multiple of its row-block pattern \[4\]"):
        row_block_ranges(30, 4, "w")
    with pytest.raises(ValueError, match="pattern 'layers.*.wk.weight' matches no Muon parameter"):
        match_row_blocks(["layers.0.attention.wq.weight"], {"layers.*.wk.weight": 8})
    with pytest.raises(ValueError, match="not a multiple"):
        Muon([("w", nn.Parameter(torch.randn(30, 8)))], row_blocks={"w": 4})
    assert match_row_blocks(["_orig_mod.layers.0.wq.weight"], {"layers.*.wq.weight": 8}) == {"_orig_mod.layers.0.wq.weight": 8}


def test_split_distributed_equals_one_process_with_heads_straddling_shards():
    world = 4
    # 30 rows in heads of 10 on 4 ranks (8, 8, 8, 6 rows): heads 0-2 straddle shard boundaries.
    results = run_distributed(dtensor_run, world, (world,), 3, {"row_blocks": ROW_BLOCKS})
    expected = one_process_run(3, row_blocks=ROW_BLOCKS)
    unsplit = one_process_run(3)
    for rank, result in enumerate(results):
        check_equal_to_one_process(result["params"], expected, 3, f"rank {rank}")
    assert (expected["a"] - unsplit["a"]).abs().max() > 1e-4


def test_attention_row_blocks_for_torchtitan_gqa_and_mla():
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    from titan_muon.attention.split import attention_row_blocks

    llama = Transformer(TransformerModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=32))
    blocks = attention_row_blocks(llama)
    assert blocks["layers.1.attention.wq.weight"] == blocks["layers.1.attention.wk.weight"] == 8
    assert set(blocks) == {f"layers.{i}.attention.{p}.weight" for i in range(2) for p in ("wq", "wk", "wv")}
    groups = [{"params": [(n, p) for n, p in llama.named_parameters() if p.ndim == 2 and "embed" not in n and "output" not in n]}]
    opt = Muon(groups, row_blocks=blocks)
    assert len(opt.engines[0].units) == 2 * (8 + 2 + 2 + 4)  # heads of wq, wk, wv + wo, w1, w2, w3 whole

    args = DeepSeekV3ModelArgs(dim=64, n_layers=1, n_dense_layers=1, n_heads=4, vocab_size=32, q_lora_rank=0,
                               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, inter_dim=96)  # fmt: skip
    mla = DeepSeekV3Model(args)
    assert attention_row_blocks(mla) == {"layers.0.attention.wq.weight": 12, "layers.0.attention.wkv_b.weight": 16}
    assert attention_row_blocks(mla, "fine") == {"layers.0.attention.wq.weight": (8, 4), "layers.0.attention.wkv_b.weight": (8, 8)}
    assert attention_row_blocks(mla, "none") == {}
    with pytest.raises(ValueError, match="mode='heads'"):
        attention_row_blocks(mla, "heads")
