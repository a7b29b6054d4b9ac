"""titan_muon.demo.dct (DeMo for Muon) against the independent loop reference in demo_reference.py.

Rounding model used for every fp32 bound below (u = 2^-24 unit roundoff): a dot product of n
terms computed in floating point in any order is within γ_n·Σ|a_i b_i| of the exact value,
γ_n = n·u/(1 − n·u); a rounded DCT basis entry is within u·|d| of the float64 one. A chunk
transform D_h·B·D_wᵀ is two products (inner lengths h then w) with two rounded bases, so it is
within c·(|D_h|·|B|·|D_w|ᵀ) of the exact transform, c = (h + w + 3)·u (the +1 covers the O(u²)
terms). We use c = (2s + 3)·u for every chunk of a chunk size s (h, w ≤ s).
"""

from __future__ import annotations

import pytest
import torch
from demo_reference import ReferenceDeMoMuon, chunk_corners, chunk_topk, kept_count, least_squares_problem, reference_dct, reference_send

from titan_muon.algorithm.newton_schulz import orthogonalize
from titan_muon.algorithm.update import update_scale
from titan_muon.demo import dct as demo

U32 = 2.0**-24
U64 = 2.0**-53
SHAPES = [(100, 70), (64, 200), (130, 130)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ fp64 per-chunk bound helpers


def _per_chunk(x: torch.Tensor, s: int, fn) -> torch.Tensor:
    out = torch.zeros_like(x, dtype=torch.float64)
    for r0, c0, h, w in chunk_corners(*x.shape, s):
        out[r0 : r0 + h, c0 : c0 + w] = fn(x[r0 : r0 + h, c0 : c0 + w].double(), h, w)
    return out


def _exact_coefficients(b, s):
    return _per_chunk(b, s, lambda x, h, w: reference_dct(h) @ x @ reference_dct(w).T)


def _abs_forward(x, s):
    return _per_chunk(x, s, lambda x, h, w: reference_dct(h).abs() @ x @ reference_dct(w).abs().T)


def _abs_inverse(x, s):
    return _per_chunk(x, s, lambda x, h, w: reference_dct(h).abs().T @ x @ reference_dct(w).abs())


def _transform_bounds(b: torch.Tensor, s: int, u: float):
    """For one matrix B: (Q, E1, V, W) with Q the exact coefficients, E1 = c·|D||B||D|ᵀ the bound on
    a computed forward transform, V = |D|ᵀ E1 |D| (that error carried through an exact inverse),
    W = |D|ᵀ(|Q| + E1)|D| (what the inverse's own rounding, c·W, acts on). Any subset of kept
    coefficients decodes to within V + c·W of its exact decode."""
    c = (2 * s + 3) * u
    q = _exact_coefficients(b, s)
    e1 = c * _abs_forward(b.double().abs(), s)
    return q, e1, _abs_inverse(e1, s), _abs_inverse(q.abs() + e1, s), c


# ------------------------------------------------------------------ DCT


@pytest.mark.parametrize("size", [1, 2, 6, 36, 64, 70])
def test_dct_basis_matches_definition_and_is_orthonormal(size):
    d64 = demo.dct_basis(size, dtype=torch.float64)
    # Both from cos() of the same float64 arguments, written independently: a few float64 ulps.
    torch.testing.assert_close(d64, reference_dct(size), rtol=0, atol=16 * U64)
    eye = torch.eye(size, dtype=torch.float64)
    # |D Dᵀ − I| in float64: a length-`size` dot product of entries of the ulp-accurate basis,
    # (size + 2)·u_64 · (|D||D|ᵀ ≤ size·(2/size) = 2); 4x for the cosines' own few-ulp error.
    assert (d64 @ d64.T - eye).abs().max() <= 4 * (size + 2) * U64 * 2
    d32 = demo.dct_basis(size)
    # fp32 basis, fp32 product: (size + 2)·u_32 · 2 (same argument with u = 2^-24).
    assert (d32 @ d32.T - eye.float()).abs().max() <= (size + 2) * U32 * 2
    assert demo.dct_basis(size) is d32  # cached


# ------------------------------------------------------------------ geometry and errors


def test_geometry_ragged_edges_and_keep():
    g = demo.chunk_geometry(100, 70, 64, 8)
    assert [(x.height, x.width, x.count, x.keep) for x in g.groups] == [(64, 64, 1, 8), (64, 6, 1, 1), (36, 64, 1, 5), (36, 6, 1, 1)]
    assert g.kept == 15
    for rows, cols in SHAPES + [(1, 1), (4096, 4096), (63, 65)]:
        g = demo.chunk_geometry(rows, cols, 64, 8)
        covered = sum(x.count * x.height * x.width for x in g.groups)
        assert covered == rows * cols
        assert g.kept == sum(kept_count(h, w, 64, 8) for _, _, h, w in chunk_corners(rows, cols, 64))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(chunk=0, topk=1), "demo_chunk"),
        (dict(chunk=2.0, topk=1), "demo_chunk"),
        (dict(chunk=8, topk=65), "demo_topk"),
        (dict(chunk=8, topk=0), "demo_topk"),
        (dict(chunk=8, topk=4, alpha=1.5), "demo_alpha"),
        (dict(chunk=8, topk=4, alpha=-0.1), "demo_alpha"),
        (dict(chunk=8, topk=4, beta=1.0), "momentum"),
    ],
)
def test_bad_settings_name_the_setting(kwargs, name):
    with pytest.raises(ValueError, match=name):
        demo.validate_settings(**kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="demo_topk"):
        demo.compress(torch.zeros(1, 8, 8), chunk=4, topk=17)
    with pytest.raises(ValueError, match="batch of matrices"):
        demo.compress(torch.zeros(8, 8))
    with pytest.raises(ValueError, match="demo_alpha"):
        demo.local_step_(torch.zeros(1, 8, 8), torch.zeros(1, 8, 8), 0.9, 4, 2, alpha=2.0)
    i, v = demo.compress(torch.zeros(1, 8, 8), 4, 2)
    with pytest.raises(ValueError, match="does not match"):
        demo.decode(i, v, (8, 8), 4, 3)
    with pytest.raises(ValueError, match="one .indices, values. pair per replica"):
        demo.average_decoded([i], [], (8, 8), 4, 2)


