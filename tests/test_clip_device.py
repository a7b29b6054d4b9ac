"""MuonClip without a GPU, proven GPU-ready: it runs on `meta` (shapes only), a step reads
nothing on the host, its all-reduce sees only device tensors, recording at sequence length 8192
costs three aten kernels (a stand-in for launches) per 64 MiB matmul, the recording hook traces
under torch.compile(fullgraph), and the rows a rank holds are those DTensor gives it.
"""

import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from test_clip import MODELS, boost, tokens
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer

from titan_muon.attention.clip import QKClip, QKClipMetrics, read_metrics
from titan_muon.attention.logits import ACCELERATOR_BLOCK_BYTES, MaxLogitRecorder, block_max_logits, held_rows

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


class OpCounter(TorchDispatchMode):
    """Counts aten ops (after decomposition: what would launch kernels) and host reads."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def host_reads(self) -> int:
        return sum(self.ops[op] for op in HOST_READS)


def llama3_8b_layer(seq_len):
    """One Llama-3-8B layer (dim 4096, 32 query heads, 8 KV heads of 128) on meta, bf16."""
    args = TransformerModelArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, vocab_size=128, max_seq_len=seq_len)
    with torch.device("meta"):
        return Transformer(args).to(torch.bfloat16)


def deepseek_v3_layer(seq_len):
    """One DeepSeek-V3 MLA layer (128 heads, q LoRA 1536, kv LoRA 512, nope 128 + rope 64) on meta, bf16."""
    args = DeepSeekV3ModelArgs(
        vocab_size=128, dim=7168, inter_dim=256, n_layers=1, n_dense_layers=1, n_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_seq_len=seq_len,
    )  # fmt: skip
    with torch.device("meta"):
        return DeepSeekV3Model(args).to(torch.bfloat16)


def recording_ops(model, seq_len):
    """aten ops the recorder adds to one forward, and its batched matmuls (one per query block)."""
    qk_clip = QKClip(model, tau=10.0)
    batch = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    counts = {}
    for enabled in (False, True):
        qk_clip.recorder.enabled = enabled
        with OpCounter() as counter, torch.no_grad():
            model(batch)
        counts[enabled] = counter.ops
    return counts[True] - counts[False]


def kernels(ops) -> int:
    """aten ops that are not views: what launches a kernel on a device."""
    return sum(n for op, n in ops.items() if not any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns))


@pytest.mark.parametrize(
    "build, seq_len, kv_heads, rep",
    [(llama3_8b_layer, 8192, 8, 4), (deepseek_v3_layer, 4096, 128, 1)],
    ids=["llama3_8b", "deepseek_v3"],
)
def test_long_sequence_recording_costs_three_kernels_per_matmul(build, seq_len, kv_heads, rep):
    extra = recording_ops(build(seq_len), seq_len)
    # Query rows per block: the 64 MiB budget over one query row's bf16 logits of all KV heads.
    rows = ACCELERATOR_BLOCK_BYTES // (kv_heads * seq_len * 2)
    matmuls = math.ceil(seq_len / rows) * rep  # one per block and position in a GQA group (batch 1)
    assert extra[aten.bmm.out] == matmuls == 64
    assert extra[aten.masked_fill_.Scalar] == extra[aten.amax.out] == matmuls  # the diagonal's mask, the block's max
    assert kernels(extra) <= 3 * matmuls + 12, extra  # measured: 204 (llama3_8b), 202 (deepseek_v3)


def test_block_budget_bounds_the_block():
    q, k = torch.empty(2, 8, 1000, 16, device="meta"), torch.empty(2, 2, 1000, 16, device="meta")
    with OpCounter() as counter:
        block_max_logits(q, k, block_bytes=2 * 1000 * 4 * 300)  # 300 fp32 query rows of 2 KV heads a block ...
    assert counter.ops[aten.bmm.out] == 7 * 2 * 4  # ... capped at q + k (1.28 MB): 160 rows, 7 blocks × 2 sequences × 4 Q heads a KV head
    with OpCounter() as counter:
        block_max_logits(q, k, block_bytes=2 * 1000 * 4 * 300 // 3)  # 100 rows a block
    assert counter.ops[aten.bmm.out] == 10 * 2 * 4


@pytest.mark.parametrize("kind", ["gqa", "mla_lora"])
def test_qk_clip_runs_on_meta(kind):
    with torch.device("meta"):
        model = MODELS[kind]()
    qk_clip = QKClip(model, tau=1.0)
    assert qk_clip.recorder.max_logits.device.type == "meta"
    model(torch.zeros(2, 12, dtype=torch.long, device="meta"))
    metrics = qk_clip.reduce_and_clip(lr=1.0)
    assert "qk_clip/max_logit/layers.1.attention" in list(metrics)  # listing keys reads nothing
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_a_clipping_step_reads_nothing_on_the_host(kind):
    model = MODELS[kind]()
    boost(model, kind)
    qk_clip = QKClip(model, tau=5.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with OpCounter() as counter:
        for micro_batch in range(2):
            model(tokens(micro_batch)).float().logsumexp(-1).mean().backward()
        optimizer.step()
        metrics = qk_clip.reduce_and_clip(optimizer)
    assert counter.host_reads == 0, {op: n for op, n in counter.ops.items() if op in HOST_READS}
    values = read_metrics([metrics])  # the logging path: one device-to-host copy for everything
    assert values["qk_clip/heads_clipped"] > 0 and values["qk_clip/max_logit"] > 5.0


def test_metrics_of_several_parts_merge_max_and_sum():
    first = QKClipMetrics(["layers.0.attention"], torch.tensor([3.0]), torch.tensor(2), torch.tensor(0))
    second = QKClipMetrics(["layers.1.attention", "layers.2.attention"], torch.tensor([7.0, -1.0]), torch.tensor(1), torch.tensor(1))
    assert read_metrics([first, second]) == {
        "qk_clip/max_logit/layers.0.attention": 3.0,
        "qk_clip/max_logit/layers.1.attention": 7.0,
        "qk_clip/max_logit/layers.2.attention": -1.0,
        "qk_clip/max_logit": 7.0,
        "qk_clip/heads_clipped": 3,
        "qk_clip/nonfinite_heads": 1,
    }
    assert read_metrics([]) == {}


def test_recording_traces_under_compile_fullgraph():
    """One llama3 attention module compiled whole with the hook inside (aot_eager: tracing and
    functionalization of the buffer update, without inductor's minutes of C++ compilation)."""
    model = MODELS["gqa"]()
    attention = model.layers["0"].attention
    recorder = MaxLogitRecorder([attention], block_bytes=3 * 12 * 4 * 5)  # 5 query rows of 3 KV heads a block: 5 + 5 + 2
    x = torch.randn(2, 12, 36, generator=torch.Generator().manual_seed(0))
    freqs_cis = model.freqs_cis[:12]
    expected_out = attention(x, freqs_cis, None)
    expected = recorder.max_logits.clone()
    recorder.reset()
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, freqs_cis, None), expected_out)
    torch.testing.assert_close(recorder.max_logits, expected)  # same ops, same order: equal up to fp32 rounding
    assert torch.isfinite(expected[0, :9]).all()


