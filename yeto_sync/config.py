"""The syncer's parsed configuration: one frozen value for every ``yeto-sync`` flag.

Defaults are the ones PINNED.md § Daemon fixes. The CLI parses flags into a :class:`SyncerConfig`;
the coordinator reads it and never anything else. :meth:`SyncerConfig.profile` derives the
semantic profile that a profile-bound HELLO must match: listener address and concrete output
paths do not change semantics and are left out of it.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

from yeto_proto.constants import U32_MAX, U64_MAX, IsoBackend
from yeto_proto.identity import DeltaCorrection, LearnerWeight, SyncerProfile

from .host_names import host_name_problem

DEFAULT_PORT = 29400
DEFAULT_HOST = "127.0.0.1"
#: The largest finite float32, 3.4028234663852886e+38.
_F32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


@dataclass(frozen=True, slots=True)
class SyncerConfig:
    learners: int
    total_steps: int
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    quorum: int = 1
    grace_ms: int = 1000
    grace_gamma: float = 0.8
    grace_tau: float = 2.0
    pipeline: int = 2
    min_round_interval_ms: int = 0
    sync_interval_steps: float = 24.0
    delta_correction: DeltaCorrection = DeltaCorrection.HELOCO
    quorum_timeout_s: int = 900
    #: ``None`` means "the quorum timeout" (the pinned default); see :attr:`final_ack_timeout`.
    final_ack_timeout_s: int | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    iso_backend: IsoBackend = IsoBackend.SCALAR
    iso_worker_queue_capacity: int = 16
    final_state: Path | None = None
    checkpoint_path: Path | None = None
    checkpoint_every: int = 8
    resume: bool = False
    mark_final_checkpoint: bool = False
    learner_budget_steps: int | None = None
    event_tape: Path | None = None
    max_base_lag: int | None = None
    learner_weight: LearnerWeight = LearnerWeight.TOKENS2_OVER_STEPS
    require_profile_binding: bool = False
    print_profile_hash: bool = False
    hello_hmac_key_file: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta_correction", DeltaCorrection(self.delta_correction))
        object.__setattr__(self, "learner_weight", LearnerWeight(self.learner_weight))
        object.__setattr__(self, "iso_backend", IsoBackend(self.iso_backend))
        # Each range is the flag's whole range: its wire type (the profile's, PINNED.md) or
        # what the daemon can do, and each message says all of it.
        _require_in("learners", self.learners, 1, U32_MAX)
        _require_in("total_steps", self.total_steps, 0, U64_MAX)
        _require_in("quorum", self.quorum, 1, U32_MAX)
        _require_in("pipeline", self.pipeline, 0, U32_MAX)
        _require_in("port", self.port, 0, 65535)
        host_problem = host_name_problem(self.host)
        _require(host_problem is None, f"--host {self.host!r}: {host_problem}")
        for name in ("grace_ms", "min_round_interval_ms"):
            _require_in(name, getattr(self, name), 0, U64_MAX)
        # 0 would end every attempt the instant it launched: retries without end, no round ever.
        _require_in("quorum_timeout_s", self.quorum_timeout_s, 1, U64_MAX)
        if self.final_ack_timeout_s is not None:
            _require_in("final_ack_timeout_s", self.final_ack_timeout_s, 0, U64_MAX)
        for name in ("grace_gamma", "grace_tau", "sync_interval_steps"):
            value = getattr(self, name)
            _require(
                math.isfinite(value) and value >= 0,
                f"--{_flag(name)} must be a finite number >= 0, got {value}",
            )
        for name in ("outer_lr", "outer_momentum"):  # f32 in the profile and in the outer step
            value = getattr(self, name)
            _require(
                math.isfinite(value) and _fits_f32(value),
                f"--{_flag(name)} must be a finite float32, in -{_F32_MAX}..{_F32_MAX}, "
                f"got {value}",
            )
        _require_in("checkpoint_every", self.checkpoint_every, 1, U64_MAX)
        # A count of jobs the iso pool admits at once: any count >= 1 is one it can keep.
        _require(
            self.iso_worker_queue_capacity >= 1,
            "--iso-worker-queue-capacity must be an integer >= 1, got "
            f"{self.iso_worker_queue_capacity}",
        )
        if self.learner_budget_steps is not None:
            # B travels as c_steps (u32): a larger budget is one no learner can report.
            _require_in("learner_budget_steps", self.learner_budget_steps, 1, U32_MAX)
        if self.max_base_lag is not None:
            _require_in("max_base_lag", self.max_base_lag, 0, U64_MAX)

    # -- derived values --------------------------------------------------------------------
    @property
    def final_ack_timeout(self) -> int:
        """Seconds to wait for every FINAL_ACK (defaults to the quorum timeout)."""
        if self.final_ack_timeout_s is None:
            return self.quorum_timeout_s
        return self.final_ack_timeout_s

    @property
    def checkpoint_enabled(self) -> bool:
        return self.checkpoint_path is not None

    @property
    def pipeline_depth_limit(self) -> int:
        """``max(--pipeline, 1)``; the coordinator also caps it at the fragment count."""
        return max(self.pipeline, 1)

    def doubtful_settings(self) -> list[str]:
        """Settings the pinned command line accepts (a drop-in refuses no value the reference
        syncer takes) that rarely mean what was meant: each is worth a warning at start."""
        doubts = []
        if not 0 <= self.outer_momentum < 1:
            doubts.append(
                f"--outer-momentum {self.outer_momentum:g} is outside [0, 1): the outer "
                "momentum buffer grows (or flips sign) every round instead of averaging"
            )
        if self.outer_lr <= 0:
            doubts.append(
                f"--outer-lr {self.outer_lr:g} is not positive: the outer step "
                + ("leaves the model as it is" if self.outer_lr == 0 else "moves the model away")
                + " from the learners' progress"
            )
        if self.quorum > self.learners:
            doubts.append(
                f"--quorum {self.quorum} is above --learners {self.learners}: every round "
                "waits for all the learners it captured (K = min(--quorum, captured))"
            )
        if self.pipeline < 1:
            doubts.append(f"--pipeline {self.pipeline} runs as 1 (one round in flight)")
        if self.mark_final_checkpoint and self.checkpoint_path is None:
            doubts.append(
                "--mark-final-checkpoint without --checkpoint-path: there is no checkpoint to "
                "mark, so no final marker is written"
            )
        return doubts

    def profile(self) -> SyncerProfile:
        """The semantic profile a profile-bound HELLO must carry the digest of."""
        return SyncerProfile(
            learners=self.learners,
            total_steps=self.total_steps,
            quorum=self.quorum,
            grace_ms=self.grace_ms,
            grace_gamma=self.grace_gamma,
            grace_tau=self.grace_tau,
            pipeline=self.pipeline,
            min_round_interval_ms=self.min_round_interval_ms,
            sync_interval_steps=self.sync_interval_steps,
            delta_correction=self.delta_correction,
            quorum_timeout_s=self.quorum_timeout_s,
            final_ack_timeout_s=self.final_ack_timeout,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            checkpoint_enabled=self.checkpoint_enabled,
            checkpoint_every=self.checkpoint_every,
            resume=self.resume,
            mark_final_checkpoint=self.mark_final_checkpoint,
            learner_budget_steps=self.learner_budget_steps,
            max_base_lag=self.max_base_lag,
            learner_weight=self.learner_weight,
            require_profile_binding=self.require_profile_binding,
        )


def _flag(field_name: str) -> str:
    return field_name.replace("_", "-")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_in(field_name: str, value: int, low: int, high: int) -> None:
    """``--learners must be in 1..4294967295, got 4294967296``."""
    _require(low <= value <= high, f"--{_flag(field_name)} must be in {low}..{high}, got {value}")


def _fits_f32(value: float) -> bool:
    try:
        struct.pack("<f", value)
    except OverflowError:
        return False
    return True
