"""Golden and property tests of yeto_sync.merge (PINNED.md § "Merge and outer step").

The slow references below are written element by element from the pinned formulas: f64 Python
floats for norms, directions and corrections, and numpy f32 *scalars* where the pin says f32
(avg accumulation, the outer step), so those comparisons are bit-exact.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import ArrayLike, NDArray

from yeto_proto.constants import IsoBackend, MergeMode, WireDtype
from yeto_proto.dtypes import BF16_OVERFLOW, f32_to_bf16
from yeto_proto.identity import DeltaCorrection, LearnerWeight
from yeto_proto.layout import WireFragment
from yeto_sync import merge as merge_module
from yeto_sync.merge import (
    SCALAR_ISO_SOLVER,
    LedgerEntry,
    MergeConfig,
    MergeError,
    Response,
    ScalarIsoSolver,
    gnorm,
    heloco_correct,
    learner_weights,
    merge_order,
    merge_round,
    merged_outer_gradient,
    nesterov_step,
    update_ledger,
)

F32 = NDArray[np.float32]
NO_CORRECTION = MergeConfig(delta_correction=DeltaCorrection.NONE)
EQUAL_NO_CORRECTION = MergeConfig(
    learner_weight=LearnerWeight.EQUAL, delta_correction=DeltaCorrection.NONE
)


def f32(values: ArrayLike) -> F32:
    return np.asarray(values, dtype=np.float32).reshape(-1)


def response(
    learner_id: int, grad: ArrayLike, *, gen: int = 1, steps: int = 1, tokens: int = 1
) -> Response:
    return Response.from_outer_gradient(learner_id, gen, steps, tokens, f32(grad))


def fragment(mode: MergeMode, *shapes: tuple[int, int]) -> WireFragment:
    numels = tuple(r * c for r, c in shapes)
    return WireFragment(mode, numels, shapes if mode is MergeMode.ISO else ())


def zeros(n: int) -> F32:
    return np.zeros(n, dtype=np.float32)


def random_grads(seed: int, learners: int, n: int, scale: float = 1.0) -> list[F32]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * scale).astype(np.float32) for _ in range(learners)]


# -- slow references ---------------------------------------------------------------------------
def ref_weight(r: Response, mode: LearnerWeight) -> float:
    if mode is LearnerWeight.EQUAL:
        return 1.0
    return float(r.c_tokens) * float(r.c_tokens) / float(r.c_steps)


def ref_norm(values: Sequence[float] | F32) -> float:
    return math.sqrt(math.fsum(float(v) * float(v) for v in values))


def ref_weighted_f32(deltas: Sequence[F32], coefs: Sequence[float]) -> list[np.float32]:
    """Σ f32(coef)·Δ, accumulated in f32 scalars from +0.0, learner by learner."""
    out = []
    for i in range(len(deltas[0])):
        acc = np.float32(0.0)
        for delta, coef in zip(deltas, coefs, strict=True):
            acc = np.float32(acc + np.float32(coef) * delta[i])
        out.append(acc)
    return out


def ref_avg(deltas: Sequence[F32], weights: Sequence[float]) -> list[np.float32]:
    total = sum(weights)
    if total <= 0:
        return [np.float32(0.0)] * len(deltas[0])
    return ref_weighted_f32(deltas, [w / total for w in weights])


def ref_rda(deltas: Sequence[F32], weights: Sequence[float]) -> list[float]:
    total = sum(weights)
    norms = [ref_norm(d) for d in deltas]
    radial = sum(w * n for w, n in zip(weights, norms, strict=True)) / total
    direction = [0.0] * len(deltas[0])
    for d, w, n in zip(deltas, weights, norms, strict=True):
        if n > 0:
            for i, v in enumerate(d):
                direction[i] += w / total / n * float(v)
    length = ref_norm(direction)
    if length < 1e-12:
        return [float(v) for v in ref_avg(deltas, weights)]
    return [v * radial / length for v in direction]


def ref_heloco(delta: Sequence[float] | F32, momentum: Sequence[float] | F32) -> list[float]:
    """The pinned HeLoCo text, literally, in f64."""
    d = [float(v) for v in delta]
    m = [float(v) for v in momentum]
    nd, nm = ref_norm(d), ref_norm(m)
    eps = 1e-8
    if nd < eps or nm < eps:
        return d
    u = [v / nd for v in d]
    vhat = [v / nm for v in m]
    c = sum(a * b for a, b in zip(u, vhat, strict=True))
    conf = nd / (nd + 3.0 * nm + eps)
    if c >= 0.2:
        return d
    if c < 0:
        beta = min(0.5 * (-c) * conf, 0.5)
        return [a - beta * c * nd * b for a, b in zip(d, vhat, strict=True)]
    lam = min(1.0 * (1 - c) * conf, 1.0)
    mixed = [(1 - lam) * a + lam * b for a, b in zip(u, vhat, strict=True)]
    length = max(ref_norm(mixed), eps)
    return [nd * v / length for v in mixed]


def ref_nesterov(
    params: F32, buf: F32, delta: F32, lr: float, mu: float
) -> tuple[list[np.float32], list[np.float32]]:
    lr32, mu32 = np.float32(lr), np.float32(mu)
    new_p, new_b = [], []
    for p, b, d in zip(params, buf, delta, strict=True):
        b2 = np.float32(np.float32(mu32 * b) + d)
        step = np.float32(lr32 * np.float32(d + np.float32(mu32 * b2)))
        new_b.append(b2)
        new_p.append(np.float32(p - step))
    return new_p, new_b


def ref_iso_by_eigh(g: NDArray[np.float64]) -> NDArray[np.float64]:
    """σ̄·U·Vᵀ through the eigen-decomposition of the small Gram (not an SVD)."""
    rows, cols = g.shape
    tall = rows >= cols
    gram = g.T @ g if tall else g @ g.T
    lam, basis = np.linalg.eigh(gram)
    sigma = np.sqrt(np.clip(lam, 0.0, None))
    sigma_bar = sigma.sum() / min(rows, cols)
    keep = sigma > sigma.max() * max(rows, cols) * 2.0**-52
    inv_root = (basis[:, keep] / sigma[keep]) @ basis[:, keep].T
    polar = g @ inv_root if tall else inv_root @ g
    result: NDArray[np.float64] = sigma_bar * polar
    return result


def assert_bits(actual: F32, expected: ArrayLike) -> None:
    assert f32(actual).tobytes() == f32(expected).tobytes()


# -- data model ------------------------------------------------------------------------------
def test_response_rejects_bad_arrays_and_counters() -> None:
    with pytest.raises(ValueError):
        Response(0, 1, 1, 1, np.zeros(3, dtype=np.float64))
    with pytest.raises(ValueError):
        Response(0, 1, 1, 1, np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(ValueError):
        Response(0, 1, 0, 1, zeros(3))
    with pytest.raises(ValueError):
        Response(0, 0, 1, 1, zeros(3))
    with pytest.raises(ValueError):
        Response(0, 1, 1, -1, zeros(3))


def test_merge_config_defaults_are_the_pinned_ones() -> None:
    config = MergeConfig()
    assert config.learner_weight is LearnerWeight.TOKENS2_OVER_STEPS
    assert config.delta_correction is DeltaCorrection.HELOCO
    assert (config.outer_lr, config.outer_momentum) == (0.7, 0.9)
    assert MergeConfig(learner_weight=1).learner_weight is LearnerWeight.EQUAL  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        MergeConfig(outer_lr=math.nan)


def test_merge_order_sorts_by_learner_then_generation_and_refuses_duplicates() -> None:
    a, b, c = response(2, [1.0], gen=5), response(0, [1.0], gen=9), response(2, [1.0], gen=3)
    assert [r.member for r in merge_order([a, b, c])] == [(0, 9), (2, 3), (2, 5)]
    with pytest.raises(ValueError, match="twice"):
        merge_order([a, response(2, [2.0], gen=5)])


def test_fragment_length_mismatch_is_refused() -> None:
    geometry = fragment(MergeMode.AVG, (1, 3))
    with pytest.raises(ValueError, match="values"):
        merged_outer_gradient(geometry, [response(0, [1.0, 2.0])], zeros(3), NO_CORRECTION)
    with pytest.raises(ValueError, match="momentum"):
        merged_outer_gradient(geometry, [response(0, [1.0, 2.0, 3.0])], zeros(2), NO_CORRECTION)


# -- weights ---------------------------------------------------------------------------------
def test_weights_tokens_squared_over_steps() -> None:
    rs = [
        response(0, [0.0], steps=10, tokens=100),
        response(1, [0.0], steps=3, tokens=7),
        response(2, [0.0], steps=4, tokens=0),
    ]
    weights = learner_weights(rs, LearnerWeight.TOKENS2_OVER_STEPS)
    assert weights.dtype == np.float64
    assert weights.tolist() == [1000.0, 49.0 / 3.0, 0.0]
    assert learner_weights(rs, LearnerWeight.EQUAL).tolist() == [1.0, 1.0, 1.0]


def test_weights_stay_exact_in_f64_for_large_counts() -> None:
    r = response(0, [0.0], steps=3, tokens=2**40 + 1)
    assert learner_weights([r], LearnerWeight.TOKENS2_OVER_STEPS)[0] == ref_weight(
        r, LearnerWeight.TOKENS2_OVER_STEPS
    )


@pytest.mark.parametrize("mode", [MergeMode.AVG, MergeMode.RDA, MergeMode.ISO])
def test_zero_weight_sum_gives_zero_delta_and_nesterov_still_runs(mode: MergeMode) -> None:
    geometry = fragment(mode, (2, 2))
    rs = [response(0, [1, 2, 3, 4], tokens=0), response(1, [5, 6, 7, 8], tokens=0)]
    params, momentum = f32([1.0, -1.0, 0.5, 0.0]), f32([0.25, 0.5, -1.0, 0.0])
    result = merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION)
    assert result.gnorm == 0.0
    expected_p, expected_b = ref_nesterov(params, momentum, zeros(4), 0.7, 0.9)
    assert_bits(result.params, expected_p)
    assert_bits(result.momentum, expected_b)
    assert not np.array_equal(result.params, params)  # the momentum alone still moved Θ
    assert result.ledger == {0: LedgerEntry(1, 1, 0), 1: LedgerEntry(1, 1, 0)}


# -- avg -------------------------------------------------------------------------------------
def test_avg_golden_values() -> None:
    geometry = fragment(MergeMode.AVG, (1, 2))
    rs = [response(0, [1.0, 0.0]), response(1, [0.0, -2.0])]
    assert_bits(merged_outer_gradient(geometry, rs, zeros(2), NO_CORRECTION), [0.5, -1.0])
    weighted = [response(0, [1.0], tokens=3, steps=1), response(1, [-3.0], tokens=1, steps=1)]
    # w = 9 and 1: (9·1 − 3)/10
    out = merged_outer_gradient(fragment(MergeMode.AVG, (1, 1)), weighted, zeros(1), NO_CORRECTION)
    assert out[0] == np.float32(np.float32(0.9) * 1 + np.float32(0.1) * -3)
    assert abs(float(out[0]) - 0.6) < 1e-6
    # The sum starts from +0.0: learners that all left an element untouched (Δ = −0.0, the
    # negation of a zero delta) give +0.0, as the reference syncer's accumulator does.
    unmoved = [response(0, [-0.0]), response(1, [-0.0])]
    out = merged_outer_gradient(fragment(MergeMode.AVG, (1, 1)), unmoved, zeros(1), NO_CORRECTION)
    assert_bits(out, [0.0])


@pytest.mark.parametrize("seed", range(5))
def test_avg_matches_f32_reference_bit_for_bit(seed: int) -> None:
    grads = random_grads(seed, 4, 11)
    rs = [response(i, g, steps=i + 1, tokens=10 * i + 3) for i, g in enumerate(grads)]
    geometry = WireFragment(MergeMode.AVG, (4, 7))
    out = merged_outer_gradient(geometry, reversed(rs), zeros(11), NO_CORRECTION)
    weights = [ref_weight(r, LearnerWeight.TOKENS2_OVER_STEPS) for r in rs]
    assert_bits(out, ref_avg(grads, weights))


def test_merge_is_independent_of_arrival_order() -> None:
    grads = random_grads(7, 5, 9)
    rs = [response(i % 3, g, gen=1 + i, tokens=i + 2) for i, g in enumerate(grads)]
    geometry = WireFragment(MergeMode.RDA, (3, 6))
    first = merged_outer_gradient(geometry, rs, zeros(9), NO_CORRECTION)
    for seed in range(3):
        shuffled = rs[:]
        random.Random(seed).shuffle(shuffled)
        assert_bits(merged_outer_gradient(geometry, shuffled, zeros(9), NO_CORRECTION), first)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    learners=st.integers(1, 6),
    n=st.integers(1, 40),
    tokens=st.integers(1, 10**6),
)
def test_avg_of_identical_deltas_is_that_delta(
    seed: int, learners: int, n: int, tokens: int
) -> None:
    (grad,) = random_grads(seed, 1, n, scale=10.0)
    rs = [response(i, grad, tokens=tokens, steps=3) for i in range(learners)]
    out = merged_outer_gradient(fragment(MergeMode.AVG, (1, n)), rs, zeros(n), NO_CORRECTION)
    np.testing.assert_allclose(out, grad, rtol=1e-6 * learners, atol=0)
    if learners & (learners - 1) == 0:  # 1/M exact in binary: so is the sum
        assert_bits(out, grad)


# -- rda -------------------------------------------------------------------------------------
def test_rda_keeps_the_norm_of_orthogonal_deltas() -> None:
    rs = [response(0, [2.0, 0.0]), response(1, [0.0, 2.0])]
    out = merged_outer_gradient(fragment(MergeMode.RDA, (1, 2)), rs, zeros(2), NO_CORRECTION)
    np.testing.assert_allclose(out, [math.sqrt(2.0), math.sqrt(2.0)], rtol=1e-7)


def test_rda_single_learner_returns_its_delta() -> None:
    rs = [response(4, [0.5, -0.5, 0.0], tokens=9)]
    out = merged_outer_gradient(fragment(MergeMode.RDA, (1, 3)), rs, zeros(3), NO_CORRECTION)
    np.testing.assert_allclose(out, [0.5, -0.5, 0.0], rtol=1e-7)


def test_rda_zero_norm_learner_counts_in_radial_only() -> None:
    rs = [response(0, [3.0, 4.0]), response(1, [0.0, 0.0])]
    out = merged_outer_gradient(fragment(MergeMode.RDA, (1, 2)), rs, zeros(2), NO_CORRECTION)
    # radial = (5 + 0)/2, direction = (0.6, 0.8)
    np.testing.assert_allclose(out, [1.5, 2.0], rtol=1e-7)


def test_rda_cancelling_directions_fall_back_to_avg() -> None:
    geometry = fragment(MergeMode.RDA, (1, 1))
    out = merged_outer_gradient(
        geometry, [response(0, [2.0]), response(1, [-1.0])], zeros(1), NO_CORRECTION
    )
    assert_bits(out, [0.5])  # the avg (2 − 1)/2, not rda's undefined 0-direction
    all_zero = [response(0, [0.0]), response(1, [0.0])]
    assert_bits(merged_outer_gradient(geometry, all_zero, zeros(1), NO_CORRECTION), [0.0])


def test_rda_of_a_delta_with_a_subnormal_norm_is_finite() -> None:
    """f32(w/S/n) of a Δ_m whose norm is ~1e-40 is infinite: inf · 0 made the commit fail
    (the syncer exited 1, again on resume) where the pinned result is finite."""
    tiny = np.array([1e-40, 0.0, 0.0, -2e-41], np.float32)
    alone = merged_outer_gradient(
        fragment(MergeMode.RDA, (1, 4)), [response(0, tiny)], zeros(4), NO_CORRECTION
    )
    np.testing.assert_allclose(alone, tiny, rtol=1e-5, atol=0)
    other = np.array([0.5, -0.25, 1.0, 0.0], np.float32)
    rs = [response(0, other, tokens=4), response(1, tiny, tokens=9)]
    out = merged_outer_gradient(fragment(MergeMode.RDA, (1, 4)), rs, zeros(4), NO_CORRECTION)
    weights = [ref_weight(r, LearnerWeight.TOKENS2_OVER_STEPS) for r in rs]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref_rda([other, tiny], weights), rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("seed", range(5))
def test_rda_matches_reference_per_tensor(seed: int) -> None:
    grads = random_grads(100 + seed, 3, 12)
    grads[1][:5] = 0.0  # a learner that did not move the first tensor
    rs = [response(i, g, steps=2 + i, tokens=5 + 3 * i) for i, g in enumerate(grads)]
    geometry = WireFragment(MergeMode.RDA, (5, 7))
    out = merged_outer_gradient(geometry, rs, zeros(12), NO_CORRECTION)
    weights = [ref_weight(r, LearnerWeight.TOKENS2_OVER_STEPS) for r in rs]
    expected = ref_rda([g[:5] for g in grads], weights) + ref_rda([g[5:] for g in grads], weights)
    np.testing.assert_allclose(out, expected, rtol=2e-6, atol=1e-7)
    whole = ref_rda(grads, weights)  # rda is per tensor, not per fragment
    assert not np.allclose(out, whole, rtol=1e-3)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), learners=st.integers(1, 5), n=st.integers(2, 30))
def test_rda_output_norm_is_the_weighted_mean_norm(seed: int, learners: int, n: int) -> None:
    grads = random_grads(seed, learners, n)
    rs = [response(i, g, tokens=i + 1) for i, g in enumerate(grads)]
    out = merged_outer_gradient(fragment(MergeMode.RDA, (1, n)), rs, zeros(n), NO_CORRECTION)
    weights = [float((i + 1) ** 2) for i in range(learners)]
    radial = sum(w * ref_norm(g) for w, g in zip(weights, grads, strict=True)) / sum(weights)
    assert ref_norm(out) == pytest.approx(radial, rel=1e-5)


def test_large_tensors_take_the_blocked_paths_with_the_same_results() -> None:
    # Longer than the internal block, and not a multiple of it.
    n = 2 * merge_module._BLOCK + 123
    grads = random_grads(21, 3, n)
    grads[2][: n // 3] = -grads[0][: n // 3]  # partly opposed, so no branch is trivial
    rs = [response(i, g, steps=1 + i, tokens=7 + i) for i, g in enumerate(grads)]
    weights = [float((7 + i) ** 2) / (1 + i) for i in range(3)]
    coefs = [w / sum(weights) for w in weights]
    # avg: the whole-array f32 accumulation is element-wise the same sum
    expected = np.zeros(n, dtype=np.float32)
    for g, c in zip(grads, coefs, strict=True):
        expected = expected + np.float32(c) * g
    avg = merged_outer_gradient(WireFragment(MergeMode.AVG, (n,)), rs, zeros(n), NO_CORRECTION)
    assert_bits(avg, expected)
    # rda, in f64 numpy
    wide = [g.astype(np.float64) for g in grads]
    norms = [float(np.sqrt(np.dot(g, g))) for g in wide]
    radial = sum(w * m for w, m in zip(weights, norms, strict=True)) / sum(weights)
    direction = sum(w / sum(weights) / m * g for w, m, g in zip(weights, norms, wide, strict=True))
    direction = direction * (radial / np.sqrt(np.dot(direction, direction)))
    rda = merged_outer_gradient(WireFragment(MergeMode.RDA, (n,)), rs, zeros(n), NO_CORRECTION)
    np.testing.assert_allclose(rda, direction, rtol=1e-5, atol=1e-6)  # f32 sums of ~1s
    assert gnorm(rda) == pytest.approx(radial, rel=1e-6)
    # heloco on long tensors, both correcting branches, against the pinned text in f64
    momentum = grads[1]
    opposed = grads[0] * np.float32(0.5) - grads[1]  # c ≈ −0.9: shrink
    skewed = grads[0] + grads[1] * np.float32(0.1)  # c ≈ 0.1: rotate
    for delta, negative in ((opposed, True), (skewed, False)):
        d, m = delta.astype(np.float64), momentum.astype(np.float64)
        nd, nm = float(np.sqrt(d @ d)), float(np.sqrt(m @ m))
        c = float(d @ m) / (nd * nm)
        assert (c < 0) is negative and c < 0.2
        conf = nd / (nd + 3.0 * nm + 1e-8)
        if c < 0:
            want = d - min(0.5 * -c * conf, 0.5) * c * nd * m / nm
        else:
            lam = min((1 - c) * conf, 1.0)
            mixed = (1 - lam) * d / nd + lam * m / nm
            want = nd * mixed / np.sqrt(mixed @ mixed)
        np.testing.assert_allclose(heloco_correct(delta, momentum), want, rtol=1e-5, atol=1e-7)


# -- iso -------------------------------------------------------------------------------------
def iso(values: Sequence[float], rows: int, cols: int) -> F32:
    rs = [response(0, values)]
    geometry = fragment(MergeMode.ISO, (rows, cols))
    return merged_outer_gradient(geometry, rs, zeros(rows * cols), NO_CORRECTION)


def test_iso_golden_flattens_the_spectrum() -> None:
    np.testing.assert_allclose(iso([3, 0, 0, 1], 2, 2), [2, 0, 0, 2], atol=1e-6)
    assert SCALAR_ISO_SOLVER.backend is IsoBackend.SCALAR


def test_iso_rectangular_shapes() -> None:
    # σ = (1, 2) → σ̄ = 1.5 on both directions
    np.testing.assert_allclose(iso([1, 0, 0, 0, 2, 0], 2, 3), [1.5, 0, 0, 0, 1.5, 0], atol=1e-6)
    np.testing.assert_allclose(iso([1, 0, 0, 2, 0, 0], 3, 2), [1.5, 0, 0, 1.5, 0, 0], atol=1e-6)
    # A single row or column has one singular value: it is its own flattening.
    np.testing.assert_allclose(iso([3, -4, 12], 1, 3), [3, -4, 12], rtol=1e-6)
    np.testing.assert_allclose(iso([3, -4, 12], 3, 1), [3, -4, 12], rtol=1e-6)


def test_iso_rank_deficient_keeps_only_the_real_directions() -> None:
    # [[1,2],[2,4]] = 5·ûûᵀ with û = (1,2)/√5: σ = (5, 0) → σ̄ = 2.5, result 2.5·ûûᵀ
    np.testing.assert_allclose(iso([1, 2, 2, 4], 2, 2), [0.5, 1, 1, 2], rtol=1e-6)
    # rank 1 in 3x4: a·bᵀ → σ̄ = ‖a‖‖b‖/3 along the same direction, i.e. a·bᵀ/3
    a, b = np.array([1.0, -2.0, 2.0]), np.array([0.5, 0.0, 1.0, -1.0])
    outer = np.outer(a, b).ravel().tolist()
    np.testing.assert_allclose(iso(outer, 3, 4), np.array(outer) / 3, rtol=1e-6, atol=1e-7)


def test_iso_zero_matrix_stays_zero() -> None:
    assert_bits(iso([0, 0, 0, 0, 0, 0], 2, 3), zeros(6))


def test_iso_averages_first_then_flattens_each_tensor() -> None:
    geometry = fragment(MergeMode.ISO, (2, 2), (1, 2))
    rs = [response(0, [5, 0, 0, 1, 3, 4]), response(1, [1, 0, 0, 1, 0, 0])]
    out = merged_outer_gradient(geometry, rs, zeros(6), NO_CORRECTION)
    # avg = [[3,0],[0,1]] → [[2,0],[0,2]]; second tensor avg (1.5, 2) is a row: unchanged
    np.testing.assert_allclose(out, [2, 0, 0, 2, 1.5, 2], atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 7), cols=st.integers(1, 7))
def test_iso_singular_values_all_equal_sigma_bar(seed: int, rows: int, cols: int) -> None:
    g = np.random.default_rng(seed).standard_normal((rows, cols))
    out = iso(g.ravel().tolist(), rows, cols).astype(np.float64).reshape(rows, cols)
    sigma_in = np.linalg.svd(g.astype(np.float32).astype(np.float64), compute_uv=False)
    sigma_out = np.linalg.svd(out, compute_uv=False)
    np.testing.assert_allclose(sigma_out, sigma_in.mean(), rtol=1e-5)
    np.testing.assert_allclose(
        out,
        ref_iso_by_eigh(g.astype(np.float32).astype(np.float64)),
        rtol=1e-4,
        atol=1e-5 * float(sigma_in.max()),
    )
    again = SCALAR_ISO_SOLVER.polar_flatten(f32(out), rows, cols)  # idempotent
    np.testing.assert_allclose(again, out.ravel(), rtol=1e-5, atol=1e-6 * float(sigma_in.max()))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rank=st.integers(1, 3))
def test_iso_rank_deficient_keeps_rank_and_divides_by_min_dim(seed: int, rank: int) -> None:
    # Small integer factors: the product is exact in f32, so its rank is exactly known.
    rng = np.random.default_rng(seed)
    g = (rng.integers(-3, 4, (6, rank)) @ rng.integers(-3, 4, (rank, 5))).astype(np.float64)
    true_rank = int(np.linalg.matrix_rank(g))
    out = SCALAR_ISO_SOLVER.polar_flatten(f32(g), 6, 5).astype(np.float64).reshape(6, 5)
    if true_rank == 0:
        assert_bits(f32(out), zeros(30))
        return
    sigma_bar = float(np.linalg.svd(g, compute_uv=False).sum()) / 5  # min(6, 5), zeros included
    sigma_out = np.linalg.svd(out, compute_uv=False)
    np.testing.assert_allclose(sigma_out[:true_rank], sigma_bar, rtol=1e-5)
    assert np.all(sigma_out[true_rank:] < 1e-5 * sigma_bar)  # null directions stay null


def test_scalar_solver_reuses_buffers_safely_across_sizes_and_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shapes = [(6, 5), (2, 2), (3, 7), (6, 5), (1, 9), (9, 1)]
    rng = np.random.default_rng(5)
    cases = [(f32(rng.standard_normal(r * c)), r, c) for r, c in shapes]
    fresh = [ScalarIsoSolver().polar_flatten(m, r, c) for m, r, c in cases]
    shared = ScalarIsoSolver()
    for _ in range(2):
        for (m, r, c), want in zip(cases, fresh, strict=True):
            assert_bits(shared.polar_flatten(m, r, c), want)
    with ThreadPoolExecutor(max_workers=4) as pool:
        jobs = [pool.submit(shared.polar_flatten, m, r, c) for m, r, c in cases * 20]
        for job, want in zip(jobs, fresh * 20, strict=True):
            assert_bits(job.result(), want)
    monkeypatch.setattr(merge_module, "_ISO_REUSE_MAX", 4)  # large matrices: fresh buffers
    for (m, r, c), want in zip(cases, fresh, strict=True):
        assert_bits(shared.polar_flatten(m, r, c), want)


class RecordingSolver:
    """A stand-in for the torch-svd pool: records what it is asked, answers a fixed value."""

    def __init__(self, answer: float) -> None:
        self.answer = answer
        self.calls: list[tuple[list[float], int, int]] = []

    @property
    def backend(self) -> IsoBackend:
        return IsoBackend.TORCH_SVD

    def polar_flatten(
        self, matrix: NDArray[np.float32] | NDArray[np.float64], rows: int, cols: int
    ) -> F32:
        self.calls.append((matrix.astype(np.float64).tolist(), rows, cols))
        return np.full(rows * cols, self.answer, dtype=np.float32)


def test_iso_solver_is_pluggable_and_checked() -> None:
    geometry = fragment(MergeMode.ISO, (2, 2), (1, 3))
    rs = [response(0, [1, 2, 3, 4, 5, 6, 7]), response(1, [3, 2, 1, 0, -1, -2, -3])]
    solver = RecordingSolver(7.0)
    out = merged_outer_gradient(geometry, rs, zeros(7), NO_CORRECTION, solver)
    assert solver.calls == [([2.0, 2.0, 2.0, 2.0], 2, 2), ([2.0, 2.0, 2.0], 1, 3)]
    assert_bits(out, [7.0] * 7)
    with pytest.raises(MergeError, match="non-finite"):
        merged_outer_gradient(geometry, rs, zeros(7), NO_CORRECTION, RecordingSolver(math.nan))


class RecordingBatchSolver(RecordingSolver):
    """A pool-like solver: takes a fragment's matrices in one call."""

    def __init__(self, answer: float, drop_last: bool = False) -> None:
        super().__init__(answer)
        self.batches: list[list[tuple[int, int]]] = []
        self.drop_last = drop_last

    def polar_flatten_many(
        self, matrices: Sequence[tuple[NDArray[np.float32] | NDArray[np.float64], int, int]]
    ) -> list[F32]:
        self.batches.append([(rows, cols) for _, rows, cols in matrices])
        results = [self.polar_flatten(m, rows, cols) for m, rows, cols in matrices]
        return results[:-1] if self.drop_last else results


