"""One process: titan_muon.Muon against torch.optim.Muon, torch.optim.AdamW and a plain fp32 reference."""

import copy

import pytest
import torch
from common import SHAPES, grads_for, make_params, max_rel, run_titan
from reference import ReferenceMuonAdamW
from torch import nn

from titan_muon import Muon, build_param_groups
from titan_muon.algorithm.newton_schulz import newton_schulz_flops


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw", "spectral_unclamped"])
def test_matches_fp32_reference(nesterov, adjust_lr_fn):
    """The reference computes each adjust_lr_fn from its formula; "spectral_unclamped" (√(A/B))
    differs from "original" (√max(1, A/B)) on the wide matrices a (30 × 64) and c (3 × 256)."""
    params = make_params()
    muon_names = {"a", "b", "c", "d"}
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ours, _ = run_titan(params, 4, muon_names, adamw_betas=(0.9, 0.99), adamw_eps=1e-8, **kwargs)
    ref = ReferenceMuonAdamW(betas=(0.9, 0.99), eps=1e-8, **kwargs)
    expected = {n: p.clone() for n, p in params.items()}
    for s in range(4):
        ref.step(expected, grads_for(s, params), {n: n in muon_names for n in params})
    # Same math in another order (NS's polynomial fused into addmm vs term by term, AdamW's
    # bias corrections): each of 4 updates (<= 0.08) rounded in fp32 and moved by NS's small
    # gain on full-rank random gradients (~20): ~1e-7 of the largest weight (~4).
    assert max_rel(ours, expected) <= 1e-6


def test_matches_torch_optim_muon_with_bf16_newton_schulz():
    """torch.optim.Muon runs NS in bf16; with ns_dtype="bf16" we run the same kernel sequence."""
    params = make_params(shapes={k: v for k, v in SHAPES.items()})
    for adjust in ("original", "match_rms_adamw"):
        ours, _ = run_titan(params, 3, set(params), lr=0.01, weight_decay=0.1, adjust_lr_fn=adjust, ns_dtype="bf16")
        tensors = {n: nn.Parameter(p.clone()) for n, p in params.items()}
        torch_opt = torch.optim.Muon(list(tensors.values()), lr=0.01, weight_decay=0.1, adjust_lr_fn=adjust)
        for s in range(3):
            for n, g in grads_for(s, params).items():
                tensors[n].grad = g
            torch_opt.step()
        # Same bf16 kernels; the update is only scaled in a different order (lr·(s·O) vs (lr·s)·O).
        assert max_rel(ours, {n: t.detach() for n, t in tensors.items()}) <= 1e-5
        # fp32 NS differs from torch's bf16 NS by bf16 rounding only.
        ours32, _ = run_titan(params, 3, set(params), lr=0.01, weight_decay=0.1, adjust_lr_fn=adjust)
        deltas = {n: ours32[n] - params[n] for n in params}
        torch_deltas = {n: tensors[n].detach() - params[n] for n in params}
        assert max_rel(deltas, torch_deltas) <= 0.05


@pytest.mark.parametrize("ns_algorithm", ["gram", "auto"])
def test_gram_newton_schulz_matches_the_standard_reference(ns_algorithm):
    """Gram NS evaluates the same polynomial as the reference's standard NS, in another order.

    Shapes where "auto" picks gram (short side >= 128, aspect >= 2.5; wide and tall) and one
    where it does not. Bound: in fp32 both algorithms stay within 3.3e-4 (spectral norm, so per
    entry) of the exact polynomial for Keller's 5 steps (docs/newton_schulz.md, the a-priori
    envelope), so their outputs differ by <= 6.6e-4 per entry; each of `steps` updates scales
    that by lr times the shape factor, and momentum does not depend on the parameters.
    """
    shapes = {"mlp_up": (128, 384), "mlp_down": (384, 128), "square": (64, 64)}
    params = make_params(shapes=shapes)
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="original")
    steps = 3
    ours, opt = run_titan(params, steps, set(shapes), ns_algorithm=ns_algorithm, **kwargs)
    ref = ReferenceMuonAdamW(**kwargs)
    expected = {n: p.clone() for n, p in params.items()}
    for s in range(steps):
        ref.step(expected, grads_for(s, params), {n: True for n in params})
    for name, (rows, cols) in shapes.items():
        bound = steps * kwargs["lr"] * max(1, rows / cols) ** 0.5 * 2 * 3.3e-4
        assert (ours[name] - expected[name]).abs().max() <= bound, name
    # The FLOP metric reports what ran: gram on the rectangular matrices, and on the square one
    # only when forced.
    square = "gram" if ns_algorithm == "gram" else "standard"
    expected_flops = 2 * newton_schulz_flops(128, 384, 5, "gram") + newton_schulz_flops(64, 64, 5, square)
    assert opt.last_step_metrics["muon/ns_flops"] == expected_flops


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_adamw_groups_match_torch_adamw(implementation):
    params = make_params()
    settings = dict(lr=3e-3, weight_decay=0.05)
    ours, _ = run_titan(params, 5, set(), adamw_betas=(0.8, 0.9), adamw_eps=1e-7, adamw_implementation=implementation, **settings)
    tensors = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    kernel = dict(foreach=implementation == "foreach", fused=implementation == "fused")
    torch_opt = torch.optim.AdamW(list(tensors.values()), betas=(0.8, 0.9), eps=1e-7, **kernel, **settings)
    for s in range(5):
        for n, g in grads_for(s, params).items():
            tensors[n].grad = g
        torch_opt.step()
    # torch's own kernel on the same tensors (ours passes lr, betas, eps through): rounding only.
    assert max_rel(ours, {n: t.detach() for n, t in tensors.items()}) <= 1e-6


