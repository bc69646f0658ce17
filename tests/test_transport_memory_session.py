"""The real coordinator and driver over the in-memory transport, on a fake clock.

Two scripted learners play whole sessions through memory sockets (HELLO, DATA_HELLOs, CHUNK
striping both ways, the same decoders as TCP). Time moves only when the test says so, so a
quorum deadline is reached exactly, with no sleeping.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import numpy as np
from scripted_learner import ScriptedLearner, SessionSpec

from yeto_proto import (
    AnyMessage,
    Chunk,
    ChunkSlicer,
    DataHello,
    FrameDecoder,
    Hello,
    MergeMode,
    PullReq,
    Reassembler,
    Role,
    WireDtype,
    WireFragment,
    WireLayout,
    encode,
)
from yeto_proto.constants import STRIPED_TYPES
from yeto_sync.config import SyncerConfig
from yeto_sync.coordinator import Coordinator
from yeto_sync.driver import KeyValueLog, Outputs
from yeto_sync.events import Exit
from yeto_sync.transport.memory import MemoryPeer, MemorySyncer

LAYOUT = WireLayout((WireFragment(MergeMode.AVG, (5000,)), WireFragment(MergeMode.AVG, (300,))))
SPEC = SessionSpec(WireDtype.BF16, LAYOUT, bytes(range(32)), bytes(range(1, 33)))
STREAMS = 2


class MemoryGroup:
    """A learner's connection group over memory sockets, with the API ScriptedLearner uses."""

    def __init__(self, syncer: MemorySyncer, learner_id: int, generation: int) -> None:
        self.syncer = syncer
        self.session = SPEC
        self.learner_id = learner_id
        self.generation = generation
        self.peers: list[MemoryPeer] = []
        self._decoders: list[FrameDecoder] = []
        self._reassembler = Reassembler(Role.LEARNER, SPEC.limits)
        self._slicer = ChunkSlicer(STREAMS, slice_size=4096)  # small slices: many CHUNKs

    def connect(self) -> None:
        hello = Hello(
            self.learner_id,
            self.generation,
            SPEC.dtype,
            SPEC.layout,
            SPEC.fingerprint,
            SPEC.contract,
            STREAMS,
        )
        firsts: list[AnyMessage] = [hello]
        firsts += [DataHello(self.learner_id, self.generation, i) for i in range(STREAMS)]
        for first in firsts:
            peer = self.syncer.connect()
            peer.send(first)
            self.peers.append(peer)
            self._decoders.append(FrameDecoder(Role.LEARNER, limits=SPEC.limits))

    def send(self, message: AnyMessage) -> None:
        if message.TYPE not in STRIPED_TYPES:
            self.peers[0].send(message)
            return
        for piece in self._slicer.slice(encode(message)):
            self.peers[1 + piece.stream_idx].write(b"".join(piece.buffers))

    def drain(self) -> list[AnyMessage]:
        """Everything the syncer sent since the last call, CHUNKs reassembled."""
        out: list[AnyMessage] = []
        for peer, decoder in zip(self.peers, self._decoders, strict=True):
            data = peer.read()
            if not data:
                continue
            decoder.feed(data)
            for frame in decoder.frames():
                if isinstance(frame, Chunk):
                    inner = self._reassembler.add(frame)
                    if inner is not None:
                        out.append(inner)
                else:
                    out.append(frame)
        return out

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    anyio.run(test)


def new_session(tmp_path: Path, **config: object) -> tuple[MemorySyncer, list[ScriptedLearner]]:
    coordinator = Coordinator(
        SyncerConfig(learners=2, total_steps=4, quorum=2, sync_interval_steps=0, **config)  # type: ignore[arg-type]
    )
    syncer = MemorySyncer(
        coordinator,
        num_learners=2,
        outputs=Outputs(event_tape_path=tmp_path / "tape.jsonl"),
        log=KeyValueLog(min_level="error"),
    )
    initial = [np.linspace(-1, 1, n, dtype=np.float32) for n in LAYOUT.numels]
    learners = [
        ScriptedLearner(MemoryGroup(syncer, i, 10 + i), initial=initial if i == 0 else None)  # type: ignore[arg-type]
        for i in range(2)
    ]
    return syncer, learners


async def play(
    syncer: MemorySyncer,
    learners: list[ScriptedLearner],
    hold: Callable[[ScriptedLearner, AnyMessage], bool],
) -> list[tuple[ScriptedLearner, AnyMessage]]:
    """Deliver messages until nothing moves; return those ``hold`` kept back."""
    held: list[tuple[ScriptedLearner, AnyMessage]] = []
    while True:
        await syncer.settle()
        delivered = False
        for learner in learners:
            group = learner.group
            assert isinstance(group, MemoryGroup)
            for message in group.drain():
                if hold(learner, message):
                    held.append((learner, message))
                else:
                    learner.handle(message)
                    delivered = True
        if not delivered:
            return held


def test_a_whole_session_over_memory_sockets(tmp_path: Path) -> None:
    async def scenario() -> None:
        syncer, learners = new_session(tmp_path)
        for learner in learners:
            learner.start()
        await play(syncer, learners, hold=lambda learner, message: False)
        assert syncer.driver.exit == Exit(0, "finalized at global step 4")
        assert all(learner.shut_down for learner in learners)
        assert syncer.clock.now() == 0.0  # nothing had to wait
        versions = sorted((f, v) for f, v, _ in learners[1].bcasts)
        assert versions == [(0, 0), (0, 1), (0, 3), (1, 0), (1, 2), (1, 4)]

    run(scenario)


def test_a_quorum_deadline_on_the_fake_clock_retries_the_round(tmp_path: Path) -> None:
    async def scenario() -> None:
        syncer, learners = new_session(tmp_path, quorum_timeout_s=30)
        for learner in learners:
            learner.start()

        def silent_in_round_3(learner: ScriptedLearner, message: AnyMessage) -> bool:
            return learner is learners[1] and message == PullReq(0, 3, 1)

        held = await play(syncer, learners, hold=silent_in_round_3)
        assert [message for _, message in held] == [PullReq(0, 3, 1)]
        assert syncer.driver.exit is None
        await syncer.advance(29.9)
        assert await play(syncer, learners, hold=silent_in_round_3) == []
        assert syncer.driver.exit is None  # still waiting for learner 1
        await syncer.advance(0.2)  # the deadline: the attempt is discarded, attempt 2 launched
        await play(syncer, learners, hold=lambda learner, message: False)
        assert syncer.driver.exit == Exit(0, "finalized at global step 4")
        tape = [json.loads(line) for line in (tmp_path / "tape.jsonl").read_text().splitlines()]
        (discarded,) = [r for r in tape if r.get("event") == "attempt_discarded"]
        assert (discarded["step"], discarded["attempt"]) == (3, 1)
        (merge_3,) = [r for r in tape if "event" not in r and r["step"] == 3]
        assert merge_3["attempt"] == 2
        assert 30.0 <= syncer.clock.now() < 30.2

    run(scenario)
