"""Shared fixtures and hypothesis strategies for the yeto test suite.

Test modules must not import this file (pytest may load several ``conftest`` modules under the
same name), so the strategies travel through the session-scoped ``wire`` fixture: a test asks
for ``wire`` and draws with ``data.draw(wire.message(FrameType.PUSH_FRAGMENT, session))``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

from yeto_proto import (
    AnyMessage,
    BcastFragment,
    BudgetDone,
    Chunk,
    DataHello,
    DecoderState,
    ErrorMessage,
    FinalAck,
    FinalFragment,
    FinalManifest,
    FrameDecoder,
    FrameType,
    Heartbeat,
    Hello,
    InitParams,
    Limits,
    MergeMode,
    PullReq,
    PushFragment,
    Role,
    Shutdown,
    WireDtype,
    WireFragment,
    WireLayout,
)

# Example-heavy tests set their own max_examples; a deadline only makes a loaded CI box flaky.
settings.register_profile("yeto", deadline=None)
settings.load_profile("yeto")

U16 = (1 << 16) - 1
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1

#: The direction column of the source's frame table, written out independently of
#: ``yeto_proto.constants.SENDABLE`` so that tests check the code against the text.
LEARNER_SENDS = frozenset(
    {
        FrameType.HELLO,
        FrameType.INIT_PARAMS,
        FrameType.PUSH_FRAGMENT,
        FrameType.HEARTBEAT,
        FrameType.DATA_HELLO,
        FrameType.CHUNK,
        FrameType.FINAL_ACK,
        FrameType.BUDGET_DONE,
    }
)
SYNCER_SENDS = frozenset(
    {
        FrameType.PULL_REQ,
        FrameType.BCAST_FRAGMENT,
        FrameType.SHUTDOWN,
        FrameType.CHUNK,
        FrameType.ERROR,
        FrameType.FINAL_MANIFEST,
        FrameType.FINAL_FRAGMENT,
    }
)


@dataclass(frozen=True)
class Session:
    """What a connection negotiates: dtype, numeric layout, and the syncer's learner count."""

    dtype: WireDtype
    layout: WireLayout
    num_learners: int

    @property
    def limits(self) -> Limits:
        return Limits.of(self.dtype, self.layout)

    @property
    def num_fragments(self) -> int:
        return len(self.layout)


def senders_of(frame_type: FrameType) -> list[Role]:
    """The roles the source table lets send ``frame_type``."""
    roles = []
    if frame_type in LEARNER_SENDS:
        roles.append(Role.LEARNER)
    if frame_type in SYNCER_SENDS:
        roles.append(Role.SYNCER)
    return roles


def receivers_of(frame_type: FrameType) -> list[Role]:
    return [sender.peer for sender in senders_of(frame_type)]


def accepted_by(receiver: Role) -> frozenset[FrameType]:
    """Frame types a receiver accepts after the first frame (HELLOs only come first)."""
    sent = LEARNER_SENDS if receiver is Role.SYNCER else SYNCER_SENDS
    return sent - {FrameType.HELLO, FrameType.DATA_HELLO}


def random_bytes(size: int) -> st.SearchStrategy[bytes]:
    """``size`` pseudo-random bytes from a drawn seed (fast for tensor-sized payloads)."""
    return st.integers(0, U32).map(lambda seed: np.random.default_rng(seed).bytes(size))