def test_iso_hands_a_batch_solver_the_whole_fragment_at_once() -> None:
    geometry = fragment(MergeMode.ISO, (2, 2), (1, 3))
    rs = [response(0, [1, 2, 3, 4, 5, 6, 7]), response(1, [3, 2, 1, 0, -1, -2, -3])]
    solver = RecordingBatchSolver(5.0)
    out = merged_outer_gradient(geometry, rs, zeros(7), NO_CORRECTION, solver)
    assert solver.batches == [[(2, 2), (1, 3)]]
    assert solver.calls == [([2.0, 2.0, 2.0, 2.0], 2, 2), ([2.0, 2.0, 2.0], 1, 3)]
    assert_bits(out, [5.0] * 7)
    short = RecordingBatchSolver(5.0, drop_last=True)
    with pytest.raises(MergeError, match="1 of 2"):
        merged_outer_gradient(geometry, rs, zeros(7), NO_CORRECTION, short)


def test_iso_non_finite_average_is_a_merge_error_not_a_linalg_crash() -> None:
    # Decode refuses non-finite pushes; should one slip through, the commit fails cleanly.
    geometry = fragment(MergeMode.ISO, (2, 2))
    rs = [response(0, [1.0, 2.0, 3.0, 4.0]), response(1, [1.0, math.inf, 3.0, 4.0])]
    with pytest.raises(MergeError, match="not finite"):
        merged_outer_gradient(geometry, rs, zeros(4), NO_CORRECTION)