@pytest.mark.parametrize("momentum_dtype", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_load_state_dict_keeps_muon_state_dtypes(momentum_dtype, param_dtype):
    """torch.optim.Optimizer.load_state_dict casts floating-point state to the parameter's dtype;
    Muon's momentum (fp32 under bf16 weights, fp8 codes as uint8) must come back as saved."""
    shapes = {"w": (16, 24), "b": (24,)}
    g = torch.Generator().manual_seed(0)
    tensors = {n: nn.Parameter(torch.randn(s, generator=g).to(param_dtype)) for n, s in shapes.items()}

    def build(ts, implementation="fused"):
        groups = [{"params": [("w", ts["w"])]}, {"params": [("b", ts["b"])], "use_muon": False}]
        return Muon(groups, lr=0.01, momentum_dtype=momentum_dtype, adamw_implementation=implementation)

    def set_grads(ts, step):
        g = torch.Generator().manual_seed(step)
        for n, t in ts.items():
            t.grad = torch.randn(t.shape, generator=g).to(param_dtype)

    saved = build(tensors)
    set_grads(tensors, 0)
    saved.step()
    copies = {n: nn.Parameter(t.detach().clone()) for n, t in tensors.items()}
    loaded = build(copies, implementation="for-loop")  # another AdamW kernel: its step counter moves
    loaded.load_state_dict(copy.deepcopy(saved.state_dict()))  # torch shares tensors with the dict
    for key, value in saved.state[tensors["w"]].items():
        assert loaded.state[copies["w"]][key].dtype == value.dtype, key
        assert torch.equal(loaded.state[copies["w"]][key], value), key
    assert loaded.state[copies["b"]]["step"].dtype == torch.float32
    assert loaded.local_state_bytes() == saved.local_state_bytes()
    set_grads(tensors, 1)
    set_grads(copies, 1)
    saved.step()
    loaded.step()
    assert torch.equal(copies["w"], tensors["w"])
    # One AdamW step by two kernels from the same state: fused rounds the new weight once, the
    # for-loop kernel after its decay and its update (its fp32 update math differs far below
    # that): at most two roundings of the largest weight apart.
    bound = 2 * torch.finfo(param_dtype).eps * tensors["b"].abs().max().item()
    assert (copies["b"] - tensors["b"]).abs().max().item() <= bound


def test_lr_zero_step_creates_state_and_changes_no_parameter():
    params = make_params()
    tensors = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    opt = Muon([{"params": [tensors[n] for n in "abc"]}, {"params": [tensors[n] for n in "de"], "use_muon": False}], lr=0.0)
    for n, t in tensors.items():
        t.grad = torch.randn_like(t)
    opt.step()
    for n, t in tensors.items():
        assert torch.equal(t.detach(), params[n])
        assert opt.state[t]
    assert set(opt.state[tensors["a"]]) == {"momentum_buffer"}
    assert set(opt.state[tensors["d"]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_state_is_created_for_parameters_without_gradients():
    w, v = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    opt = Muon([w, v], lr=0.1)
    w.grad = torch.randn(8, 8)
    before = v.detach().clone()
    opt.step()
    assert set(opt.state[v]) == {"momentum_buffer"} and torch.equal(v.detach(), before)


def test_non_matrix_in_muon_group_is_named():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"'0\.bias' has shape \(8,\)"):
        Muon(list(model.named_parameters()))


@pytest.mark.parametrize(
    "group,match",
    [
        ({"params": [("x", nn.Parameter(torch.randn(8)))]}, r"'x' has shape \(8,\)"),  # refused while planning
        ({"params": [("x", nn.Parameter(torch.randn(8, 8)))], "momentum": 1.5}, "momentum"),  # by the settings check
        ({"params": [("x", nn.Parameter(torch.randn(8, 8)))], "eps": 1e-6, "ns_eps": 1e-5}, "'eps'=1e-06 and 'ns_eps'=1e-05"),
        ({"params": [("x", nn.Parameter(torch.randn(4, 8, 8)))]}, "matrix_stacks=True"),
        ({"params": [("x", torch.zeros(8, dtype=torch.int64))], "use_muon": False}, "floating-point"),
        # refused by the re-planning itself, which then plans the layout without it again
        ({"params": [("x", nn.Parameter(torch.randn(8, 8, device="meta")))]}, "several devices"),
    ],
)
def test_a_refused_param_group_leaves_nothing_behind(group, match):
    """add_param_group that raises adds nothing: the group is not in param_groups (nor saved),
    and the optimizer steps exactly like one that never saw it."""
    params = make_params()
    _, untouched = run_titan(params, 1, {"a", "b"}, lr=0.01)
    _, refused = run_titan(params, 1, {"a", "b"}, lr=0.01)
    with pytest.raises(ValueError, match=match):
        refused.add_param_group(group)
    assert len(refused.param_groups) == 2 and len(refused.state_dict()["param_groups"]) == 2
    for opt in (untouched, refused):
        tensors = [p for g in opt.param_groups for p in g["params"]]
        for p, g in zip(tensors, grads_for(1, params).values()):
            p.grad = g
        opt.step()
    for before, after in zip(*[[p for g in o.param_groups for p in g["params"]] for o in (untouched, refused)]):
        assert torch.equal(before, after)
    assert set(refused.state_dict()["state"]) == set(untouched.state_dict()["state"])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(momentum=1.0), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(adjust_lr_fn="rms"), "adjust_lr_fn"),
        (dict(ns_coefficients="cubic"), "ns_coefficients"),
        (dict(ns_algorithm="fast"), "ns_algorithm"),
        (dict(ns_dtype="fp8"), "ns_dtype"),
        (dict(comm_dtype="fp16"), "comm_dtype"),  # fp16 NS yes (it scales first), fp16 on the wire no
        (dict(comm_dtype="int8"), "comm_dtype"),
        (dict(lr=-1.0), "lr"),
        (dict(nonfinite_grads="ignore"), "nonfinite_grads"),
        (dict(adamw_implementation="apex"), "adamw_implementation"),
    ],
)
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon([nn.Parameter(torch.randn(4, 4))], **kwargs)


