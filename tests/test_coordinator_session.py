"""A whole session, M=2, F=3, total_steps=6, run to Exit(0) and checked against plain numpy.

The expectation is computed independently of yeto_sync.merge, in f64 straight from the pinned
formulas: Δ_m = −d_m, HeLoCo per learner and tensor against the pre-commit momentum, the
weighted mean with w = c_tokens²/c_steps, then Nesterov buf ← μ·buf + Δ; Θ ← Θ − lr·(Δ + μ·buf).
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate

import numpy as np
import pytest
from numpy.typing import NDArray
from sim import Sim, avg_layout, default_counters, initial_params, seeded_delta

from yeto_proto.constants import WireDtype
from yeto_proto.dtypes import decode_tensor, encode_tensor
from yeto_proto.identity import DeltaCorrection
from yeto_proto.messages import BcastFragment, FinalFragment, FinalManifest, Shutdown
from yeto_sync.config import SyncerConfig

F64 = NDArray[np.float64]
LAYOUT = avg_layout((3, 4), (5,), (2, 3, 4))
LEARNERS = 2
TOTAL = 6


def reference_heloco(delta: F64, momentum: F64, branches: Counter[str]) -> F64:
    d_norm, m_norm = float(np.linalg.norm(delta)), float(np.linalg.norm(momentum))
    if d_norm < 1e-8 or m_norm < 1e-8:
        branches["skip"] += 1
        return delta
    u, v = delta / d_norm, momentum / m_norm
    c = float(u @ v)
    conf = d_norm / (d_norm + 3.0 * m_norm + 1e-8)
    if c >= 0.2:
        branches["aligned"] += 1
        return delta
    if c < 0.0:
        branches["opposed"] += 1
        beta = min(0.5 * (-c) * conf, 0.5)
        shrunk: F64 = delta - beta * c * d_norm * v
        return shrunk
    branches["rotated"] += 1
    lam = min(1.0 * (1.0 - c) * conf, 1.0)
    mixed = (1.0 - lam) * u + lam * v
    rotated: F64 = d_norm * mixed / max(float(np.linalg.norm(mixed)), 1e-8)
    return rotated


def wire_delta(learner: int, step: int, fragment: int, dtype: WireDtype) -> F64:
    """The d a learner pushes, as the syncer can see it after the wire dtype."""
    numel = LAYOUT.fragments[fragment].numel
    sent = encode_tensor(seeded_delta(learner, step, fragment, numel), dtype, push=True)
    return decode_tensor(sent, dtype, numel, push=True).astype(np.float64)


def reference_run(
    config: SyncerConfig, dtype: WireDtype, branches: Counter[str]
) -> dict[int, tuple[int, F64]]:
    """Global step → (fragment, Θ of that fragment after the step)."""
    start = [p.astype(np.float64) for p in initial_params(LAYOUT)]
    if dtype is not WireDtype.F32:  # INIT travels in the bulk dtype
        start = [
            decode_tensor(
                encode_tensor(p.astype(np.float32), dtype, push=False), dtype, p.size, push=False
            ).astype(np.float64)
            for p in start
        ]
    theta = start
    momentum = [np.zeros_like(p) for p in theta]
    lr, mu = config.outer_lr, config.outer_momentum
    out: dict[int, tuple[int, F64]] = {}
    for step in range(1, TOTAL + 1):
        fragment = (step - 1) % len(LAYOUT)
        ends = list(accumulate(LAYOUT.fragments[fragment].numels))
        slices = [
            slice(e - n, e) for n, e in zip(LAYOUT.fragments[fragment].numels, ends, strict=True)
        ]
        weights, grads = [], []
        for learner in range(LEARNERS):
            grad = -wire_delta(learner, step, fragment, dtype)
            if config.delta_correction is DeltaCorrection.HELOCO:
                for part in slices:
                    grad[part] = reference_heloco(grad[part], momentum[fragment][part], branches)
            c_steps, c_tokens = default_counters(learner, step)
            weights.append(c_tokens**2 / c_steps)
            grads.append(grad)
        merged = sum(w * g for w, g in zip(weights, grads, strict=True)) / sum(weights)
        momentum[fragment] = mu * momentum[fragment] + merged
        theta[fragment] = theta[fragment] - lr * (merged + mu * momentum[fragment])
        out[step] = (fragment, theta[fragment].copy())
    return out


@pytest.mark.parametrize("dtype", [WireDtype.F32, WireDtype.BF16, WireDtype.Q4])
@pytest.mark.parametrize("correction", [DeltaCorrection.NONE, DeltaCorrection.HELOCO])
def test_full_session_matches_numpy(correction: DeltaCorrection, dtype: WireDtype) -> None:
    config = SyncerConfig(
        learners=LEARNERS, total_steps=TOTAL, quorum=LEARNERS, delta_correction=correction
    )
    sim = Sim(config, LAYOUT, dtype=dtype)
    crew = sim.start()

    finished = sim.run()

    assert (finished.code, finished.reason) == (0, "finalized at global step 6")
    branches: Counter[str] = Counter()
    expected = reference_run(config, dtype, branches)
    if correction is DeltaCorrection.HELOCO:
        # The script exercises both corrective branches, so the check is not vacuous.
        assert branches["opposed"] > 0 and branches["rotated"] > 0
    # bf16 BCASTs round Θ to 8 mantissa bits; compare the f32 truth through the same rounding.
    tolerance = 1e-5 if dtype is WireDtype.F32 else 8e-3
    for learner in crew:
        bcasts = [m for m in sim.sends_to(learner.key, BcastFragment) if m.version > 0]
        assert [(m.version, m.fragment_id) for m in bcasts] == [
            (step, fragment) for step, (fragment, _) in expected.items()
        ]
        for message in bcasts:
            got = sim.decode_bulk(message.data, message.fragment_id)
            np.testing.assert_allclose(got, expected[message.version][1], rtol=tolerance, atol=1e-6)
        finals = sim.sends_to(learner.key, FinalFragment)
        manifest = sim.sends_to(learner.key, FinalManifest)
        assert manifest == [FinalManifest(6, (4, 5, 6))]
        for message in finals:  # the authoritative f32 values, before any bf16 rounding
            got = np.frombuffer(message.data, dtype="<f4")
            np.testing.assert_allclose(got, expected[message.version][1], rtol=1e-5, atol=1e-6)
        assert sim.sends_to(learner.key, Shutdown) == [Shutdown()]
    assert [r["step"] for r in sim.merges] == list(range(1, 7))
    assert sim.coordinator.model is not None
    assert sim.coordinator.model.ledger == {
        learner: (
            TOTAL,
            sum(default_counters(learner, s)[0] for s in range(1, 7)),
            sum(default_counters(learner, s)[1] for s in range(1, 7)),
        )
        for learner in range(LEARNERS)
    }


def test_heloco_changes_the_result() -> None:
    """Guard against a correction that silently does nothing: the two runs must differ."""
    finals = []
    for correction in (DeltaCorrection.NONE, DeltaCorrection.HELOCO):
        config = SyncerConfig(learners=2, total_steps=TOTAL, quorum=2, delta_correction=correction)
        sim = Sim(config, LAYOUT)
        sim.start()
        sim.run()
        assert sim.coordinator.model is not None
        finals.append(np.concatenate([s.arrays()[0] for s in sim.coordinator.model.fragments]))
    assert not np.allclose(finals[0], finals[1])
