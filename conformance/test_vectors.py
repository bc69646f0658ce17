"""The reference runner of the YETO v4 conformance vectors (``conformance/vectors/*.json``).

This is the file a third party ports to their language; ``spec/conformance.md`` describes the
same steps in prose. For every frame vector the decoder named by the group's ``context`` is fed
the frame three ways — whole, one byte at a time, and followed by the start of another frame —
and must produce exactly the ``decoded`` message (valid) or raise exactly the named ``code``
(invalid); ``acceptable`` allows either of the two (INIT and PUSH values: only ``decoded``,
the code being the codec's, checked on the decoded tensor). Valid frames must also re-encode to
the same bytes, and a valid frame cut short must read as "need more data" until the stream ends.

Run with ``pytest conformance/``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import numpy as np
import pytest

from yeto_learn.session import (
    AnchorRecorded,
    ApplyBroadcast,
    ApplyFinal,
    Effect,
    LearnerSession,
    SendMessage,
    ShutdownReceived,
)
from yeto_proto import (
    CLOSED,
    NEED_DATA,
    PROTOCOL_VERSION,
    AnyMessage,
    BcastFragment,
    BudgetDone,
    Chunk,
    ChunkSlicer,
    DataHello,
    DecoderState,
    DeltaCorrection,
    ErrorCode,
    ErrorMessage,
    FinalAck,
    FinalFragment,
    FinalManifest,
    FrameDecoder,
    FrameType,
    Heartbeat,
    Hello,
    InitParams,
    Layout,
    LearnerWeight,
    Limits,
    MergeMode,
    ProtocolError,
    PullReq,
    PushFragment,
    Reassembler,
    RemoteProtocolError,
    Role,
    Shutdown,
    SyncerProfile,
    WireDtype,
    WireFragment,
    WireLayout,
    encode,
    encode_bytes,
    hello_mac,
    verify_hello,
)
from yeto_proto.checkpoint import Checkpoint, load_layout, read_checkpoint
from yeto_proto.constants import FINALIZATION_REVISION
from yeto_proto.dtypes import (
    all_finite,
    bf16_to_f32,
    decode_tensor,
    f32_to_bf16,
    q4_decode,
    q4_encode,
)
from yeto_proto.errors import CheckpointError
from yeto_sync.config import SyncerConfig
from yeto_sync.coordinator import Coordinator
from yeto_sync.events import (
    Action,
    AdmitGroup,
    AppendTape,
    CloseGroup,
    ConnId,
    Exit,
    GroupClosed,
    GroupKey,
    GroupReady,
    HelloReceived,
    Log,
    MessageReceived,
    RefuseConnection,
    Send,
    SetTimer,
    TimerFired,
    WriteCheckpoint,
    WriteFinalMarker,
    WriteFinalState,
)
from yeto_sync.transport.group import ConnectionGroups, Hangup, WireCommand

Json = dict[str, Any]

HERE = Path(__file__).resolve().parent
VECTOR_DIR = HERE / "vectors"
SCHEMA_PATH = HERE / "vectors.schema.json"
GENERATOR = HERE / "generate_vectors.py"

#: One file per frame type; each must hold at least 3 valid and 5 invalid vectors.
FRAME_TYPE_FILES = (
    "hello.json",
    "data_hello.json",
    "init_params.json",
    "pull_req.json",
    "push_fragment.json",
    "bcast_fragment.json",
    "heartbeat.json",
    "shutdown.json",
    "chunk.json",
    "error.json",
    "final_manifest.json",
    "final_ack.json",
    "final_fragment.json",
    "budget_done.json",
)

#: A frame each receiver accepts in any session, appended to vectors as "trailing data":
#: to a syncer HEARTBEAT(learner_id=0, local_step=1), to a learner SHUTDOWN.
NEXT_FRAME = {
    Role.SYNCER: bytes.fromhex("dec070d1060c00000000000000000000000100000000000000"),
    Role.LEARNER: bytes.fromhex("dec070d1070000000000000000"),
}
NEXT_MESSAGE = {Role.SYNCER: Heartbeat(learner_id=0, local_step=1), Role.LEARNER: Shutdown()}


# -- loading -------------------------------------------------------------------------------------


@cache
def load(name: str) -> Json:
    doc: Json = json.loads((VECTOR_DIR / name).read_text(encoding="utf-8"))
    return doc


@cache
def schema_validator() -> Any:
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


VECTOR_FILES = sorted(path.name for path in VECTOR_DIR.glob("*.json"))


@dataclass(frozen=True)
class Context:
    """The decoder a group of tests needs (``context`` in the vector file)."""

    receiver: Role
    #: The frame is the first on a new syncer socket: the first-frame rule applies.
    first_frame: bool
    limits: Limits | None
    session_hello: bytes | None
    num_learners: int | None
    hello_key: bytes | None
    #: The syncer's ``--learner-budget-steps`` (``None``: no budget), for BUDGET_DONE.
    learner_budget_steps: int | None = None

    @classmethod
    def from_json(cls, ctx: Json) -> Context:
        session = ctx.get("session")
        key = ctx.get("hello_key")
        return cls(
            receiver=Role(ctx["receiver"]),
            first_frame=ctx["first_frame"],
            limits=(
                Limits(WireDtype[session["dtype"].upper()], tuple(session["numels"]))
                if session
                else None
            ),
            session_hello=bytes.fromhex(session["hello"]) if session else None,
            num_learners=ctx.get("num_learners"),
            hello_key=bytes.fromhex(key) if key is not None else None,
            learner_budget_steps=ctx.get("learner_budget_steps"),
        )

    def decoder(self) -> FrameDecoder:
        if self.first_frame:  # a syncer's new socket: no session limits yet
            return FrameDecoder(
                Role.SYNCER, num_learners=self.num_learners, hello_key=self.hello_key
            )
        return FrameDecoder(
            self.receiver,
            limits=self.limits,
            num_learners=self.num_learners,
            hello_key=self.hello_key,
            enforce_first_frame=False,
        )

    def limits_after(self, first: AnyMessage) -> Limits:
        """The limits a syncer installs once a socket's first frame was accepted."""
        if isinstance(first, Hello):
            return Limits.of(first.dtype, first.layout)
        assert self.limits is not None, "a DATA_HELLO vector's context must name the session"
        return self.limits


@dataclass(frozen=True)
class Case:
    file: str
    #: The decoder context (frame and chunk-sequence groups).
    context: Context | None
    test: Json
    #: The group's ``context`` as written, for the groups that do not name a decoder.
    settings: Json | None = None

    @property
    def id(self) -> str:
        return f"{self.file.removesuffix('.json')}-{self.test['tcId']}"

    @property
    def result(self) -> str:
        result: str = self.test["result"]
        return result

    @property
    def code(self) -> str:
        code: str = self.test["code"]
        return code

    @property
    def frame(self) -> bytes:
        return bytes.fromhex(self.test["hex"])


#: Group types whose ``context`` describes a decoder (:class:`Context`).
DECODER_GROUPS = ("FrameTest", "ChunkSequenceTest", "LearnerSessionTest")


def cases(group_type: str) -> list[Case]:
    out: list[Case] = []
    for name in VECTOR_FILES:
        for group in load(name)["testGroups"]:
            if group["type"] != group_type:
                continue
            settings = group.get("context")
            context = (
                Context.from_json(settings)
                if settings is not None and group_type in DECODER_GROUPS
                else None
            )
            out.extend(Case(name, context, test, settings) for test in group["tests"])
    return out