class WireKit:
    """Hypothesis strategies for sessions and each of the 14 messages, plus feeding helpers."""

    learner_sends = LEARNER_SENDS
    syncer_sends = SYNCER_SENDS
    senders_of = staticmethod(senders_of)
    receivers_of = staticmethod(receivers_of)
    accepted_by = staticmethod(accepted_by)
    random_bytes = staticmethod(random_bytes)

    # -- sessions ---------------------------------------------------------------------------
    @staticmethod
    def fragment() -> st.SearchStrategy[WireFragment]:
        plain = st.builds(
            WireFragment,
            st.sampled_from([MergeMode.AVG, MergeMode.RDA]),
            st.lists(st.integers(1, 700), min_size=1, max_size=3).map(tuple),
        )
        shapes = st.lists(
            st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=3
        ).map(tuple)
        iso = shapes.map(lambda s: WireFragment(MergeMode.ISO, tuple(r * c for r, c in s), s))
        return st.one_of(plain, iso)

    def layout(self, max_fragments: int = 3) -> st.SearchStrategy[WireLayout]:
        return st.lists(self.fragment(), min_size=1, max_size=max_fragments).map(
            lambda fragments: WireLayout(tuple(fragments))
        )

    def session(self, max_fragments: int = 3) -> st.SearchStrategy[Session]:
        return st.builds(
            Session,
            st.sampled_from(list(WireDtype)),
            self.layout(max_fragments),
            st.integers(1, 64),
        )

    # -- messages ---------------------------------------------------------------------------
    def hello(
        self, session: Session, *, profile_hash: bool | None = None
    ) -> st.SearchStrategy[Hello]:
        hashes: st.SearchStrategy[bytes | None]
        if profile_hash is None:
            hashes = st.none() | st.binary(min_size=32, max_size=32)
        else:
            hashes = st.binary(min_size=32, max_size=32) if profile_hash else st.none()
        return st.builds(
            Hello,
            learner_id=st.integers(0, session.num_learners - 1),
            generation=st.integers(1, U64),
            dtype=st.just(session.dtype),
            layout=st.just(session.layout),
            layout_fingerprint=st.binary(min_size=32, max_size=32),
            session_contract=st.binary(min_size=32, max_size=32),
            num_streams=st.integers(0, 256),
            profile_hash=hashes,
        )

    def message(self, frame_type: FrameType, session: Session) -> st.SearchStrategy[AnyMessage]:
        """Valid messages of ``frame_type`` that fit ``session`` (ids in range, exact sizes)."""
        limits = session.limits
        fragment_ids = st.integers(0, session.num_fragments - 1)
        learner_ids = st.integers(0, session.num_learners - 1)
        u32, u64 = st.integers(0, U32), st.integers(0, U64)

        match frame_type:
            case FrameType.HELLO:
                return self.hello(session)
            case FrameType.DATA_HELLO:
                return st.builds(DataHello, learner_ids, st.integers(1, U64), st.integers(0, 255))
            case FrameType.INIT_PARAMS:
                return fragment_ids.flatmap(
                    lambda f: st.builds(
                        InitParams, st.just(f), random_bytes(limits.tensor_bytes(frame_type, f))
                    )
                )
            case FrameType.PULL_REQ:
                return st.builds(PullReq, fragment_ids, u64, u32)
            case FrameType.PUSH_FRAGMENT:
                return fragment_ids.flatmap(
                    lambda f: st.builds(
                        PushFragment,
                        learner_id=learner_ids,
                        fragment_id=st.just(f),
                        global_step=u64,
                        round_attempt=u32,
                        base_version=u64,
                        local_step=u64,
                        c_steps=st.integers(1, U32),
                        c_tokens=u64,
                        data=random_bytes(limits.tensor_bytes(frame_type, f)),
                    )
                )
            case FrameType.BCAST_FRAGMENT | FrameType.FINAL_FRAGMENT:
                cls = BcastFragment if frame_type is FrameType.BCAST_FRAGMENT else FinalFragment
                return fragment_ids.flatmap(
                    lambda f: st.builds(
                        cls, st.just(f), u64, random_bytes(limits.tensor_bytes(frame_type, f))
                    )
                )
            case FrameType.HEARTBEAT:
                return st.builds(Heartbeat, learner_ids, u64)
            case FrameType.SHUTDOWN:
                return st.just(Shutdown())
            case FrameType.CHUNK:
                return st.builds(Chunk, u64, u64, u64, st.binary(min_size=1, max_size=300))
            case FrameType.ERROR:
                return st.builds(ErrorMessage, st.text(max_size=120))
            case FrameType.FINAL_MANIFEST:
                versions = st.lists(
                    u64, min_size=session.num_fragments, max_size=session.num_fragments
                )
                return st.builds(FinalManifest, u64, versions.map(tuple))
            case FrameType.FINAL_ACK:
                return st.builds(FinalAck, u64)
            case FrameType.BUDGET_DONE:
                return st.builds(BudgetDone, u64)
        raise AssertionError(frame_type)

    def message_for(self, receiver: Role, session: Session) -> st.SearchStrategy[AnyMessage]:
        """Any message ``receiver`` accepts once the session is set up."""
        return st.sampled_from(sorted(accepted_by(receiver))).flatmap(
            lambda t: self.message(t, session)
        )

    @staticmethod
    def cuts(size: int) -> st.SearchStrategy[list[int]]:
        """Sorted split points inside ``0..size``."""
        return st.lists(st.integers(0, size), max_size=8).map(sorted)

    # -- driving a decoder ------------------------------------------------------------------
    @staticmethod
    def decoder(
        receiver: Role, session: Session, *, hello_key: bytes | None = None
    ) -> FrameDecoder:
        """A decoder already past the first frame, with the session's limits installed."""
        return FrameDecoder(
            receiver,
            limits=session.limits,
            num_learners=session.num_learners,
            hello_key=hello_key,
            enforce_first_frame=False,
        )

    @staticmethod
    def drain(decoder: FrameDecoder) -> tuple[list[AnyMessage], DecoderState]:
        """Every message decodable now, and the state the decoder stopped in."""
        out: list[AnyMessage] = []
        while True:
            item = decoder.next_frame()
            if isinstance(item, DecoderState):
                return out, item
            out.append(item)

    @staticmethod
    def pieces(data: bytes, cuts: Iterable[int]) -> list[bytes]:
        bounds = [0, *cuts, len(data)]
        return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]

    def feed_pieces(self, decoder: FrameDecoder, pieces: Sequence[bytes]) -> list[AnyMessage]:
        """Feed ``pieces`` one by one, collecting messages after each, like a socket loop."""
        out: list[AnyMessage] = []
        for piece in pieces:
            decoder.feed(piece)
            out += self.drain(decoder)[0]
        return out


@pytest.fixture(scope="session")
def wire() -> WireKit:
    return WireKit()