def test_scalar_solver_refuses_a_wrong_shape() -> None:
    with pytest.raises(ValueError):
        ScalarIsoSolver().polar_flatten(zeros(6), 4, 2)


# -- heloco ----------------------------------------------------------------------------------
def test_heloco_aligned_delta_is_returned_unchanged() -> None:
    delta = f32([1.0, 0.1])
    assert heloco_correct(delta, f32([1.0, 0.0])) is delta  # c ≈ 0.995 ≥ c_ok


def test_heloco_skips_tiny_delta_or_momentum() -> None:
    tiny = f32([1e-9, -1e-9])
    assert heloco_correct(tiny, f32([-1.0, 1.0])) is tiny
    delta = f32([-3.0, 4.0])
    assert heloco_correct(delta, f32([1e-9, 0.0])) is delta
    assert heloco_correct(delta, zeros(2)) is delta


def test_heloco_opposing_delta_is_shrunk_golden() -> None:
    # c = −1, conf = 1/(1 + 3 + ε), β = 0.5·1·conf ≈ 0.125: Δ + 0.125·m
    delta, momentum = f32([-1.0, 0.0]), f32([1.0, 0.0])
    out = heloco_correct(delta, momentum)
    np.testing.assert_allclose(out, [-0.875, 0.0], rtol=1e-7)
    assert_bits(delta, [-1.0, 0.0])  # the input is not written