def params(selected: list[Case]) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("case", selected, ids=[c.id for c in selected])


#: ``incomplete`` tests are only the start of a frame: they have their own test below.
FRAME_CASES = [c for c in cases("FrameTest") if c.result != "incomplete"]
INCOMPLETE = [c for c in cases("FrameTest") if c.result == "incomplete"]
DECODABLE = [c for c in FRAME_CASES if c.result != "invalid"]
VALID = [c for c in FRAME_CASES if c.result == "valid"]
FAIL_EARLY = [c for c in FRAME_CASES if "fail_after" in c.test]


# -- messages as JSON ----------------------------------------------------------------------------


def message_json(message: AnyMessage) -> Json:
    """A decoded message in the vector files' form: wire names, hex bytes, enum names."""
    match message:
        case Hello():
            hello: Json = {
                "type": "HELLO",
                "protocol_version": PROTOCOL_VERSION,
                "learner_id": message.learner_id,
                "connection_generation": message.generation,
                "dtype": message.dtype.name.lower(),
                "fragments": [fragment_json(f) for f in message.layout.fragments],
                "layout_fingerprint": message.layout_fingerprint.hex(),
                "session_contract_hash": message.session_contract.hex(),
                "num_streams": message.num_streams,
            }
            if message.profile_hash is not None:
                hello["syncer_profile_hash"] = message.profile_hash.hex()
            return hello
        case DataHello():
            return {
                "type": "DATA_HELLO",
                "protocol_version": PROTOCOL_VERSION,
                "learner_id": message.learner_id,
                "connection_generation": message.generation,
                "stream_idx": message.stream_idx,
            }
        case InitParams():
            return {
                "type": "INIT_PARAMS",
                "fragment_id": message.fragment_id,
                "data": message.data.hex(),
            }
        case PullReq():
            return {
                "type": "PULL_REQ",
                "fragment_id": message.fragment_id,
                "global_step": message.global_step,
                "round_attempt": message.round_attempt,
            }
        case PushFragment():
            return {
                "type": "PUSH_FRAGMENT",
                "learner_id": message.learner_id,
                "fragment_id": message.fragment_id,
                "global_step": message.global_step,
                "round_attempt": message.round_attempt,
                "base_version": message.base_version,
                "local_step": message.local_step,
                "c_steps": message.c_steps,
                "c_tokens": message.c_tokens,
                "data": message.data.hex(),
            }
        case BcastFragment() | FinalFragment():
            return {
                "type": message.TYPE.name,
                "fragment_id": message.fragment_id,
                "version": message.version,
                "data": message.data.hex(),
            }
        case Heartbeat():
            return {
                "type": "HEARTBEAT",
                "learner_id": message.learner_id,
                "local_step": message.local_step,
            }
        case Shutdown():
            return {"type": "SHUTDOWN"}
        case Chunk():
            return {
                "type": "CHUNK",
                "msg_id": message.msg_id,
                "total_len": message.total_len,
                "offset": message.offset,
                "data": message.data.hex(),
            }
        case ErrorMessage():
            return {"type": "ERROR", "text": message.text}
        case FinalManifest():
            return {
                "type": "FINAL_MANIFEST",
                "revision": FINALIZATION_REVISION,
                "final_global_step": message.final_global_step,
                "expected_versions": list(message.expected_versions),
            }
        case FinalAck():
            return {
                "type": "FINAL_ACK",
                "revision": FINALIZATION_REVISION,
                "final_global_step": message.final_global_step,
            }
        case BudgetDone():
            return {"type": "BUDGET_DONE", "exact_local_steps": message.exact_local_steps}
    raise AssertionError(f"unhandled message {message!r}")


def fragment_json(fragment: WireFragment) -> Json:
    out: Json = {"merge_mode": fragment.merge_mode.name.lower(), "numels": list(fragment.numels)}
    if fragment.merge_mode is MergeMode.ISO:
        out["matrix_shapes"] = [{"rows": r, "cols": c} for r, c in fragment.matrix_shapes]
    return out


def message_from_json(obj: Json) -> AnyMessage:
    """The inverse of :func:`message_json`: build the message a ``decoded`` object describes."""
    fields = {k: v for k, v in obj.items() if k not in ("type", "protocol_version", "revision")}
    if "data" in fields:
        fields["data"] = bytes.fromhex(fields["data"])
    match obj["type"]:
        case "HELLO":
            profile = fields.get("syncer_profile_hash")
            return Hello(
                learner_id=fields["learner_id"],
                generation=fields["connection_generation"],
                dtype=WireDtype[fields["dtype"].upper()],
                layout=WireLayout(
                    tuple(
                        WireFragment(
                            MergeMode[f["merge_mode"].upper()],
                            tuple(f["numels"]),
                            tuple((s["rows"], s["cols"]) for s in f.get("matrix_shapes", [])),
                        )
                        for f in fields["fragments"]
                    )
                ),
                layout_fingerprint=bytes.fromhex(fields["layout_fingerprint"]),
                session_contract=bytes.fromhex(fields["session_contract_hash"]),
                num_streams=fields["num_streams"],
                profile_hash=bytes.fromhex(profile) if profile is not None else None,
            )
        case "DATA_HELLO":
            return DataHello(
                fields["learner_id"], fields["connection_generation"], fields["stream_idx"]
            )
        case "FINAL_MANIFEST":
            return FinalManifest(fields["final_global_step"], tuple(fields["expected_versions"]))
        case "ERROR":
            return ErrorMessage(fields["text"])
    simple: dict[str, type[AnyMessage]] = {
        "INIT_PARAMS": InitParams,
        "PULL_REQ": PullReq,
        "PUSH_FRAGMENT": PushFragment,
        "BCAST_FRAGMENT": BcastFragment,
        "HEARTBEAT": Heartbeat,
        "SHUTDOWN": Shutdown,
        "CHUNK": Chunk,
        "FINAL_ACK": FinalAck,
        "FINAL_FRAGMENT": FinalFragment,
        "BUDGET_DONE": BudgetDone,
    }
    build: Any = simple[obj["type"]]
    message: AnyMessage = build(**fields)
    return message


# -- driving a decoder ---------------------------------------------------------------------------


