"""SyncerConfig: pinned defaults, the derived profile, and refusals of impossible values."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from yeto_proto.constants import IsoBackend
from yeto_proto.identity import DeltaCorrection, LearnerWeight, SyncerProfile
from yeto_sync.config import SyncerConfig


def test_defaults_are_the_pinned_ones() -> None:
    config = SyncerConfig(learners=3, total_steps=100)
    assert (config.host, config.port) == ("127.0.0.1", 29400)
    assert config.quorum == 1
    assert (config.grace_ms, config.grace_gamma, config.grace_tau) == (1000, 0.8, 2.0)
    assert config.pipeline == 2 and config.min_round_interval_ms == 0
    assert config.sync_interval_steps == 24.0
    assert config.delta_correction is DeltaCorrection.HELOCO
    assert config.quorum_timeout_s == 900 and config.final_ack_timeout == 900
    assert (config.outer_lr, config.outer_momentum) == (0.7, 0.9)
    assert config.iso_backend is IsoBackend.SCALAR and config.iso_worker_queue_capacity == 16
    assert config.checkpoint_every == 8 and config.checkpoint_path is None
    assert not (config.resume or config.mark_final_checkpoint or config.require_profile_binding)
    assert config.learner_budget_steps is None and config.max_base_lag is None
    assert config.learner_weight is LearnerWeight.TOKENS2_OVER_STEPS


def test_final_ack_timeout_follows_the_quorum_timeout_unless_set() -> None:
    assert SyncerConfig(learners=1, total_steps=1, quorum_timeout_s=60).final_ack_timeout == 60
    explicit = SyncerConfig(learners=1, total_steps=1, quorum_timeout_s=60, final_ack_timeout_s=5)
    assert explicit.final_ack_timeout == 5


def test_profile_carries_every_semantic_flag(tmp_path: Path) -> None:
    config = SyncerConfig(
        learners=4,
        total_steps=50,
        quorum=3,
        grace_ms=250,
        grace_gamma=0.5,
        grace_tau=1.5,
        pipeline=3,
        min_round_interval_ms=10,
        sync_interval_steps=12.0,
        delta_correction=DeltaCorrection.NONE,
        quorum_timeout_s=30,
        outer_lr=0.5,
        outer_momentum=0.8,
        checkpoint_path=tmp_path / "c",
        checkpoint_every=2,
        resume=True,
        mark_final_checkpoint=True,
        learner_budget_steps=1000,
        max_base_lag=2,
        learner_weight=LearnerWeight.EQUAL,
        require_profile_binding=True,
    )
    assert config.profile() == SyncerProfile(
        learners=4,
        total_steps=50,
        quorum=3,
        grace_ms=250,
        grace_gamma=0.5,
        grace_tau=1.5,
        pipeline=3,
        min_round_interval_ms=10,
        sync_interval_steps=12.0,
        delta_correction=DeltaCorrection.NONE,
        quorum_timeout_s=30,
        final_ack_timeout_s=30,
        outer_lr=0.5,
        outer_momentum=0.8,
        checkpoint_enabled=True,
        checkpoint_every=2,
        resume=True,
        mark_final_checkpoint=True,
        learner_budget_steps=1000,
        max_base_lag=2,
        learner_weight=LearnerWeight.EQUAL,
        require_profile_binding=True,
    )


@pytest.mark.parametrize(
    "change",
    [
        {"port": 0},
        {"host": "0.0.0.0"},
        {"checkpoint_path": Path("elsewhere")},
        {"event_tape": Path("tape.jsonl")},
        {"final_state": Path("final")},
        {"iso_worker_queue_capacity": 3},
        {"print_profile_hash": True},
        {"hello_hmac_key_file": Path("key")},
    ],
)
def test_port_and_output_paths_do_not_change_the_profile_hash(change: dict[str, Any]) -> None:
    base = SyncerConfig(learners=2, total_steps=10, checkpoint_path=Path("ckpt"))
    assert dataclasses.replace(base, **change).profile().digest() == base.profile().digest()


@pytest.mark.parametrize(
    "change",
    [
        {"quorum": 2},
        {"outer_lr": 0.69},
        {"checkpoint_path": None},
        {"max_base_lag": 0},
        {"learner_budget_steps": 5},
        {"final_ack_timeout_s": 899},
        {"require_profile_binding": True},
    ],
)
def test_semantic_flags_change_the_profile_hash(change: dict[str, Any]) -> None:
    base = SyncerConfig(learners=2, total_steps=10, checkpoint_path=Path("ckpt"))
    assert dataclasses.replace(base, **change).profile().digest() != base.profile().digest()


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"learners": 0}, "--learners"),
        ({"total_steps": -1}, "--total-steps"),
        ({"quorum": 0}, "--quorum"),
        ({"pipeline": -1}, "--pipeline"),
        ({"port": 70000}, "--port"),
        ({"host": "a..b"}, "--host"),  # a label IDNA refuses: the resolver is never asked
        ({"host": "x" * 64}, "--host"),
        ({"grace_ms": -1}, "--grace-ms"),
        ({"quorum_timeout_s": -5}, "--quorum-timeout-s"),
        ({"quorum_timeout_s": 0}, "--quorum-timeout-s"),  # every attempt would time out at once
        ({"final_ack_timeout_s": -5}, "--final-ack-timeout-s"),
        ({"outer_lr": float("nan")}, "--outer-lr"),
        ({"grace_gamma": -0.1}, "--grace-gamma"),
        ({"checkpoint_every": 0}, "--checkpoint-every"),
        ({"learner_budget_steps": 0}, "--learner-budget-steps"),
        ({"learner_budget_steps": 1 << 32}, "--learner-budget-steps"),  # c_steps is a u32
        ({"max_base_lag": -1}, "--max-base-lag"),
        ({"iso_worker_queue_capacity": 0}, "--iso-worker-queue-capacity"),
    ],
)
def test_impossible_values_are_refused_naming_the_flag(change: dict[str, Any], flag: str) -> None:
    options: dict[str, Any] = {"learners": 2, "total_steps": 10, **change}
    with pytest.raises(ValueError, match=flag):
        SyncerConfig(**options)


U32, U64 = (1 << 32) - 1, (1 << 64) - 1


@pytest.mark.parametrize(
    ("change", "line"),
    [
        ({"learners": U32 + 1}, f"--learners must be in 1..{U32}, got {U32 + 1}"),
        ({"learners": 0}, f"--learners must be in 1..{U32}, got 0"),
        ({"total_steps": U64 + 1}, f"--total-steps must be in 0..{U64}, got {U64 + 1}"),
        ({"quorum": U32 + 1}, f"--quorum must be in 1..{U32}"),
        ({"pipeline": -1}, f"--pipeline must be in 0..{U32}"),
        ({"grace_ms": U64 + 1}, f"--grace-ms must be in 0..{U64}"),
        ({"min_round_interval_ms": -1}, f"--min-round-interval-ms must be in 0..{U64}"),
        ({"quorum_timeout_s": 0}, f"--quorum-timeout-s must be in 1..{U64}"),
        ({"final_ack_timeout_s": U64 + 1}, f"--final-ack-timeout-s must be in 0..{U64}"),
        ({"checkpoint_every": 0}, f"--checkpoint-every must be in 1..{U64}"),
        ({"learner_budget_steps": U32 + 1}, f"--learner-budget-steps must be in 1..{U32}"),
        ({"max_base_lag": U64 + 1}, f"--max-base-lag must be in 0..{U64}"),
        ({"grace_tau": float("inf")}, "--grace-tau must be a finite number >= 0, got inf"),
        ({"sync_interval_steps": -1.0}, "--sync-interval-steps must be a finite number >= 0"),
        ({"outer_lr": 1e39}, "--outer-lr must be a finite float32, in -3.4028234663852886e+38.."),
    ],
)
def test_a_refusal_says_the_whole_range(change: dict[str, Any], line: str) -> None:
    """Not only the lower bound: ``--learners 4294967296`` used to get "must be >= 1"."""
    with pytest.raises(ValueError) as refused:
        SyncerConfig(**{"learners": 2, "total_steps": 10, **change})
    assert str(refused.value).startswith(line), refused.value


def test_enum_flags_are_normalized() -> None:
    raw: dict[str, Any] = {"delta_correction": 0, "learner_weight": 1, "iso_backend": 1}
    config = SyncerConfig(learners=1, total_steps=1, **raw)
    assert config.delta_correction is DeltaCorrection.NONE
    assert config.learner_weight is LearnerWeight.EQUAL
    assert config.iso_backend is IsoBackend.TORCH_SVD


def test_settings_accepted_but_rarely_meant_are_named() -> None:
    assert SyncerConfig(learners=2, total_steps=9).doubtful_settings() == []
    doubts = SyncerConfig(
        learners=2, total_steps=9, outer_momentum=1.5, outer_lr=-1.0, quorum=3, pipeline=0
    ).doubtful_settings()
    assert [doubt.split(" ", 2)[:2] for doubt in doubts] == [
        ["--outer-momentum", "1.5"],
        ["--outer-lr", "-1"],
        ["--quorum", "3"],
        ["--pipeline", "0"],
    ]
    assert (
        "leaves the model as it is"
        in SyncerConfig(learners=1, total_steps=1, outer_lr=0.0).doubtful_settings()[0]
    )
    (unmarked,) = SyncerConfig(
        learners=1, total_steps=1, mark_final_checkpoint=True
    ).doubtful_settings()
    assert unmarked.startswith("--mark-final-checkpoint without --checkpoint-path")
    marked = SyncerConfig(
        learners=1, total_steps=1, mark_final_checkpoint=True, checkpoint_path=Path("c")
    )
    assert marked.doubtful_settings() == []