def test_nonfinite_gradient_raises_or_skips_without_touching_state():
    for policy in ("raise", "skip"):
        w = nn.Parameter(torch.randn(8, 8))
        b = nn.Parameter(torch.randn(8))
        opt = Muon([{"params": [("w", w)]}, {"params": [("b", b)], "use_muon": False}], lr=0.1, nonfinite_grads=policy)
        w.grad, b.grad = torch.randn(8, 8), torch.randn(8)
        opt.step()
        state = copy.deepcopy(opt.state_dict())
        before = (w.detach().clone(), b.detach().clone())
        w.grad, b.grad = torch.randn(8, 8), torch.full((8,), float("nan"))
        if policy == "raise":
            with pytest.raises(FloatingPointError, match=r"\['b'\]"):
                opt.step()
        else:
            opt.step()
            assert opt.last_step_metrics["muon/skipped_steps"] == 1
        assert torch.equal(w.detach(), before[0]) and torch.equal(b.detach(), before[1])
        after = opt.state_dict()
        assert torch.equal(after["state"][0]["momentum_buffer"], state["state"][0]["momentum_buffer"])
        assert torch.equal(after["state"][1]["exp_avg"], state["state"][1]["exp_avg"])


def test_state_dict_round_trip_and_refuses_a_changed_split():
    params = make_params()
    _, opt = run_titan(params, 2, {"a", "b"}, lr=0.01)
    saved = opt.state_dict()
    _, fresh = run_titan(params, 0, {"a", "b"}, lr=0.01)
    fresh.load_state_dict(copy.deepcopy(saved))
    assert torch.equal(fresh.state_dict()["state"][0]["momentum_buffer"], saved["state"][0]["momentum_buffer"])
    # Same group sizes, Muon and AdamW swapped: refused before anything is loaded.
    tensors = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    swapped = Muon([{"params": [tensors["a"], tensors["b"]], "use_muon": False}, {"params": [tensors[n] for n in "cde"]}])
    with pytest.raises(ValueError, match="param group 0 was saved with use_muon=True"):
        swapped.load_state_dict(copy.deepcopy(saved))
    assert not swapped.state
    # The same groups but state written by another optimizer (AdamW keys on a Muon param).
    forged = copy.deepcopy(saved)
    forged["state"][0] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(30, 64), "exp_avg_sq": torch.zeros(30, 64)}
    with pytest.raises(ValueError, match=r"saved state of .* has keys \['exp_avg', 'exp_avg_sq', 'step'\]"):
        fresh.load_state_dict(forged)


def test_build_param_groups_splits_a_transformer_the_usual_way():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm = nn.RMSNorm(16)
            self.wq = nn.Linear(16, 16, bias=False)
            self.w1 = nn.Linear(16, 32, bias=True)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(50, 16)
            self.layers = nn.ModuleList([Block(), Block()])
            self.norm = nn.RMSNorm(16)
            self.output = nn.Linear(16, 50, bias=False)

    model = Model()
    muon, adamw = build_param_groups(model, adamw_lr=1e-3, adamw_patterns=["layers.1.w1.*"])
    assert muon["use_muon"] and not adamw["use_muon"] and adamw["lr"] == 1e-3 and "lr" not in muon
    assert muon["param_names"] == ["layers.0.wq.weight", "layers.0.w1.weight", "layers.1.wq.weight"]
    assert set(adamw["param_names"]) == {
        "tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention_norm.weight",
        "layers.0.w1.bias", "layers.1.attention_norm.weight", "layers.1.w1.weight", "layers.1.w1.bias",
    }  # fmt: skip
    opt = Muon(build_param_groups(model), lr=0.01)
    loss = model.output(model.layers[0].w1(model.layers[0].wq(model.tok_embeddings(torch.tensor([1, 2]))))[:, :16]).sum()
    loss.backward()
    opt.step()


def test_fp8_momentum_tracks_fp32_and_costs_about_one_byte():
    params = make_params()
    fp32, _ = run_titan(params, 10, set(params), lr=0.02, weight_decay=0.0)
    fp8, opt = run_titan(params, 10, set(params), lr=0.02, weight_decay=0.0, momentum_dtype="fp8")
    deltas = {n: fp8[n] - params[n] for n in params}
    reference = {n: fp32[n] - params[n] for n in params}
    error = max(((deltas[n] - reference[n]).norm() / reference[n].norm()).item() for n in params)
    assert 0 < error < 0.1, error  # white-noise gradients: the worst case for quantized momentum
    state = next(iter(opt.state.values()))
    assert set(state) == {"momentum_fp8", "momentum_exp", "step"}
    assert opt.storage.bytes_per_element(1024, 1024) < 1.1
    with pytest.raises(ValueError, match="momentum_dtype='fp4'"):
        Muon([nn.Parameter(torch.randn(4, 4))], momentum_dtype="fp4")


