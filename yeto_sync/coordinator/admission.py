"""HELLO admission: the checks left to the coordinator after the decoder, and session fixation.

The decoder already checked version, structure, generation ≠ 0, dtype and (when it was given
M) the learner id. What remains needs configuration or session state, in this order:

1. ``learner_id < M`` (again: a decoder built without M cannot know);
2. profile binding: ``--require-profile-binding`` refuses an omitted hash; a present hash must
   equal the digest of this syncer's own profile;
3. session fixation: dtype, layout, fingerprint, contract and profile binding must equal the
   first accepted HELLO's, byte for byte;
4. a ``(learner_id, generation)`` admitted before is refused.

A refusal affects only the connection that sent the HELLO.
"""

from __future__ import annotations

from dataclasses import dataclass

from yeto_proto.constants import WireDtype
from yeto_proto.errors import ErrorCode
from yeto_proto.layout import WireLayout
from yeto_proto.messages import ErrorMessage, Hello


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a peer's message is not accepted, with its stable code."""

    code: ErrorCode
    detail: str

    @property
    def text(self) -> str:
        return f"{self.code.value}: {self.detail}"

    def error(self) -> ErrorMessage:
        return ErrorMessage(self.text)


@dataclass(frozen=True, slots=True)
class SessionIdentity:
    """What the first accepted HELLO fixes for the whole session."""

    dtype: WireDtype
    layout: WireLayout
    fingerprint: bytes
    contract: bytes
    profile_hash: bytes | None
    #: The learner whose HELLO fixed the session: a refused learner may be the right one (the
    #: first to connect decides), so its ERROR says whose identity it was compared with.
    fixed_by: int = 0

    @classmethod
    def of(cls, hello: Hello) -> SessionIdentity:
        return cls(
            dtype=WireDtype(hello.dtype),
            layout=hello.layout,
            fingerprint=bytes(hello.layout_fingerprint),
            contract=bytes(hello.session_contract),
            profile_hash=None if hello.profile_hash is None else bytes(hello.profile_hash),
            fixed_by=hello.learner_id,
        )

    def mismatch(self, hello: Hello) -> Refusal | None:
        """The first field of ``hello`` that differs from this session, if any."""
        fixed = f"the session (fixed by learner {self.fixed_by}'s HELLO, the first accepted)"
        if WireDtype(hello.dtype) is not self.dtype:
            return Refusal(
                ErrorCode.SESSION_DTYPE_MISMATCH,
                f"session dtype is {self.dtype.name.lower()}, HELLO has "
                f"{WireDtype(hello.dtype).name.lower()}; {fixed}",
            )
        if hello.layout != self.layout:
            return Refusal(
                ErrorCode.SESSION_LAYOUT_MISMATCH,
                f"HELLO fragment layout differs from {fixed}: "
                f"{_layout_difference(hello.layout, self.layout)}",
            )
        if bytes(hello.layout_fingerprint) != self.fingerprint:
            return Refusal(
                ErrorCode.SESSION_FINGERPRINT_MISMATCH,
                f"HELLO layout fingerprint differs from {fixed} (tensor names or shapes)",
            )
        if bytes(hello.session_contract) != self.contract:
            return Refusal(
                ErrorCode.SESSION_CONTRACT_MISMATCH,
                f"HELLO session contract differs from {fixed} (for yeto learners: the run id or "
                "the experiment settings, num_learners included); the session stays fixed until "
                "yeto-sync restarts",
            )
        theirs = None if hello.profile_hash is None else bytes(hello.profile_hash)
        if theirs != self.profile_hash:
            bound = "carries" if self.profile_hash is not None else "omits"
            return Refusal(
                ErrorCode.SESSION_PROFILE_MISMATCH,
                f"the session {bound} a syncer profile hash; this HELLO does not match it",
            )
        return None


def _layout_difference(theirs: WireLayout, ours: WireLayout) -> str:
    """Where two fragment layouts first differ, in a few words."""
    if len(theirs.fragments) != len(ours.fragments):
        return f"{len(theirs.fragments)} fragments, the session has {len(ours.fragments)}"
    for index, (mine, session) in enumerate(zip(theirs.fragments, ours.fragments, strict=True)):
        where = f"fragment {index}"
        if mine.merge_mode is not session.merge_mode:
            return (
                f"{where} is {mine.merge_mode.name.lower()}, "
                f"the session's {session.merge_mode.name.lower()}"
            )
        if len(mine.numels) != len(session.numels):
            return f"{where} has {len(mine.numels)} tensors, the session's {len(session.numels)}"
        for tensor, (a, b) in enumerate(zip(mine.numels, session.numels, strict=True)):
            if a != b:
                return f"{where} tensor {tensor} has {a} values, the session's {b}"
        for tensor, (a_shape, b_shape) in enumerate(
            zip(mine.matrix_shapes, session.matrix_shapes, strict=True)
        ):
            if a_shape != b_shape:
                return (
                    f"{where} tensor {tensor} is a {a_shape[0]}x{a_shape[1]} matrix, "
                    f"the session's {b_shape[0]}x{b_shape[1]}"
                )
    return "the same fragments"  # unreachable while layouts compare field by field


class Admission:
    """Decides on each HELLO; remembers the session identity once the first one is accepted."""

    def __init__(self, *, learners: int, profile_digest: bytes, require_profile_binding: bool):
        self._learners = learners
        self._profile_digest = profile_digest
        self._require_binding = require_profile_binding
        self.session: SessionIdentity | None = None

    def check(self, hello: Hello, *, generation_seen: bool) -> Refusal | None:
        """The first reason to refuse ``hello``, or ``None`` to admit it."""
        if hello.learner_id >= self._learners:
            return Refusal(
                ErrorCode.LEARNER_ID_OUT_OF_RANGE,
                f"learner_id {hello.learner_id} outside 0..{self._learners - 1}",
            )
        if hello.profile_hash is None:
            if self._require_binding:
                return Refusal(
                    ErrorCode.PROFILE_BINDING_REQUIRED,
                    "this syncer requires a syncer profile hash in HELLO",
                )
        elif bytes(hello.profile_hash) != self._profile_digest:
            return Refusal(
                ErrorCode.SESSION_PROFILE_MISMATCH,
                f"HELLO profile hash {bytes(hello.profile_hash).hex()} differs from this "
                f"syncer's {self._profile_digest.hex()}",
            )
        if self.session is not None:
            mismatch = self.session.mismatch(hello)
            if mismatch is not None:
                return mismatch
        if generation_seen:
            return Refusal(
                ErrorCode.DUPLICATE_GENERATION,
                f"learner {hello.learner_id} generation {hello.generation} was already admitted",
            )
        return None

    def fix(self, hello: Hello) -> SessionIdentity:
        """Fix the session from the first accepted HELLO (idempotent afterwards)."""
        if self.session is None:
            self.session = SessionIdentity.of(hello)
        return self.session