# ------------------------------------------------------------------ compress / decode


@pytest.mark.parametrize("shape, chunk", [((100, 70), 64), ((64, 200), 64), ((130, 130), 64), ((37, 29), 8), ((5, 3), 4)])
def test_full_topk_is_identity(shape, chunk):
    m = torch.randn(2, *shape, generator=_gen(0))
    out = demo.decode(*demo.compress(m, chunk, chunk * chunk), shape, chunk, chunk * chunk)
    for b, o in zip(m, out):
        # forward error E1 through the exact inverse (V) plus the inverse's own rounding (c·W).
        _, _, v, w, c = _transform_bounds(b, chunk, U32)
        err = (o.double() - b.double()).abs()
        assert (err <= v + c * w).all(), (err / (v + c * w)).max()


def test_select_topk_ties_match_brute_force():
    g = _gen(1)
    # Small integers: many exact ties in magnitude, including +x / −x pairs and zeros.
    x = torch.randint(-3, 4, (5, 7, 36), generator=g).float()
    for keep in (1, 5, 36):
        pos, val = demo.select_topk(x, keep)
        for a in range(5):
            for b in range(7):
                expected = chunk_topk(x[a, b], keep)
                assert pos[a, b].tolist() == expected
                assert val[a, b].tolist() == [x[a, b, p].item() for p in expected]


def test_compress_zeros_takes_first_positions():
    # All coefficients tie at 0: every chunk keeps positions 0..keep-1, in order.
    i, v = demo.compress(torch.zeros(1, 100, 70), 64, 8)
    geometry = demo.chunk_geometry(100, 70, 64, 8)
    expected = [p for g in geometry.groups for _ in range(g.count) for p in range(g.keep)]
    assert i[0].tolist() == expected and (v == 0).all()


def _demo_pairs_by_corner(indices, values, shape, chunk, topk):
    """{(r0, c0): [(position, value), ...]} from one matrix's payload, via the documented order."""
    out, start = {}, 0
    for g in demo.chunk_geometry(*shape, chunk, topk).groups:
        for a in range(g.row_chunks):
            for b in range(g.col_chunks):
                corner = (g.row_start + a * g.height, g.col_start + b * g.width)
                out[corner] = list(zip(indices[start : start + g.keep].tolist(), values[start : start + g.keep].tolist()))
                start += g.keep
    assert start == indices.numel()
    return out


