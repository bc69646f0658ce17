"""End to end: two scripted learners (plain sockets) against the real ``yeto-sync`` daemon.

For f32, bf16 and q4 sessions, with no data streams and with three, and a fragment whose BCAST
is over 4 MiB (so striped frames span several CHUNKs): every BCAST either learner receives is
checked against an independent numpy computation of the pinned avg merge and f32 Nesterov step
from the exact PUSH bytes the learners sent; then finalization (f32 FINAL_FRAGMENTs, manifest,
FINAL_ACK, SHUTDOWN), exit 0, the final checkpoint, its marker, the final state and the tape.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from daemon_harness import Daemon
from numpy.typing import NDArray
from scripted_learner import LearnerGroup, PushRecord, ScriptedLearner, SessionSpec

from yeto_proto import MergeMode, WireDtype, WireFragment, WireLayout
from yeto_proto.checkpoint import marker_state, read_checkpoint

F32 = NDArray[np.float32]
BIG = 2_300_000  # f32 9.2 MB, bf16 4.6 MB: every BCAST of it spans several 4 MiB CHUNKs
LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (BIG,)), WireFragment(MergeMode.AVG, (300, 200))))
TOTAL_STEPS = 4
LEARNERS = 2
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


# -- an independent reading of the pinned codecs and math ----------------------------------------
def bf16_round(values: F32) -> F32:
    """f32 → bf16 → f32, round to nearest even (finite inputs)."""
    bits = values.astype("<f4").view("<u4").astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype("<u4").view("<f4")


def bf16_decode(data: bytes) -> F32:
    return (np.frombuffer(data, "<u2").astype("<u4") << 16).view("<f4")


def q4_decode(data: bytes, numel: int) -> F32:
    blocks = np.frombuffer(data, np.uint8).reshape(-1, 132)
    scales = blocks[:, :4].copy().view("<f4")  # (blocks, 1)
    packed = blocks[:, 4:]
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(len(blocks), 256)
    level = (nibbles & 0x7).astype(np.int32)
    sign = np.where(nibbles & 0x8, -1.0, 1.0)
    values = np.where(level == 0, 0.0, sign * np.exp2(level - 7.0) * scales)
    return values.reshape(-1)[:numel].astype(np.float32)


def wire_values(data: bytes, dtype: WireDtype, numel: int, *, push: bool) -> F32:
    if dtype is WireDtype.F32:
        return np.frombuffer(data, "<f4").astype(np.float32)
    if dtype is WireDtype.Q4 and push:
        return q4_decode(data, numel)
    return bf16_decode(data)


def expected_trajectory(
    dtype: WireDtype, initial: list[F32], pushes: list[list[PushRecord]]
) -> dict[tuple[int, int], F32]:
    """Θ per (fragment, version) from INIT and the exact PUSH bytes, by the pinned rules."""
    params = [bf16_round(x) if dtype is not WireDtype.F32 else x.copy() for x in initial]
    momentum = [np.zeros_like(x) for x in params]
    states = {(f, 0): p.copy() for f, p in enumerate(params)}
    by_step: dict[int, list[tuple[int, PushRecord]]] = {}
    for learner_id, records in enumerate(pushes):
        for record in records:
            by_step.setdefault(record.step, []).append((learner_id, record))
    lr, mu = np.float32(OUTER_LR), np.float32(OUTER_MOMENTUM)
    for step in range(1, TOTAL_STEPS + 1):
        fragment = (step - 1) % len(LAYOUT)
        responses = sorted(by_step[step], key=lambda item: item[0])
        assert [learner for learner, _ in responses] == list(range(LEARNERS))
        weights = [r.c_tokens**2 / r.c_steps for _, r in responses]
        total = sum(weights)
        delta = np.zeros(LAYOUT.numels[fragment], np.float32)
        for weight, (_, record) in zip(weights, responses, strict=True):
            sent = wire_values(record.payload, dtype, delta.size, push=True)
            delta += np.float32(weight / total) * -sent  # Δ_m = −d_m, accumulated in f32
        buf = (mu * momentum[fragment] + delta).astype(np.float32, copy=False)
        momentum[fragment] = buf
        params[fragment] = (params[fragment] - lr * (delta + mu * buf)).astype(
            np.float32, copy=False
        )
        states[(fragment, step)] = params[fragment].copy()
    return states


def assert_close(got: F32, want: F32, dtype: WireDtype) -> None:
    if dtype is WireDtype.F32:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:  # a one-ulp f32 difference may tip a bf16 rounding: allow one bf16 ulp
        np.testing.assert_allclose(got, bf16_round(want), rtol=2**-7, atol=1e-6)


# -- the test ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_streams", [0, 3])
@pytest.mark.parametrize(
    "dtype", [WireDtype.F32, WireDtype.BF16, WireDtype.Q4], ids=lambda d: d.name.lower()
)
def test_two_learners_run_a_session_to_shutdown(
    tmp_path: Path, dtype: WireDtype, num_streams: int
) -> None:
    checkpoint, final_state, tape = tmp_path / "ckpt", tmp_path / "final", tmp_path / "tape"
    spec = SessionSpec(dtype, LAYOUT, bytes(range(32)), bytes(range(100, 132)))
    rng = np.random.default_rng(7)
    initial = [rng.normal(0, 1, n).astype(np.float32) for n in LAYOUT.numels]
    flags = [
        f"--learners={LEARNERS}",
        f"--quorum={LEARNERS}",
        f"--total-steps={TOTAL_STEPS}",
        "--sync-interval-steps=0",
        "--delta-correction=none",
        f"--outer-lr={OUTER_LR}",
        f"--outer-momentum={OUTER_MOMENTUM}",
        f"--checkpoint-path={checkpoint}",
        "--checkpoint-every=1",
        "--mark-final-checkpoint",
        f"--final-state={final_state}",
        f"--event-tape={tape}",
    ]
    with Daemon(*flags) as daemon:
        learners = [
            ScriptedLearner(
                LearnerGroup(
                    daemon.address, spec, learner_id=i, generation=100 + i, num_streams=num_streams
                ),
                initial=initial if i == 0 else None,
                steps_per_round=3 + i,
                tokens_per_step=500 * (i + 1),
            )
            for i in range(LEARNERS)
        ]
        failures: list[BaseException] = []

        def play(learner: ScriptedLearner) -> None:
            try:
                learner.start()
                learner.run(timeout=60)
            except BaseException as exc:  # surfaced below
                failures.append(exc)
            finally:
                learner.group.close()

        threads = [threading.Thread(target=play, args=(lr,)) for lr in learners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not failures, f"{failures!r}\n{daemon.stderr}"
        assert daemon.wait(30) == 0, daemon.stderr
        assert daemon.rest_of_stdout() == ""  # the ready line was the only stdout line

    states = expected_trajectory(dtype, initial, [lr.pushes for lr in learners])
    for learner in learners:
        seen = sorted((f, v) for f, v, _ in learner.bcasts)
        assert seen == [(0, 0), (0, 1), (0, 3), (1, 0), (1, 2), (1, 4)]
        for fragment, version, values in learner.bcasts:
            assert_close(values, states[(fragment, version)], dtype)
        assert learner.acked and learner.shut_down
        for fragment, (version, values) in learner.finals.items():
            assert version == (TOTAL_STEPS if fragment == 1 else TOTAL_STEPS - 1)
            np.testing.assert_allclose(values, states[(fragment, version)], rtol=1e-6, atol=1e-6)

    final = read_checkpoint(checkpoint)
    assert final.global_step == TOTAL_STEPS
    assert marker_state(checkpoint, TOTAL_STEPS).status.name == "FINAL"
    for fragment, state in enumerate(final.fragments):
        _, delivered = learners[0].finals[fragment]
        np.testing.assert_array_equal(state.params, delivered)  # FINAL_FRAGMENT is exact f32
        np.testing.assert_array_equal(
            read_checkpoint(final_state).fragments[fragment].params, delivered
        )
    merges = [json.loads(line) for line in tape.read_text().splitlines()]
    merge_steps = [record["step"] for record in merges if "event" not in record]
    assert merge_steps == list(range(1, TOTAL_STEPS + 1))
    assert "final checkpoint" in daemon.stderr.strip().splitlines()[-1]