def test_settings_changed_after_load_state_dict_take_effect():
    """load_state_dict replaces the group dicts; lr schedules must keep reaching Muon matrices."""
    params = make_params()
    _, opt = run_titan(params, 2, {"a", "b"}, lr=0.01)
    tensors, fresh = run_titan(params, 0, {"a", "b"}, lr=0.01)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for group in fresh.param_groups:
        group["lr"] = 0.0
    before = {n: t.clone() for n, t in tensors.items()}
    for p in fresh.param_groups[0]["params"] + fresh.param_groups[1]["params"]:
        p.grad = torch.randn_like(p)
    fresh.step()
    for n in tensors:
        assert torch.equal(tensors[n], before[n]), n


def test_bf16_parameters_step_with_fp32_momentum():
    """bf16 weights (and gradients): momentum stays fp32, the update is applied in bf16."""
    params = make_params(shapes={"a": (30, 64), "b": (64, 30)})
    ours32, _ = run_titan(params, 3, set(params), lr=0.02)
    tensors = {n: nn.Parameter(p.clone().bfloat16()) for n, p in params.items()}
    opt = Muon(list(tensors.values()), lr=0.02)
    for s in range(3):
        for n, g in grads_for(s, params).items():
            tensors[n].grad = g.bfloat16()
        opt.step()
    assert all(opt.state[t]["momentum_buffer"].dtype == torch.float32 for t in tensors.values())
    for n in params:
        # bf16 weights round to 2^-8 relative: once when cast, then after the weight decay and
        # after the update of each of the 3 steps (7 roundings); bf16 gradients move the
        # orthogonalized update by about 2^-8 of itself (5 % of the total change allowed).
        change = (ours32[n] - params[n]).abs().max()
        assert (tensors[n].detach().float() - ours32[n]).abs().max() <= 7 * 2**-8 * params[n].abs().max() + 0.05 * change


@pytest.mark.parametrize("shape", [(16, 0), (0, 16)])
def test_empty_matrix_is_refused_by_name(shape):
    good, empty = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(*shape))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\.params\[1\] \(shape \(%d, %d\)\).*non-empty" % shape):
        Muon([good, empty])
    named = [{"params": [("w", good), ("layers.0.empty", empty)]}]
    with pytest.raises(ValueError, match="'layers.0.empty' has shape"):
        Muon(named)


@pytest.mark.parametrize("nesterov", [True, False])
def test_owner_nesterov_helper_matches_the_step_and_commit_rules(nesterov):
    """With overlap the owner computes the new momentum and the NS input in one helper; both
    must be bit for bit what the shard side's pass (the step) and momentum_update_ (the commit) give."""
    from titan_muon.algorithm.update import Elementwise

    eager = Elementwise(compiled=False)
    gen = torch.Generator().manual_seed(3)
    grad, momentum = torch.randn(17, 9, generator=gen), torch.randn(17, 9, generator=gen)
    out, expected = torch.empty_like(grad), torch.empty_like(grad)
    (new,) = eager.nesterov_inputs_and_momenta_into([out], [grad], [momentum], 0.95, nesterov)
    eager.nesterov_inputs_into([expected], [grad], [momentum], 0.95, nesterov)
    assert torch.equal(out, expected)
    stored = momentum.clone()
    eager.momentum_updates_([stored], [grad], 0.95)
    assert torch.equal(new, stored)


