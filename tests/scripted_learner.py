"""A scripted YETO v4 learner on plain blocking sockets: the conformance client.

It is built on ``yeto_proto`` (frames, decoder, CHUNK striping, dtype codecs), the standard
library's ``socket`` and ``selectors``, and numpy; nothing from the syncer. Read it as the
shortest complete client of a v4 syncer:

1. **Connect a group** (:class:`LearnerGroup`): socket 0 sends HELLO; each of the
   ``num_streams`` data sockets sends DATA_HELLO with the same learner id and connection
   generation and its 0-based ``stream_idx``.
2. **Send**: small frames go on socket 0. INIT, PUSH (and, from a syncer, BCAST and
   FINAL_FRAGMENT) are complete inner frames sliced into ≤ 4 MiB CHUNKs dealt round-robin over
   the data sockets; with no data sockets they go plain on socket 0.
3. **Receive**: every socket has its own learner-side :class:`~yeto_proto.FrameDecoder`; CHUNKs
   from any socket of the group go to one :class:`~yeto_proto.Reassembler`.
4. **Play the protocol** (:class:`ScriptedLearner`): learner 0 INITs every fragment; each BCAST
   becomes the raw anchor of its fragment (lower versions are dropped, an equal version must
   carry equal bytes); a PULL_REQ is answered with ``PUSH = local − raw_anchor`` once the
   fragment has an anchor (a PULL may overtake the first striped BCAST, so it waits); at the
   end, the learner collects every f32 FINAL_FRAGMENT named by FINAL_MANIFEST, adopts them,
   sends FINAL_ACK and accepts SHUTDOWN.

The learner's "training" is scripted: ``progress(fragment, step)`` says how far its local copy
moves before it answers a pull, so a test knows every byte it sent.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from yeto_proto import (
    AnyMessage,
    BcastFragment,
    Chunk,
    ChunkSlicer,
    DataHello,
    DecoderState,
    ErrorMessage,
    FinalAck,
    FinalFragment,
    FinalManifest,
    FrameDecoder,
    Hello,
    InitParams,
    Limits,
    PullReq,
    PushFragment,
    Reassembler,
    Role,
    Shutdown,
    WireDtype,
    WireLayout,
    encode,
)
from yeto_proto.constants import STRIPED_TYPES
from yeto_proto.dtypes import decode_tensor, encode_tensor

F32Array = NDArray[np.float32]
RECV_SIZE = 1 << 20


class SyncerError(Exception):
    """The syncer sent ERROR (``text`` is its text) or broke the protocol."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class GroupClosed(Exception):
    """Every socket of the group reached EOF."""


@dataclass(frozen=True)
class SessionSpec:
    """What HELLO declares: identical for every learner of one session."""

    dtype: WireDtype
    layout: WireLayout
    fingerprint: bytes
    contract: bytes
    profile_hash: bytes | None = None

    @property
    def limits(self) -> Limits:
        return Limits.of(self.dtype, self.layout)