class Run:
    """One decoder fed piece by piece, collecting messages like a socket loop does."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.decoder = context.decoder()
        self.messages: list[AnyMessage] = []
        self.error: ProtocolError | None = None
        self.fed = 0

    def feed(self, data: bytes) -> None:
        """Feed ``data`` (``b""`` = end of stream), then take every message now available."""
        if self.error is not None:
            return
        self.decoder.feed(data)
        self.fed += len(data)
        try:
            while not isinstance(item := self.decoder.next_frame(), DecoderState):
                if self.context.first_frame and not self.messages:
                    # A syncer accepts the first frame, then installs the session's limits.
                    self.decoder.set_limits(self.context.limits_after(item))
                self.messages.append(item)
        except RemoteProtocolError as exc:
            self.error = exc

    def state(self) -> object:
        return self.decoder.next_frame()


def check_outcome(case: Case, messages: list[AnyMessage], error: ProtocolError | None) -> None:
    """valid: exactly ``decoded``; invalid: exactly ``code``; acceptable: one of the two, except
    that INIT and PUSH values are judged after the frame (spec/syncer.md § 6): ``decoded``."""
    decoded_ok = error is None and [message_json(m) for m in messages] == [case.test.get("decoded")]
    failed_ok = error is not None and not messages and error.code.value == case.test.get("code")
    if case.result == "valid":
        assert error is None, f"valid frame raised {error!r}"
        assert decoded_ok, f"decoded {[message_json(m) for m in messages]}"
    elif case.result == "invalid":
        assert not messages, f"invalid frame decoded to {messages!r}"
        assert error is not None, "invalid frame raised nothing"
        assert error.code.value == case.code, f"raised {error.code.value}, expected {case.code}"
    elif case.test["decoded"]["type"] in VALUES_JUDGED_LATER:
        assert decoded_ok, (
            f"acceptable {case.test['decoded']['type']}: got {messages!r} / {error!r}"
        )
    else:
        assert decoded_ok or failed_ok, f"acceptable frame: got {messages!r} / {error!r}"


#: Frame types whose acceptable vectors the syncer's decoder must return: their values are
#: judged by the coordinator after the round or fragment checks (spec/syncer.md § 1, § 6).
VALUES_JUDGED_LATER = ("INIT_PARAMS", "PUSH_FRAGMENT")


# -- the vector files themselves -----------------------------------------------------------------


@pytest.mark.parametrize("name", VECTOR_FILES)
def test_file_matches_the_schema(name: str) -> None:
    errors = sorted(schema_validator().iter_errors(load(name)), key=lambda e: e.json_path)
    assert not errors, "\n".join(f"{e.json_path}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize("name", VECTOR_FILES)
def test_file_bookkeeping(name: str) -> None:
    """Counts, unique tcIds, described flags, and codes that exist."""
    doc = load(name)
    tests = [t for g in doc["testGroups"] for t in g["tests"]]
    assert doc["numberOfTests"] == len(tests)
    ids = [t["tcId"] for t in tests]
    assert len(set(ids)) == len(ids), "tcIds repeat"
    used = {flag for t in tests for flag in t["flags"]}
    assert used == set(doc["notes"]), "every flag used is described in notes, and only those"
    for test in tests:
        if "code" in test:
            ErrorCode(test["code"])  # raises for a code yeto_proto does not define


@pytest.mark.parametrize("name", VECTOR_FILES)
def test_session_hello_establishes_the_session(name: str) -> None:
    """A context's ``session.hello`` decodes, on a new syncer socket, to its dtype and numels."""
    for group in load(name)["testGroups"]:
        session = group.get("context", {}).get("session")
        if session is None:
            continue
        context = Context.from_json(group["context"])
        run = Run(Context(Role.SYNCER, True, None, None, context.num_learners, context.hello_key))
        run.feed(bytes.fromhex(session["hello"]))
        assert run.error is None and len(run.messages) == 1
        hello = run.messages[0]
        assert isinstance(hello, Hello)
        assert Limits.of(hello.dtype, hello.layout) == context.limits


def test_every_frame_type_has_enough_vectors() -> None:
    total = 0
    for name in FRAME_TYPE_FILES:
        results = [t["result"] for g in load(name)["testGroups"] for t in g["tests"]]
        assert results.count("valid") >= 3, name
        assert results.count("invalid") >= 5, name
    for name in VECTOR_FILES:
        total += load(name)["numberOfTests"]
    assert total >= 250


def test_the_schema_is_strict() -> None:
    """additionalProperties: false bites: an unknown field anywhere makes a file invalid."""
    doc = json.loads((VECTOR_DIR / "pull_req.json").read_text(encoding="utf-8"))
    doc["testGroups"][0]["tests"][0]["surprise"] = 1
    assert not schema_validator().is_valid(doc)
    doc = json.loads((VECTOR_DIR / "pull_req.json").read_text(encoding="utf-8"))
    doc["testGroups"][0]["tests"][0]["decoded"]["extra_field"] = 0
    assert not schema_validator().is_valid(doc)