def test_compiled_elementwise_passes_equal_the_eager_ones():
    """compile_elementwise=True runs each pass as one torch.compile'd kernel. Same formulas, so
    the results agree to fp32 rounding: the compiler may contract a multiply and an add into one
    fused multiply-add, which rounds once instead of twice, so each of the (at most two) lerps or
    the decay-and-step differs by at most one rounding of its operands' magnitude:
    |Δ| ≤ 2·eps32·(|g| + |M|) (lerp), 2·eps32·(|W| + lr·|U|) (step, lr·|U| = lr·wd·|R|). A bf16 output may then round
    to the neighbouring bf16 value: one bf16 ulp, eps_bf16·|value|, on top. The compiled passes take
    β as an fp32 tensor and compute 1 − β from it (exact for β ≥ ½) where the eager ones round 1 − β
    once: the momentum lerp's weights differ by ≤ eps32/2, its result by ≤ eps32/2·|g − M| more."""
    from titan_muon.algorithm.update import Elementwise, commit_scale

    eager, compiled = Elementwise(compiled=False), Elementwise(compiled=True)
    gen = torch.Generator().manual_seed(5)
    eps32, eps16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    for shape in [(37, 53), (8, 64)]:  # two shapes: one dynamic-shape kernel serves both
        grad, momentum = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        scale = 2.5 * eps32 * (grad.abs() + momentum.abs())
        for dtype in (torch.float32, torch.bfloat16):
            for nesterov in (True, False):
                a, b = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
                eager.nesterov_inputs_into([a], [grad], [momentum], 0.95, nesterov)
                compiled.nesterov_inputs_into([b], [grad], [momentum], 0.95, nesterov)
                bound = 2 * scale + (eps16 * a.float().abs() if dtype == torch.bfloat16 else 0)
                assert ((a.float() - b.float()).abs() <= bound).all(), (shape, dtype, nesterov)
                (new_a,) = eager.nesterov_inputs_and_momenta_into([a], [grad], [momentum], 0.95, nesterov)
                (new_b,) = compiled.nesterov_inputs_and_momenta_into([b], [grad], [momentum], 0.95, nesterov)
                assert ((new_a - new_b).abs() <= scale).all()
        stored_a, stored_b = momentum.clone(), momentum.clone()
        eager.momentum_updates_([stored_a], [grad], 0.95)
        compiled.momentum_updates_([stored_b], [grad], 0.95)
        assert ((stored_a - stored_b).abs() <= scale).all()
        # The commit from R = U·commit_scale(wd) = −U/wd as owners return it: lerp(W, R, lr·wd)
        # compiled, a multiply and an add eagerly for a bf16 R (lerp takes one dtype) and one
        # foreach lerp for an fp32 R; lr·|U| = lr·wd·|R|.
        weights = torch.randn(shape, generator=gen)
        for returned in (torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen)):
            for weight_decay in (0.1, 0.0):  # folded into one lerp, or a decay and a step
                w_a, w_b, w_c = weights.clone(), weights.clone(), weights.clone()
                eager.decay_and_step_([w_a], [returned], lr=0.02, weight_decay=weight_decay)
                compiled.decay_and_step_([w_b], [returned], lr=0.02, weight_decay=weight_decay)
                step = 0.02 * returned.float().abs() * (weight_decay or 1.0)  # lr·|U|: |U| = wd·|R| where folded, |R| else
                assert ((w_a - w_b).abs() <= 2 * eps32 * (weights.abs() + step)).all()
                # measuring muon/update_rms in the same pass writes the same weights, and its sum of
                # squares ‖lr·U‖² agrees with an fp64 one to fp32 summation: n·eps32 relative
                # (a sequential sum's bound; either order is within it) plus the norm's own rounding.
                sums = []
                for passes, target in ((eager, w_a), (compiled, w_c)):
                    update_sq, scratch = torch.zeros(()), torch.zeros(())
                    target.copy_(weights)
                    passes.decay_and_step_([target], [returned], 0.02, weight_decay, update_sq, scratch)
                    sums.append(update_sq.item())
                assert torch.equal(w_c, w_b)
                u = returned.double() * (0.02 / commit_scale(weight_decay))
                exact = u.square().sum().item()
                assert all(abs(total - exact) <= (returned.numel() + 4) * eps32 * exact for total in sums), (sums, exact)


def test_compiled_passes_over_lists_of_blocks_equal_the_eager_ones():
    """Compiled passes take their blocks in lists, one call per chunk of 16, 8, 4, 2 or 1 blocks
    (update.call_chunks): five blocks of uneven shapes whose outputs are slices of one
    send buffer (aliased inputs, as in the step) are two calls, of 4 and 1. Each block must get
    what the eager pass gives it, to the fp32 rounding the one-block test derives: |Δ| ≤
    2.5·eps32·(|g| + |M|) per lerp (two for the Nesterov input), 2·eps32·(|W| + lr·|U|) for the step."""
    from titan_muon.algorithm.update import Elementwise, call_chunks

    assert [(c.start, c.stop) for c in call_chunks(21)] == [(0, 16), (16, 20), (20, 21)]
    assert [c.stop - c.start for c in call_chunks(15)] == [8, 4, 2, 1]
    assert [c.stop - c.start for c in call_chunks(5)] == [4, 1] and call_chunks(0) == []
    eager, compiled = Elementwise(compiled=False), Elementwise(compiled=True)
    gen = torch.Generator().manual_seed(8)
    shapes = [(7, 5), (3, 16), (1, 9), (12, 4), (6, 6)]
    eps32 = torch.finfo(torch.float32).eps
    grads = [torch.randn(s, generator=gen) for s in shapes]
    momenta = [torch.randn(s, generator=gen) for s in shapes]
    results = []
    for passes in (eager, compiled):
        buffer = torch.full((sum(a * b for a, b in shapes),), float("nan"))
        outs = [piece.view(s) for piece, s in zip(buffer.split([a * b for a, b in shapes]), shapes)]
        stored = [m.clone() for m in momenta]
        passes.momenta_and_nesterov_inputs_(stored, outs, grads, 0.95, True)
        results.append((buffer, stored))
    (out_a, stored_a), (out_b, stored_b) = results
    scale = torch.cat([2.5 * eps32 * (g.abs() + m.abs()).flatten() for g, m in zip(grads, momenta)])
    assert ((out_a - out_b).abs() <= 2 * scale).all()  # every slot written: NaN would fail
    assert all(((a - b).abs() <= 2.5 * eps32 * (g.abs() + m.abs())).all() for a, b, g, m in zip(stored_a, stored_b, grads, momenta))
    weights = [torch.randn(s, generator=gen) for s in shapes]
    returned = [torch.randn(s, generator=gen) for s in shapes]
    stepped = []
    for passes in (eager, compiled):
        targets = [w.clone() for w in weights]
        passes.decay_and_step_(targets, returned, lr=0.02, weight_decay=0.1)
        stepped.append(targets)
    for a, b, w, r in zip(*stepped, weights, returned):
        assert ((a - b).abs() <= 2 * eps32 * (w.abs() + 0.02 * 0.1 * r.abs())).all()