class LearnerGroup:
    """One connection group: socket 0 (control) plus ``num_streams`` data sockets."""

    def __init__(
        self,
        address: tuple[str, int],
        session: SessionSpec,
        *,
        learner_id: int,
        generation: int,
        num_streams: int,
        hello_key: bytes | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.address = address
        self.session = session
        self.learner_id = learner_id
        self.generation = generation
        self.num_streams = num_streams
        self.hello_key = hello_key
        self.timeout = timeout
        self.sockets: list[socket.socket] = []
        self._decoders: dict[socket.socket, FrameDecoder] = {}
        self._open: set[socket.socket] = set()
        self._reassembler = Reassembler(Role.LEARNER, session.limits)
        self._slicer = ChunkSlicer(num_streams) if num_streams else None
        self._selector = selectors.DefaultSelector()
        self._inbox: deque[AnyMessage] = deque()

    # -- connecting ----------------------------------------------------------------------------
    def connect(self) -> None:
        hello = Hello(
            learner_id=self.learner_id,
            generation=self.generation,
            dtype=self.session.dtype,
            layout=self.session.layout,
            layout_fingerprint=self.session.fingerprint,
            session_contract=self.session.contract,
            num_streams=self.num_streams,
            profile_hash=self.session.profile_hash,
        )
        self._add_socket().sendall(b"".join(encode(hello, hello_key=self.hello_key)))
        for stream_idx in range(self.num_streams):
            data_hello = DataHello(self.learner_id, self.generation, stream_idx)
            self._add_socket().sendall(b"".join(encode(data_hello)))

    def _add_socket(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sockets.append(sock)
        self._decoders[sock] = FrameDecoder(Role.LEARNER, limits=self.session.limits)
        self._open.add(sock)
        self._selector.register(sock, selectors.EVENT_READ)
        return sock

    def close(self) -> None:
        self._selector.close()
        for sock in self.sockets:
            sock.close()

    # -- sending -----------------------------------------------------------------------------
    def send(self, message: AnyMessage) -> None:
        """Bulk frames striped over the data sockets; everything else plain on socket 0."""
        frame = encode(message)
        if self._slicer is None or message.TYPE not in STRIPED_TYPES:
            _send_frame(self.sockets[0], frame)
            return
        for chunk in self._slicer.slice(frame):  # data stream i is socket 1 + i
            _send_frame(self.sockets[1 + chunk.stream_idx], chunk.buffers)

    # -- receiving ---------------------------------------------------------------------------
    def receive(self, timeout: float | None = None) -> AnyMessage:
        """The next message from any socket of the group (CHUNKs come back reassembled)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self._inbox:
            if not self._open:
                raise GroupClosed(f"learner {self.learner_id}: every socket closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"learner {self.learner_id}: nothing received in time")
            for key, _ in self._selector.select(left):
                self._read(key.fileobj)  # type: ignore[arg-type]
        return self._inbox.popleft()

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(RECV_SIZE)
        except ConnectionResetError:
            data = b""
        decoder = self._decoders[sock]
        decoder.feed(data)
        if not data:
            self._selector.unregister(sock)
            self._open.discard(sock)
        while not isinstance(frame := decoder.next_frame(), DecoderState):
            if isinstance(frame, Chunk):
                inner = self._reassembler.add(frame)
                if inner is not None:
                    self._inbox.append(inner)
            else:
                self._inbox.append(frame)


def _send_frame(sock: socket.socket, buffers: list[bytes | memoryview]) -> None:
    for buffer in buffers:
        sock.sendall(buffer)


# -- the scripted protocol ---------------------------------------------------------------------
def default_progress(learner_id: int) -> Callable[[int, int, int], F32Array]:
    """Deterministic local progress per (fragment, step): small, signed, learner-specific."""

    def progress(fragment: int, step: int, numel: int) -> F32Array:
        rng = np.random.default_rng([learner_id, fragment, step])
        return rng.normal(0.0, 0.01, numel).astype(np.float32)

    return progress


@dataclass
class PushRecord:
    step: int
    fragment: int
    attempt: int
    base_version: int
    c_steps: int
    c_tokens: int
    payload: bytes


@dataclass
class ScriptedLearner:
    """Plays one learner's side of a session over a :class:`LearnerGroup`."""

    group: LearnerGroup
    #: Learner 0 INITs the session with these f32 fragments.
    initial: list[F32Array] | None = None
    progress: Callable[[int, int, int], F32Array] | None = None
    alpha: float = 0.5
    steps_per_round: int = 4
    tokens_per_step: int = 1000
    #: Called with each PULL_REQ before it is answered (tests pause the learner here).
    before_push: Callable[[PullReq], None] = lambda pull: None
    anchors: dict[int, tuple[int, bytes, F32Array]] = field(default_factory=dict)
    local: dict[int, F32Array] = field(default_factory=dict)
    bcasts: list[tuple[int, int, F32Array]] = field(default_factory=list)
    pushes: list[PushRecord] = field(default_factory=list)
    finals: dict[int, tuple[int, F32Array]] = field(default_factory=dict)
    manifest: FinalManifest | None = None
    acked: bool = False
    shut_down: bool = False
    local_step: int = 0
    _deferred: dict[int, PullReq] = field(default_factory=dict)
    _c_steps: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.progress is None:
            self.progress = default_progress(self.group.learner_id)

    @property
    def session(self) -> SessionSpec:
        return self.group.session

    def start(self) -> None:
        self.group.connect()
        if self.initial is not None:
            for fragment, values in enumerate(self.initial):
                data = encode_tensor(values, self.session.dtype, push=False)
                self.group.send(InitParams(fragment, data.data))

    def run(self, *, timeout: float = 60.0) -> None:
        """Answer the syncer until SHUTDOWN; raises :class:`SyncerError` on ERROR."""
        deadline = time.monotonic() + timeout
        while not self.shut_down:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"learner {self.group.learner_id}: no SHUTDOWN in time")
            self.handle(self.group.receive(left))

    def handle(self, message: AnyMessage) -> None:
        match message:
            case BcastFragment():
                self._on_bcast(message)
            case PullReq():
                self._on_pull(message)
            case FinalFragment():
                self._on_final_fragment(message)
            case FinalManifest():
                self.manifest = message
                self._maybe_ack()
            case Shutdown():
                if not self.acked:
                    raise SyncerError("SHUTDOWN before this learner sent FINAL_ACK")
                self.shut_down = True
            case ErrorMessage():
                raise SyncerError(message.text)
            case _:
                raise SyncerError(f"unexpected {type(message).__name__}")

    def _numel(self, fragment: int) -> int:
        return self.session.layout.numels[fragment]

    def _on_bcast(self, bcast: BcastFragment) -> None:
        held = self.anchors.get(bcast.fragment_id)
        if held is not None:
            version, data, _ = held
            if bcast.version < version:
                return  # a late stripe: never regress the anchor
            if bcast.version == version:
                if bytes(bcast.data) != data:
                    raise SyncerError(f"BCAST {bcast.fragment_id} v{version} changed its bytes")
                return
        numel = self._numel(bcast.fragment_id)
        raw = np.array(decode_tensor(bcast.data, self.session.dtype, numel, push=False))
        self.anchors[bcast.fragment_id] = (bcast.version, bytes(bcast.data), raw)
        self.bcasts.append((bcast.fragment_id, bcast.version, raw))
        previous = self.local.get(bcast.fragment_id)
        blended = raw.copy() if previous is None else self.alpha * previous + (1 - self.alpha) * raw
        self.local[bcast.fragment_id] = blended.astype(np.float32)
        self._c_steps[bcast.fragment_id] = 0
        pull = self._deferred.pop(bcast.fragment_id, None)
        if pull is not None:
            self._on_pull(pull)

    def _on_pull(self, pull: PullReq) -> None:
        anchor = self.anchors.get(pull.fragment_id)
        if anchor is None:
            self._deferred[pull.fragment_id] = pull  # the first BCAST is still on its way
            return
        self.before_push(pull)
        assert self.progress is not None
        base_version, _, raw = anchor
        numel = self._numel(pull.fragment_id)
        local = self.local[pull.fragment_id] + self.progress(
            pull.fragment_id, pull.global_step, numel
        )
        self.local[pull.fragment_id] = local
        self.local_step += self.steps_per_round
        c_steps = self._c_steps[pull.fragment_id] + self.steps_per_round
        self._c_steps[pull.fragment_id] = c_steps
        delta = (local - raw).astype(np.float32)
        payload = encode_tensor(delta, self.session.dtype, push=True)
        push = PushFragment(
            learner_id=self.group.learner_id,
            fragment_id=pull.fragment_id,
            global_step=pull.global_step,
            round_attempt=pull.round_attempt,
            base_version=base_version,
            local_step=self.local_step,
            c_steps=c_steps,
            c_tokens=c_steps * self.tokens_per_step,
            data=payload.data,
        )
        self.pushes.append(
            PushRecord(
                pull.global_step,
                pull.fragment_id,
                pull.round_attempt,
                base_version,
                c_steps,
                push.c_tokens,
                payload.tobytes(),
            )
        )
        self.group.send(push)

    def _on_final_fragment(self, final: FinalFragment) -> None:
        held = self.finals.get(final.fragment_id)
        if held is not None and final.version <= held[0]:
            return
        numel = self._numel(final.fragment_id)
        values = np.array(decode_tensor(final.data, WireDtype.F32, numel, push=False))
        self.finals[final.fragment_id] = (final.version, values)
        self._maybe_ack()

    def _maybe_ack(self) -> None:
        """ACK once the manifest and the exact f32 version of every fragment are here."""
        manifest = self.manifest
        if manifest is None or self.acked:
            return
        for fragment, expected in enumerate(manifest.expected_versions):
            held = self.finals.get(fragment)
            if held is None or held[0] != expected:
                return
        for fragment, (_, values) in self.finals.items():
            self.local[fragment] = values.copy()  # adopt the authoritative state, no blending
        self.group.send(FinalAck(manifest.final_global_step))
        self.acked = True


def play_in_thread(
    learner: ScriptedLearner, failures: list[BaseException], timeout: float = 60.0
) -> threading.Thread:
    """Run ``learner`` (start, then play until its syncer ends) on a thread of its own; what
    goes wrong for it lands in ``failures``, and its sockets are closed either way."""

    def play() -> None:
        try:
            learner.start()
            learner.run(timeout=timeout)
        except BaseException as exc:
            failures.append(exc)
        finally:
            learner.group.close()

    thread = threading.Thread(target=play)
    thread.start()
    return thread