def test_heloco_orthogonal_delta_is_rotated_golden() -> None:
    # c = 0 lies in [0, c_ok): λ = conf ≈ 0.25, ũ = (0.75, 0.25) → ‖Δ‖·ũ/‖ũ‖ = (3, 1)/√10
    out = heloco_correct(f32([1.0, 0.0]), f32([0.0, 1.0]))
    np.testing.assert_allclose(out, np.array([3.0, 1.0]) / math.sqrt(10.0), rtol=1e-6)


@pytest.mark.parametrize(
    ("delta", "momentum"),
    [
        ([-2.0, 0.5, 1.0], [1.0, 0.0, 0.2]),  # c < 0
        ([0.1, 1.0, -0.3], [1.0, 0.0, 0.0]),  # 0 ≤ c < c_ok
        ([0.3, 1.0, 0.0], [0.01, 0.0, 0.0]),  # 0 ≤ c < c_ok, small momentum: high confidence
        ([-1.0, 0.2, 0.0], [100.0, 0.0, 0.0]),  # c < 0, huge momentum: low confidence
        ([1.0, 1.0, 1.0], [1.0, 0.0, 0.0]),  # c ≥ c_ok
    ],
)
def test_heloco_matches_the_pinned_formula(delta: list[float], momentum: list[float]) -> None:
    out = heloco_correct(f32(delta), f32(momentum))
    np.testing.assert_allclose(out, ref_heloco(f32(delta), f32(momentum)), rtol=2e-6, atol=1e-8)


