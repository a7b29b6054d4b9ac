"""QK-clip under tensor and pipeline parallelism on 4 gloo ranks: the same clip as one process.

One 4-rank job (spawning ranks is the expensive part) runs three layouts, each checked by its
own test against one-process references:

* ``tp``: torchtitan's own TP plans (llama3 ``apply_tp``, deepseek_v3 ``apply_non_moe_tp``) on
  the ``tp`` dimension of a (dp 2 × tp 2) mesh, data parallel replicated: every rank computes
  only its heads and holds only their rows (``Shard(0)`` on ``tp``);
* ``tp_compiled``: ``tp`` for GQA with each block under ``torch.compile(fullgraph=True)``;
* ``fsdp_tp``: the same with FSDP2 on ``dp`` on top (``_StridedShard(0)`` × ``Shard(0)``),
  reduced over the product of the dp and tp groups, as under pipeline parallel;
* ``pp``: torchtitan's ``ParallelDims`` with pp 2 × fsdp 2, pipeline stages of different
  layer counts (stage 1 also has a part without attention): each stage reduces over its own
  ranks only, so stage 0 is not clipped because of stage 1's logits.

Head rows straddle the FSDP boundary: GQA wq has 18 rows per TP rank (3 heads of 6; FSDP
9/9), MLA wkv_b 39 rows per TP rank (3 heads of 13; FSDP 20/19, uneven).
"""

import copy
from types import SimpleNamespace

import pytest
import torch
from distributed import run_distributed
from test_clip import boost, llama, mla, tau_between, tokens
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from titan_muon.attention.clip import QKClip, build_qk_clips, read_metrics
from titan_muon.attention.logits import held_rows

BATCH = 4
KINDS = {
    "gqa": lambda: llama(n_heads=6, n_kv_heads=2, head_dim=6),  # 3 Q heads per K head; 1 K head per TP rank
    "mla": lambda: mla(n_heads=6),
    "mla_lora": lambda: mla(8, n_heads=6),
}
BOOSTED = {"gqa": [0, 1, 2, 3], "mla": [1, 4], "mla_lora": [1, 4]}  # both TP ranks; GQA: group 0 whole, group 1 partly


def boosted(kind):
    model = KINDS[kind]()
    return model, boost(model, kind, BOOSTED[kind])


def full_params(model):
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
    return {n.replace("_orig_mod.", ""): p for n, p in full.items()}  # compiled blocks add _orig_mod


def one_process_clip(kind):
    """Record on the whole batch, pick tau between the boosted heads and the rest, clip."""
    model, mask = boosted(kind)
    qk_clip = QKClip(model, tau=1.0)
    with torch.no_grad():
        model(tokens(0, BATCH))
    qk_clip.tau = tau_between(qk_clip.recorder.max_logits, mask)
    metrics = dict(qk_clip.reduce_and_clip(lr=1.0))
    return qk_clip.tau, metrics, full_params(model)


def tensor_parallel(model, kind, tp_mesh):
    if kind == "gqa":
        from torchtitan.models.llama3.infra.parallelize import apply_tp

        apply_tp(model, tp_mesh, loss_parallel=False, enable_float8_tensorwise_tp=False)
    else:
        from torchtitan.models.deepseek_v3.infra.parallelize import apply_non_moe_tp

        apply_non_moe_tp(model, tp_mesh, loss_parallel=False, enable_float8_tensorwise_tp=False, cp_enabled=False)