def test_regenerating_reproduces_every_committed_byte(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(GENERATOR), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    assert sorted(p.name for p in tmp_path.glob("*.json")) == VECTOR_FILES
    for name in VECTOR_FILES:
        assert (tmp_path / name).read_bytes() == (VECTOR_DIR / name).read_bytes(), name


# -- frame vectors -------------------------------------------------------------------------------


@params(FRAME_CASES)
def test_frame_fed_whole(case: Case) -> None:
    assert case.context is not None
    run = Run(case.context)
    run.feed(case.frame)
    check_outcome(case, run.messages, run.error)
    if run.error is None:
        assert run.state() is NEED_DATA


@params(FRAME_CASES)
def test_frame_fed_byte_by_byte(case: Case) -> None:
    assert case.context is not None
    run = Run(case.context)
    frame = case.frame
    fail_after = case.test.get("fail_after", len(frame))
    for i in range(len(frame)):
        run.feed(frame[i : i + 1])
        if run.error is not None:
            break
        if i + 1 < len(frame):
            assert not run.messages, f"a message appeared after {i + 1} of {len(frame)} bytes"
        if case.result == "invalid":
            assert i + 1 < fail_after, f"no error once {fail_after} bytes were fed"
    check_outcome(case, run.messages, run.error)
    if run.error is not None and case.result == "invalid":
        assert run.fed <= fail_after


@params(FAIL_EARLY)
def test_header_errors_need_no_payload_byte(case: Case) -> None:
    """Feeding exactly ``fail_after`` bytes (13: the header) raises; nothing is allocated."""
    assert case.context is not None
    run = Run(case.context)
    run.feed(case.frame[: case.test["fail_after"]])
    assert run.error is not None, "the header alone must decide"
    assert run.error.code.value == case.code


@params(FRAME_CASES)
def test_frame_followed_by_trailing_data(case: Case) -> None:
    """The bytes after a frame are the start of the next one: NEED_DATA, then that frame. After
    a socket's first frame, even a whole following frame is held until the limits are set."""
    assert case.context is not None
    context = case.context
    next_frame = NEXT_FRAME[context.receiver]
    decoder = context.decoder()
    # A first-frame socket also gets one whole frame before the partial one (spec/wire.md § 6.2).
    whole_next = next_frame if context.first_frame else b""
    decoder.feed(case.frame + whole_next + next_frame[:5])
    try:
        first = decoder.next_frame()
    except RemoteProtocolError as exc:
        check_outcome(case, [], exc)
        return
    assert not isinstance(first, DecoderState), "a complete frame must decode"
    check_outcome(case, [first], None)
    if context.first_frame:
        # The socket's first frame: later bytes wait, unparsed, until the syncer installs the
        # limits, even when they hold a whole frame.
        assert decoder.next_frame() is NEED_DATA, "bytes after the first frame must be held"
        assert decoder.next_frame() is NEED_DATA
        decoder.set_limits(context.limits_after(first))
        assert decoder.next_frame() == NEXT_MESSAGE[context.receiver]
    assert decoder.next_frame() is NEED_DATA
    decoder.feed(next_frame[5:])
    assert decoder.next_frame() == NEXT_MESSAGE[context.receiver]
    assert decoder.next_frame() is NEED_DATA


@params(VALID)
def test_truncated_frame_needs_data_until_the_stream_ends(case: Case) -> None:
    assert case.context is not None
    frame = case.frame
    for cut in sorted({1, 12, 13, len(frame) - 1} & set(range(1, len(frame)))):
        run = Run(case.context)
        run.feed(frame[:cut])
        assert run.error is None and not run.messages, f"cut at {cut}"
        assert run.state() is NEED_DATA
        run.feed(b"")
        assert run.error is not None, f"cut at {cut}: end of stream inside a frame"
        assert run.error.code is ErrorCode.CONNECTION_CLOSED_MID_FRAME
    run = Run(case.context)
    run.feed(frame)
    run.feed(b"")
    assert len(run.messages) == 1 and run.error is None
    assert run.state() is CLOSED


@params(VALID)
def test_valid_frame_reencodes_to_the_same_bytes(case: Case) -> None:
    assert case.context is not None
    run = Run(case.context)
    run.feed(case.frame)
    (message,) = run.messages
    key = case.context.hello_key if isinstance(message, Hello) else None
    assert encode_bytes(message, hello_key=key) == case.frame
    rebuilt = message_from_json(case.test["decoded"])
    assert encode_bytes(rebuilt, hello_key=key) == case.frame


@params(INCOMPLETE)
def test_frame_start_at_a_limit_needs_data(case: Case) -> None:
    """``incomplete``: the start of a frame at a size limit exactly (a 16 MiB HELLO, a CHUNK of
    24 + 4 MiB) is accepted as far as it goes, fed whole or byte by byte: the decoder needs
    data, and the end of the stream is then CONNECTION_CLOSED_MID_FRAME."""
    assert case.context is not None
    frame = case.frame
    for pieces in ([frame], [frame[i : i + 1] for i in range(len(frame))]):
        run = Run(case.context)
        for piece in pieces:
            run.feed(piece)
            assert run.error is None, f"refused after {run.fed} bytes: {run.error!r}"
            assert not run.messages
            assert run.state() is NEED_DATA
        run.feed(b"")
        assert run.error is not None
        assert run.error.code is ErrorCode.CONNECTION_CLOSED_MID_FRAME


# -- chunk sequences -----------------------------------------------------------------------------

CHUNK_SEQUENCES = cases("ChunkSequenceTest")


def reassemble(context: Context, chunks: list[bytes]) -> Iterator[AnyMessage | None]:
    """Decode each CHUNK frame and hand it to one reassembler; yield what each completes."""
    decoder = context.decoder()
    assert context.limits is not None
    reassembler = Reassembler(context.receiver, context.limits)
    for frame in chunks:
        decoder.feed(frame)
        item = decoder.next_frame()
        assert isinstance(item, Chunk), f"expected a CHUNK, got {item!r}"
        assert decoder.next_frame() is NEED_DATA
        yield reassembler.add(item)


@params(CHUNK_SEQUENCES)
def test_chunk_sequence(case: Case) -> None:
    assert case.context is not None and not case.context.first_frame
    chunks = [bytes.fromhex(c) for c in case.test["chunks"]]
    steps = reassemble(case.context, chunks)
    if case.result == "valid":
        completed = [m for m in steps if m is not None]
        assert [message_json(m) for m in completed] == case.test["decoded"]
        return
    # Every CHUNK but the last is accepted, completing exactly the listed messages.
    completed = [m for m in itertools.islice(steps, len(chunks) - 1) if m is not None]
    expected = case.test.get("completed_before_error", [])
    assert [message_json(m) for m in completed] == expected
    with pytest.raises(RemoteProtocolError) as caught:
        next(steps)
    assert caught.value.code.value == case.code


@params([c for c in CHUNK_SEQUENCES if "slice_size" in c.test])
def test_chunk_sequence_is_what_a_sender_emits(case: Case) -> None:
    slicer = ChunkSlicer(case.test["num_data_streams"], slice_size=case.test["slice_size"])
    sent = [
        piece
        for decoded in case.test["decoded"]
        for piece in slicer.slice(encode(message_from_json(decoded)))
    ]
    assert [b"".join(bytes(b) for b in s.buffers).hex() for s in sent] == case.test["chunks"]
    assert [s.stream_idx for s in sent] == case.test["streams"]


# -- dtype codecs --------------------------------------------------------------------------------


def f32_of(hex_text: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    return np.frombuffer(bytes.fromhex(hex_text), dtype="<f4")


def expect_error(case: Case, error: BaseException | None) -> None:
    assert isinstance(error, ProtocolError), f"expected {case.code}, got {error!r}"
    assert error.code.value == case.code


@params(cases("Bf16CodecTest"))
def test_bf16_codec(case: Case) -> None:
    test = case.test
    if test["op"] == "decode":
        if case.result == "invalid":
            with pytest.raises(ProtocolError) as caught:
                bf16_to_f32(bytes.fromhex(test["bf16"]))
            expect_error(case, caught.value)
            return
        assert bf16_to_f32(bytes.fromhex(test["bf16"])).astype("<f4").tobytes().hex() == test["f32"]
        return
    got = f32_to_bf16(f32_of(test["f32"])).astype("<u2")
    if case.result == "valid":
        assert got.tobytes().hex() == test["bf16"]
        return
    # acceptable: the inputs are NaNs; any quiet bf16 NaN of the same sign will do.
    inputs = f32_of(test["f32"])
    assert np.isnan(inputs).all()
    assert ((got & 0x7F80) == 0x7F80).all() and ((got & 0x0040) != 0).all()
    assert ((got >> 15) == (inputs.view("<u4") >> 31)).all(), "a NaN keeps its sign"


@params(cases("Q4CodecTest"))
def test_q4_codec(case: Case) -> None:
    test = case.test
    error: BaseException | None = None
    try:
        if test["op"] == "encode":
            got = q4_encode(f32_of(test["f32"])).tobytes().hex()
            expected = test.get("q4")
        else:
            values = q4_decode(bytes.fromhex(test["q4"]), test["numel"])
            got = values.astype("<f4").tobytes().hex()
            expected = test.get("f32")
    except ProtocolError as exc:
        error = exc
    if case.result == "invalid":
        expect_error(case, error)
    else:
        assert error is None, repr(error)
        assert got == expected


# -- identity ------------------------------------------------------------------------------------


@params(cases("LayoutFingerprintTest"))
def test_layout_fingerprint(case: Case) -> None:
    expected = case.test["fingerprint"]
    assert hashlib.sha256(bytes.fromhex(case.test["canonical_hex"])).hexdigest() == expected
    assert Layout.from_json_dict(case.test["layout"]).fingerprint().hex() == expected


@params(cases("LayoutFileTest"))
def test_layout_file(case: Case, tmp_path: Path) -> None:
    path = tmp_path / "layout.json"
    path.write_bytes(bytes.fromhex(case.test["hex"]))
    if case.result == "valid":
        assert load_layout(path).fingerprint().hex() == case.test["fingerprint"]
        return
    with pytest.raises(CheckpointError) as caught:
        load_layout(path)
    assert caught.value.code.value == case.code


@params(cases("ProfileHashTest"))
def test_profile_hash(case: Case) -> None:
    fields = dict(case.test["profile"])
    fields["delta_correction"] = DeltaCorrection[fields["delta_correction"].upper()]
    fields["learner_weight"] = LearnerWeight[fields["learner_weight"].upper().replace("-", "_")]
    profile = SyncerProfile(**fields)
    assert profile.canonical_bytes().hex() == case.test["canonical_hex"]
    assert profile.digest().hex() == case.test["digest"]


@params(cases("HelloMacTest"))
def test_hello_mac(case: Case) -> None:
    key, body, mac = (bytes.fromhex(case.test[k]) for k in ("key", "body", "mac"))
    if case.result == "valid":
        assert hello_mac(key, body) == mac
        assert bytes(verify_hello(key, memoryview(body + mac))) == body
        return
    assert hello_mac(key, body) != mac
    with pytest.raises(RemoteProtocolError) as caught:
        verify_hello(key, memoryview(body + mac))
    assert caught.value.code.value == case.code


# -- the coordinator's verdict on acceptable BUDGET_DONE reports ---------------------------------


def coordinator_with_session(context: Context) -> tuple[Coordinator, GroupKey]:
    """A syncer with the context's M and budget whose session the context's HELLO opened."""
    assert context.session_hello is not None and context.num_learners is not None
    config = SyncerConfig(
        learners=context.num_learners,
        total_steps=1000,
        learner_budget_steps=context.learner_budget_steps,
    )
    coordinator = Coordinator(config)
    hello = decode_first_hello(context.session_hello, context.num_learners)
    key = GroupKey(hello.learner_id, hello.generation)
    actions = coordinator.handle(HelloReceived(1, hello), 0.0)
    assert any(isinstance(a, AdmitGroup) for a in actions), actions
    coordinator.handle(GroupReady(key), 0.0)
    return coordinator, key


@params(
    [
        c
        for c in FRAME_CASES
        if c.result == "acceptable" and c.test["decoded"]["type"] == "BUDGET_DONE"
    ]
)
def test_budget_done_refused_by_the_coordinator(case: Case) -> None:
    """An acceptable BUDGET_DONE decodes; the coordinator, with the context's budget (absent:
    none), then closes the sender's group with ERROR ``code`` (spec/closure.md § 2)."""
    assert case.context is not None and case.context.receiver is Role.SYNCER
    coordinator, key = coordinator_with_session(case.context)
    message = message_from_json(case.test["decoded"])
    actions = coordinator.handle(MessageReceived(key, message), 1.0)
    closes = [a for a in actions if isinstance(a, CloseGroup)]
    assert len(closes) == 1 and closes[0].group == key, actions
    assert closes[0].error is not None
    assert closes[0].error.text.split(":", 1)[0] == case.code


@params(
    [
        c
        for c in FRAME_CASES
        if c.result == "acceptable" and c.test["decoded"]["type"] in VALUES_JUDGED_LATER
    ]
)
def test_acceptable_values_are_refused_by_the_codec(case: Case) -> None:
    """INIT and PUSH values: the syncer's decoder returns the message (the coordinator judges it
    before its values, spec/syncer.md § 1 item 2 and § 6); decoding the tensor in the session
    dtype raises ``code`` or, for NON_FINITE_VALUE, yields a value that is not finite."""
    assert case.context is not None and case.context.limits is not None
    run = Run(case.context)
    run.feed(case.frame)
    check_outcome(case, run.messages, run.error)
    [message] = run.messages
    assert isinstance(message, InitParams | PushFragment)
    push = isinstance(message, PushFragment)
    limits = case.context.limits
    numel = limits.numels[message.fragment_id]
    try:
        values = decode_tensor(message.data, limits.dtype, numel, push=push)
    except ProtocolError as error:
        assert error.code.value == case.code
        return
    assert case.code == "NON_FINITE_VALUE" and not all_finite(values)


@params(
    [c for c in FRAME_CASES if c.result == "acceptable" and c.test["decoded"]["type"] == "CHUNK"]
)
def test_acceptable_chunk_is_refused_by_the_reassembler(case: Case) -> None:
    """An acceptable CHUNK is well formed; if the frame decoder returns it, a fresh reassembler
    of the context's receiver and session refuses it with ``code`` (spec/striping.md § 4)."""
    assert case.context is not None and case.context.limits is not None
    run = Run(case.context)
    run.feed(case.frame)
    check_outcome(case, run.messages, run.error)
    if run.error is not None:
        return  # the decoder refused it already, with the code
    [message] = run.messages
    assert isinstance(message, Chunk)
    reassembler = Reassembler(case.context.receiver, case.context.limits)
    with pytest.raises(RemoteProtocolError) as caught:
        reassembler.add(message)
    assert caught.value.code.value == case.code


# -- session admission ---------------------------------------------------------------------------


def decode_first_hello(frame: bytes, num_learners: int | None) -> Hello:
    """``frame`` as the first frame of a new syncer socket: exactly one HELLO."""
    decoder = FrameDecoder(Role.SYNCER, num_learners=num_learners)
    decoder.feed(frame)
    hello = decoder.next_frame()
    assert isinstance(hello, Hello), f"expected a HELLO, got {hello!r}"
    decoder.set_limits(Limits.of(hello.dtype, hello.layout))
    assert decoder.next_frame() is NEED_DATA
    return hello


def syncer_config(settings: Json) -> SyncerConfig:
    """The syncer an admission group describes: its profile's flags, checked against the rest."""
    fields = dict(settings["syncer_profile"])
    checkpoint_enabled = fields.pop("checkpoint_enabled")
    fields["delta_correction"] = DeltaCorrection[fields["delta_correction"].upper()]
    fields["learner_weight"] = LearnerWeight[fields["learner_weight"].upper().replace("-", "_")]
    config = SyncerConfig(
        **fields, checkpoint_path=Path("admission.ckpt") if checkpoint_enabled else None
    )
    assert config.learners == settings["num_learners"]
    assert config.require_profile_binding == settings["require_profile_binding"]
    assert config.profile().digest().hex() == settings["syncer_profile_hash"]
    return config


def refusal_code(actions: list[Action], conn: ConnId) -> str | None:
    """The code of the ERROR a RefuseConnection of ``conn`` carries, if any."""
    refusals = [a for a in actions if isinstance(a, RefuseConnection)]
    if not refusals:
        return None
    assert [a.conn for a in refusals] == [conn], actions
    code, _, detail = refusals[0].error.text.partition(": ")
    assert detail, "ERROR text is <CODE>: <detail>"
    return code


def admit_or_refuse(
    coordinator: Coordinator, conn: ConnId, frame: bytes, num_learners: int
) -> list[Action]:
    """``frame`` as the first frame of socket ``conn``, handed to the coordinator."""
    hello = decode_first_hello(frame, None)
    actions = coordinator.handle(HelloReceived(conn, hello), 1.0)
    # A frame decoder that knows M may refuse learner_id >= M itself (spec/wire.md § 5.2): then
    # with the coordinator's code.
    strict = Run(Context(Role.SYNCER, True, None, None, num_learners, None))
    strict.feed(frame)
    if strict.error is not None:
        assert strict.error.code.value == refusal_code(actions, conn), (strict.error, actions)
    return actions


@params(cases("HelloAdmissionTest"))
def test_hello_admission(case: Case) -> None:
    """Admit ``accepted`` in order, close ``closed``, refuse ``refused_before``, then
    ``hello``: admitted (closing the groups of ``evicts``) or refused."""
    assert case.settings is not None
    num_learners = case.settings["num_learners"]
    coordinator = Coordinator(syncer_config(case.settings))
    keys: list[GroupKey] = []
    for conn, frame in enumerate(case.test["accepted"], start=1):
        hello = decode_first_hello(bytes.fromhex(frame), num_learners)
        key = GroupKey(hello.learner_id, hello.generation)
        actions = coordinator.handle(HelloReceived(conn, hello), 0.0)
        assert refusal_code(actions, conn) is None, f"accepted[{conn - 1}] refused: {actions}"
        session = coordinator.session
        assert session is not None
        limits = Limits.of(session.dtype, session.layout)
        assert [a for a in actions if isinstance(a, AdmitGroup)] == [
            AdmitGroup(conn, key, hello.num_streams, limits)
        ]
        keys.append(key)
    for index in case.test.get("closed", []):
        coordinator.handle(GroupClosed(keys[index], "closed by the vector"), 0.0)
        assert not coordinator.registry.is_open(keys[index])
    conn = len(keys)
    for refused in case.test.get("refused_before", []):
        conn += 1
        session_before = coordinator.session
        actions = admit_or_refuse(coordinator, conn, bytes.fromhex(refused["hello"]), num_learners)
        assert refusal_code(actions, conn) == refused["code"], actions
        assert not any(isinstance(a, AdmitGroup | CloseGroup) for a in actions), actions
        assert coordinator.session == session_before, "a refused HELLO fixes nothing"
    session_before = coordinator.session

    conn += 1
    actions = admit_or_refuse(coordinator, conn, bytes.fromhex(case.test["hello"]), num_learners)
    hello = decode_first_hello(bytes.fromhex(case.test["hello"]), None)
    key = GroupKey(hello.learner_id, hello.generation)
    admits = [a for a in actions if isinstance(a, AdmitGroup)]
    if case.result == "admitted":
        assert refusal_code(actions, conn) is None, actions
        session = coordinator.session
        assert session is not None
        assert admits == [
            AdmitGroup(conn, key, hello.num_streams, Limits.of(session.dtype, session.layout))
        ]
        assert coordinator.registry.is_open(key)
        if session_before is not None:
            assert session == session_before, "a later HELLO never changes the session"
        evicted = [keys[i] for i in case.test.get("evicts", [])]
        closes = [a for a in actions if isinstance(a, CloseGroup)]
        assert closes == [CloseGroup(k, None) for k in evicted], "closed without ERROR"
        assert not any(coordinator.registry.is_open(k) for k in evicted)
        return
    assert refusal_code(actions, conn) == case.code, actions
    assert not admits and not any(isinstance(a, CloseGroup) for a in actions), actions
    assert coordinator.session == session_before, "a refused HELLO fixes and changes nothing"
    closed = {keys[i] for i in case.test.get("closed", [])}
    assert all(coordinator.registry.is_open(k) == (k not in closed) for k in keys)
    assert coordinator.registry.was_admitted(key) == (key in keys), "nothing new was admitted"


# -- attaching data sockets ----------------------------------------------------------------------


def attach_effects(groups: ConnectionGroups, wire: list[WireCommand]) -> list[Json]:
    """What the connection table did, in the vector's form: the sockets it closed (with the code
    of the ERROR it sent first, if any) and the groups that became ready."""
    effects: list[Json] = []
    for command in wire:
        assert isinstance(command, Hangup), f"a handshake sends nothing but ERROR: {command!r}"
        if command.error is None:
            effects.append({"effect": "close", "socket": command.conn})
            continue
        code, _, detail = command.error.text.partition(": ")
        assert detail, "ERROR text is <CODE>: <detail>"
        effects.append({"effect": "error", "socket": command.conn, "code": code})
    while (event := groups.pop_event()) is not None:
        if isinstance(event, GroupReady):
            key = event.group
            effects.append({"effect": "ready", "id": key.learner_id, "generation": key.generation})
        else:  # the close of a group is seen on its sockets
            assert isinstance(event, GroupClosed), f"unexpected event {event!r}"
    return effects


def effect_set(effects: list[Json]) -> list[str]:
    """One step's effects, comparable whatever their order (a step's effects form a set)."""
    return sorted(json.dumps(effect, sort_keys=True) for effect in effects)


def first_frame_of(step: Json, num_learners: int) -> AnyMessage:
    """The step's frame decoded as a socket's first frame; its repeated fields must agree."""
    decoder = FrameDecoder(Role.SYNCER, num_learners=num_learners)
    decoder.feed(bytes.fromhex(step["hex"]))
    message = decoder.next_frame()
    if step["step"] == "hello":
        assert isinstance(message, Hello), message
        fields = (message.learner_id, message.generation, message.num_streams)
        assert fields == (step["learner_id"], step["generation"], step["num_streams"])
    else:
        assert isinstance(message, DataHello), message
        fields = (message.learner_id, message.generation, message.stream_idx)
        assert fields == (step["learner_id"], step["generation"], step["stream_idx"])
    return message


@params(cases("AttachSequenceTest"))
def test_attach_sequence(case: Case) -> None:
    """Drive yeto's sans-IO connection table through the steps on a fake clock: each step must
    have exactly its ``effects``."""
    assert case.settings is not None
    num_learners = case.settings["num_learners"]
    groups = ConnectionGroups(num_learners)
    now = 0.0
    closed: set[ConnId] = set()
    for index, step in enumerate(case.test["steps"]):
        kind = step["step"]
        wire: list[WireCommand] = []
        if kind == "open":
            wire += groups.open(step["socket"], now)
        elif kind == "advance":
            now += step["seconds"]
            # As the daemon does: enforce each deadline when it comes, in order.
            while (deadline := groups.next_deadline()) is not None and deadline <= now:
                wire += groups.expire(deadline)
            assert not groups.expire(now), "a deadline next_deadline() did not report"
        else:
            conn = step["socket"]
            assert conn not in closed, "a vector sends nothing on a closed socket"
            message = first_frame_of(step, num_learners)
            wire += groups.receive(conn, bytes.fromhex(step["hex"]), now)
            if kind == "hello":
                assert isinstance(message, Hello)
                assert groups.pop_event() == HelloReceived(conn, message)
                if step["decision"] == "admit":
                    key = GroupKey(message.learner_id, message.generation)
                    limits = Limits.of(message.dtype, message.layout)
                    wire += groups.admit(conn, key, message.num_streams, limits, now)
                else:
                    error = ErrorMessage(f"{step['code']}: refused by the vector")
                    wire += groups.refuse(conn, error)
        effects = attach_effects(groups, wire)
        assert effect_set(effects) == effect_set(step["effects"]), f"step {index} ({kind})"
        for effect in effects:
            if "socket" in effect:
                assert effect["socket"] not in closed, f"socket {effect['socket']} closed twice"
                closed.add(effect["socket"])
    assert all(not groups.is_open(conn) for conn in closed)


# -- PUSH acceptance -----------------------------------------------------------------------------


def profile_config(profile: Json) -> SyncerConfig:
    """A SyncerConfig from a profile in the ProfileHashTest form."""
    fields = dict(profile)
    checkpoint_enabled = fields.pop("checkpoint_enabled")
    fields["delta_correction"] = DeltaCorrection[fields["delta_correction"].upper()]
    fields["learner_weight"] = LearnerWeight[fields["learner_weight"].upper().replace("-", "_")]
    return SyncerConfig(**fields, checkpoint_path=Path("push.ckpt") if checkpoint_enabled else None)


def decode_on_group(frame: bytes, limits: Limits, num_learners: int) -> AnyMessage:
    """``frame`` on an admitted group's socket: exactly one message."""
    decoder = FrameDecoder(
        Role.SYNCER, limits=limits, num_learners=num_learners, enforce_first_frame=False
    )
    return decode_one(decoder, frame)


def decode_one(decoder: FrameDecoder, frame: bytes) -> AnyMessage:
    """``frame`` fed to ``decoder``: exactly one message (or the decoder's error, raised)."""
    decoder.feed(frame)
    message = decoder.next_frame()
    assert not isinstance(message, DecoderState), message
    assert decoder.next_frame() is NEED_DATA
    return message


def rejected_tape(actions: list[Action]) -> list[dict[str, Any]]:
    return [
        a.record
        for a in actions
        if isinstance(a, AppendTape) and a.record.get("event") == "push_rejected"
    ]


def check_sends(actions: list[Action], expected: list[Json] | None) -> None:
    """The frames ``actions`` queue are exactly ``expected`` (a ``sends`` field): per group, in
    that order; across groups in any order; nothing to any other group. ``None``: unchecked."""
    if expected is None:
        return
    want = {GroupKey(e["id"], e["generation"]): e["frames"] for e in expected}
    assert len(want) == len(expected), "sends names each group once"
    got: dict[GroupKey, list[str]] = {}
    for action in actions:
        if isinstance(action, Send):
            got.setdefault(action.group, []).append(encode_bytes(action.message).hex())
    assert got == want, (got, want)


def context_checkpoint(settings: Json) -> Checkpoint | None:
    """The checkpoint a scripted group's syncer resumes from (its ``checkpoint``), if any."""
    if "checkpoint" not in settings:
        return None
    assert settings["syncer_profile"]["resume"], "a checkpoint goes with --resume"
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "resume.ckpt"
        path.write_bytes(bytes.fromhex(settings["checkpoint"]))
        return read_checkpoint(path)


def run_script(
    config: SyncerConfig, script: list[Json], checkpoint: Checkpoint | None = None
) -> Coordinator:
    """A coordinator (resuming from ``checkpoint``, if given) that has handled ``script`` (all
    at time 0), each event normally, each queueing exactly its ``sends`` if it has them."""
    coordinator = Coordinator(config, checkpoint=checkpoint)
    timers: dict[str, str] = {}  # "quorum:<step>" -> the latest quorum timer key of that step
    conn = 0
    for event in script:
        match event["event"]:
            case "hello":
                conn += 1
                hello = decode_first_hello(bytes.fromhex(event["hex"]), config.learners)
                assert hello.num_streams == 0
                key = GroupKey(hello.learner_id, hello.generation)
                actions = coordinator.handle(HelloReceived(conn, hello), 0.0)
                assert refusal_code(actions, conn) is None, actions
                actions += coordinator.handle(GroupReady(key), 0.0)
            case "frame":
                session = coordinator.session
                assert session is not None
                message = decode_on_group(
                    bytes.fromhex(event["hex"]),
                    Limits.of(session.dtype, session.layout),
                    config.learners,
                )
                key = GroupKey(event["id"], event["generation"])
                actions = coordinator.handle(MessageReceived(key, message), 0.0)
            case "close":
                key = GroupKey(event["id"], event["generation"])
                actions = coordinator.handle(GroupClosed(key, "closed by the vector"), 0.0)
            case "quorum_deadline":
                actions = coordinator.handle(TimerFired(timers[f"quorum:{event['step']}"]), 0.0)
            case other:
                raise AssertionError(f"unknown script event {other}")
        assert not any(isinstance(a, CloseGroup | RefuseConnection | Exit) for a in actions), (
            event,
            actions,
        )
        assert not rejected_tape(actions), (event, actions)
        check_sends(actions, event.get("sends"))
        for action in actions:
            if isinstance(action, SetTimer) and action.key.startswith("quorum:"):
                timers[action.key.rsplit(":", 1)[0]] = action.key
    return coordinator


def scripted_case(case: Case, field: str) -> tuple[Coordinator, GroupKey, AnyMessage]:
    """The coordinator after the case's ``script`` (all at time 0), the sender's group, and the
    frame under ``field`` decoded as that group's decoder would."""
    assert case.settings is not None
    config = profile_config(case.settings["syncer_profile"])
    coordinator = run_script(config, case.test["script"], context_checkpoint(case.settings))
    sender = GroupKey(case.test["sender"]["id"], case.test["sender"]["generation"])
    assert coordinator.registry.is_open(sender)
    session = coordinator.session
    assert session is not None
    message = decode_on_group(
        bytes.fromhex(case.test[field]), Limits.of(session.dtype, session.layout), config.learners
    )
    return coordinator, sender, message


def assert_closed_with(
    coordinator: Coordinator, actions: list[Action], sender: GroupKey, code: str | None
) -> None:
    """Exactly the sender's group closed, with an ERROR naming ``code``."""
    closes = [a for a in actions if isinstance(a, CloseGroup)]
    assert len(closes) == 1 and closes[0].group == sender, actions
    assert closes[0].error is not None
    assert closes[0].error.text.split(":", 1)[0] == code
    assert not coordinator.registry.is_open(sender)


@params(cases("PushAcceptanceTest"))
def test_push_acceptance(case: Case) -> None:
    """Run ``script`` through the coordinator (all at time 0), then ``push`` from ``sender``:
    accepted (with ``staleness``), rejected on the tape with ``code``, or fatal ``code``."""
    coordinator, sender, push = scripted_case(case, "push")
    assert isinstance(push, PushFragment)
    actions = coordinator.handle(MessageReceived(sender, push), 0.0)
    check_sends(actions, case.test.get("sends"))
    tape_lines = rejected_tape(actions)
    if case.result == "fatal":
        assert not tape_lines, actions
        assert_closed_with(coordinator, actions, sender, case.code)
        return
    assert not any(isinstance(a, CloseGroup) for a in actions), actions
    assert coordinator.registry.is_open(sender), "the connection stays open"
    if case.result == "rejected":
        assert len(tape_lines) == 1, actions
        line = tape_lines[0]
        assert line["code"] == case.code
        assert (line["id"], line["generation"]) == (sender.learner_id, sender.generation)
        assert (line["step"], line["fragment"], line["attempt"]) == (
            push.global_step,
            push.fragment_id,
            push.round_attempt,
        )
        assert (line["base_version"], line["local_step"]) == (push.base_version, push.local_step)
        assert not any(isinstance(a, Send) for a in actions), "a rejected PUSH changes nothing"
        return
    assert case.result == "accepted" and not tape_lines, actions
    accepted = [a for a in actions if isinstance(a, Log) and a.text == "PUSH accepted"]
    assert len(accepted) == 1, actions
    assert accepted[0].fields["staleness"] == case.test["staleness"]


# -- syncer session rules ------------------------------------------------------------------------


def held_fragments(coordinator: Coordinator) -> list[tuple[int, bytes | None, bytes | None]]:
    """Each fragment's version, params and momentum (bytes; ``None`` while not held)."""
    model = coordinator.model
    if model is None:
        return []
    return [
        (
            slot.version,
            None if slot.params is None else slot.params.tobytes(),
            None if slot.momentum is None else slot.momentum.tobytes(),
        )
        for slot in model.fragments
    ]


@params(cases("SyncerSessionTest"))
def test_syncer_session(case: Case) -> None:
    """Run ``script`` through the coordinator, then ``frame`` from ``sender``: accepted (it
    takes effect), ignored (nothing changes), finalized (the last FINAL_ACK: SHUTDOWN, exit 0),
    cutoff (the last BUDGET_DONE: the recovery checkpoint, exit 0), or fatal ``code`` (the
    sender's group closes)."""
    coordinator, sender, message = scripted_case(case, "frame")
    before = held_fragments(coordinator)
    actions = coordinator.handle(MessageReceived(sender, message), 0.0)
    check_sends(actions, case.test.get("sends"))
    if case.result == "fatal":
        assert_closed_with(coordinator, actions, sender, case.code)
        assert not any(isinstance(a, AppendTape | Exit) for a in actions), actions
        assert held_fragments(coordinator) == before, "a refused frame changes no fragment"
        return
    if case.result == "cutoff":
        assert isinstance(message, BudgetDone), "cutoff vectors are BUDGET_DONEs"
        assert not any(isinstance(a, CloseGroup | Send) for a in actions), actions
        assert not any(isinstance(a, WriteFinalMarker | WriteFinalState) for a in actions), actions
        writes = [a for a in actions if isinstance(a, WriteCheckpoint)]
        assert len(writes) == 1 and writes[0].recovery, actions
        assert writes[0].state.global_step == coordinator.global_step
        lines = [a.record for a in actions if isinstance(a, AppendTape)]
        assert [line["event"] for line in lines] == ["budget_done", "budget_cutoff"], lines
        assert lines[1]["complete"] and lines[1]["step"] == coordinator.global_step
        assert [a.code for a in actions if isinstance(a, Exit)] == [0], actions
        assert held_fragments(coordinator) == before, "the cutoff changes no fragment"
        return
    if case.result == "finalized":
        assert isinstance(message, FinalAck), "finalized vectors are FINAL_ACKs"
        assert not any(isinstance(a, CloseGroup | AppendTape) for a in actions), actions
        assert held_fragments(coordinator) == before, "an ACK changes no fragment"
        acked = {sender} | {
            GroupKey(e["id"], e["generation"])
            for e in case.test["script"]
            if e["event"] == "frame" and bytes.fromhex(e["hex"])[4] == FrameType.FINAL_ACK
        }
        sends = [a for a in actions if isinstance(a, Send)]
        assert all(isinstance(a.message, Shutdown) for a in sends), actions
        assert sorted(a.group for a in sends) == sorted(acked), actions
        assert [a.code for a in actions if isinstance(a, Exit)] == [0], actions
        return
    assert not any(isinstance(a, CloseGroup | Exit) for a in actions), actions
    assert coordinator.registry.is_open(sender), "the connection stays open"
    if case.result == "ignored":
        assert not any(isinstance(a, AppendTape | Send) for a in actions), actions
        assert held_fragments(coordinator) == before, "an ignored frame changes nothing"
        return
    assert case.result == "accepted"
    assert isinstance(message, InitParams), "accepted vectors are INIT_PARAMS"
    after = held_fragments(coordinator)
    fragment = message.fragment_id
    assert before[fragment][1] is None, "the fragment was not held before"
    values = np.frombuffer(bytes(message.data), dtype="<f4")
    assert after[fragment] == (0, values.tobytes(), np.zeros_like(values).tobytes())
    assert [a for i, a in enumerate(after) if i != fragment] == [
        b for i, b in enumerate(before) if i != fragment
    ]


# -- learner session -----------------------------------------------------------------------------

F32Values = np.ndarray[Any, np.dtype[np.float32]]


def sent_json(message: AnyMessage) -> Json:
    return {"effect": "send", "hex": encode_bytes(message).hex()}


def effect_json(effect: Effect) -> Json | None:
    """An effect in the vector files' form; ``None`` for yeto's informational AnchorRecorded
    (frozen mode: nothing to carry out; the anchor shows in later PUSHes)."""
    match effect:
        case ApplyBroadcast():
            return {
                "effect": "apply_broadcast",
                "fragment": effect.fragment_id,
                "version": effect.version,
                "f32": effect.global_params.astype("<f4").tobytes().hex(),
            }
        case ApplyFinal():
            return {
                "effect": "apply_final",
                "final_global_step": effect.final_global_step,
                "f32": [values.astype("<f4").tobytes().hex() for values in effect.fragments],
            }
        case SendMessage():
            return sent_json(effect.message)
        case ShutdownReceived():
            return {"effect": "shutdown"}
        case AnchorRecorded():
            return None
    raise AssertionError(f"unexpected effect {effect!r}")


class LearnerDriver:
    """A LearnerSession with the context's identity, driven by script events; the learner's
    parameters are what the script says (this driver blends nothing itself)."""

    def __init__(self, context: Context, params: list[str]) -> None:
        assert context.session_hello is not None
        hello = decode_first_hello(context.session_hello, None)
        self.context = context
        self.session = LearnerSession(
            hello.layout,
            hello.dtype,
            hello.learner_id,
            layout_fingerprint=hello.layout_fingerprint,
            session_contract=hello.session_contract,
            profile_hash=hello.profile_hash,
            budget_steps=context.learner_budget_steps,
        )
        self.params = [f32_of(values).copy() for values in params]
        self.final: ApplyFinal | None = None

    def read(self, fragment: int) -> F32Values:
        return self.params[fragment]

    def run(self, event: Json) -> list[Json]:
        """Carry out one event; its effects in the vector form. A fatal error is raised."""
        session = self.session
        match event["event"]:
            case "connect":
                hello = session.hello(event["num_streams"], generation=event["generation"])
                sent: list[AnyMessage] = [hello, *session.data_hellos()]
                if session.learner_id == 0:
                    sent += session.init_messages(self.read)
                return [sent_json(message) for message in sent]
            case "receive":
                message = decode_one(self.context.decoder(), bytes.fromhex(event["hex"]))
                effects = session.receive(message)
                if session.error is not None:
                    raise session.error  # ERROR: yeto returns SyncerFailed and fails the session
                for effect in effects:
                    if isinstance(effect, ApplyFinal):
                        self.final = effect
                return [out for effect in effects if (out := effect_json(effect)) is not None]
            case "applied":
                self.params[event["fragment"]] = f32_of(event["params"]).copy()
                session.broadcast_applied(event["fragment"], event["version"])
                return []
            case "train":
                for tokens in event["tokens"]:
                    session.record_step(tokens)
                self.params = [f32_of(values).copy() for values in event["params"]]
                return []
            case "answer_pulls":
                return [sent_json(push) for push in session.answer_pulls(self.read)]
            case "final_applied":
                step = event["final_global_step"]
                assert self.final is not None and self.final.final_global_step == step
                self.params = [values.copy() for values in self.final.fragments]
                ack = session.final_applied(step)
                return [] if ack is None else [sent_json(ack)]
            case "connection_lost":
                session.connection_lost()
                return []
            case "heartbeat":
                return [sent_json(session.heartbeat())]
            case "budget_done":
                return [sent_json(session.budget_done())]
        raise AssertionError(f"unknown script event {event['event']}")


@params(cases("LearnerSessionTest"))
def test_learner_session(case: Case) -> None:
    """Run ``script`` through a LearnerSession, each event with exactly its ``effects``; a
    fatal test's ``event`` then stops the learner with ``code``."""
    assert case.context is not None
    driver = LearnerDriver(case.context, case.test["params"])
    for index, event in enumerate(case.test["script"]):
        got = driver.run(event)
        assert got == event.get("effects", []), f"script[{index}] ({event['event']}): {got}"
    if case.result == "completed":
        return
    with pytest.raises(ProtocolError) as caught:
        driver.run(case.test["event"])
    assert caught.value.code.value == case.code, caught.value