finite32 = st.floats(-100.0, 100.0, width=32, allow_subnormal=False)


@settings(max_examples=100, deadline=None)
@given(pairs=st.lists(st.tuples(finite32, finite32), min_size=1, max_size=12))
def test_heloco_properties(pairs: list[tuple[float, float]]) -> None:
    delta, momentum = f32([d for d, _ in pairs]), f32([m for _, m in pairs])
    out = heloco_correct(delta, momentum)
    expected = ref_heloco(delta, momentum)
    scale = max(ref_norm(delta), 1.0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * scale)
    nd, nm = ref_norm(delta), ref_norm(momentum)
    if nd >= 1e-8 and nm >= 1e-8:
        c = sum(float(a) * float(b) for a, b in pairs) / (nd * nm)
        if 0.0 <= c < 0.2:
            assert ref_norm(out) == pytest.approx(nd, rel=1e-5)  # rotation keeps ‖Δ‖
        if c < 0.2 and nd > 1e-3:
            c_out = sum(float(a) * float(m) for a, m in zip(out, momentum, strict=True))
            assert c_out / (ref_norm(out) * nm) >= c - 1e-6  # never turns further away


def test_heloco_in_a_merge_is_per_tensor_against_pre_commit_momentum() -> None:
    geometry = fragment(MergeMode.AVG, (1, 2), (1, 2))
    grads = [f32([1.0, 0.0, -1.0, 0.0]), f32([0.5, 0.5, -2.0, 1.0])]
    momentum = f32([1.0, 0.0, 1.0, 0.0])  # tensor 0 aligned-ish, tensor 1 opposed
    rs = [response(i, g) for i, g in enumerate(grads)]
    out = merged_outer_gradient(geometry, rs, momentum, MergeConfig())
    corrected = [
        np.concatenate([heloco_correct(g[:2], momentum[:2]), heloco_correct(g[2:], momentum[2:])])
        for g in grads
    ]
    assert_bits(out, ref_avg(corrected, [1.0, 1.0]))
    plain = merged_outer_gradient(geometry, rs, momentum, NO_CORRECTION)
    assert_bits(plain, ref_avg(grads, [1.0, 1.0]))
    assert not np.array_equal(out, plain)
    assert_bits(grads[0], [1.0, 0.0, -1.0, 0.0])  # responses are read, never written