def _tp_layouts(taus):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batch = tokens(0, BATCH).chunk(2)[mesh["dp"].get_local_rank()]
    out = {}
    for layout in ("tp", "fsdp_tp", "tp_compiled"):
        for kind, tau in taus.items():
            if layout == "tp_compiled" and kind != "gqa":
                continue
            model, _ = boosted(kind)
            tensor_parallel(model, kind, mesh["tp"])
            if layout == "tp_compiled":  # as torchtitan compiles: each block whole, hook inside
                for name, block in model.layers.named_children():
                    model.layers.register_module(name, torch.compile(block, fullgraph=True, backend="aot_eager"))
            group = None  # the world: dp × tp, what the adapter uses without pipeline parallel
            if layout == "fsdp_tp":
                for block in model.layers.values():
                    fully_shard(block, mesh=mesh["dp"])
                fully_shard(model, mesh=mesh["dp"])
                group = [mesh["dp"].get_group(), mesh["tp"].get_group()]  # the product form used under PP
            qk_clip = QKClip(model, tau=tau, group=group)
            with torch.no_grad():
                model(batch)
            metrics = dict(qk_clip.reduce_and_clip(lr=1.0))
            weights = {n: p for n, p in model.named_parameters() if n.endswith(("wq.weight", "wq_b.weight", "wkv_b.weight"))}
            out[layout, kind] = dict(
                metrics=metrics,
                params=full_params(model),
                placements={n: tuple(p.placements) for n, p in weights.items()},
                # the rows each rank says it holds, checked against the gathered weight
                held_rows_match=[  # a list, not a generator: every rank gathers every weight
                    torch.equal(p.to_local(), p.full_tensor()[slice(*held_rows(p))]) for p in weights.values()
                ],
            )
    return out


def pipeline_stages(full):
    """torchtitan-style stages (layers keep their global ids): stage 0 = embeddings + layers 0, 1;
    stage 1 = layer 2, and a second part with only norm + output (no attention)."""

    def part(layers, first, last):
        stage = copy.deepcopy(full)
        for name in list(stage.layers):
            if name not in layers:
                del stage.layers[name]
        if not first:
            stage.tok_embeddings = None
        if not last:
            stage.norm, stage.output = None, None
        return stage

    return [[part({"0", "1"}, True, False)], [part({"2"}, False, False), part(set(), False, True)]]


def pp_model():
    model = llama(n_heads=6, n_kv_heads=2, head_dim=6, n_layers=3)
    with torch.no_grad():
        model.layers["2"].attention.wq.weight *= 4  # stage 1's logits dwarf stage 0's
    return model


def run_stage(parts, batch, qk_clips):
    h = batch
    with torch.no_grad():
        for part in parts:
            h = part(h)
    metrics = read_metrics([clip.reduce_and_clip(lr=1.0) for clip in qk_clips if clip is not None])
    return metrics, [full_params(part) for part in parts]


def _pipeline(tau):
    from titan_muon.torchtitan.cpu import use_cpu_device
    from titan_muon.torchtitan.qk_clip import build_model_part_qk_clips, qk_clip_group

    use_cpu_device()
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=2, ep=1, etp=1, world_size=4)
    stage, dp_rank = dims.get_mesh("pp").get_local_rank(), dims.get_mesh("fsdp").get_local_rank()
    full = pp_model()
    stages = pipeline_stages(full)
    batch = tokens(0, BATCH).chunk(2)[dp_rank]
    if stage == 1:  # this stage's input: stage 0's output for the same micro-batch
        with torch.no_grad():
            batch = stages[0][0](batch)
    parts = stages[stage]
    for part in parts:
        for block in part.layers.values():
            fully_shard(block, mesh=dims.get_mesh("fsdp"))
        fully_shard(part, mesh=dims.get_mesh("fsdp"))
    groups = qk_clip_group(dims)
    qk_clips = build_model_part_qk_clips(parts, SimpleNamespace(qk_clip_tau=tau, qk_clip_alpha=0.5, qk_clip_recording="auto"), dims)
    metrics, params = run_stage(parts, batch, qk_clips)
    return dict(stage=stage, group_sizes=[g.size() for g in groups], skipped=[c is None for c in qk_clips], metrics=metrics, params=params)


def _rank(rank, world, taus, pp_tau):
    return dict(_tp_layouts(taus), pp=_pipeline(pp_tau))