def test_the_all_reduce_sees_only_device_tensors():
    """A process group with a backend for `meta` only rejects CPU tensors, as NCCL does (the
    first assertion shows it): the max-logit reduce of a meta model goes through it."""
    from torch.testing._internal.distributed import fake_pg

    if "meta_only" not in dist.Backend.backend_list:
        dist.Backend.register_backend("meta_only", fake_pg._create_fake_pg, extended_api=True, devices=["meta"])
    dist.init_process_group("meta:meta_only", store=fake_pg.FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.zeros(2))
        with torch.device("meta"):
            model = MODELS["mla"]()
        qk_clip = QKClip(model, tau=1.0, group=[dist.group.WORLD, dist.group.WORLD])
        model(torch.zeros(2, 12, dtype=torch.long, device="meta"))
        with OpCounter() as counter:
            qk_clip.reduce_and_clip(lr=1.0)
        assert sum(n for op, n in counter.ops.items() if "allreduce" in str(op)) == 2  # one per group
    finally:
        dist.destroy_process_group()


HELD_ROWS_PLACEMENTS = {
    (2, 2): [
        (Shard(0), Shard(0)),
        (_StridedShard(0, split_factor=2), Shard(0)),  # FSDP2 on top of tensor parallel
        (Replicate(), Shard(0)),  # tensor parallel only, or HSDP replicate × TP
        (Shard(0), Replicate()),
        (Shard(1), Shard(0)),  # a column shard leaves every row in place
    ],
    (2, 2, 2): [(Replicate(), _StridedShard(0, split_factor=2), Shard(0))],  # HSDP on top of TP
}


@pytest.mark.parametrize("mesh_shape", sorted(HELD_ROWS_PLACEMENTS))
def test_held_rows_match_dtensor_sharding(mesh_shape):
    """Ground truth is DTensor itself: ``distribute_tensor(..., src_data_rank=None)`` splits with
    DTensor's own placement code (no communication), for every rank of a fake group in turn."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = math.prod(mesh_shape)
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            for rows in (16, 13, 3, 0):  # even, uneven, fewer rows than shards, empty
                row_ids = torch.arange(rows)
                for placements in HELD_ROWS_PLACEMENTS[mesh_shape]:
                    weight = distribute_tensor(row_ids[:, None].expand(rows, 2), mesh, placements, src_data_rank=None)
                    assert list(range(*held_rows(weight))) == weight.to_local()[:, 0].tolist(), (rank, rows, placements)
                    bias_placements = [Replicate() if getattr(p, "dim", 0) == 1 else p for p in placements]  # a bias has no columns
                    bias = distribute_tensor(row_ids, mesh, bias_placements, src_data_rank=None)
                    assert list(range(*held_rows(bias))) == bias.to_local().tolist()
            heads = distribute_tensor(torch.arange(8)[None, :, None, None].expand(2, 8, 3, 4), mesh, [Replicate()] * (len(mesh_shape) - 1) + [Shard(1)], src_data_rank=None)
            assert list(range(*held_rows(heads, dim=1))) == heads.to_local()[0, :, 0, 0].tolist()  # q (B, H, L, D) of a TP rank
        finally:
            dist.destroy_process_group()
    assert held_rows(torch.zeros(7, 3)) == (0, 7)