# -- outer step ------------------------------------------------------------------------------
def test_nesterov_hand_values() -> None:
    params, buf = nesterov_step(f32([1.0]), f32([0.0]), f32([0.5]), 0.7, 0.9)
    assert buf[0] == np.float32(0.5)
    assert params[0] == pytest.approx(1.0 - 0.7 * (0.5 + 0.9 * 0.5), abs=1e-7)
    params, buf = nesterov_step(f32([0.0]), f32([2.0]), f32([1.0]), 0.25, 0.5)
    assert (float(buf[0]), float(params[0])) == (2.0, -0.5)  # buf = 1 + 1; Θ = −0.25·(1 + 1)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 30),
    lr=st.floats(0.01, 2.0),
    mu=st.floats(0.0, 0.99),
)
def test_nesterov_matches_f32_reference_bit_for_bit(
    seed: int, n: int, lr: float, mu: float
) -> None:
    params, buf, delta = random_grads(seed, 3, n)
    before = (params.copy(), buf.copy(), delta.copy())
    new_params, new_buf = nesterov_step(params, buf, delta, lr, mu)
    expected_p, expected_b = ref_nesterov(params, buf, delta, lr, mu)
    assert_bits(new_params, expected_p)
    assert_bits(new_buf, expected_b)
    for original, kept in zip(before, (params, buf, delta), strict=True):
        assert_bits(kept, original)


SPECIAL_F32 = st.sampled_from([math.nan, math.inf, -math.inf, 3.0e38, -3.0e38, 1.0, 0.0, -0.0])


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.tuples(SPECIAL_F32, SPECIAL_F32, SPECIAL_F32), min_size=1, max_size=6),
    lr=st.sampled_from([0.0, 0.7, 1.0, 2.0]),
    mu=st.sampled_from([0.0, 0.9, 1.0]),
)
def test_the_step_is_refused_exactly_when_delta_momentum_or_params_end_non_finite(
    values: list[tuple[float, float, float]], lr: float, mu: float
) -> None:
    params, buf, delta = (f32([v[i] for v in values]) for i in range(3))
    with np.errstate(all="ignore"):
        expected_p, expected_b = ref_nesterov(params, buf, delta, lr, mu)
    bad = not all(np.isfinite(a).all() for a in (delta, expected_b, expected_p))
    if bad:
        with pytest.raises(MergeError):
            nesterov_step(params, buf, delta, lr, mu)
    else:
        new_params, new_buf = nesterov_step(params, buf, delta, lr, mu)
        assert_bits(new_params, expected_p)
        assert_bits(new_buf, expected_b)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_delta_fails_the_commit_without_touching_state(bad: float) -> None:
    params, buf = f32([1.0, 2.0]), f32([0.5, 0.5])
    with pytest.raises(MergeError, match="not finite"):
        nesterov_step(params, buf, f32([0.0, bad]), 0.7, 0.9)
    assert_bits(params, [1.0, 2.0])
    assert_bits(buf, [0.5, 0.5])


def test_overflowing_step_fails_the_whole_round() -> None:
    geometry = fragment(MergeMode.AVG, (1, 2))
    params, momentum = f32([3.0e38, 1.0]), f32([0.0, 0.0])
    ledger = {0: (4, 40, 400)}
    rs = [response(0, [-3.0e38, 0.0])]
    with pytest.raises(MergeError, match="non-finite parameters"):
        merge_round(geometry, rs, params, momentum, ledger, NO_CORRECTION)
    assert_bits(params, [3.0e38, 1.0])
    assert_bits(momentum, [0.0, 0.0])
    assert ledger == {0: (4, 40, 400)}


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_step_beyond_bf16s_range_fails_a_bf16_sessions_round(sign: float) -> None:
    # Θ' ≈ ±3.3998e38 is finite in f32, so it was committed, and its bf16 BCAST carried an
    # infinity that every learner must refuse as the syncer's violation (spec/learner.md § 3).
    geometry = fragment(MergeMode.AVG, (1, 2))
    params, momentum = f32([sign * 3.3e38, 1.0]), f32([0.0, 0.0])
    rs = [response(0, [sign * -7.5e36, 0.0])]
    committed = merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION)  # f32: fine
    assert np.isfinite(committed.params).all()
    assert abs(committed.params[0]) >= BF16_OVERFLOW
    bits = np.zeros(2, np.uint16)
    with pytest.raises(MergeError, match="beyond bf16's range"):
        merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION, params_bf16=bits)
    assert_bits(params, [sign * 3.3e38, 1.0])


def test_a_step_just_inside_bf16s_range_is_committed_in_a_bf16_session() -> None:
    geometry = fragment(MergeMode.AVG, (1, 2))
    below = np.nextafter(BF16_OVERFLOW, np.float32(0))
    params, momentum = f32([below, -below]), f32([0.0, 0.0])
    bits = np.zeros(2, np.uint16)
    merge_round(geometry, [response(0, [0.0, 0.0])], params, momentum, {}, NO_CORRECTION,
                params_bf16=bits)  # fmt: skip
    assert bits.tolist() == [0x7F7F, 0xFF7F]


def test_nesterov_refuses_mismatched_arrays() -> None:
    with pytest.raises(ValueError):
        nesterov_step(f32([1.0]), f32([1.0, 2.0]), f32([1.0]), 0.7, 0.9)
    with pytest.raises(ValueError):
        nesterov_step(f32([1.0]), f32([1.0]), np.ones(1), 0.7, 0.9)  # type: ignore[arg-type]