def pp_reference():
    """Per stage, one process: the stage's parts on the whole batch, reduced over nothing."""
    full = pp_model()
    qk_clip = QKClip(full, tau=1.0)
    with torch.no_grad():
        full(tokens(0, BATCH))
    stage0_max, stage1_max = qk_clip.recorder.max_logits[:2].max().item(), qk_clip.recorder.max_logits[2].max().item()
    assert stage1_max > 1.5 * stage0_max, (stage0_max, stage1_max)
    tau = (stage0_max + stage1_max) / 2
    qk_clip.remove()
    stages = pipeline_stages(full)
    initial = [[full_params(part) for part in parts] for parts in stages]
    stage1_input = stages[0][0](tokens(0, BATCH)).detach()
    expected = []
    for parts, batch in zip(stages, (tokens(0, BATCH), stage1_input)):
        clips = build_qk_clips(parts, tau, 0.5, allow_parts_without_attention=True)
        expected.append(run_stage(parts, batch, clips))
    return tau, initial, expected


@pytest.fixture(scope="module")
def four_ranks():
    references = {kind: one_process_clip(kind) for kind in KINDS}
    pp_tau, pp_initial, pp_expected = pp_reference()
    taus = {kind: reference[0] for kind, reference in references.items()}
    results = run_distributed(_rank, 4, taus, pp_tau, timeout=600)
    return references, (pp_initial, pp_expected), results


def check_equal_to_one_process(result, reference):
    _, metrics, params = reference
    assert metrics["qk_clip/heads_clipped"] > 0
    # Logits agree to fp32 rounding: TP sums the output projection in another order between
    # layers (~1e-7 relative). Clipped rows are multiplied by gamma^alpha with gamma = tau / S,
    # so they inherit S's relative error (~1e-7); 1e-5 relative leaves room for other kernels.
    assert result["metrics"] == pytest.approx(metrics, rel=1e-5, abs=1e-6)
    for name, p in params.items():
        torch.testing.assert_close(result["params"][name], p, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_tensor_parallel_clip_equals_one_process(four_ranks, kind):
    references, _, results = four_ranks
    for result in results:
        got = result["tp", kind]
        assert all(p == (Shard(0),) for p in got["placements"].values()), got["placements"]
        assert all(got["held_rows_match"])
        check_equal_to_one_process(got, references[kind])


def test_tensor_parallel_recording_traces_under_compile(four_ranks):
    references, _, results = four_ranks
    for result in results:
        check_equal_to_one_process(result["tp_compiled", "gqa"], references["gqa"])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fsdp_on_tensor_parallel_clip_equals_one_process(four_ranks, kind):
    references, _, results = four_ranks
    for result in results:
        got = result["fsdp_tp", kind]
        assert all(p == (_StridedShard(0, split_factor=2), Shard(0)) for p in got["placements"].values()), got["placements"]
        assert all(got["held_rows_match"])
        check_equal_to_one_process(got, references[kind])


def test_pipeline_stages_reduce_and_clip_on_their_own(four_ranks):
    _, (initial, expected), results = four_ranks
    assert [r["pp"]["stage"] for r in results] == [0, 0, 1, 1]
    for result in results:
        got, stage = result["pp"], result["pp"]["stage"]
        assert got["group_sizes"] == [2]  # the stage's fsdp ranks, never the pp dimension
        assert got["skipped"] == ([False] if stage == 0 else [False, True])  # norm + output: nothing to clip
        metrics, params = expected[stage]
        assert got["metrics"] == pytest.approx(metrics, rel=1e-5)  # as in check_equal_to_one_process
        assert {key for key in got["metrics"] if key.count("/") == 2} == {
            f"qk_clip/max_logit/layers.{layer}.attention" for layer in ((0, 1) if stage == 0 else (2,))
        }  # keyed by global layer id
        for got_part, part, before in zip(got["params"], params, initial[stage]):
            for name, p in part.items():
                torch.testing.assert_close(got_part[name], p, rtol=1e-5, atol=1e-6)
            if stage == 0:  # stage 1's far larger logits must not reach stage 0
                assert all(torch.equal(got_part[name], p) for name, p in before.items())
    assert expected[0][0]["qk_clip/heads_clipped"] == 0 and expected[1][0]["qk_clip/heads_clipped"] > 0
