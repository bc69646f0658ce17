"""Session identity: the syncer profile hash and the optional HELLO authentication code.

The layout fingerprint lives with the layout (:mod:`yeto_proto.layout`); the session contract
is 32 opaque bytes to the syncer.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass

from .constants import DIGEST_SIZE
from .errors import ErrorCode, RemoteProtocolError

PROFILE_DOMAIN = b"yeto-syncer-semantic-profile-v1\0"
HELLO_MAC_DOMAIN = b"yeto-hello-mac-v1\0"


class DeltaCorrection(enum.IntEnum):
    NONE = 0
    HELOCO = 1


class LearnerWeight(enum.IntEnum):
    TOKENS2_OVER_STEPS = 0
    EQUAL = 1


@dataclass(frozen=True, slots=True)
class SyncerProfile:
    """The parsed merge/schedule/recovery configuration that the profile hash binds.

    Listener port and output paths are deliberately absent: they do not change semantics.
    """

    learners: int
    total_steps: int
    quorum: int = 1
    grace_ms: int = 1000
    grace_gamma: float = 0.8
    grace_tau: float = 2.0
    pipeline: int = 2
    min_round_interval_ms: int = 0
    sync_interval_steps: float = 24.0
    delta_correction: DeltaCorrection = DeltaCorrection.HELOCO
    quorum_timeout_s: int = 900
    final_ack_timeout_s: int = 900
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    checkpoint_enabled: bool = False
    checkpoint_every: int = 8
    resume: bool = False
    mark_final_checkpoint: bool = False
    learner_budget_steps: int | None = None
    max_base_lag: int | None = None
    learner_weight: LearnerWeight = LearnerWeight.TOKENS2_OVER_STEPS
    require_profile_binding: bool = False

    def canonical_bytes(self) -> bytes:
        def optional_u64(value: int | None) -> bytes:
            return b"\0" if value is None else struct.pack("<BQ", 1, value)

        return b"".join(
            (
                PROFILE_DOMAIN,
                struct.pack(
                    "<IIQddIQdBQQQB",
                    self.learners,
                    self.quorum,
                    self.grace_ms,
                    self.grace_gamma,
                    self.grace_tau,
                    self.pipeline,
                    self.min_round_interval_ms,
                    self.sync_interval_steps,
                    int(self.delta_correction),
                    self.quorum_timeout_s,
                    self.final_ack_timeout_s,
                    self.total_steps,
                    0,  # policy_sweep_fragments: not supported, always absent
                ),
                struct.pack(
                    "<ffBQBB",
                    self.outer_lr,
                    self.outer_momentum,
                    self.checkpoint_enabled,
                    self.checkpoint_every,
                    self.resume,
                    self.mark_final_checkpoint,
                ),
                optional_u64(self.learner_budget_steps),
                optional_u64(self.max_base_lag),
                struct.pack("<BB", int(self.learner_weight), self.require_profile_binding),
            )
        )

    def digest(self) -> bytes:
        return hashlib.sha256(self.canonical_bytes()).digest()


def hello_key_of_file(raw: bytes) -> bytes:
    """The HELLO key a key file holds: its bytes without one trailing line ending.

    ``\\n``, ``\\r\\n`` or a lone ``\\r`` is removed (a key written by ``print`` or an editor on
    any system); anything before it, including a second line ending, is part of the key.
    """
    return raw.removesuffix(b"\n").removesuffix(b"\r")


def hello_mac(key: bytes, body: bytes | memoryview) -> bytes:
    mac = hmac.new(key, HELLO_MAC_DOMAIN, hashlib.sha256)
    mac.update(body)
    return mac.digest()


def sign_hello(key: bytes, body: bytes) -> bytes:
    """HELLO payload with the authentication code appended."""
    return body + hello_mac(key, body)


def verify_hello(key: bytes, payload: memoryview) -> memoryview:
    """Strip and check the trailing code; return the HELLO body to parse."""
    if len(payload) < DIGEST_SIZE:
        raise RemoteProtocolError(ErrorCode.HELLO_AUTH_FAILED, "HELLO too short for its MAC")
    body, tag = payload[:-DIGEST_SIZE], payload[-DIGEST_SIZE:]
    if not hmac.compare_digest(hello_mac(key, body), bytes(tag)):
        raise RemoteProtocolError(ErrorCode.HELLO_AUTH_FAILED, "HELLO MAC does not verify")
    return body