# -- ledger, gnorm, one round ----------------------------------------------------------------
def test_ledger_accumulates_per_learner_id() -> None:
    ledger = {3: (2, 20, 200)}
    rs = [
        response(3, [0.0], gen=2, steps=5, tokens=50),
        response(7, [0.0], gen=1, steps=4, tokens=9),
    ]
    updated = update_ledger(ledger, rs)
    assert updated == {3: LedgerEntry(3, 25, 250), 7: LedgerEntry(1, 4, 9)}
    assert updated[3].merges == 3
    assert ledger == {3: (2, 20, 200)}  # the old ledger is left as it was
    # two generations of one id in the same commit each count (PINNED: "for each merge its
    # response entered")
    twice = update_ledger({}, [response(1, [0.0], gen=1), response(1, [0.0], gen=2, steps=2)])
    assert twice == {1: LedgerEntry(2, 3, 2)}


def test_ledger_counts_stop_at_the_largest_u64() -> None:
    """Two legal PUSHes of c_tokens 2^63 made a count the checkpoint writer refuses: every
    write of the run failed, and a resumed checkpoint at the limit failed the same way."""
    top = (1 << 64) - 1
    pushes = [response(0, [0.0], tokens=1 << 63), response(0, [0.0], gen=2, tokens=1 << 63)]
    assert update_ledger({}, pushes) == {0: LedgerEntry(2, 2, top)}
    at_limit = update_ledger({5: (top, top - 1, 7)}, [response(5, [0.0], steps=3, tokens=1)])
    assert at_limit == {5: LedgerEntry(top, top, 8)}


def test_gnorm_is_the_f64_l2_norm() -> None:
    delta = f32([3.0, 4.0, 1e-4])
    assert gnorm(delta) == pytest.approx(ref_norm(delta), rel=1e-15)
    assert gnorm(zeros(5)) == 0.0


def test_merge_round_end_to_end() -> None:
    geometry = fragment(MergeMode.AVG, (2, 3))
    grads = random_grads(11, 3, 6)
    rs = [
        response(2, grads[0], tokens=4, steps=2),
        response(0, grads[1], tokens=2),
        response(1, grads[2], tokens=6, steps=3),
    ]
    params, momentum = random_grads(12, 2, 6)
    result = merge_round(geometry, rs, params, momentum, {0: (1, 1, 1)}, NO_CORRECTION)
    assert [r.learner_id for r in result.responses] == [0, 1, 2]
    assert result.weights == (4.0, 12.0, 8.0)
    expected_delta = ref_avg([grads[1], grads[2], grads[0]], [4.0, 12.0, 8.0])
    assert result.gnorm == pytest.approx(ref_norm(f32(expected_delta)), rel=1e-12)
    expected_p, expected_b = ref_nesterov(params, momentum, f32(expected_delta), 0.7, 0.9)
    assert_bits(result.params, expected_p)
    assert_bits(result.momentum, expected_b)
    assert result.ledger[0] == LedgerEntry(2, 2, 3)
    assert result.ledger[1] == LedgerEntry(1, 3, 6)


# -- the pushed sign and the fused outer step ----------------------------------------------------
def test_pushed_payload_is_negated_by_the_merge_signed_zeros_included() -> None:
    # Δ = −d: d = +0 gives Δ = −0 and the sum from +0.0 is +0.0; d = −0 gives Δ = +0 → +0.0.
    geometry = fragment(MergeMode.AVG, (1, 4))
    pushed = f32([0.0, -0.0, 1.5, -2.0])
    r = Response(0, 1, 1, 1, pushed)
    out = merged_outer_gradient(geometry, [r], zeros(4), NO_CORRECTION)
    reference = f32([0.0, 0.0, 0.0, 0.0])
    for i, delta in enumerate(np.negative(pushed)):
        reference[i] = np.float32(0.0) + np.float32(1.0) * delta
    assert_bits(out, reference)
    assert np.signbit(out).tolist() == [False, False, True, False]


def test_response_from_outer_gradient_stores_the_pushed_payload() -> None:
    r = Response.from_outer_gradient(3, 2, 1, 5, f32([1.0, -2.0]))
    assert_bits(r.pushed, [-1.0, 2.0])
    assert_bits(r.outer_gradient(), [1.0, -2.0])


@given(
    st.lists(
        st.tuples(st.floats(-1e3, 1e3, width=32), st.floats(-1e3, 1e3, width=32)),
        min_size=1,
        max_size=12,
    )
)
def test_sign_folding_matches_adding_the_negated_payload(pairs: list[tuple[float, float]]) -> None:
    a, b = f32([p[0] for p in pairs]), f32([p[1] for p in pairs])
    rs = [Response(0, 1, 3, 7, a), Response(1, 1, 2, 5, b)]
    geometry = fragment(MergeMode.AVG, (1, a.size))
    got = merged_outer_gradient(geometry, rs, zeros(a.size), NO_CORRECTION)
    weights = learner_weights(rs, NO_CORRECTION.learner_weight)
    assert_bits(got, ref_avg([np.negative(a), np.negative(b)], [float(w) for w in weights]))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_outer_step_bits_do_not_depend_on_threads(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import yeto_sync.merge as merge_module

    monkeypatch.setattr(merge_module, "_STEP_THREADS", threads)
    n = merge_module._THREADED_MIN + 12_345  # more than one thread's worth, a ragged tail
    geometry = fragment(MergeMode.AVG, (1, n))
    grads = random_grads(21, 2, n, scale=1e-3)
    rs = [response(0, grads[0], tokens=3), response(1, grads[1], tokens=5, steps=2)]
    params, momentum = random_grads(22, 2, n)
    result = merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION)
    delta = merged_outer_gradient(geometry, rs, momentum, NO_CORRECTION)
    # The reference: Δ stored, then a plain full-array f32 Nesterov in numpy.
    mu, lr = np.float32(0.9), np.float32(0.7)
    buf = momentum * mu + delta
    theta = params - lr * ((buf * mu) + delta)
    assert_bits(result.momentum, buf)
    assert_bits(result.params, theta)
    assert result.gnorm == gnorm(delta)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", [MergeMode.AVG, MergeMode.RDA])
def test_the_step_writes_the_new_params_as_bf16_bits_for_the_broadcast(
    threads: int, mode: MergeMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    import yeto_sync.merge as merge_module

    monkeypatch.setattr(merge_module, "_STEP_THREADS", threads)
    n = merge_module._THREADED_MIN + 777
    geometry = fragment(mode, (1, n))
    grads = random_grads(41, 2, n, scale=1e-3)
    rs = [response(0, grads[0]), response(1, grads[1])]
    params, momentum = random_grads(42, 2, n)
    params[:3] = [np.float32(3.0e38), -0.0, np.float32(1e-40)]  # rounding edge, sign, subnormal
    bits = np.full(n, 0xFFFF, np.uint16)  # garbage must be overwritten
    result = merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION, params_bf16=bits)
    assert np.array_equal(bits, f32_to_bf16(result.params))
    with pytest.raises(ValueError, match="params_bf16"):
        merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION, params_bf16=bits[1:])