def test_each_variant_of_a_compiled_list_pass_compiles_once(monkeypatch):
    """Dynamo allows 8 recompiles per code object and a pass compiles once per list length (five):
    a second wire dtype must not push some lengths onto the eager path, and a momentum schedule
    (a new β every step, as in a momentum warm-up) must not compile at all after its first step.
    With the limit at 1 and a hit made an error, calls of two lengths, four β and two wire dtypes
    must all run, and each still equals the eager pass (2·eps32·(|g| + |M|) per lerp, two lerps for
    the Nesterov input; fp32 outputs; the bf16 one within its own rounding, eps_bf16·|out|, on top;
    and the weight: the compiled pass computes 1 − β from fp32 β, exactly for β ≥ ½, where the
    eager one rounds 1 − β once; they differ by ≤ eps32/2, the lerp then by ≤ eps32/2·|g − M|)."""
    from titan_muon.algorithm import update
    from titan_muon.algorithm.update import Elementwise

    # copies of its own (the process shares them): one compiled by another test for outputs at
    # a storage offset ≥ 2 would recompile once for these at offset 0 (dynamo's 0/1 specialization)
    monkeypatch.setattr(update, "_COMPILED_COPIES", {})
    eager, compiled = Elementwise(compiled=False), Elementwise(compiled=True, device_type="cpu")
    gen = torch.Generator().manual_seed(9)
    eps32 = torch.finfo(torch.float32).eps
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        variants = [(1, 0.9, torch.float32), (1, 0.95, torch.float32), (1, 0.95, torch.bfloat16), (2, 0.95, torch.float32)]
        for blocks, beta, wire in variants + [(1, 0.97, torch.float32), (2, 0.99, torch.float32), (1, 0.9, torch.float32)]:
            grads = [torch.randn(6, 4, generator=gen) for _ in range(blocks)]
            momenta = [torch.randn(6, 4, generator=gen) for _ in range(blocks)]
            results = []
            for passes in (eager, compiled):
                outs, stored = [torch.empty(6, 4, dtype=wire) for _ in range(blocks)], [m.clone() for m in momenta]
                passes.momenta_and_nesterov_inputs_(stored, outs, grads, beta, True)
                results.append((outs, stored))
            (outs_a, stored_a), (outs_b, stored_b) = results
            for a, b, sa, sb, g, m in zip(outs_a, outs_b, stored_a, stored_b, grads, momenta):
                bound = 2.5 * eps32 * (g.abs() + m.abs())  # 2 for the lerp's rounding, 0.5 for its weight
                assert ((sa - sb).abs() <= bound).all()
                rounding = torch.finfo(wire).eps * a.float().abs() if wire != torch.float32 else 0
                assert ((a.float() - b.float()).abs() <= 2 * bound + rounding).all(), (blocks, beta, wire)
        # another optimizer's passes (a second model part on this rank) use the same compiled copies
        copies = dict(update._COMPILED_COPIES)
        assert len(copies) == 3  # (length, wire dtype): (1, fp32), (1, bf16), (2, fp32); β in none
        another = Elementwise(compiled=True, device_type="cpu")
        another.momenta_and_nesterov_inputs_([torch.randn(6, 4)], [torch.empty(6, 4)], [torch.randn(6, 4)], 0.8, True)
        assert update._COMPILED_COPIES == copies


@pytest.mark.parametrize("commit", ["streaming", "atomic"])
def test_a_compiled_step_equals_the_eager_one(commit):
    """The whole step with compile_elementwise=True (every pass compiled, blocks in lists of the
    step's own lengths) against the eager step. With momentum 0 the momentum is g and the Nesterov
    input g exactly (lerp(M, g, 1) = g − (g − M)·0, lerp(g, M', 0) = g + 0·(M' − g), in either
    form), so both orthogonalize the same matrices and differ by the commit's rounding alone:
    2·eps32·(|W| + lr·|U|) per weight (the one-block test's bound), lr·|U| ≤ |W₁ − W₀| + lr·wd·|W₀|,
    and eps32·|W₁| for estimating it from the eager W₁."""
    params = make_params()
    lr, weight_decay = 0.02, 0.1
    runs = [run_titan(params, 1, set(SHAPES), lr=lr, weight_decay=weight_decay, momentum=0.0, commit=commit, compile_elementwise=compiled)
            for compiled in (False, True)]  # fmt: skip
    (eager, eager_opt), (compiled, compiled_opt) = runs
    eps32 = torch.finfo(torch.float32).eps
    for name, w0 in params.items():
        step = (eager[name] - w0).abs()
        bound = 2 * eps32 * ((1 + lr * weight_decay) * w0.abs() + step) + eps32 * eager[name].abs()
        assert ((compiled[name] - eager[name]).abs() <= bound).all(), name
    for a, b in zip(eager_opt.param_groups[0]["params"], compiled_opt.param_groups[0]["params"], strict=True):
        assert torch.equal(eager_opt.state[a]["momentum_buffer"], compiled_opt.state[b]["momentum_buffer"])


