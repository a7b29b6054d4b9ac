"""On a CUDA machine (skipped elsewhere): the step on real GPU tensors over a one-rank NCCL group.

scripts/gpu_check.sh runs this file. It checks what the meta suite can only simulate: the
results equal the CPU's (fp32 NS) and bf16 NS stays close, no collective sees a CPU tensor,
and the step reads the device from the host at most twice.
"""

import os

import pytest
import torch
import torch.distributed as dist
from common import grads_for, make_params, run_titan
from scale_replay.meta_device import DeviceAudit
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan_muon import Muon

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")

MUON = {"a", "b", "c", "d"}
SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw", exchange_memory_mb=0.01)


@pytest.fixture(scope="module")
def nccl_world():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


def _cuda_run(mesh, steps, **overrides):
    params = make_params()
    module = torch.nn.Module()
    for name, full in params.items():
        module.register_parameter(name, torch.nn.Parameter(distribute_tensor(full.cuda(), mesh, [Shard(0)])))
    named = dict(module.named_parameters())
    groups = [{"params": [(n, named[n]) for n in named if n in MUON]},
              {"params": [(n, named[n]) for n in named if n not in MUON], "use_muon": False}]  # fmt: skip
    opt = Muon(groups, **{**SETTINGS, **overrides})
    audits = []
    for s in range(steps):
        for n, g in grads_for(s, params).items():
            named[n].grad = distribute_tensor(g.cuda(), mesh, [Shard(0)])
        audit = DeviceAudit("cuda")
        with audit:
            opt.step()
        audits.append(audit)
    return {n: p.full_tensor().cpu() for n, p in named.items()}, audits


def test_cuda_step_equals_cpu_and_is_device_clean(nccl_world):
    ours, audits = _cuda_run(nccl_world, 3, ns_dtype="fp32", comm_dtype="fp32")
    expected, _ = run_titan(make_params(), 3, MUON, **SETTINGS)
    for name, tensor in expected.items():
        # fp32 on both; GPU GEMMs sum in another order (and may use TF32 if enabled: it is not).
        assert (ours[name] - tensor).abs().max() <= 1e-4 * tensor.abs().max(), name
    for audit in audits[1:]:
        assert audit.foreign_collectives == [] and audit.host_to_device == 0 and audit.host_syncs <= 2


def test_cuda_bf16_newton_schulz_stays_close(nccl_world):
    ours, _ = _cuda_run(nccl_world, 3)  # "auto": bf16 NS and bf16 traffic on CUDA
    expected, _ = run_titan(make_params(), 3, MUON, **SETTINGS)
    initial = make_params()
    for name in MUON:
        change = (expected[name] - initial[name]).abs().max()
        # bf16 NS (8-bit mantissa) moves each update by a few 2^-8 of its size.
        assert (ours[name] - expected[name]).abs().max() <= 0.05 * change, name


def test_cuda_recording_reads_q_and_k_in_place():
    """Max-logit recording on CUDA (not run without a GPU so far): cuBLAS's strided batched GEMM
    reads torchtitan's (B, L, H, D) views of q and k in place, so the peak extra memory is the
    logits buffer (within the 64 MiB budget) plus small terms, and the maxima equal a dense bf16
    reference within one bf16 ulp (fp32 accumulation in both, one rounding to bf16)."""
    from titan_muon.attention.logits import (
        ACCELERATOR_BLOCK_BYTES,
        block_max_logits,
        block_rows,
    )

    g = torch.Generator(device="cuda").manual_seed(0)
    seq, q_heads, kv_heads, dim = 4096, 32, 8, 128  # a Llama-3-8B layer
    q = torch.randn(1, seq, q_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k = torch.randn(1, seq, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    block_max_logits(q, k)  # warm-up: cuBLAS workspace
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = block_max_logits(q, k)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    rows = block_rows(q, k)
    logits = kv_heads * rows * seq * 2
    assert logits <= ACCELERATOR_BLOCK_BYTES
    # + the (rows, rows) diagonal mask, the per-block maxima, scalars (each rounded up to 512 B)
    assert extra <= logits + rows * rows + (1 << 20), (extra, logits)
    dense = q @ k.repeat_interleave(q_heads // kv_heads, dim=1).transpose(-1, -2)
    dense.masked_fill_(torch.ones(seq, seq, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    expected = dense.amax(dim=(0, 2, 3)).float() * dim**-0.5
    torch.testing.assert_close(got, expected, rtol=2.0**-7, atol=0)


def test_cuda_fp16_normalization_casts_in_registers():
    """fp16 NS on a GPU scales a bf16 input without an fp32 copy (newton_schulz._normalized): no
    allocation beyond the result and the workspace (workspace_bytes charges no staging buffer),
    and the scaled input equals the CPU's staged fp32 arithmetic up to the fp32 norm's summation
    order: one fp16 rounding of |x| / ‖x‖ either way, so within one fp16 ulp (eps16·|value|)."""
    from titan_muon.algorithm.newton_schulz import _normalized, workspace_bytes
    from titan_muon.buffers import FreshBuffers

    gen = torch.Generator().manual_seed(3)
    m = (torch.randn(3, 512, 2048, generator=gen) * 1e-6).bfloat16()
    results = {}
    for device in ("cpu", "cuda"):
        x = torch.empty(m.shape, dtype=torch.float16, device=device)
        norm = torch.empty(3, 1, 1, dtype=torch.float32, device=device)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _normalized(m.to(device), x, norm, 1e-7, 1.0, FreshBuffers(torch.device(device)))
        if device == "cuda":
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before - m.numel() * 2  # the input's own copy on the GPU
            assert extra <= 1024, extra  # the norm reduction's few bytes of scratch at most
        results[device] = x.float().cpu()
    eps16 = torch.finfo(torch.float16).eps
    assert ((results["cpu"] - results["cuda"]).abs() <= eps16 * results["cpu"].abs() + 1e-7).all()
    assert workspace_bytes(1, 512, 2048, "gram", torch.float16, "cuda") < workspace_bytes(1, 512, 2048, "gram", torch.float16, "cpu")


def test_cuda_commit_pass_sums_its_squares_in_its_own_kernels():
    """With muon/update_rms measured, the compiled commit pass (Elementwise.decay_and_step_ with
    update_sq) writes the weights inside the reduction that sums Σ R², so R is read once: its
    Triton kernels are reductions (triton_red / triton_per; a large block's reduction may be split
    in two), none a separate pointwise pass (triton_poi). Its weights equal the unmeasured pass's,
    and its sum equals an fp64 one within fp32 summation (n·eps32 relative)."""
    from titan_muon.algorithm.update import Elementwise, commit_scale

    passes = Elementwise(compiled=True)
    gen = torch.Generator().manual_seed(7)
    weights = torch.randn(4096, 2048, generator=gen).cuda()
    returned = torch.randn(4096, 2048, generator=gen).bfloat16().cuda()
    update_sq, scratch = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    measured, plain = weights.clone(), weights.clone()
    passes.decay_and_step_([measured], [returned], 0.02, 0.1, update_sq, scratch)  # compiles
    passes.decay_and_step_([plain], [returned], 0.02, 0.1)
    assert torch.equal(measured, plain)
    exact = (returned.double() * (0.02 / commit_scale(0.1))).square().sum().item()
    assert abs(update_sq.item() - exact) <= returned.numel() * torch.finfo(torch.float32).eps * exact
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        passes.decay_and_step_([measured], [returned], 0.02, 0.1, update_sq, scratch)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    triton = [n for n in names if n.startswith("triton_")]
    assert triton and not any(n.startswith("triton_poi") for n in triton), names