def _assert_same_selection(m, demo_pairs, chunk, topk, u=U32):
    """demo's pairs of matrix m are a top-k of the exact coefficients up to the forward error
    (every kept exact magnitude ≥ every dropped one − 2·E1), the same positions as the loop
    reference's, and values within both sides' forward error 2·E1 of the reference's. (A set
    differing from the reference's would be legitimate only at a near-tie within 2·E1; the
    validity check says which, and the equality is then reported rather than widened.)"""
    _, ref_pairs = reference_send(m, chunk, topk)
    q, e1, *_ = _transform_bounds(m, chunk, u)
    for (r0, c0, h, w), ref in zip(chunk_corners(*m.shape, chunk), ref_pairs):
        exact = q[r0 : r0 + h, c0 : c0 + w].reshape(-1).abs()
        slack = 2 * e1[r0 : r0 + h, c0 : c0 + w].max().item()
        got = demo_pairs[(r0, c0)]
        kept = torch.zeros(h * w, dtype=torch.bool)
        kept[[p for p, _ in got]] = True
        assert len(got) == len(ref) == int(kept.sum())
        if not kept.all():
            assert exact[kept].min() >= exact[~kept].max() - slack, f"not a top-k at chunk ({r0}, {c0})"
        assert sorted(p for p, _ in got) == sorted(p for p, _ in ref), f"selection differs at chunk ({r0}, {c0})"
        ref_values = dict(ref)
        assert max(abs(v - ref_values[p]) for p, v in got) <= slack


@pytest.mark.parametrize("shape", SHAPES)
def test_compress_matches_loop_reference_and_batching(shape):
    chunk, topk = 64, 8
    m = torch.randn(3, *shape, generator=_gen(2))
    i, v = demo.compress(m, chunk, topk)
    assert i.dtype == torch.int16 and v.dtype == torch.float32 and i.shape == (3, demo.chunk_geometry(*shape, chunk, topk).kept)
    dense = demo.decode(i, v, shape, chunk, topk)
    for n in range(3):
        _assert_same_selection(m[n], _demo_pairs_by_corner(i[n], v[n], shape, chunk, topk), chunk, topk)
        # batched == per-matrix: the same chunk products, possibly through another GEMM kernel
        # (summation order): indices exact, values within 2·E1, decode within 2·(V + c·W).
        i1, v1 = demo.compress(m[n : n + 1], chunk, topk)
        assert torch.equal(i1[0], i[n])
        _, e1, vb, wb, c = _transform_bounds(m[n], chunk, U32)
        assert ((v1[0] - v[n]).abs() <= 2 * e1.max()).all()
        d1 = demo.decode(i1, v1, shape, chunk, topk)[0]
        assert ((d1.double() - dense[n].double()).abs() <= 2 * (vb + c * wb)).all()


def test_local_step_subtracts_exactly_alpha_times_what_it_sends():
    beta, alpha, chunk, topk = 0.9, 0.2, 64, 8
    m0 = torch.randn(2, 130, 130, generator=_gen(3))
    g = torch.randn(2, 130, 130, generator=_gen(4))
    m = m0.clone()
    i, v = demo.local_step_(m, g, beta, chunk, topk, alpha)
    a = m0.clone().mul_(beta).add_(g)  # the same two elementwise roundings: bit for bit
    ia, va = demo.compress(a, chunk, topk)
    assert torch.equal(i, ia) and torch.equal(v, va)  # it sent the compression of βM + g
    d = demo.decode(i, v, (130, 130), chunk, topk).double()
    expected = a.double() - alpha * d
    # M − α·D in fp32: α rounded (u·α|D|), the product (u·α|D|), the difference (u·|result|).
    assert ((m.double() - expected).abs() <= U32 * (expected.abs() + 2 * alpha * d.abs())).all()
    m = m0.clone()
    demo.local_step_(m, g, beta, chunk, topk, alpha=0.0)
    assert torch.equal(m, a)


def test_average_decoded_is_the_mean_of_decodes():
    shape, chunk, topk, replicas = (100, 70), 64, 8, 3
    ms = [torch.randn(2, *shape, generator=_gen(10 + r)) for r in range(replicas)]
    payloads = [demo.compress(m, chunk, topk) for m in ms]
    q = demo.average_decoded([p[0] for p in payloads], [p[1] for p in payloads], shape, chunk, topk)
    exact = sum(demo.decode(*p, shape, chunk, topk).double() for p in payloads) / replicas
    for n in range(2):
        bound = 0
        for m in ms:
            _, _, v, w, c = _transform_bounds(m[n], chunk, U32)
            # the R coefficient sums, the 1/R product, the inverse: (R + 1)·u + c on W, both sides
            bound = bound + 2 * (c + (replicas + 1) * U32) * w / replicas
        assert ((q[n].double() - exact[n]).abs() <= bound).all()


# ------------------------------------------------------------------ the pipeline vs the reference