def test_merge_round_takes_its_arrays_from_allocate_and_writes_no_argument() -> None:
    geometry = fragment(MergeMode.AVG, (2, 3))
    grads = random_grads(31, 2, 6)
    rs = [response(0, grads[0]), response(1, grads[1])]
    params, momentum = random_grads(32, 2, 6)
    before = (params.copy(), momentum.copy(), grads[0].copy(), grads[1].copy())
    handed: list[F32] = []

    def allocate(numel: int) -> F32:
        handed.append(np.full(numel, np.nan, np.float32))  # garbage must be overwritten
        return handed[-1]

    result = merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION, allocate=allocate)
    assert result.params is handed[0] and result.momentum is handed[1]
    expected = merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION)
    assert_bits(result.params, expected.params)
    assert_bits(result.momentum, expected.momentum)
    for was, now in zip(before, (params, momentum, *grads), strict=True):
        assert_bits(now, was)


def test_overflowing_outer_step_is_refused_all_or_nothing() -> None:
    geometry = fragment(MergeMode.AVG, (1, 3))
    rs = [response(0, [3e38, 1.0, 1.0])]
    params, momentum = f32([-3e38, 0.0, 0.0]), f32([3e38, 0.0, 0.0])
    with pytest.raises(MergeError, match="non-finite parameters or momentum"):
        merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION)


@pytest.mark.parametrize("dtype", [WireDtype.BF16, WireDtype.Q4])
@pytest.mark.parametrize(
    ("mode", "config"),
    [
        (MergeMode.AVG, NO_CORRECTION),
        (MergeMode.AVG, MergeConfig()),
        (MergeMode.RDA, NO_CORRECTION),
    ],
)
def test_wire_form_pushes_merge_to_the_bits_of_decoded_ones(
    dtype: WireDtype, mode: MergeMode, config: MergeConfig
) -> None:
    import yeto_sync.merge as merge_module
    from yeto_proto.dtypes import decode_tensor, encode_tensor
    from yeto_proto.wire_tensor import WireTensor

    n = 2 * merge_module._BLOCK + 1000  # several blocks and a ragged q4 tail
    geometry = fragment(mode, (1, n - 600), (1, 600))
    pushes = random_grads(41, 3, n, scale=1e-2)
    params, momentum = random_grads(42, 2, n, scale=1e-1)
    wire = [encode_tensor(d, dtype, push=True) for d in pushes]
    as_wire = [
        Response(i, 1, 2 + i, 100 * (i + 1), WireTensor(w, dtype, n, push=True))
        for i, w in enumerate(wire)
    ]
    as_arrays = [
        Response(i, 1, 2 + i, 100 * (i + 1), decode_tensor(w, dtype, n, push=True))
        for i, w in enumerate(wire)
    ]
    got = merge_round(geometry, as_wire, params, momentum, {}, config)
    want = merge_round(geometry, as_arrays, params, momentum, {}, config)
    assert_bits(got.params, want.params)
    assert_bits(got.momentum, want.momentum)
    assert got.gnorm == want.gnorm


# -- progress of the outer step (a broadcast streams behind it) ---------------------------------
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_step_reports_its_finished_prefix_growing_to_the_whole_fragment(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import yeto_sync.merge as merge_module

    monkeypatch.setattr(merge_module, "_STREAMED_STEP_THREADS", threads)
    n = merge_module._THREADED_MIN + 4_321
    geometry = fragment(MergeMode.AVG, (1, n))
    grads = random_grads(51, 2, n, scale=1e-3)
    rs = [response(0, grads[0]), response(1, grads[1])]
    params, momentum = random_grads(52, 2, n)
    into = np.full(n, np.nan, np.float32)
    bits = np.zeros(n, np.uint16)
    seen: list[int] = []

    def on_progress(count: int) -> None:
        # Whatever is reported final already holds its final values.
        seen.append(count)
        assert not np.isnan(into[:count]).any()
        assert np.array_equal(bits[:count], f32_to_bf16(into[:count]))

    result = merge_round(
        geometry,
        rs,
        params,
        momentum,
        {},
        NO_CORRECTION,
        params_bf16=bits,
        new_params=into,
        on_progress=on_progress,
    )
    assert result.params is into
    assert seen == sorted(set(seen)) and seen[-1] == n and seen[0] > 0
    expected = merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION)
    assert_bits(result.params, expected.params)
    assert_bits(result.momentum, expected.momentum)
    assert result.gnorm == expected.gnorm
    with pytest.raises(ValueError, match="new_params"):
        merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION, new_params=into[1:])


def test_a_step_a_broadcast_streams_behind_leaves_a_core_to_the_writers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    import yeto_sync.merge as merge_module

    assert merge_module._STREAMED_STEP_THREADS == max(
        1, min(merge_module._STEP_THREADS, (os.cpu_count() or 1) - 1)
    )
    monkeypatch.setattr(merge_module, "_STEP_THREADS", 3)
    monkeypatch.setattr(merge_module, "_STREAMED_STEP_THREADS", 1)
    n = merge_module._THREADED_MIN + 5
    geometry = fragment(MergeMode.AVG, (1, n))
    grads = random_grads(61, 2, n, scale=1e-3)
    rs = [response(0, grads[0]), response(1, grads[1])]
    params, momentum = random_grads(62, 2, n)
    reporters: set[int] = set()
    merge_round(
        geometry,
        rs,
        params,
        momentum,
        {},
        NO_CORRECTION,
        on_progress=lambda count: reporters.add(threading.get_ident()),
    )
    assert reporters == {threading.get_ident()}  # one thread: the caller's own


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_failing_step_reports_the_first_failing_block_and_no_prefix_past_it(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import yeto_sync.merge as merge_module

    monkeypatch.setattr(merge_module, "_STREAMED_STEP_THREADS", threads)
    block = merge_module._BLOCK
    n = merge_module._THREADED_MIN + 99
    geometry = fragment(MergeMode.AVG, (1, n))
    grad = np.zeros(n, np.float32)
    params, momentum = np.zeros(n, np.float32), np.zeros(n, np.float32)
    # Block 3 overflows the outer step (finite Δ); every later block has a non-finite Δ —
    # a different message, so the error tells which block a merge stopped at.
    params[3 * block] = np.float32(-3e38)
    momentum[3 * block] = np.float32(3e38)
    grad[3 * block] = np.float32(3e38)
    grad[4 * block :] = np.inf
    rs = [response(0, grad)]
    seen: list[int] = []
    for _ in range(3):  # whichever thread meets which block first
        with pytest.raises(MergeError, match="non-finite parameters or momentum"):
            merge_round(geometry, rs, params, momentum, {}, NO_CORRECTION, on_progress=seen.append)
    assert all(count <= 3 * block for count in seen)