@pytest.mark.parametrize("weight_decay", [0.1, 1e-13, 0.0])
def test_the_commit_from_returned_updates_is_decay_and_step(weight_decay):
    """Owners return R = U·commit_scale(wd) (−U/wd where the decay is folded, U below
    MIN_FOLDED_DECAY); decay_and_step_ then writes (1 − lr·wd)·W − lr·U. Against that formula in
    float64, four fp32 roundings of at most eps32·(|W| + lr·|U|) each: R's own (|U|/wd, times
    lr·wd), the lerp's two (R − W times lr·wd, and the sum), and lr·wd's to fp32 (relative, on
    both terms)."""
    from titan_muon.algorithm.update import Elementwise, commit_scale

    gen = torch.Generator().manual_seed(11)
    weights, update = torch.randn(64, 48, generator=gen), torch.randn(64, 48, generator=gen)
    lr, eps32 = 0.02, torch.finfo(torch.float32).eps
    returned = update * commit_scale(weight_decay)
    stepped = weights.clone()
    Elementwise(compiled=False).decay_and_step_([stepped], [returned], lr=lr, weight_decay=weight_decay)
    exact = (1 - lr * weight_decay) * weights.double() - lr * update.double()
    bound = 4 * eps32 * (weights.abs() + lr * update.abs()).double()
    assert ((stepped.double() - exact).abs() <= bound).all()


def test_step_phases_are_named_for_the_profiler():
    """Every phase a one-process step runs appears as a titan_muon/<phase> range in a trace."""
    from torch.profiler import ProfilerActivity, profile

    params = make_params()
    tensors = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    opt = Muon([{"params": [tensors[n] for n in "abc"]}, {"params": [tensors[n] for n in "de"], "use_muon": False}])
    for n, g in grads_for(0, params).items():
        tensors[n].grad = g
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    names = {e.key for e in prof.key_averages()}
    expected = {"check_gradients", "pack", "newton_schulz", "agree_on_success", "commit", "adamw"}
    assert {f"titan_muon/{p}" for p in expected} <= names


def test_bf16_weight_decay_uses_the_exact_factor():
    """bf16 parameters decay by 1 - lr·wd computed in fp32, as ``param.mul_(factor)`` does; the
    foreach kernels round a Python float factor to bf16 first (0.998 -> 0.99609375: 1.95x the
    decay). With the update zeroed (lr·U = 0 needs lr = 0, so compare the decay step alone)."""
    from titan_muon.algorithm.update import Elementwise

    weights = torch.full((4, 4), 3.0, dtype=torch.bfloat16)
    Elementwise(compiled=False).decay_and_step_([weights], [torch.zeros(4, 4, dtype=torch.bfloat16)], lr=0.02, weight_decay=0.1)
    expected = torch.full((4, 4), 3.0, dtype=torch.bfloat16).mul_(1 - 0.02 * 0.1)  # 2.994 rounds to 3.0 in bf16
    assert torch.equal(weights, expected)


def _tiny_optimizer(**kwargs):
    p, q = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4))
    opt = Muon([{"params": [p]}, {"params": [q], "use_muon": False}], **kwargs)
    return opt, p, q


def _step(opt, p, q, seed):
    g = torch.Generator().manual_seed(seed)
    p.grad, q.grad = torch.randn(p.shape, generator=g), torch.randn(q.shape, generator=g)
    opt.step()


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_tensor_learning_rates_of_one_element_equal_the_number(shape):
    """torch.optim accepts a one-element tensor lr; the step must take it as the number it holds."""
    expected, p0, q0 = _tiny_optimizer(lr=0.01)
    opt, p, q = _tiny_optimizer(lr=torch.full(shape, 0.01))
    p.data.copy_(p0), q.data.copy_(q0)
    for seed in range(2):
        _step(expected, p0, q0, seed)
        _step(opt, p, q, seed)
    assert torch.equal(p, p0) and torch.equal(q, q0)


def test_bad_lr_tensor_and_sparse_gradient_are_refused_by_name_before_anything_changes():
    with pytest.raises(ValueError, match=r"param group 0: lr must be a number or a one-element tensor, got a tensor of shape \(2,\)"):
        Muon([nn.Parameter(torch.randn(8, 4))], lr=torch.tensor([0.01, 0.02]))
    opt, p, q = _tiny_optimizer(lr=0.01)
    _step(opt, p, q, 0)
    before = (p.detach().clone(), opt.state[p]["momentum_buffer"].clone())
    opt.param_groups[0]["lr"] = torch.tensor([0.01, 0.02])  # a schedule gone wrong
    with pytest.raises(ValueError, match="lr must be a number or a one-element tensor"):
        _step(opt, p, q, 1)
    opt.param_groups[0]["lr"] = 0.01
    p.grad = torch.randn(8, 4).to_sparse()
    with pytest.raises(ValueError, match=r"'param_groups\[0\]\.params\[0\] \(shape \(8, 4\)\)' has a sparse gradient"):
        opt.step()
    assert torch.equal(p, before[0]) and torch.equal(opt.state[p]["momentum_buffer"], before[1])


def test_three_dimensional_parameters_need_an_explicit_opt_in():
    """A Conv1d weight (32, 16, 3) is not 32 matrices 16x3; only experts are stacks, by opt-in."""
    conv = nn.Conv1d(16, 32, 3)
    with pytest.raises(ValueError, match=r"has shape \(32, 16, 3\): a 3-D parameter .* matrix_stacks=True"):
        Muon([{"params": [conv.weight]}])
    Muon([{"params": [nn.Parameter(torch.randn(4, 16, 8))], "matrix_stacks": True}])