class DemoPipeline:
    """What the integration will run, on one process: per replica a batched local_step_ over the
    matrices of one shape, then average_decoded over the replicas' payloads, Newton–Schulz, update."""

    def __init__(self, params, replicas, lr, wd, beta, chunk, topk, alpha, shared_momentum=False, nesterov=False):
        self.replicas, self.lr, self.wd, self.beta, self.chunk, self.topk, self.alpha = replicas, lr, wd, beta, chunk, topk, alpha
        self.shared_momentum, self.nesterov = shared_momentum, nesterov
        self.by_shape: dict[tuple, list[str]] = {}
        for n, p in params.items():
            self.by_shape.setdefault(tuple(p.shape), []).append(n)
        dtype = next(iter(params.values())).dtype
        self.momenta = [{s: torch.zeros(len(ns), *s, dtype=dtype) for s, ns in self.by_shape.items()} for _ in range(replicas)]
        self.shared = {s: torch.zeros(len(ns), *s, dtype=dtype) for s, ns in self.by_shape.items()}
        self.last_q = {}

    def step(self, params, grads):
        for shape, names in self.by_shape.items():
            payloads = [
                demo.local_step_(self.momenta[r][shape], torch.stack([grads[r][n] for n in names]), self.beta, self.chunk, self.topk, self.alpha)
                for r in range(self.replicas)
            ]
            q = demo.average_decoded([p[0] for p in payloads], [p[1] for p in payloads], shape, self.chunk, self.topk)
            ns_input = demo.shared_momentum_input_(self.shared[shape], q, self.beta, self.nesterov) if self.shared_momentum else q
            u = orthogonalize(ns_input, dtype=q.dtype)
            for k, n in enumerate(names):
                self.last_q[n] = q[k]
                params[n].mul_(1 - self.lr * self.wd).sub_(self.lr * update_scale(None, *shape) * u[k])


SETTINGS = dict(lr=0.02, wd=0.01, beta=0.95, chunk=64, topk=8, alpha=0.2)
PIPELINE_SHAPES = SHAPES + [(100, 70)]  # two 100×70 matrices: one batched local_step_


@pytest.mark.parametrize("shared_momentum, nesterov, alpha", [(False, False, 0.2), (True, True, 1.0), (True, False, 0.2)])
def test_pipeline_follows_reference_trajectory_float64(shared_momentum, nesterov, alpha):
    """Free-running, 4 steps, float64: the parameters of the pipeline and of the loop reference.

    Tolerance 1e-9 of the parameter change: the transforms differ by rounding, ≲ 1e-13 relative
    in float64 (u = 2^-53 times the inner lengths ≤ 2s + 3 = 131, elementwise bounds as in the
    per-step test below), and Keller's Newton–Schulz multiplies a perturbation by at most
    max|p'|⁵ < 4⁵ ≈ 1e3 on its singular-value range [0, 1.2] (2x more for its normalisation): ≲ 1e-9
    per step. That chain is first order; a worst-case bound does not compose through several
    free-running Newton–Schulz steps (differences in W feed the next gradients), which is why the
    rigorous elementwise bounds are checked per step, teacher-forced, in the two tests below.
    A defect (wrong chunk, k, α, replica or tie rule) changes the trajectory by percents.
    With the shared momentum (issue 27) the same bound holds: S and the Nesterov input are two
    more lerps per element (relative rounding ≲ 3·2^-53 each), far inside the 1e-9.
    """
    replicas, steps = 3, 4
    params, grads = least_squares_problem(PIPELINE_SHAPES, replicas, torch.float64)
    start = {n: p.clone() for n, p in params.items()}
    ref_params = {n: p.clone() for n, p in params.items()}
    s = SETTINGS
    pipeline = DemoPipeline(params, replicas, s["lr"], s["wd"], s["beta"], s["chunk"], s["topk"], alpha, shared_momentum, nesterov)
    reference = ReferenceDeMoMuon(replicas, s["lr"], s["wd"], s["beta"], s["chunk"], s["topk"], alpha,
                                  shared_momentum=shared_momentum, nesterov=nesterov)  # fmt: skip
    for _ in range(steps):
        pipeline.step(params, grads(params))
        reference.step(ref_params, grads(ref_params))
    for n in params:
        change = (ref_params[n] - start[n]).norm()
        diff = (params[n] - ref_params[n]).norm()
        assert diff <= 1e-9 * change, (n, (diff / change).item())


@pytest.mark.parametrize("dtype, u", [(torch.float32, U32), (torch.float64, U64)])
def test_pipeline_matches_reference_per_step(dtype, u):
    """Several steps along one trajectory; each step starts both from the same state (the
    reference's), and the pipeline's new momenta and q equal the reference's within the
    elementwise bounds derived at the top of this file (both sides' errors from the exact values)."""
    replicas, steps = 3, 4
    s = SETTINGS
    params, grads = least_squares_problem(PIPELINE_SHAPES, replicas, dtype, seed=21)
    pipeline = DemoPipeline(params, replicas, s["lr"], s["wd"], s["beta"], s["chunk"], s["topk"], s["alpha"])
    reference = ReferenceDeMoMuon(replicas, s["lr"], s["wd"], s["beta"], s["chunk"], s["topk"], s["alpha"])
    for _ in range(steps):
        g = grads(params)
        old = [{n: reference.momenta[r].get(n, torch.zeros_like(p)).clone() for n, p in params.items()} for r in range(replicas)]
        for r in range(replicas):
            for shape, names in pipeline.by_shape.items():
                for k, n in enumerate(names):
                    pipeline.momenta[r][shape][k].copy_(old[r][n])
        # βM + g, rounded as both sides round it (two elementwise IEEE operations)
        accumulated = [{n: old[r][n] * s["beta"] + g[r][n] for n in params} for r in range(replicas)]
        for acc in accumulated:  # the demo's selection equals the loop's, per replica and matrix
            for n, a in acc.items():
                i, v = demo.compress(a[None], s["chunk"], s["topk"])
                _assert_same_selection(a, _demo_pairs_by_corner(i[0], v[0], a.shape, s["chunk"], s["topk"]), s["chunk"], s["topk"], u)
        ref_params = {n: p.clone() for n, p in params.items()}
        pipeline.step({n: p.clone() for n, p in params.items()}, g)
        reference.step(ref_params, g)
        for shape, names in pipeline.by_shape.items():
            for k, n in enumerate(names):
                bounds = [_transform_bounds(acc[n], s["chunk"], u) for acc in accumulated]
                # q: each side within mean_r(V_r) + (c + (R + 1)·u)·mean_r(W_r) of the exact mean
                # (the decode bound, R − 1 sums and the 1/R product on |S_r| ≤ W_r).
                q_bound = sum(2 * (v + (c + (replicas + 1) * u) * w) for _, _, v, w, c in bounds) / replicas
                q_diff = (pipeline.last_q[n].double() - reference.last_q[n].double()).abs()
                assert (q_diff <= q_bound).all(), (n, (q_diff / q_bound).max().item())
                for r in range(replicas):
                    _, _, v, w, c = bounds[r]
                    a = accumulated[r][n].double()
                    # M − α·S: α times both sides' decode bound, plus each side's subtraction
                    # rounding u·(|A| + 2α·|S|), |S| ≤ W.
                    m_bound = s["alpha"] * 2 * (v + c * w) + 2 * u * (a.abs() + 2 * s["alpha"] * w)
                    diff = (pipeline.momenta[r][shape][k].double() - reference.momenta[r][n].double()).abs()
                    assert (diff <= m_bound).all(), (n, r, (diff / m_bound).max().item())
        params = ref_params  # both continue from the reference's parameters


# ------------------------------------------------------------------ bytes


def test_bytes_default_4096_square():
    payload = demo.payload_bytes(4096, 4096)
    # 64×64 chunks: 4096 of them, 8 kept each, int16 index + fp32 value = 6 bytes.
    assert payload == 4096 * 8 * 6
    dense = demo.dense_bytes(4096, 4096)
    assert dense == 4096 * 4096 * 4
    for replicas in (2, 4, 8):
        ratio = demo.allreduce_bytes_sent(dense, replicas) / demo.allgather_bytes_sent(payload, replicas)
        # ring all-reduce 2(R−1)/R·N vs ring all-gather (R−1)·b: ratio 2N/(R·b) = 682.7/R
        assert ratio == pytest.approx(2 * dense / (replicas * payload))
        assert ratio >= 20
    assert demo.allgather_bytes_sent(payload, 1) == 0 and demo.allreduce_bytes_sent(dense, 1) == 0


def test_index_dtype_covers_chunk_positions():
    assert demo.index_dtype(64) == torch.int16 and demo.index_dtype(181) == torch.int16
    assert demo.index_dtype(182) == torch.int32
    i, _ = demo.compress(torch.randn(1, 181, 181, generator=_gen(5)), 181, 181 * 181)
    assert int(i.max()) == 181 * 181 - 1  # the largest position is representable (no wrap)