def test_state_dict_round_trips_and_a_deep_copy_steps_like_the_original():
    opt, p, q = _tiny_optimizer(lr=0.01)
    _step(opt, p, q, 0)
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    assert opt.state_dict()["param_groups"] == saved["param_groups"]  # torch's loader adds "differentiable"
    clone = copy.deepcopy(opt)
    cp, cq = clone.param_groups[0]["params"][0], clone.param_groups[1]["params"][0]
    _step(opt, p, q, 1)
    _step(clone, cp, cq, 1)
    assert torch.equal(cp, p) and torch.equal(cq, q)


def test_coalesce_merges_only_blocks_that_continue_each_other_in_memory():
    """update.coalesce: rows of blocks become one flat view per run where every block of a row
    starts where the previous row's ends (an EP rank's experts and their buffer slots); a gap,
    another tensor, a column block or a second tensor out of step ends the run. The merged views
    alias the blocks: a pass over them writes the parameter itself."""
    from titan_muon.algorithm.update import coalesce

    experts, buffer, other = torch.zeros(4, 3, 5), torch.arange(60.0), torch.zeros(4, 3, 5)
    slots = [buffer[15 * i : 15 * (i + 1)].view(3, 5) for i in range(4)]
    runs = coalesce([(experts[i], slots[i]) for i in range(4)])
    assert len(runs) == 1 and runs[0][0].shape == (60,) and torch.equal(runs[0][1], buffer)
    runs[0][0].copy_(runs[0][1])
    assert torch.equal(experts.reshape(-1), buffer)  # written through the merged view
    # a gap (expert 2 skipped), another tensor, and slots out of step each start a new run
    assert len(coalesce([(experts[0], slots[0]), (experts[1], slots[1]), (experts[3], slots[2])])) == 2
    assert len(coalesce([(experts[0], slots[0]), (other[1], slots[1])])) == 2
    assert len(coalesce([(experts[0], slots[0]), (experts[1], slots[2])])) == 2
    # column blocks are not contiguous: never merged
    assert len(coalesce([(experts[0][:, :2], slots[0][:, :2]), (experts[1][:, :2], slots[1][:, :2])])) == 2
    assert coalesce([]) == []


def test_update_rms_is_the_applied_update_and_an_unmeasured_step_skips_only_it():
    params = make_params()
    lr, wd = 0.5, 0.1
    runs = []
    for measured in (True, False):
        tensors = {n: nn.Parameter(p.clone()) for n, p in params.items()}
        opt = Muon([{"params": [(n, tensors[n]) for n in "abce"]}, {"params": [(n, tensors[n]) for n in "d"], "use_muon": False}],
                   lr=lr, weight_decay=wd)  # fmt: skip
        opt.measure_update_rms = measured
        metrics = []
        for step in range(2):
            before = {n: t.detach().clone() for n, t in tensors.items()}
            for n, g in grads_for(step, params).items():
                tensors[n].grad = g
            opt.step()
            metrics.append(opt.last_step_metrics)
        runs.append((tensors, before, metrics))
    (measured, before, with_rms), (unmeasured, _, without_rms) = runs
    for n in params:  # the metric reads the updates; it changes none of them
        assert torch.equal(measured[n].detach(), unmeasured[n].detach()), n
    assert all("muon/update_rms" in m for m in with_rms) and not any("muon/update_rms" in m for m in without_rms)
    # the update applied: lr·U = (1 − lr·wd)·W_before − W_after over the Muon matrices. Computing it
    # from the weights in fp32 cancels (1 − lr·wd)·W against itself: each entry is off by a few fp32
    # ulps of |W| (≤ 4 of them: the product, the step's own rounding, the subtraction), which bounds the
    # RMS's error by 4·2⁻²³·max|W| absolutely.
    applied = torch.cat([((1 - lr * wd) * before[n] - measured[n].detach()).flatten() for n in "abce"])
    rms = applied.square().mean().sqrt().item()
    bound = 4 * 2**-23 * max(before[n].abs().max().item() for n in "abce")
    assert abs(with_rms[-1]["muon/update_rms"] - rms) <= bound, (with_rms[-1]["muon/update_rms"], rms, bound)
    # two fp32 scalars (the sum of squares and the one the commit's pass sums each block into, alive
    # through the step) fewer in its transient memory, every other figure the same
    m, u = with_rms[-1], without_rms[-1]
    assert m["muon/peak_transient_bytes"] - u["muon/peak_transient_bytes"] == 8.0
    assert m["muon/update_elements"] == sum(params[n].numel() for n in "abce")  # every Muon block this rank holds
    assert {k: v for k, v in m.items() if "time" not in k and k not in ("muon/update_rms", "muon/update_elements", "muon/peak_transient_bytes")} == \
        {k: v for k, v in u.items() if "time" not in k and k != "muon/peak_transient_bytes"}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_gradient_check_does_not_overflow_on_finite_half_precision_gradients(dtype):
    """512 entries of 60000 are finite in fp16, but their L2 norm (1.36e6) is not: the check took
    the norm in the gradient's dtype and refused the step as non-finite. It now sums in fp32; an
    Inf entry still raises, naming the parameter, with nothing changed."""
    p = nn.Parameter(torch.zeros(16, 32, dtype=dtype))
    opt = Muon([{"params": [("w", p)]}], lr=0.01)
    p.grad = torch.full_like(p, 60000.0)
    opt.step()
    assert torch.isfinite(p.float()).all() and p.float().abs().max() > 0
    before = p.detach().clone()
    p.grad[3, 4] = float("inf")
    with pytest.raises(FloatingPointError, match=r"non-finite \(NaN/Inf\) gradients in \['w'\]"):
        opt.step()
    assert torch.equal(p.detach(), before)
