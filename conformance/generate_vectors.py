#!/usr/bin/env python3
"""Write the golden YETO v4 conformance vectors: ``conformance/vectors/*.json``.

Run ``python conformance/generate_vectors.py [--out DIR]``. The output is deterministic (sorted
keys, fixed seeds, no clock); ``conformance/test_vectors.py`` regenerates into a temporary
directory and requires every committed byte to be reproduced. The committed files are the
golden truth: a change here that alters them is a protocol change (see spec/conformance.md).

This script deliberately imports nothing from ``yeto_proto``. Every frame is written byte by
byte with ``struct.pack`` from the pinned layout, every ``decoded`` field is the value that was
packed, and hashes, MACs and dtype codecs are computed by small reference implementations
below. The vectors therefore test the library against the text, not against itself.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import itertools
import json
import math
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Json = dict[str, Any]
F32Array = npt.NDArray[np.float32]

# -- protocol numbers, restated from spec/ ------------------------------------------------------
MAGIC = 0xD170C0DE
HEADER = struct.Struct("<IBQ")  # magic:u32 | type:u8 | len:u64
HEADER_SIZE = HEADER.size
HELLO, INIT_PARAMS, PULL_REQ, PUSH_FRAGMENT, BCAST_FRAGMENT, HEARTBEAT, SHUTDOWN = range(1, 8)
DATA_HELLO, CHUNK, ERROR, FINAL_MANIFEST, FINAL_ACK, FINAL_FRAGMENT, BUDGET_DONE = range(8, 15)
TYPE_NAMES = {
    HELLO: "HELLO",
    INIT_PARAMS: "INIT_PARAMS",
    PULL_REQ: "PULL_REQ",
    PUSH_FRAGMENT: "PUSH_FRAGMENT",
    BCAST_FRAGMENT: "BCAST_FRAGMENT",
    HEARTBEAT: "HEARTBEAT",
    SHUTDOWN: "SHUTDOWN",
    DATA_HELLO: "DATA_HELLO",
    CHUNK: "CHUNK",
    ERROR: "ERROR",
    FINAL_MANIFEST: "FINAL_MANIFEST",
    FINAL_ACK: "FINAL_ACK",
    FINAL_FRAGMENT: "FINAL_FRAGMENT",
    BUDGET_DONE: "BUDGET_DONE",
}
F32, BF16, Q4 = 1, 2, 3
DTYPE_NAMES = {F32: "f32", BF16: "bf16", Q4: "q4"}
AVG, RDA, ISO = 0, 1, 2
MODE_NAMES = {AVG: "avg", RDA: "rda", ISO: "iso"}
MIB = 1 << 20
FIRST_FRAME_LIMIT = 16 * MIB
SLICE_SIZE = 4 * MIB
CHUNK_ENVELOPE = 24
ERROR_LIMIT = 65536
MAX_PARTIALS = 64
MSG_ID_WINDOW = 1 << 16  # spec/striping.md § 4.2
Q4_BLOCK_VALUES, Q4_BLOCK_BYTES = 256, 132
U16_MAX, U32_MAX, U64_MAX = (1 << 16) - 1, (1 << 32) - 1, (1 << 64) - 1
#: The largest numel sum a HELLO fragment may declare: 4·sum plus the largest header still fits.
LARGEST_NUMEL_SUM = (U64_MAX - 77) // 4
LAYOUT_DOMAIN = b"yeto-layout-v1\0"
PROFILE_DOMAIN = b"yeto-syncer-semantic-profile-v1\0"
HELLO_MAC_DOMAIN = b"yeto-hello-mac-v1\0"
TESTS_PER_GROUP = 100  # group g numbers its tests from 100·g + 1, so appending never renumbers

FLAG_NOTES = {
    "Boundary": "A field at the edge of its range (0, the maximum, or a limit exactly).",
    "BeforeHello": "A DATA_HELLO arrives before its group's HELLO and waits for the group.",
    "Budget": "A BUDGET_DONE report was accepted before (spec/closure.md § 3).",
    "CheckOrder": "Several faults at once: the pinned order of checks decides the code.",
    "ClosedGroups": "Groups of earlier accepted HELLOs closed before this HELLO arrived; the "
    "session and the generations admitted outlive them.",
    "CountBeyondPayload": "A count promises more bytes than the payload holds; it must be "
    "rejected before anything is allocated for it.",
    "Deadline": "The clock passes a deadline of the connection table, or stops just before "
    "one (spec/wire.md § 5.4).",
    "DecoderMayDefer": "The frame is well formed; the named code is raised by the session, the "
    "reassembler or the dtype codec rather than necessarily by the frame decoder (for INIT and "
    "PUSH values never by the syncer's frame decoder: they are judged after the frame).",
    "Deferred": "A pending pull that is not answerable yet (spec/learner.md § 5 item 2).",
    "Direction": "A frame type the peer may not send in this direction.",
    "ExactSize": "A frame type whose payload size is exact.",
    "Final": "The final cut was taken (spec/syncer.md § 12).",
    "FirstFrame": "The first frame on a socket must be HELLO or DATA_HELLO within 16 MiB.",
    "Grace": "quorum < M: the K-th response opens a grace window (spec/syncer.md § 4, § 5).",
    "Frozen": "A learner that reported its budget (spec/learner.md § 10): frozen parameters, "
    "anchors that die with the group.",
    "HeaderOnly": "The error is decided by the 13-byte header; no payload byte may be read or "
    "allocated first.",
    "GroupCap": "A learner id keeps at most 4 groups open; a fifth closes its oldest other "
    "group without ERROR (spec/syncer.md § 9).",
    "HelloMac": "HELLO authentication: HMAC-SHA256 over the domain string and the body.",
    "HugeLength": "A declared length of 2^62 bytes or more.",
    "IntegerOverflow": "Arithmetic that wraps in 64-bit unsigned integers if done naively.",
    "Interleaved": "CHUNKs of several messages arrive interleaved.",
    "Iso": "An iso fragment: (rows, cols) per tensor follow its numels.",
    "Limit": "A size limit derived from the session (dtype and fragment numels).",
    "NaN": "A NaN value or NaN-carrying bit pattern.",
    "NeedData": "Only the start of a frame (its header, maybe a few payload bytes) at a size "
    "limit exactly: the decoder must accept it so far and ask for more data (result "
    "incomplete).",
    "NewGeneration": "Another connection_generation of a learner id that was admitted before.",
    "NonFinite": "A NaN or an infinity in a tensor the learner receives or would send.",
    "Normal": "An ordinary, typical case.",
    "OutOfOrder": "CHUNKs arrive in another order than they were sent.",
    "Pipeline": "A later round completed before a lower one and waits for its commit.",
    "Subnormal": "A value below 2^-126 (an f32 subnormal): kept and rounded to nearest even, "
    "never flushed to zero.",
    "Sends": "The test states the exact frames the syncer queues in response to an event "
    "(sends): to which groups, in which order per group, and nothing else.",
    "Padding": "The last q4 block is zero-padded to 256 values.",
    "ProfileHash": "HELLO carries the optional 32-byte syncer profile hash.",
    "Reconnect": "The connection group drops and the learner redials with a new generation "
    "(spec/learner.md § 8).",
    "RefusedHello": "The coordinator refuses a HELLO whose group data sockets are waiting for.",
    "RefusedBefore": "HELLOs refused before this one; a refused HELLO fixes and records nothing.",
    "Replay": "A version the learner holds again, or an older one: idempotent or dropped.",
    "Resume": "The syncer resumed from the context's checkpoint (spec/syncer.md § 1).",
    "Retry": "A quorum deadline discarded an attempt before the PUSH arrived.",
    "Rounding": "A value that is not exactly representable; pins the rounding rule.",
    "SameLimits": "The numeric layout differs from the session's, yet every frame limit derived "
    "from it (dtype and fragment numel sums) is the same: comparing limits is not enough.",
    "SessionSize": "A tensor byte count fixed by the fragment's numel and the dtype.",
    "Tie": "A value exactly halfway between two representable values (round half to even).",
    "Truncated": "The payload ends inside a field.",
    "Unicode": "Text or names outside ASCII.",
    "Version": "The protocol or finalization revision field.",
}


# -- reference arithmetic (own implementations of spec/) -----------------------------------------


def bf16_from_f32(values: F32Array) -> npt.NDArray[np.uint16]:
    """Round to nearest even; a NaN stays a NaN with its quiet bit set."""
    bits = values.astype("<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    quiet = (bits >> 16) | 0x0040
    return np.where(is_nan, quiet, rounded).astype("<u2")


def f32_from_bf16(halves: npt.NDArray[np.uint16]) -> F32Array:
    return (halves.astype(np.uint32) << 16).view("<f4")


def q4_encode(values: F32Array) -> bytes:
    """E3M0 blocks of 256: ``scale:f32`` = absmax, then 128 bytes, element 2i in the low nibble."""
    blocks = -(-len(values) // Q4_BLOCK_VALUES)
    padded = np.zeros(blocks * Q4_BLOCK_VALUES, dtype=np.float32)
    padded[: len(values)] = values
    grid = padded.reshape(blocks, Q4_BLOCK_VALUES)
    scale = np.abs(grid).max(axis=1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(scale[:, None] > 0, np.abs(grid) / scale[:, None], np.float32(0))
        # log2 in f32, correctly rounded: evaluate in f64, then round once to f32 (-inf for 0).
        exponent = np.log2(ratio.astype(np.float32).astype(np.float64)).astype(np.float32)
    level = np.clip(np.rint(exponent) + 7, 0, 7).astype(np.uint8)  # rint: half to even
    sign = ((grid < 0) & (level > 0)).astype(np.uint8) << 3
    nibbles = level | sign
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    out = np.empty((blocks, Q4_BLOCK_BYTES), dtype=np.uint8)
    out[:, :4] = scale.astype("<f4").view(np.uint8).reshape(blocks, 4)
    out[:, 4:] = packed
    return out.tobytes()


def q4_decode(data: bytes, numel: int) -> F32Array:
    grid = np.frombuffer(data, dtype=np.uint8).reshape(-1, Q4_BLOCK_BYTES)
    scale = grid[:, :4].copy().view("<f4")[:, 0]
    nibbles = np.empty((len(grid), Q4_BLOCK_VALUES), dtype=np.uint8)
    nibbles[:, 0::2] = grid[:, 4:] & 0x0F
    nibbles[:, 1::2] = grid[:, 4:] >> 4
    level = (nibbles & 7).astype(np.int32)
    magnitude = np.where(level > 0, np.ldexp(np.float32(1), level - 7), 0).astype(np.float32)
    signed = np.where(((nibbles & 8) != 0) & (level > 0), -magnitude, magnitude)
    values: F32Array = (signed.astype(np.float32) * scale[:, None]).astype(np.float32)
    return values.reshape(-1)[:numel]


def f32_bytes(values: Sequence[float] | F32Array) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def sample_values(seed: str, count: int) -> F32Array:
    """Reproducible, finite, human-sized values (``random.Random`` with a string seed is stable)."""
    rng = random.Random(seed)
    return np.array([round(rng.uniform(-2.0, 2.0), 4) for _ in range(count)], dtype=np.float32)


# -- layouts, sessions and their identities ------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class WireFragment:
    """A fragment as HELLO carries it (the numeric layout)."""

    mode: int
    numels: tuple[int, ...]
    shapes: tuple[tuple[int, int], ...] = ()

    def encode(self) -> bytes:
        out = struct.pack("<BI", self.mode, len(self.numels))
        out += struct.pack(f"<{len(self.numels)}Q", *self.numels)
        if self.mode == ISO:
            out += b"".join(struct.pack("<QQ", rows, cols) for rows, cols in self.shapes)
        return out

    def decoded(self) -> Json:
        out: Json = {"merge_mode": MODE_NAMES[self.mode], "numels": list(self.numels)}
        if self.mode == ISO:
            out["matrix_shapes"] = [{"rows": r, "cols": c} for r, c in self.shapes]
        return out


@dataclass(frozen=True)
class Fragment:
    mode: int
    tensors: tuple[Tensor, ...]

    def wire(self) -> WireFragment:
        numels = tuple(t.numel for t in self.tensors)
        if self.mode != ISO:
            return WireFragment(self.mode, numels)
        shapes = tuple((t.shape[0], t.numel // t.shape[0]) for t in self.tensors)
        return WireFragment(self.mode, numels, shapes)


@dataclass(frozen=True)
class NamedLayout:
    fragments: tuple[Fragment, ...]

    def wire(self) -> tuple[WireFragment, ...]:
        return tuple(f.wire() for f in self.fragments)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(sum(t.numel for t in f.tensors) for f in self.fragments)

    def canonical(self) -> bytes:
        """The fingerprint preimage of spec/identity.md § 1."""
        out = LAYOUT_DOMAIN + struct.pack("<I", len(self.fragments))
        for fragment in self.fragments:
            out += struct.pack("<BI", fragment.mode, len(fragment.tensors))
            for tensor in fragment.tensors:
                name = tensor.name.encode("utf-8")
                out += struct.pack("<I", len(name)) + name
                out += struct.pack("<QI", tensor.numel, len(tensor.shape))
                out += struct.pack(f"<{len(tensor.shape)}Q", *tensor.shape)
        return out

    def fingerprint(self) -> bytes:
        return hashlib.sha256(self.canonical()).digest()

    def file_json(self) -> Json:
        """The layout file form (``format`` plus fragments) that yeto's Layout reads."""
        return {
            "format": "yeto-layout-v1",
            "fragments": [
                {
                    "merge_mode": MODE_NAMES[f.mode],
                    "tensors": [{"name": t.name, "shape": list(t.shape)} for t in f.tensors],
                }
                for f in self.fragments
            ],
        }


def layout(*fragments: tuple[int, Sequence[tuple[str, tuple[int, ...]]]]) -> NamedLayout:
    return NamedLayout(
        tuple(
            Fragment(mode, tuple(Tensor(n, s) for n, s in tensors)) for mode, tensors in fragments
        )
    )


def digest_of(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


@dataclass(frozen=True)
class HelloFields:
    """Every HELLO field; ``payload()`` packs them in the pinned order."""

    learner_id: int
    generation: int
    dtype: int
    fragments: tuple[WireFragment, ...]
    fingerprint: bytes
    contract: bytes
    num_streams: int
    profile: bytes | None = None
    version: int = 4

    def payload(self) -> bytes:
        head = struct.pack(
            "<HIQBI",
            self.version,
            self.learner_id,
            self.generation,
            self.dtype,
            len(self.fragments),
        )
        body = b"".join(f.encode() for f in self.fragments) + self.fingerprint + self.contract
        return head + body + (self.profile or b"") + struct.pack("<H", self.num_streams)

    def decoded(self) -> Json:
        out: Json = {
            "type": "HELLO",
            "protocol_version": self.version,
            "learner_id": self.learner_id,
            "connection_generation": self.generation,
            "dtype": DTYPE_NAMES[self.dtype],
            "fragments": [f.decoded() for f in self.fragments],
            "layout_fingerprint": self.fingerprint.hex(),
            "session_contract_hash": self.contract.hex(),
            "num_streams": self.num_streams,
        }
        if self.profile is not None:
            out["syncer_profile_hash"] = self.profile.hex()
        return out

    def built(self) -> tuple[bytes, Json]:
        return frame(HELLO, self.payload()), self.decoded()


@dataclass(frozen=True)
class Session:
    """A negotiated session: dtype and named layout; its HELLO establishes it."""

    name: str
    dtype: int
    layout: NamedLayout

    @property
    def numels(self) -> tuple[int, ...]:
        return self.layout.numels

    @property
    def hello(self) -> HelloFields:
        return HelloFields(
            learner_id=0,
            generation=1,
            dtype=self.dtype,
            fragments=self.layout.wire(),
            fingerprint=self.layout.fingerprint(),
            contract=digest_of(f"conformance contract: {self.name}"),
            num_streams=2,
        )

    def hello_frame(self, learner_id: int, generation: int, num_streams: int) -> bytes:
        """The session's HELLO as learner ``learner_id`` sends it on a dial (no MAC)."""
        fields = replace(
            self.hello, learner_id=learner_id, generation=generation, num_streams=num_streams
        )
        return frame(HELLO, fields.payload())

    def context(
        self,
        receiver: str,
        *,
        num_learners: int | None = None,
        hello_key: bytes | None = None,
        learner_id: int = 0,
        learner_budget_steps: int | None = None,
    ) -> Json:
        hello = replace(self.hello, learner_id=learner_id).payload()
        if hello_key is not None:
            hello += hello_mac(hello_key, hello)
        ctx: Json = {
            "receiver": receiver,
            "first_frame": False,
            "session": {
                "dtype": DTYPE_NAMES[self.dtype],
                "numels": list(self.numels),
                "hello": frame(HELLO, hello).hex(),
            },
        }
        if num_learners is not None:
            ctx["num_learners"] = num_learners
        if hello_key is not None:
            ctx["hello_key"] = hello_key.hex()
        if learner_budget_steps is not None:
            ctx["learner_budget_steps"] = learner_budget_steps
        return ctx

    # Tensor byte counts, as the limits of spec/wire.md § 3 derive them.
    def bulk_itemsize(self) -> int:
        return 4 if self.dtype == F32 else 2

    def bulk(self, fragment: int, seed: str, count: int | None = None) -> bytes:
        """INIT/BCAST tensor bytes (bf16 in a q4 session)."""
        return self.bulk_of(sample_values(seed, self.numels[fragment] if count is None else count))

    def bulk_of(self, values: F32Array) -> bytes:
        """``values`` in the bulk dtype of INIT and BCAST (f32, else bf16)."""
        if self.dtype == F32:
            return f32_bytes(values)
        return bf16_from_f32(values).tobytes()

    def bulk_decoded(self, values: F32Array) -> F32Array:
        """What a receiver decodes from ``bulk_of(values)``: f32 (bf16 decodes as bits << 16)."""
        if self.dtype == F32:
            return values.astype(np.float32)
        return f32_from_bf16(bf16_from_f32(values))

    def push_delta(self, fragment: int, seed: str) -> bytes:
        return self.push_of(sample_values(seed, self.numels[fragment]))

    def push_of(self, delta: F32Array) -> bytes:
        """``delta`` in the PUSH dtype: f32, bf16, or q4 blocks."""
        if self.dtype == Q4:
            return q4_encode(delta)
        return self.bulk_of(delta)

    def final(self, fragment: int, seed: str, count: int | None = None) -> bytes:
        return f32_bytes(sample_values(seed, self.numels[fragment] if count is None else count))


S_F32 = Session(
    "f32-mlp",
    F32,
    layout(
        (AVG, [("fc.weight", (2, 2)), ("fc.bias", (1,))]),
        (RDA, [("head.weight", (3,))]),
    ),
)
S_BF16 = Session(
    "bf16-iso",
    BF16,
    layout(
        (AVG, [("embed.weight", (3, 2))]),
        (ISO, [("block.proj.weight", (2, 2))]),
    ),
)
S_Q4 = Session(
    "q4-wide",
    Q4,
    layout(
        (AVG, [("wide.weight", (257,))]),
        (RDA, [("norm.scale", (4,))]),
    ),
)
S_THREE = Session(
    "bf16-three",
    BF16,
    layout(
        (AVG, [("tok.weight", (4, 2))]),
        (RDA, [("ln.weight", (2,)), ("ln.bias", (2,))]),
        (ISO, [("attn.qkv.weight", (3, 2)), ("attn.out.weight", (2, 3))]),
    ),
)
SESSIONS = (S_F32, S_BF16, S_Q4, S_THREE)
#: Large enough for a PUSH split into more separate ranges than a receiver keeps (4,096);
#: used by the chunk_sequences file only.
S_WIDE = Session("f32-wide", F32, layout((AVG, [("wide.weight", (2048,))])))
#: spec/striping.md § 4 rule 9: separate ranges a partial may hold at least.
MAX_CHUNK_RANGES = 4096
HELLO_KEY = b"conformance hello key, 32 bytes!"
OTHER_KEY = b"another key"


@dataclass(frozen=True)
class Profile:
    """Every field of the syncer profile hash, in the pinned order (spec/identity.md)."""

    learners: int
    total_steps: int
    quorum: int = 1
    grace_ms: int = 1000
    grace_gamma: float = 0.8
    grace_tau: float = 2.0
    pipeline: int = 2
    min_round_interval_ms: int = 0
    sync_interval_steps: float = 24.0
    delta_correction: str = "heloco"
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
    learner_weight: str = "tokens2-over-steps"
    require_profile_binding: bool = False

    def canonical(self) -> bytes:
        def optional(value: int | None) -> bytes:
            return b"\x00" if value is None else b"\x01" + struct.pack("<Q", value)

        out = PROFILE_DOMAIN
        out += struct.pack("<II", self.learners, self.quorum)
        out += struct.pack("<Qdd", self.grace_ms, self.grace_gamma, self.grace_tau)
        out += struct.pack(
            "<IQd", self.pipeline, self.min_round_interval_ms, self.sync_interval_steps
        )
        out += struct.pack("<B", {"none": 0, "heloco": 1}[self.delta_correction])
        out += struct.pack(
            "<QQQ", self.quorum_timeout_s, self.final_ack_timeout_s, self.total_steps
        )
        out += b"\x00"  # policy_sweep_fragments: always absent
        out += struct.pack("<ff", self.outer_lr, self.outer_momentum)
        out += struct.pack("<BQ", self.checkpoint_enabled, self.checkpoint_every)
        out += struct.pack("<BB", self.resume, self.mark_final_checkpoint)
        out += optional(self.learner_budget_steps) + optional(self.max_base_lag)
        weight = {"tokens2-over-steps": 0, "equal": 1}[self.learner_weight]
        out += struct.pack("<BB", weight, self.require_profile_binding)
        return out

    def digest(self) -> bytes:
        return hashlib.sha256(self.canonical()).digest()

    def as_json(self) -> Json:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


PROFILES = (
    Profile(learners=2, total_steps=100),
    Profile(learners=4, total_steps=1000, quorum=3, require_profile_binding=True),
    Profile(
        learners=8,
        total_steps=4096,
        quorum=6,
        grace_ms=250,
        grace_gamma=0.5,
        grace_tau=1.5,
        pipeline=4,
        min_round_interval_ms=20,
        sync_interval_steps=12.5,
        delta_correction="none",
        quorum_timeout_s=60,
        final_ack_timeout_s=120,
        outer_lr=0.1,
        outer_momentum=0.95,
        checkpoint_enabled=True,
        checkpoint_every=1,
        resume=True,
        mark_final_checkpoint=True,
        learner_budget_steps=512,
        max_base_lag=3,
        learner_weight="equal",
        require_profile_binding=True,
    ),
    Profile(learners=1, total_steps=1, learner_budget_steps=0, max_base_lag=0),
    Profile(learners=U32_MAX, total_steps=U64_MAX, checkpoint_every=U64_MAX, grace_ms=U64_MAX),
)


def hello_mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, HELLO_MAC_DOMAIN + body, hashlib.sha256).digest()


# -- frames --------------------------------------------------------------------------------------

#: Payload offsets inside HELLO: num_fragments, and the first fragment's merge_mode.
HELLO_NUM_FRAGMENTS_AT = struct.calcsize("<HIQB")  # 15
HELLO_FIRST_FRAGMENT_AT = struct.calcsize("<HIQBI")  # 19


def patched(data: bytes, offset: int, new: bytes) -> bytes:
    """``data`` with the bytes at ``offset`` overwritten by ``new``."""
    return data[:offset] + new + data[offset + len(new) :]


def frame(
    frame_type: int, payload: bytes, *, length: int | None = None, magic: int = MAGIC
) -> bytes:
    """A frame; ``length`` overrides the declared payload length (to lie about it)."""
    return HEADER.pack(magic, frame_type, len(payload) if length is None else length) + payload


def init_params(fragment_id: int, data: bytes) -> tuple[bytes, Json]:
    payload = struct.pack("<I", fragment_id) + data
    return frame(INIT_PARAMS, payload), {
        "type": "INIT_PARAMS",
        "fragment_id": fragment_id,
        "data": data.hex(),
    }


def pull_req(fragment_id: int, global_step: int, round_attempt: int) -> tuple[bytes, Json]:
    payload = struct.pack("<IQI", fragment_id, global_step, round_attempt)
    return frame(PULL_REQ, payload), {
        "type": "PULL_REQ",
        "fragment_id": fragment_id,
        "global_step": global_step,
        "round_attempt": round_attempt,
    }


PUSH_FIELDS = (
    "learner_id",
    "fragment_id",
    "global_step",
    "round_attempt",
    "base_version",
    "local_step",
    "c_steps",
    "c_tokens",
)


def push_fragment(data: bytes, **fields: int) -> tuple[bytes, Json]:
    """PUSH_FRAGMENT; unspecified fields take ordinary values."""
    values = {
        "learner_id": 1,
        "fragment_id": 0,
        "global_step": 3,
        "round_attempt": 1,
        "base_version": 1,
        "local_step": 40,
        "c_steps": 24,
        "c_tokens": 24 * 2048,
    }
    values.update(fields)
    payload = struct.pack("<IIQIQQIQ", *(values[name] for name in PUSH_FIELDS)) + data
    return frame(PUSH_FRAGMENT, payload), {"type": "PUSH_FRAGMENT", **values, "data": data.hex()}


def versioned_fragment(
    frame_type: int, fragment_id: int, version: int, data: bytes
) -> tuple[bytes, Json]:
    payload = struct.pack("<IQ", fragment_id, version) + data
    return frame(frame_type, payload), {
        "type": TYPE_NAMES[frame_type],
        "fragment_id": fragment_id,
        "version": version,
        "data": data.hex(),
    }


def heartbeat(learner_id: int, local_step: int) -> tuple[bytes, Json]:
    return frame(HEARTBEAT, struct.pack("<IQ", learner_id, local_step)), {
        "type": "HEARTBEAT",
        "learner_id": learner_id,
        "local_step": local_step,
    }


def shutdown() -> tuple[bytes, Json]:
    return frame(SHUTDOWN, b""), {"type": "SHUTDOWN"}


def data_hello(
    learner_id: int, generation: int, stream_idx: int, version: int = 4
) -> tuple[bytes, Json]:
    payload = struct.pack("<HIQH", version, learner_id, generation, stream_idx)
    return frame(DATA_HELLO, payload), {
        "type": "DATA_HELLO",
        "protocol_version": version,
        "learner_id": learner_id,
        "connection_generation": generation,
        "stream_idx": stream_idx,
    }


def chunk(msg_id: int, total_len: int, offset: int, data: bytes) -> tuple[bytes, Json]:
    payload = struct.pack("<QQQ", msg_id, total_len, offset) + data
    return frame(CHUNK, payload), {
        "type": "CHUNK",
        "msg_id": msg_id,
        "total_len": total_len,
        "offset": offset,
        "data": data.hex(),
    }


def error_frame(text: str) -> tuple[bytes, Json]:
    return frame(ERROR, text.encode("utf-8")), {"type": "ERROR", "text": text}


def final_manifest(
    final_global_step: int, versions: Sequence[int], revision: int = 1
) -> tuple[bytes, Json]:
    payload = struct.pack("<HQI", revision, final_global_step, len(versions))
    payload += struct.pack(f"<{len(versions)}Q", *versions)
    return frame(FINAL_MANIFEST, payload), {
        "type": "FINAL_MANIFEST",
        "revision": revision,
        "final_global_step": final_global_step,
        "expected_versions": list(versions),
    }


def final_ack(final_global_step: int, revision: int = 1) -> tuple[bytes, Json]:
    return frame(FINAL_ACK, struct.pack("<HQ", revision, final_global_step)), {
        "type": "FINAL_ACK",
        "revision": revision,
        "final_global_step": final_global_step,
    }


def budget_done(steps: int) -> tuple[bytes, Json]:
    return frame(BUDGET_DONE, struct.pack("<Q", steps)), {
        "type": "BUDGET_DONE",
        "exact_local_steps": steps,
    }


# -- test records --------------------------------------------------------------------------------


def valid(comment: str, built: tuple[bytes, Json], *flags: str) -> Json:
    return {
        "comment": comment,
        "flags": list(flags),
        "hex": built[0].hex(),
        "result": "valid",
        "decoded": built[1],
    }


def invalid(
    comment: str, data: bytes, code: str, *flags: str, fail_after: int | None = None
) -> Json:
    """An invalid frame; ``fail_after=13`` marks a rejection the header alone decides."""
    if fail_after == HEADER_SIZE and "HeaderOnly" not in flags:
        flags = ("HeaderOnly", *flags)
    test: Json = {
        "comment": comment,
        "flags": list(flags),
        "hex": data.hex(),
        "result": "invalid",
        "code": code,
    }
    if fail_after is not None:
        test["fail_after"] = fail_after
    return test


def acceptable(comment: str, built: tuple[bytes, Json], code: str, *flags: str) -> Json:
    test = valid(comment, built, *flags, "DecoderMayDefer")
    test["result"] = "acceptable"
    test["code"] = code
    return test


def incomplete(comment: str, data: bytes, *flags: str) -> Json:
    """The start of a frame the decoder must accept as far as it goes (it then needs data)."""
    return {
        "comment": comment,
        "flags": ["NeedData", *flags],
        "hex": data.hex(),
        "result": "incomplete",
    }


def header_error(
    comment: str,
    frame_type: int,
    length: int,
    code: str,
    *flags: str,
    magic: int = MAGIC,
    body: bytes = b"",
) -> Json:
    """A frame rejected by its header alone (the decoder must fail after 13 bytes)."""
    data = HEADER.pack(magic, frame_type, length) + body
    return invalid(comment, data, code, *flags, fail_after=HEADER_SIZE)


def frame_group(context: Json, tests: list[Json]) -> Json:
    return {"type": "FrameTest", "context": context, "tests": tests}


def fresh_syncer(
    num_learners: int | None = 4, hello_key: bytes | None = None, session: Session | None = None
) -> Json:
    """A syncer's new socket: the vector is the first frame (first-frame rule applies)."""
    ctx: Json = {"receiver": "syncer", "first_frame": True}
    if num_learners is not None:
        ctx["num_learners"] = num_learners
    if hello_key is not None:
        ctx["hello_key"] = hello_key.hex()
    if session is not None:
        ctx["session"] = session.context("syncer")["session"]
    return ctx


def vector_file(subject: str, header: list[str], groups: list[Json]) -> Json:
    used: set[str] = set()
    count = 0
    for index, group in enumerate(groups):
        tests = group["tests"]
        assert len(tests) < TESTS_PER_GROUP, f"{subject}: group {index} is full"
        for position, test in enumerate(tests):
            test["tcId"] = TESTS_PER_GROUP * index + position + 1
            used.update(test["flags"])
        count += len(tests)
    return {
        "schema": "vectors.schema.json",
        "protocol": "yeto-v4",
        "subject": subject,
        "header": header,
        "notes": {flag: FLAG_NOTES[flag] for flag in sorted(used)},
        "numberOfTests": count,
        "testGroups": groups,
    }


# -- HELLO ---------------------------------------------------------------------------------------

BASE_HELLO = S_F32.hello


def hello_file() -> Json:
    h = BASE_HELLO
    good = [
        valid(
            "HELLO of the f32 session (learner 0, generation 1, two data streams)",
            h.built(),
            "Normal",
        ),
        valid(
            "HELLO of the bf16 session with an iso fragment", S_BF16.hello.built(), "Normal", "Iso"
        ),
        valid("HELLO of the q4 session", S_Q4.hello.built(), "Normal"),
        valid("HELLO of a three-fragment session", S_THREE.hello.built(), "Normal", "Iso"),
        valid(
            "learner_id M-1, generation 2^64-1, no data streams",
            replace(h, learner_id=3, generation=U64_MAX, num_streams=0).built(),
            "Boundary",
        ),
        valid("num_streams = 256, the maximum", replace(h, num_streams=256).built(), "Boundary"),
        valid(
            "with a syncer profile hash (34 bytes remain after the contract)",
            replace(h, profile=PROFILES[0].digest()).built(),
            "ProfileHash",
        ),
        valid(
            "a numel of 2^61: its f32 byte count 2^63 still fits a u64",
            replace(h, fragments=(WireFragment(AVG, (1 << 61,)),)).built(),
            "Boundary",
        ),
        valid(
            "numel sum exactly floor((2^64-1-77)/4): every frame size derived from it fits a u64",
            replace(
                h, fragments=(WireFragment(AVG, (1 << 61, LARGEST_NUMEL_SUM - (1 << 61))),)
            ).built(),
            "Boundary",
        ),
        valid(
            "one fragment with many tensors",
            replace(h, fragments=(WireFragment(RDA, tuple(range(1, 18))),)).built(),
            "Normal",
        ),
    ]
    bad_version = [
        invalid(
            "protocol_version 3",
            frame(HELLO, replace(h, version=3).payload()),
            "UNSUPPORTED_VERSION",
            "Version",
        ),
        invalid(
            "protocol_version 5",
            frame(HELLO, replace(h, version=5).payload()),
            "UNSUPPORTED_VERSION",
            "Version",
        ),
        invalid(
            "protocol_version written big-endian (00 04 = 1024)",
            frame(HELLO, b"\x00\x04" + h.payload()[2:]),
            "UNSUPPORTED_VERSION",
            "Version",
        ),
        invalid(
            "a bare older version field: never guessed, the version alone decides",
            frame(HELLO, struct.pack("<H", 3)),
            "UNSUPPORTED_VERSION",
            "Version",
        ),
        invalid("empty payload", frame(HELLO, b""), "TRUNCATED_PAYLOAD", "Truncated"),
        invalid("one payload byte", frame(HELLO, b"\x04"), "TRUNCATED_PAYLOAD", "Truncated"),
        invalid(
            "payload ends inside the learner_id",
            frame(HELLO, h.payload()[:4]),
            "TRUNCATED_PAYLOAD",
            "Truncated",
        ),
    ]
    bad_fields = [
        invalid(
            "learner_id = M (4)",
            frame(HELLO, replace(h, learner_id=4).payload()),
            "LEARNER_ID_OUT_OF_RANGE",
            "Boundary",
        ),
        invalid(
            "learner_id = 2^32-1",
            frame(HELLO, replace(h, learner_id=U32_MAX).payload()),
            "LEARNER_ID_OUT_OF_RANGE",
        ),
        invalid(
            "connection_generation 0",
            frame(HELLO, replace(h, generation=0).payload()),
            "ZERO_GENERATION",
        ),
        invalid("dtype 0", frame(HELLO, replace(h, dtype=0).payload()), "BAD_DTYPE"),
        invalid("dtype 4", frame(HELLO, replace(h, dtype=4).payload()), "BAD_DTYPE"),
        invalid("dtype 255", frame(HELLO, replace(h, dtype=255).payload()), "BAD_DTYPE"),
        invalid(
            "num_fragments 0", frame(HELLO, replace(h, fragments=()).payload()), "NO_FRAGMENTS"
        ),
        invalid(
            "merge_mode 3",
            frame(HELLO, replace(h, fragments=(WireFragment(3, (5,)),)).payload()),
            "BAD_MERGE_MODE",
        ),
        invalid(
            "num_tensors 0",
            frame(HELLO, replace(h, fragments=(WireFragment(AVG, ()),)).payload()),
            "EMPTY_FRAGMENT",
        ),
        invalid(
            "a tensor numel of 0",
            frame(HELLO, replace(h, fragments=(WireFragment(AVG, (4, 0)),)).payload()),
            "ZERO_NUMEL",
        ),
        invalid(
            "numels 2^63 + 2^63 overflow a u64 sum",
            frame(HELLO, replace(h, fragments=(WireFragment(AVG, (1 << 63, 1 << 63)),)).payload()),
            "SIZE_OVERFLOW",
            "IntegerOverflow",
        ),
        invalid(
            "numel sum one above floor((2^64-1-77)/4), though its own sum fits a u64",
            frame(
                HELLO,
                replace(
                    h, fragments=(WireFragment(AVG, (1 << 61, LARGEST_NUMEL_SUM + 1 - (1 << 61))),)
                ).payload(),
            ),
            "SIZE_OVERFLOW",
            "Boundary",
        ),
        invalid(
            "numels 2^63, 2^63, 0: every numel is checked for 0 before the sum",
            frame(
                HELLO, replace(h, fragments=(WireFragment(AVG, (1 << 63, 1 << 63, 0)),)).payload()
            ),
            "ZERO_NUMEL",
            "CheckOrder",
        ),
        invalid(
            "numel 2^64-1: its f32 byte size overflows a u64",
            frame(HELLO, replace(h, fragments=(WireFragment(AVG, (U64_MAX,)),)).payload()),
            "SIZE_OVERFLOW",
            "IntegerOverflow",
        ),
        invalid(
            "num_fragments 2^32-1 with one fragment's bytes present",
            frame(HELLO, patched(h.payload(), HELLO_NUM_FRAGMENTS_AT, struct.pack("<I", U32_MAX))),
            "TRUNCATED_PAYLOAD",
            "CountBeyondPayload",
        ),
        invalid(
            "num_tensors 2^32-1 with two numels present",
            frame(
                HELLO,
                patched(
                    replace(h, fragments=(WireFragment(AVG, (1, 2)),)).payload(),
                    HELLO_FIRST_FRAGMENT_AT + 1,  # num_tensors, after merge_mode
                    struct.pack("<I", U32_MAX),
                ),
            ),
            "TRUNCATED_PAYLOAD",
            "CountBeyondPayload",
        ),
        invalid(
            "num_streams 257",
            frame(HELLO, replace(h, num_streams=257).payload()),
            "TOO_MANY_STREAMS",
            "Boundary",
        ),
        invalid(
            "num_streams 65535",
            frame(HELLO, replace(h, num_streams=U16_MAX).payload()),
            "TOO_MANY_STREAMS",
        ),
    ]
    no_tail = h.payload()[:-2]
    bad_tail = [
        invalid(
            "nothing after the contract (num_streams missing)",
            frame(HELLO, no_tail),
            "BAD_HELLO_TAIL",
        ),
        invalid("1 byte after the contract", frame(HELLO, no_tail + b"\x02"), "BAD_HELLO_TAIL"),
        invalid(
            "3 bytes after the contract: a trailing byte",
            frame(HELLO, h.payload() + b"\x00"),
            "BAD_HELLO_TAIL",
        ),
        invalid(
            "33 bytes after the contract: a profile hash one byte short",
            frame(HELLO, no_tail + bytes(31) + b"\x02\x00"),
            "BAD_HELLO_TAIL",
            "ProfileHash",
        ),
        invalid(
            "36 bytes after the contract: profile hash, num_streams and two trailing bytes",
            frame(HELLO, replace(h, profile=PROFILES[0].digest()).payload() + b"\x00\x00"),
            "BAD_HELLO_TAIL",
            "ProfileHash",
        ),
        invalid(
            "the session contract cut short (payload ends 24 bytes into it)",
            frame(HELLO, no_tail[:-8]),
            "TRUNCATED_PAYLOAD",
            "Truncated",
        ),
    ]
    order = [
        invalid(
            "version 3 and generation 0: the version is checked first",
            frame(HELLO, replace(h, version=3, generation=0).payload()),
            "UNSUPPORTED_VERSION",
            "CheckOrder",
        ),
        invalid(
            "learner_id 9 and generation 0: learner_id is checked before the generation",
            frame(HELLO, replace(h, learner_id=9, generation=0).payload()),
            "LEARNER_ID_OUT_OF_RANGE",
            "CheckOrder",
        ),
        invalid(
            "generation 0 and dtype 9: generation first",
            frame(HELLO, replace(h, generation=0, dtype=9).payload()),
            "ZERO_GENERATION",
            "CheckOrder",
        ),
        invalid(
            "dtype 9 and num_fragments 0: dtype first",
            frame(HELLO, replace(h, dtype=9, fragments=()).payload()),
            "BAD_DTYPE",
            "CheckOrder",
        ),
        invalid(
            "merge_mode 7 and num_tensors 0: merge_mode first",
            frame(HELLO, replace(h, fragments=(WireFragment(7, ()),)).payload()),
            "BAD_MERGE_MODE",
            "CheckOrder",
        ),
        invalid(
            "numel 0 and a bad iso shape: numels before shapes",
            frame(HELLO, replace(h, fragments=(WireFragment(ISO, (0,), ((2, 2),)),)).payload()),
            "ZERO_NUMEL",
            "CheckOrder",
            "Iso",
        ),
        invalid(
            "bad iso shape and num_streams 300: shapes before num_streams",
            frame(
                HELLO,
                replace(
                    h, fragments=(WireFragment(ISO, (4,), ((3, 2),)),), num_streams=300
                ).payload(),
            ),
            "BAD_ISO_SHAPE",
            "CheckOrder",
            "Iso",
        ),
    ]
    # Added after the first release of this file: at the end, so no tcId moves.
    iso_cut = [
        invalid(
            "an iso record with numel 0 whose shapes are cut off: numels before the shapes' bound",
            frame(
                HELLO, replace(h, fragments=(WireFragment(ISO, (0,), ((2, 2),)),)).payload()[:32]
            ),
            "ZERO_NUMEL",
            "CheckOrder",
            "Iso",
        ),
        invalid(
            "an iso record whose shapes are cut off",
            frame(
                HELLO, replace(h, fragments=(WireFragment(ISO, (4,), ((2, 2),)),)).payload()[:32]
            ),
            "TRUNCATED_PAYLOAD",
            "Iso",
        ),
    ]
    first_frame_limit = [
        header_error(
            "HELLO declaring 16 MiB + 1 bytes",
            HELLO,
            FIRST_FRAME_LIMIT + 1,
            "FRAME_TOO_LARGE",
            "FirstFrame",
            "Boundary",
        ),
        header_error(
            "HELLO declaring 2^62 bytes",
            HELLO,
            1 << 62,
            "FRAME_TOO_LARGE",
            "FirstFrame",
            "HugeLength",
        ),
        header_error(
            "HELLO declaring 2^63 bytes",
            HELLO,
            1 << 63,
            "FRAME_TOO_LARGE",
            "FirstFrame",
            "HugeLength",
        ),
        header_error(
            "HELLO declaring 2^64-1 bytes, followed by the start of a real payload",
            HELLO,
            U64_MAX,
            "FRAME_TOO_LARGE",
            "FirstFrame",
            "HugeLength",
            body=h.payload()[:16],
        ),
    ]
    unchecked = [
        valid(
            "learner_id 2^32-1 is in range when the syncer was given no learner count",
            replace(h, learner_id=U32_MAX).built(),
            "Boundary",
        ),
        valid("learner_id 4", replace(h, learner_id=4).built(), "Normal"),
        valid("learner_id 1000", replace(h, learner_id=1000, generation=77).built(), "Normal"),
        invalid(
            "generation 0 is refused regardless",
            frame(HELLO, replace(h, generation=0).payload()),
            "ZERO_GENERATION",
        ),
    ]
    later = [
        header_error(
            "a second HELLO on a socket whose first frame was HELLO",
            HELLO,
            len(h.payload()),
            "UNEXPECTED_HELLO",
            body=h.payload(),
        ),
        header_error(
            "a second HELLO from another learner",
            HELLO,
            len(h.payload()),
            "UNEXPECTED_HELLO",
            body=replace(h, learner_id=2, generation=5).payload(),
        ),
        header_error(
            "a second HELLO declaring 2^63 bytes: still the same code",
            HELLO,
            1 << 63,
            "UNEXPECTED_HELLO",
            "HugeLength",
        ),
    ]
    return vector_file(
        "HELLO",
        [
            "HELLO (type 1, learner -> syncer): the first frame of a learner's control socket.",
            "Payload checks run in the pinned order; the numeric layout drives decoding.",
        ],
        [
            frame_group(
                fresh_syncer(),
                good
                + bad_version
                + bad_fields
                + bad_tail
                + order
                + first_frame_limit
                + iso_cut
                # Added after the first release of this group: at the end, so no tcId moves.
                + [
                    incomplete(
                        "HELLO declaring exactly 16 MiB, followed by the start of a real "
                        "payload: within the first-frame limit, so the decoder waits for the rest",
                        HEADER.pack(MAGIC, HELLO, FIRST_FRAME_LIMIT) + h.payload()[:16],
                        "FirstFrame",
                        "Boundary",
                        "Limit",
                    )
                ],
            ),
            frame_group(fresh_syncer(num_learners=None), unchecked),
            frame_group(S_F32.context("syncer", num_learners=4), later),
            frame_group(
                S_F32.context("learner"),
                [
                    header_error(
                        "HELLO sent to a learner",
                        HELLO,
                        len(h.payload()),
                        "WRONG_DIRECTION",
                        "Direction",
                        body=h.payload(),
                    )
                ],
            ),
        ],
    )


def hello_variants_file() -> Json:
    h = BASE_HELLO
    iso_pair = WireFragment(ISO, (6, 12), ((3, 2), (4, 3)))

    def iso(*fragments: WireFragment) -> HelloFields:
        return replace(h, fragments=fragments)

    iso_tests = [
        valid("one iso fragment with two matrices", iso(iso_pair).built(), "Iso"),
        valid(
            "avg, iso and rda fragments mixed",
            iso(WireFragment(AVG, (3,)), iso_pair, WireFragment(RDA, (2, 2))).built(),
            "Iso",
        ),
        valid(
            "a 1 x 1 iso matrix", iso(WireFragment(ISO, (1,), ((1, 1),))).built(), "Iso", "Boundary"
        ),
        valid("a 1 x 7 iso row", iso(WireFragment(ISO, (7,), ((1, 7),))).built(), "Iso"),
        valid(
            "iso with a profile hash and bf16",
            replace(S_BF16.hello, profile=PROFILES[1].digest()).built(),
            "Iso",
            "ProfileHash",
        ),
        invalid(
            "rows * cols != numel",
            frame(HELLO, iso(WireFragment(ISO, (6,), ((4, 2),))).payload()),
            "BAD_ISO_SHAPE",
            "Iso",
        ),
        invalid(
            "rows 0",
            frame(HELLO, iso(WireFragment(ISO, (6,), ((0, 6),))).payload()),
            "BAD_ISO_SHAPE",
            "Iso",
        ),
        invalid(
            "cols 0",
            frame(HELLO, iso(WireFragment(ISO, (6,), ((6, 0),))).payload()),
            "BAD_ISO_SHAPE",
            "Iso",
        ),
        invalid(
            "rows (2^32+1) * cols (2^32) wraps to 2^32 = numel in u64 arithmetic",
            frame(HELLO, iso(WireFragment(ISO, (1 << 32,), (((1 << 32) + 1, 1 << 32),))).payload()),
            "BAD_ISO_SHAPE",
            "Iso",
            "IntegerOverflow",
        ),
        invalid(
            "second matrix wrong, first right",
            frame(HELLO, iso(WireFragment(ISO, (6, 12), ((3, 2), (3, 3)))).payload()),
            "BAD_ISO_SHAPE",
            "Iso",
        ),
        invalid(
            "an iso fragment without its shapes: the fingerprint is misread as shapes",
            frame(
                HELLO,
                patched(iso(WireFragment(AVG, (6,))).payload(), HELLO_FIRST_FRAGMENT_AT, b"\x02"),
            ),
            "BAD_ISO_SHAPE",
            "Iso",
        ),
        invalid(
            "an avg fragment followed by shapes: 16 extra bytes before the tail",
            frame(
                HELLO,
                patched(
                    iso(WireFragment(ISO, (6,), ((3, 2),))).payload(),
                    HELLO_FIRST_FRAGMENT_AT,
                    b"\x00",
                ),
            ),
            "BAD_HELLO_TAIL",
            "Iso",
        ),
        invalid(
            "iso shapes cut off by the end of the payload",
            frame(
                HELLO,
                iso(WireFragment(ISO, (6,) * 8, ((3, 2),) * 8)).payload()[
                    : HELLO_FIRST_FRAGMENT_AT + 5 + 64 + 60
                ],
            ),
            "TRUNCATED_PAYLOAD",
            "Iso",
            "Truncated",
        ),
        # Added after the first release of this group: at the end, so no tcId moves.
        invalid(
            "an iso record of two tensors whose first shape has rows 0 and whose second shape is "
            "cut off: the 16 * n bound on the shapes comes before check 10",
            frame(
                HELLO,
                iso(WireFragment(ISO, (6, 6), ((0, 6), (3, 2)))).payload()[
                    : HELLO_FIRST_FRAGMENT_AT + 5 + 16 + 16
                ],
            ),
            "TRUNCATED_PAYLOAD",
            "CheckOrder",
            "Iso",
            "Truncated",
        ),
    ]
    profile_tests = [
        valid(
            f"profile hash of configuration #{i}",
            replace(h, profile=p.digest()).built(),
            "ProfileHash",
        )
        for i, p in enumerate(PROFILES[:3])
    ] + [
        valid(
            "profile hash with num_streams 0",
            replace(h, profile=PROFILES[3].digest(), num_streams=0).built(),
            "ProfileHash",
            "Boundary",
        ),
        invalid(
            "profile hash and num_streams 257",
            frame(HELLO, replace(h, profile=PROFILES[0].digest(), num_streams=257).payload()),
            "TOO_MANY_STREAMS",
            "ProfileHash",
        ),
    ]

    def signed(fields: HelloFields, key: bytes = HELLO_KEY) -> bytes:
        body = fields.payload()
        return body + hello_mac(key, body)

    def signed_valid(comment: str, fields: HelloFields, *flags: str) -> Json:
        return valid(comment, (frame(HELLO, signed(fields)), fields.decoded()), "HelloMac", *flags)

    good_mac = signed(h)
    mac_tests = [
        signed_valid("signed HELLO of the f32 session", h),
        signed_valid(
            "signed HELLO with a profile hash",
            replace(h, profile=PROFILES[1].digest()),
            "ProfileHash",
        ),
        signed_valid("signed HELLO of the bf16 session with an iso fragment", S_BF16.hello, "Iso"),
        signed_valid("signed HELLO of the q4 session", S_Q4.hello),
        invalid(
            "last MAC byte flipped",
            frame(HELLO, good_mac[:-1] + bytes([good_mac[-1] ^ 1])),
            "HELLO_AUTH_FAILED",
            "HelloMac",
        ),
        invalid(
            "unsigned HELLO to a syncer that has a key",
            frame(HELLO, h.payload()),
            "HELLO_AUTH_FAILED",
            "HelloMac",
        ),
        invalid(
            "signed with another key",
            frame(HELLO, signed(h, OTHER_KEY)),
            "HELLO_AUTH_FAILED",
            "HelloMac",
        ),
        invalid(
            "body changed after signing (learner_id 0 -> 1)",
            frame(HELLO, good_mac[:2] + b"\x01" + good_mac[3:]),
            "HELLO_AUTH_FAILED",
            "HelloMac",
        ),
        invalid(
            "MAC computed without the domain string",
            frame(HELLO, h.payload() + hmac.new(HELLO_KEY, h.payload(), hashlib.sha256).digest()),
            "HELLO_AUTH_FAILED",
            "HelloMac",
        ),
        invalid(
            "payload shorter than a MAC",
            frame(HELLO, bytes(31)),
            "HELLO_AUTH_FAILED",
            "HelloMac",
            "Truncated",
        ),
        invalid("empty payload", frame(HELLO, b""), "HELLO_AUTH_FAILED", "HelloMac", "Truncated"),
        invalid(
            "a correctly signed version-3 body: the MAC is checked, then the version",
            frame(HELLO, signed(replace(h, version=3))),
            "UNSUPPORTED_VERSION",
            "HelloMac",
            "CheckOrder",
        ),
        invalid(
            "a wrongly signed version-3 body: the MAC is checked before anything is parsed",
            frame(HELLO, signed(replace(h, version=3), OTHER_KEY)),
            "HELLO_AUTH_FAILED",
            "HelloMac",
            "CheckOrder",
        ),
        invalid(
            "a correctly signed body with a trailing byte",
            frame(HELLO, signed(h)[:-32] + b"\x00" + hello_mac(HELLO_KEY, h.payload() + b"\x00")),
            "BAD_HELLO_TAIL",
            "HelloMac",
        ),
    ]
    unkeyed = [
        invalid(
            "a signed HELLO with a profile hash to a syncer without a key: 66 bytes remain",
            frame(HELLO, signed(replace(h, profile=PROFILES[1].digest()))),
            "BAD_HELLO_TAIL",
            "HelloMac",
            "ProfileHash",
        ),
    ]
    return vector_file(
        "HELLO",
        [
            "HELLO variants: iso shapes, the optional syncer profile hash, and the optional MAC.",
            "With a key, payload = body | HMAC-SHA256(key, 'yeto-hello-mac-v1\\0' | body); the",
            "syncer strips and checks the last 32 bytes before parsing the body.",
        ],
        [
            frame_group(fresh_syncer(), iso_tests),
            frame_group(fresh_syncer(), profile_tests),
            frame_group(fresh_syncer(hello_key=HELLO_KEY), mac_tests),
            frame_group(fresh_syncer(), unkeyed),
        ],
    )


# -- DATA_HELLO ----------------------------------------------------------------------------------


def data_hello_file() -> Json:
    body = data_hello(1, 7, 1)[0][HEADER_SIZE:]
    first = [
        valid("stream 0 of learner 0, generation 1", data_hello(0, 1, 0), "Normal"),
        valid("stream 1 of learner 1, generation 7", data_hello(1, 7, 1), "Normal"),
        valid(
            "learner M-1, generation 2^64-1, stream 255", data_hello(3, U64_MAX, 255), "Boundary"
        ),
        acceptable(
            "stream_idx 256: no HELLO can declare that many streams",
            data_hello(0, 1, 256),
            "BAD_STREAM_INDEX",
            "Boundary",
        ),
        acceptable("stream_idx 65535", data_hello(2, 3, U16_MAX), "BAD_STREAM_INDEX", "Boundary"),
        invalid(
            "protocol_version 3",
            data_hello(0, 1, 0, version=3)[0],
            "UNSUPPORTED_VERSION",
            "Version",
        ),
        invalid(
            "protocol_version 0",
            data_hello(0, 1, 0, version=0)[0],
            "UNSUPPORTED_VERSION",
            "Version",
        ),
        invalid("learner_id = M", data_hello(4, 1, 0)[0], "LEARNER_ID_OUT_OF_RANGE", "Boundary"),
        invalid("learner_id 2^32-1", data_hello(U32_MAX, 1, 0)[0], "LEARNER_ID_OUT_OF_RANGE"),
        invalid("connection_generation 0", data_hello(0, 0, 0)[0], "ZERO_GENERATION"),
        invalid(
            "version 3 and generation 0: version first",
            data_hello(0, 0, 0, version=3)[0],
            "UNSUPPORTED_VERSION",
            "CheckOrder",
        ),
        header_error("len 15", DATA_HELLO, 15, "BAD_FRAME_LENGTH", "ExactSize", body=body[:15]),
        header_error(
            "len 17: a trailing byte",
            DATA_HELLO,
            17,
            "BAD_FRAME_LENGTH",
            "ExactSize",
            body=body + b"\x00",
        ),
        header_error("len 0", DATA_HELLO, 0, "BAD_FRAME_LENGTH", "ExactSize"),
        header_error(
            "len 2^63", DATA_HELLO, 1 << 63, "BAD_FRAME_LENGTH", "ExactSize", "HugeLength"
        ),
    ]
    unchecked = [
        valid(
            "learner_id 2^32-1 with no learner count configured",
            data_hello(U32_MAX, 9, 0),
            "Boundary",
        ),
        valid("learner_id 12", data_hello(12, 2, 3), "Normal"),
        valid("learner_id 0, stream 2", data_hello(0, 5, 2), "Normal"),
    ]
    later = [
        header_error(
            "DATA_HELLO after the socket's first frame",
            DATA_HELLO,
            16,
            "UNEXPECTED_HELLO",
            body=body,
        ),
        header_error(
            "DATA_HELLO after the first frame, len 2^63",
            DATA_HELLO,
            1 << 63,
            "UNEXPECTED_HELLO",
            "HugeLength",
        ),
    ]
    to_learner = [
        header_error(
            "DATA_HELLO sent to a learner",
            DATA_HELLO,
            16,
            "WRONG_DIRECTION",
            "Direction",
            body=body,
        ),
    ]
    return vector_file(
        "DATA_HELLO",
        [
            "DATA_HELLO (type 8, learner -> syncer): the first frame of a data socket,",
            "exactly 16 bytes.",
            "stream_idx is 0-based; that it is below the group's num_streams is a session check.",
        ],
        [
            frame_group(fresh_syncer(session=S_BF16), first),
            frame_group(fresh_syncer(num_learners=None, session=S_BF16), unchecked),
            frame_group(S_BF16.context("syncer", num_learners=4), later),
            frame_group(S_BF16.context("learner"), to_learner),
        ],
    )


# -- bulk frames ---------------------------------------------------------------------------------


def init_params_file() -> Json:
    def f32_groups() -> list[Json]:
        s = S_F32
        nan = f32_bytes([1.0, 2.0]) + bytes.fromhex("0000c07f") + f32_bytes([0.5, 0.25])
        inf = f32_bytes([1.0, 2.0, float("inf")])
        return [
            valid("fragment 0 (5 f32)", init_params(0, s.bulk(0, "init/f32/0")), "Normal"),
            valid("fragment 1 (3 f32)", init_params(1, s.bulk(1, "init/f32/1")), "Normal"),
            valid("all zeros", init_params(1, bytes(12)), "Normal"),
            acceptable(
                "a NaN value: the syncer rejects non-finite INIT values",
                init_params(0, nan),
                "NON_FINITE_VALUE",
                "NaN",
            ),
            acceptable("+inf", init_params(1, inf), "NON_FINITE_VALUE"),
            invalid(
                "fragment_id 2 = F",
                init_params(2, s.bulk(1, "x"))[0],
                "BAD_FRAGMENT_ID",
                "Boundary",
            ),
            invalid(
                "fragment_id 2^32-1", init_params(U32_MAX, s.bulk(1, "x"))[0], "BAD_FRAGMENT_ID"
            ),
            invalid(
                "fragment 0 one element short",
                init_params(0, s.bulk(0, "x")[:-4])[0],
                "BAD_TENSOR_LENGTH",
                "SessionSize",
            ),
            invalid(
                "fragment 1 one element long (still within the frame limit)",
                init_params(1, s.bulk(1, "x") + bytes(4))[0],
                "BAD_TENSOR_LENGTH",
                "SessionSize",
            ),
            invalid(
                "fragment 1 carrying fragment 0's byte count",
                init_params(1, s.bulk(0, "x"))[0],
                "BAD_TENSOR_LENGTH",
                "SessionSize",
            ),
            invalid(
                "fragment 0 with one stray byte",
                init_params(0, s.bulk(0, "x") + b"\x00")[0],
                "FRAME_TOO_LARGE",
                "Limit",
                fail_after=HEADER_SIZE,
            ),
            invalid(
                "fragment_id 5 and a wrong length: the id is checked first",
                init_params(5, bytes(8))[0],
                "BAD_FRAGMENT_ID",
                "CheckOrder",
            ),
            invalid(
                "payload ends inside fragment_id",
                frame(INIT_PARAMS, b"\x00\x00\x00"),
                "TRUNCATED_PAYLOAD",
                "Truncated",
            ),
            invalid("empty payload", frame(INIT_PARAMS, b""), "TRUNCATED_PAYLOAD", "Truncated"),
            header_error(
                "len = limit + 1 (4 + 5*4 + 1)",
                INIT_PARAMS,
                25,
                "FRAME_TOO_LARGE",
                "Limit",
                "Boundary",
            ),
            header_error("len 2^63", INIT_PARAMS, 1 << 63, "FRAME_TOO_LARGE", "HugeLength"),
            header_error("len 2^62", INIT_PARAMS, 1 << 62, "FRAME_TOO_LARGE", "HugeLength"),
        ]

    def bf16_groups() -> list[Json]:
        s = S_BF16
        return [
            valid("fragment 0 (6 bf16)", init_params(0, s.bulk(0, "init/bf16/0")), "Normal"),
            valid(
                "fragment 1, the iso fragment (4 bf16)",
                init_params(1, s.bulk(1, "init/bf16/1")),
                "Normal",
                "Iso",
            ),
            acceptable(
                "bf16 -inf (0xff80)",
                init_params(1, bytes.fromhex("803f000080ff0040")),
                "NON_FINITE_VALUE",
            ),
            invalid(
                "an odd byte count",
                init_params(1, s.bulk(1, "x")[:-1])[0],
                "BAD_TENSOR_LENGTH",
                "SessionSize",
            ),
            invalid(
                "f32 bytes for fragment 1 in a bf16 session: 4 + 16 > the limit 4 + 12",
                init_params(1, S_F32.bulk(0, "x", count=4))[0],
                "FRAME_TOO_LARGE",
                "Limit",
                fail_after=HEADER_SIZE,
            ),
        ]

    def q4_groups() -> list[Json]:
        s = S_Q4
        return [
            valid(
                "fragment 0: INIT stays bf16 in a q4 session (257 values)",
                init_params(0, s.bulk(0, "init/q4/0")),
                "Normal",
            ),
            valid("fragment 1 (4 bf16)", init_params(1, s.bulk(1, "init/q4/1")), "Normal"),
            invalid(
                "fragment 1 sent as one q4 block (132 bytes) instead of 4 bf16",
                init_params(1, q4_encode(sample_values("x", 4)))[0],
                "BAD_TENSOR_LENGTH",
                "SessionSize",
            ),
        ]

    # bf16 -inf written out: 1.0, 0.0... as explicit halves
    to_learner = [
        header_error(
            "INIT_PARAMS sent to a learner",
            INIT_PARAMS,
            24,
            "WRONG_DIRECTION",
            "Direction",
            body=init_params(0, S_F32.bulk(0, "x"))[0][13:],
        ),
    ]
    return vector_file(
        "INIT_PARAMS",
        [
            "INIT_PARAMS (type 2, learner -> syncer): fragment_id:u32 then the full tensor bytes",
            "in the bulk dtype (f32, or bf16 for bf16 and q4 sessions).",
        ],
        [
            frame_group(S_F32.context("syncer", num_learners=4), f32_groups()),
            frame_group(S_BF16.context("syncer", num_learners=4), bf16_groups()),
            frame_group(S_Q4.context("syncer", num_learners=4), q4_groups()),
            frame_group(S_F32.context("learner"), to_learner),
        ],
    )


def push_fragment_file() -> Json:
    f32, bf16, q4 = S_F32, S_BF16, S_Q4

    def scaled_block(scale_bits: str) -> bytes:
        """One q4 block for 4 values with its scale replaced by raw f32 bits."""
        block = q4_encode(np.array([1.0, -0.5, 0.25, 0.0], dtype=np.float32))
        return bytes.fromhex(scale_bits) + block[4:]

    f32_tests = [
        valid("f32 delta for fragment 0", push_fragment(f32.push_delta(0, "push/f32/0")), "Normal"),
        valid(
            "f32 delta for fragment 1, learner 3, attempt 2",
            push_fragment(
                f32.push_delta(1, "push/f32/1"), learner_id=3, fragment_id=1, round_attempt=2
            ),
            "Normal",
        ),
        valid(
            "every counter at its maximum",
            push_fragment(
                f32.push_delta(1, "push/f32/max"),
                learner_id=U32_MAX,
                fragment_id=1,
                global_step=U64_MAX,
                round_attempt=U32_MAX,
                base_version=U64_MAX,
                local_step=U64_MAX,
                c_steps=U32_MAX,
                c_tokens=U64_MAX,
            ),
            "Boundary",
        ),
        valid(
            "c_steps 1, c_tokens 0",
            push_fragment(f32.push_delta(0, "push/f32/c1"), c_steps=1, c_tokens=0),
            "Boundary",
        ),
        acceptable(
            "a NaN delta value",
            push_fragment(
                f32_bytes([0.5, 1.0, 2.0]) + bytes.fromhex("0000c0ff") + f32_bytes([1.0])
            ),
            "NON_FINITE_VALUE",
            "NaN",
        ),
        invalid(
            "c_steps 0",
            push_fragment(f32.push_delta(0, "x"), c_steps=0)[0],
            "ZERO_C_STEPS",
            "Boundary",
        ),
        invalid(
            "fragment_id 2 = F",
            push_fragment(f32.push_delta(1, "x"), fragment_id=2)[0],
            "BAD_FRAGMENT_ID",
        ),
        invalid(
            "fragment 0 one element short",
            push_fragment(f32.push_delta(0, "x")[:-4])[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
        invalid(
            "c_steps 0 and fragment_id 2 = F: c_steps, a fixed field, is checked first",
            push_fragment(f32.push_delta(1, "x"), fragment_id=2, c_steps=0)[0],
            "ZERO_C_STEPS",
            "CheckOrder",
        ),
        invalid(
            "c_steps 0 and one element short: c_steps is checked before the tensor length",
            push_fragment(f32.push_delta(0, "x")[:-4], c_steps=0)[0],
            "ZERO_C_STEPS",
            "CheckOrder",
        ),
        invalid(
            "fragment 1 with fragment 0's byte count",
            push_fragment(f32.push_delta(0, "x"), fragment_id=1)[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
        invalid(
            "payload of 47 bytes ends inside c_tokens",
            frame(PUSH_FRAGMENT, push_fragment(b"")[0][13:-1]),
            "TRUNCATED_PAYLOAD",
            "Truncated",
        ),
        header_error(
            "len = limit + 1 (48 + 20 + 1)",
            PUSH_FRAGMENT,
            69,
            "FRAME_TOO_LARGE",
            "Limit",
            "Boundary",
        ),
        header_error("len 2^63", PUSH_FRAGMENT, 1 << 63, "FRAME_TOO_LARGE", "HugeLength"),
        # Added after the first release of this group: at the end, so no tcId moves.
        invalid(
            "payload of 40 bytes with c_steps 0 and no c_tokens: the whole fixed prefix is read "
            "before c_steps is judged",
            frame(PUSH_FRAGMENT, push_fragment(b"", c_steps=0)[0][HEADER_SIZE:-8]),
            "TRUNCATED_PAYLOAD",
            "CheckOrder",
            "Truncated",
        ),
        invalid(
            "payload of 47 bytes with c_steps 0, ending inside c_tokens: TRUNCATED_PAYLOAD",
            frame(PUSH_FRAGMENT, push_fragment(b"", c_steps=0)[0][HEADER_SIZE:-1]),
            "TRUNCATED_PAYLOAD",
            "CheckOrder",
            "Truncated",
        ),
    ]
    bf16_tests = [
        valid(
            "bf16 delta for fragment 0", push_fragment(bf16.push_delta(0, "push/bf16/0")), "Normal"
        ),
        valid(
            "bf16 delta for the iso fragment",
            push_fragment(bf16.push_delta(1, "push/bf16/1"), fragment_id=1),
            "Normal",
            "Iso",
        ),
        acceptable(
            "bf16 +inf in a delta",
            push_fragment(bytes.fromhex("803f807f0000803f"), fragment_id=1),
            "NON_FINITE_VALUE",
        ),
        invalid(
            "f32 bytes for fragment 1 in a bf16 session: 48 + 16 > the limit 48 + 12",
            push_fragment(f32_bytes([1, 2, 3, 4]), fragment_id=1)[0],
            "FRAME_TOO_LARGE",
            "Limit",
            fail_after=HEADER_SIZE,
        ),
        invalid(
            "fragment 1 carrying fragment 0's bf16 byte count",
            push_fragment(bf16.push_delta(0, "x"), fragment_id=1)[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
    ]
    q4_tests = [
        valid(
            "q4 delta for fragment 0: two blocks (257 values)",
            push_fragment(q4.push_delta(0, "push/q4/0")),
            "Normal",
            "Padding",
        ),
        valid(
            "q4 delta for fragment 1: one block, 252 padding values",
            push_fragment(q4.push_delta(1, "push/q4/1"), fragment_id=1),
            "Normal",
            "Padding",
        ),
        valid(
            "the golden q4 block [1, -0.5, 0.25, 0] for fragment 1",
            push_fragment(scaled_block("0000803f"), fragment_id=1),
            "Normal",
            "Padding",
        ),
        acceptable(
            "q4 scale NaN",
            push_fragment(scaled_block("0000c07f"), fragment_id=1),
            "BAD_Q4_SCALE",
            "NaN",
        ),
        acceptable(
            "q4 scale +inf", push_fragment(scaled_block("0000807f"), fragment_id=1), "BAD_Q4_SCALE"
        ),
        acceptable(
            "q4 scale -1.0", push_fragment(scaled_block("000080bf"), fragment_id=1), "BAD_Q4_SCALE"
        ),
        invalid(
            "fragment 0 with one q4 block instead of two",
            push_fragment(q4.push_delta(1, "x"))[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
        invalid(
            "fragment 1 as raw bf16 (8 bytes) instead of a q4 block",
            push_fragment(q4.bulk(1, "x"), fragment_id=1)[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
        invalid(
            "fragment 1 with a q4 block and one stray byte",
            push_fragment(q4.push_delta(1, "x") + b"\x00", fragment_id=1)[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
        header_error(
            "len = limit + 1 (48 + 264 + 1)",
            PUSH_FRAGMENT,
            313,
            "FRAME_TOO_LARGE",
            "Limit",
            "Boundary",
        ),
    ]
    to_learner = [
        header_error(
            "PUSH_FRAGMENT sent to a learner", PUSH_FRAGMENT, 68, "WRONG_DIRECTION", "Direction"
        ),
    ]
    return vector_file(
        "PUSH_FRAGMENT",
        [
            "PUSH_FRAGMENT (type 4, learner -> syncer): 48 bytes of counters, then the learner",
            "delta (local - raw anchor) in the push dtype: f32, bf16, or q4 blocks of 132 bytes.",
        ],
        [
            frame_group(f32.context("syncer", num_learners=4), f32_tests),
            frame_group(bf16.context("syncer", num_learners=4), bf16_tests),
            frame_group(q4.context("syncer", num_learners=4), q4_tests),
            frame_group(f32.context("learner"), to_learner),
        ],
    )


def bcast_fragment_file() -> Json:
    def bcast(fragment_id: int, version: int, data: bytes) -> tuple[bytes, Json]:
        return versioned_fragment(BCAST_FRAGMENT, fragment_id, version, data)

    f32_tests = [
        valid(
            "fragment 0 at version 0 (right after INIT)",
            bcast(0, 0, S_F32.bulk(0, "bcast/f32/0")),
            "Normal",
        ),
        valid("fragment 1 at version 2", bcast(1, 2, S_F32.bulk(1, "bcast/f32/1")), "Normal"),
        valid("version 2^64-1", bcast(1, U64_MAX, S_F32.bulk(1, "bcast/f32/max")), "Boundary"),
        invalid(
            "fragment_id 2 = F", bcast(2, 1, S_F32.bulk(1, "x"))[0], "BAD_FRAGMENT_ID", "Boundary"
        ),
        invalid(
            "fragment 0 one element short",
            bcast(0, 1, S_F32.bulk(0, "x")[:-4])[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
        invalid(
            "payload of 11 bytes ends inside version",
            frame(BCAST_FRAGMENT, bytes(11)),
            "TRUNCATED_PAYLOAD",
            "Truncated",
        ),
        header_error(
            "len = limit + 1 (12 + 20 + 1)",
            BCAST_FRAGMENT,
            33,
            "FRAME_TOO_LARGE",
            "Limit",
            "Boundary",
        ),
        header_error("len 2^63", BCAST_FRAGMENT, 1 << 63, "FRAME_TOO_LARGE", "HugeLength"),
        # Added after the first release of this group: at the end, so no tcId moves.
        invalid(
            "payload of 4 bytes naming fragment 99 = F + 97: the whole fixed prefix (12 bytes) "
            "is read before the fragment id is judged",
            frame(BCAST_FRAGMENT, struct.pack("<I", 99)),
            "TRUNCATED_PAYLOAD",
            "CheckOrder",
            "Truncated",
        ),
        invalid(
            "payload of 11 bytes naming fragment 2 = F, ending inside version: TRUNCATED_PAYLOAD",
            frame(BCAST_FRAGMENT, struct.pack("<I", 2) + bytes(7)),
            "TRUNCATED_PAYLOAD",
            "CheckOrder",
            "Truncated",
        ),
    ]
    bf16_tests = [
        valid("fragment 0 (6 bf16)", bcast(0, 3, S_BF16.bulk(0, "bcast/bf16/0")), "Normal"),
        valid(
            "the iso fragment (4 bf16)",
            bcast(1, 4, S_BF16.bulk(1, "bcast/bf16/1")),
            "Normal",
            "Iso",
        ),
        invalid(
            "f32 bytes for fragment 0 in a bf16 session: 12 + 24 > the limit 12 + 12",
            bcast(0, 3, S_F32.bulk(0, "x", count=6))[0],
            "FRAME_TOO_LARGE",
            "Limit",
            fail_after=HEADER_SIZE,
        ),
        invalid(
            "fragment 1 with an odd byte count",
            bcast(1, 4, S_BF16.bulk(1, "x")[:-1])[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
    ]
    q4_tests = [
        valid(
            "BCAST stays bf16 in a q4 session (257 values)",
            bcast(0, 1, S_Q4.bulk(0, "bcast/q4/0")),
            "Normal",
        ),
        valid("fragment 1 (4 bf16)", bcast(1, 2, S_Q4.bulk(1, "bcast/q4/1")), "Normal"),
        invalid(
            "fragment 1 sent as a q4 block",
            bcast(1, 2, q4_encode(sample_values("x", 4)))[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
    ]
    to_syncer = [
        header_error(
            "BCAST_FRAGMENT sent to the syncer", BCAST_FRAGMENT, 32, "WRONG_DIRECTION", "Direction"
        ),
    ]
    return vector_file(
        "BCAST_FRAGMENT",
        [
            "BCAST_FRAGMENT (type 5, syncer -> learner): fragment_id:u32, version:u64, then the",
            "full global fragment in the bulk dtype (f32, or bf16 for bf16 and q4 sessions).",
        ],
        [
            frame_group(S_F32.context("learner"), f32_tests),
            frame_group(S_BF16.context("learner"), bf16_tests),
            frame_group(S_Q4.context("learner"), q4_tests),
            frame_group(S_F32.context("syncer", num_learners=4), to_syncer),
        ],
    )


def final_fragment_file() -> Json:
    def final(fragment_id: int, version: int, data: bytes) -> tuple[bytes, Json]:
        return versioned_fragment(FINAL_FRAGMENT, fragment_id, version, data)

    f32_tests = [
        valid("fragment 0 at version 7", final(0, 7, S_F32.final(0, "final/f32/0")), "Normal"),
        valid("fragment 1 at version 8", final(1, 8, S_F32.final(1, "final/f32/1")), "Normal"),
        valid(
            "version 0 (no round ever committed)",
            final(1, 0, S_F32.final(1, "final/f32/v0")),
            "Boundary",
        ),
        invalid(
            "fragment_id 2 = F", final(2, 8, S_F32.final(1, "x"))[0], "BAD_FRAGMENT_ID", "Boundary"
        ),
        invalid(
            "fragment 0 one element short",
            final(0, 7, S_F32.final(0, "x")[:-4])[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
        invalid(
            "not a whole number of f32 values (4*4 + 1 bytes)",
            final(0, 7, S_F32.final(0, "x", count=4) + b"\x00")[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
        invalid(
            "payload of 11 bytes",
            frame(FINAL_FRAGMENT, bytes(11)),
            "TRUNCATED_PAYLOAD",
            "Truncated",
        ),
        header_error(
            "len = limit + 1 (12 + 20 + 1)",
            FINAL_FRAGMENT,
            33,
            "FRAME_TOO_LARGE",
            "Limit",
            "Boundary",
        ),
        header_error("len 2^63", FINAL_FRAGMENT, 1 << 63, "FRAME_TOO_LARGE", "HugeLength"),
        invalid(
            "fragment_id 2 = F with 17 tensor bytes (not whole f32 values): the fragment id "
            "is checked before the tensor length",
            final(2, 7, S_F32.final(0, "x", count=4) + b"\x00")[0],
            "BAD_FRAGMENT_ID",
            "CheckOrder",
        ),
    ]
    bf16_tests = [
        valid(
            "always f32, even in a bf16 session (6 values)",
            final(0, 5, S_BF16.final(0, "final/bf16/0")),
            "Normal",
        ),
        valid(
            "the iso fragment in f32", final(1, 6, S_BF16.final(1, "final/bf16/1")), "Normal", "Iso"
        ),
        invalid(
            "bf16 bytes for fragment 0 in a bf16 session",
            final(0, 5, S_BF16.bulk(0, "x"))[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
    ]
    q4_tests = [
        valid(
            "always f32 in a q4 session (257 values)",
            final(0, 9, S_Q4.final(0, "final/q4/0")),
            "Normal",
        ),
        invalid(
            "a q4 block (132 bytes) instead of 4 f32 values",
            final(1, 9, S_Q4.push_delta(1, "x"))[0],
            "BAD_TENSOR_LENGTH",
            "SessionSize",
        ),
    ]
    to_syncer = [
        header_error(
            "FINAL_FRAGMENT sent to the syncer", FINAL_FRAGMENT, 32, "WRONG_DIRECTION", "Direction"
        ),
    ]
    return vector_file(
        "FINAL_FRAGMENT",
        [
            "FINAL_FRAGMENT (type 13, syncer -> learner): fragment_id:u32, version:u64, then the",
            "authoritative fragment, always little-endian f32 whatever the session dtype.",
        ],
        [
            frame_group(S_F32.context("learner"), f32_tests),
            frame_group(S_BF16.context("learner"), bf16_tests),
            frame_group(S_Q4.context("learner"), q4_tests),
            frame_group(S_F32.context("syncer", num_learners=4), to_syncer),
        ],
    )


# -- small control frames ------------------------------------------------------------------------


def pull_req_file() -> Json:
    body = pull_req(1, 2, 1)[0][HEADER_SIZE:]
    tests = [
        valid(
            "fragment 0, global step 1, attempt 1 (the first round)", pull_req(0, 1, 1), "Normal"
        ),
        valid("fragment 1, step 2, attempt 3", pull_req(1, 2, 3), "Normal"),
        valid("step 2^64-1, attempt 2^32-1", pull_req(1, U64_MAX, U32_MAX), "Boundary"),
        invalid("fragment_id 2 = F", pull_req(2, 3, 1)[0], "BAD_FRAGMENT_ID", "Boundary"),
        invalid("fragment_id 2^32-1", pull_req(U32_MAX, 3, 1)[0], "BAD_FRAGMENT_ID"),
        header_error("len 15", PULL_REQ, 15, "BAD_FRAME_LENGTH", "ExactSize", body=body[:15]),
        header_error(
            "len 17: a trailing byte",
            PULL_REQ,
            17,
            "BAD_FRAME_LENGTH",
            "ExactSize",
            body=body + b"\x00",
        ),
        header_error("len 0", PULL_REQ, 0, "BAD_FRAME_LENGTH", "ExactSize"),
        header_error("len 2^63", PULL_REQ, 1 << 63, "BAD_FRAME_LENGTH", "ExactSize", "HugeLength"),
    ]
    three = [
        valid("fragment 2 of three", pull_req(2, 3, 1), "Boundary"),
        invalid("fragment 3 of three", pull_req(3, 4, 1)[0], "BAD_FRAGMENT_ID", "Boundary"),
    ]
    to_syncer = [
        header_error(
            "PULL_REQ sent to the syncer", PULL_REQ, 16, "WRONG_DIRECTION", "Direction", body=body
        ),
    ]
    return vector_file(
        "PULL_REQ",
        [
            "PULL_REQ (type 3, syncer -> learner): fragment_id:u32, global_step:u64,",
            "round_attempt:u32; exactly 16 bytes.",
        ],
        [
            frame_group(S_F32.context("learner"), tests),
            frame_group(S_THREE.context("learner"), three),
            frame_group(S_F32.context("syncer", num_learners=4), to_syncer),
        ],
    )


def heartbeat_file() -> Json:
    body = heartbeat(1, 2)[0][HEADER_SIZE:]
    tests = [
        valid("learner 0 at local step 0", heartbeat(0, 0), "Normal"),
        valid("learner 3 at local step 12345", heartbeat(3, 12345), "Normal"),
        valid("learner_id 2^32-1, local step 2^64-1", heartbeat(U32_MAX, U64_MAX), "Boundary"),
        header_error("len 11", HEARTBEAT, 11, "BAD_FRAME_LENGTH", "ExactSize", body=body[:11]),
        header_error(
            "len 13: a trailing byte",
            HEARTBEAT,
            13,
            "BAD_FRAME_LENGTH",
            "ExactSize",
            body=body + b"\x00",
        ),
        header_error("len 0", HEARTBEAT, 0, "BAD_FRAME_LENGTH", "ExactSize"),
        header_error("len 2^63", HEARTBEAT, 1 << 63, "BAD_FRAME_LENGTH", "ExactSize", "HugeLength"),
        header_error("len 2^62", HEARTBEAT, 1 << 62, "BAD_FRAME_LENGTH", "ExactSize", "HugeLength"),
    ]
    first = [
        header_error(
            "HEARTBEAT as a socket's first frame",
            HEARTBEAT,
            12,
            "INVALID_FIRST_FRAME",
            "FirstFrame",
            body=body,
        ),
    ]
    to_learner = [
        header_error(
            "HEARTBEAT sent to a learner", HEARTBEAT, 12, "WRONG_DIRECTION", "Direction", body=body
        ),
    ]
    return vector_file(
        "HEARTBEAT",
        [
            "HEARTBEAT (type 6, learner -> syncer): learner_id:u32, local_step:u64;",
            "exactly 12 bytes.",
        ],
        [
            frame_group(S_F32.context("syncer", num_learners=4), tests),
            frame_group(fresh_syncer(), first),
            frame_group(S_F32.context("learner"), to_learner),
        ],
    )


def shutdown_file() -> Json:
    groups = [
        frame_group(
            S_F32.context("learner"), [valid("SHUTDOWN: an empty payload", shutdown(), "Normal")]
        ),
        frame_group(
            S_BF16.context("learner"), [valid("SHUTDOWN in a bf16 session", shutdown(), "Normal")]
        ),
        frame_group(
            S_Q4.context("learner"),
            [
                valid("SHUTDOWN in a q4 session", shutdown(), "Normal"),
                header_error("len 1", SHUTDOWN, 1, "BAD_FRAME_LENGTH", "ExactSize", body=b"\x00"),
                header_error("len 8", SHUTDOWN, 8, "BAD_FRAME_LENGTH", "ExactSize", body=bytes(8)),
                header_error(
                    "len 2^63", SHUTDOWN, 1 << 63, "BAD_FRAME_LENGTH", "ExactSize", "HugeLength"
                ),
                header_error(
                    "len 2^64-1", SHUTDOWN, U64_MAX, "BAD_FRAME_LENGTH", "ExactSize", "HugeLength"
                ),
                invalid(
                    "bad magic",
                    frame(SHUTDOWN, b"", magic=0xD170C0DF),
                    "BAD_MAGIC",
                    fail_after=HEADER_SIZE,
                ),
            ],
        ),
        frame_group(
            S_F32.context("syncer", num_learners=4),
            [
                header_error(
                    "SHUTDOWN sent to the syncer", SHUTDOWN, 0, "WRONG_DIRECTION", "Direction"
                )
            ],
        ),
        frame_group(
            fresh_syncer(),
            [
                header_error(
                    "SHUTDOWN as a socket's first frame",
                    SHUTDOWN,
                    0,
                    "INVALID_FIRST_FRAME",
                    "FirstFrame",
                )
            ],
        ),
    ]
    return vector_file(
        "SHUTDOWN",
        ["SHUTDOWN (type 7, syncer -> learner): an empty payload; exactly 0 bytes."],
        groups,
    )


def error_file() -> Json:
    tests = [
        # Any UTF-8 text is valid; the texts of spec/wire.md § 5.5 are appended below.
        valid(
            "the first-frame refusal",
            error_frame("invalid first frame: type 3 (expected HELLO or DATA_HELLO)"),
            "Normal",
        ),
        valid(
            "HELLO authentication failure",
            error_frame("HELLO authentication failed: MAC does not verify"),
            "Normal",
        ),
        valid("multi-byte UTF-8", error_frame("Größe ≠ 5 — fragment ✓ 🚀"), "Unicode"),
        valid("empty text", error_frame(""), "Boundary"),
        valid(
            "a NUL and a newline are valid UTF-8", error_frame("line one\nline\x00two"), "Unicode"
        ),
        invalid("0xff is never UTF-8", frame(ERROR, b"bad \xff byte"), "INVALID_UTF8", "Unicode"),
        invalid(
            "overlong encoding of '/' (c0 af)", frame(ERROR, b"\xc0\xaf"), "INVALID_UTF8", "Unicode"
        ),
        invalid(
            "encoded surrogate U+D800 (ed a0 80)",
            frame(ERROR, b"x\xed\xa0\x80"),
            "INVALID_UTF8",
            "Unicode",
        ),
        invalid(
            "a three-byte sequence cut short",
            frame(ERROR, b"price \xe2\x82"),
            "INVALID_UTF8",
            "Unicode",
            "Truncated",
        ),
        invalid(
            "above U+10FFFF (f4 90 80 80)",
            frame(ERROR, b"\xf4\x90\x80\x80"),
            "INVALID_UTF8",
            "Unicode",
        ),
        invalid("a lone continuation byte", frame(ERROR, b"a\x80b"), "INVALID_UTF8", "Unicode"),
        header_error(
            "len 65537, one over the limit",
            ERROR,
            ERROR_LIMIT + 1,
            "FRAME_TOO_LARGE",
            "Limit",
            "Boundary",
        ),
        header_error("len 2^63", ERROR, 1 << 63, "FRAME_TOO_LARGE", "HugeLength"),
        # Added after the first release of this group: at the end, so no tcId moves.
        valid(
            "exactly 65,536 bytes (the limit): 32,768 two-byte characters",
            error_frame("é" * (ERROR_LIMIT // 2)),
            "Limit",
            "Boundary",
            "Unicode",
        ),
        # The texts of spec/wire.md § 5.5, as yeto's syncer writes them.
        valid(
            "the first-frame refusal as spec/wire.md § 5.5 words it: "
            "invalid first frame: <CODE>: detail",
            error_frame(
                "invalid first frame: INVALID_FIRST_FRAME: type 3 (expected HELLO or DATA_HELLO)"
            ),
            "Normal",
        ),
        valid(
            "HELLO authentication failure as spec/wire.md § 5.5 words it: "
            "HELLO authentication failed: <CODE>: detail",
            error_frame(
                "HELLO authentication failed: HELLO_AUTH_FAILED: HELLO MAC does not verify"
            ),
            "Normal",
        ),
    ]
    to_syncer = [
        header_error(
            "ERROR sent to the syncer", ERROR, 5, "WRONG_DIRECTION", "Direction", body=b"oops!"
        ),
    ]
    return vector_file(
        "ERROR",
        [
            "ERROR (type 10, syncer -> learner): a UTF-8 reason of at most 65,536 bytes;",
            "the syncer then closes the connection.",
        ],
        [
            frame_group(S_BF16.context("learner"), tests),
            frame_group(S_BF16.context("syncer", num_learners=4), to_syncer),
        ],
    )


def final_manifest_file() -> Json:
    body = final_manifest(8, [7, 8])[0][HEADER_SIZE:]
    two = [
        valid("final step 8, versions [7, 8]", final_manifest(8, [7, 8]), "Normal"),
        valid("final step 0: nothing committed", final_manifest(0, [0, 0]), "Boundary"),
        valid("every value 2^64-1", final_manifest(U64_MAX, [U64_MAX, U64_MAX]), "Boundary"),
        invalid(
            "revision 0", final_manifest(8, [7, 8], revision=0)[0], "BAD_FINAL_REVISION", "Version"
        ),
        invalid(
            "revision 2", final_manifest(8, [7, 8], revision=2)[0], "BAD_FINAL_REVISION", "Version"
        ),
        invalid(
            "num_fragments 3 in a 30-byte payload",
            frame(FINAL_MANIFEST, body[:10] + struct.pack("<I", 3) + body[14:]),
            "BAD_MANIFEST",
        ),
        invalid(
            "num_fragments 1 in a 30-byte payload",
            frame(FINAL_MANIFEST, body[:10] + struct.pack("<I", 1) + body[14:]),
            "BAD_MANIFEST",
        ),
        invalid(
            "num_fragments 2^32-1",
            frame(FINAL_MANIFEST, body[:10] + struct.pack("<I", U32_MAX) + body[14:]),
            "BAD_MANIFEST",
            "CountBeyondPayload",
        ),
        invalid(
            "revision 2 and a wrong count: revision first",
            frame(
                FINAL_MANIFEST, struct.pack("<H", 2) + body[2:10] + struct.pack("<I", 5) + body[14:]
            ),
            "BAD_FINAL_REVISION",
            "CheckOrder",
        ),
        header_error(
            "len 22 (a one-fragment manifest) in a two-fragment session",
            FINAL_MANIFEST,
            22,
            "BAD_FRAME_LENGTH",
            "ExactSize",
            body=final_manifest(8, [8])[0][13:],
        ),
        header_error(
            "len 31: a trailing byte",
            FINAL_MANIFEST,
            31,
            "BAD_FRAME_LENGTH",
            "ExactSize",
            body=body + b"\x00",
        ),
        header_error(
            "len 2^63", FINAL_MANIFEST, 1 << 63, "BAD_FRAME_LENGTH", "ExactSize", "HugeLength"
        ),
        # Added after the first release of this group: at the end, so no tcId moves.
        valid(
            "a version (9) above final_global_step (8) decodes: the learner's session refuses "
            "it with BAD_MANIFEST (learner_session.json), the frame decoder does not judge it",
            final_manifest(8, [7, 9]),
            "Boundary",
        ),
    ]
    three = [
        valid("three fragments, final step 9", final_manifest(9, [7, 8, 9]), "Normal"),
        header_error(
            "a two-fragment manifest in a three-fragment session",
            FINAL_MANIFEST,
            30,
            "BAD_FRAME_LENGTH",
            "ExactSize",
            body=body,
        ),
    ]
    to_syncer = [
        header_error(
            "FINAL_MANIFEST sent to the syncer",
            FINAL_MANIFEST,
            30,
            "WRONG_DIRECTION",
            "Direction",
            body=body,
        ),
    ]
    return vector_file(
        "FINAL_MANIFEST",
        [
            "FINAL_MANIFEST (type 11, syncer -> learner): revision:u16 (=1),",
            "final_global_step:u64, num_fragments:u32, expected_version:u64 x F;",
            "exactly 14 + 8F bytes.",
        ],
        [
            frame_group(S_F32.context("learner"), two),
            frame_group(S_THREE.context("learner"), three),
            frame_group(S_F32.context("syncer", num_learners=4), to_syncer),
        ],
    )


def final_ack_file() -> Json:
    body = final_ack(8)[0][HEADER_SIZE:]
    tests = [
        valid("final step 8", final_ack(8), "Normal"),
        valid("final step 0", final_ack(0), "Boundary"),
        valid("final step 2^64-1", final_ack(U64_MAX), "Boundary"),
        invalid("revision 0", final_ack(8, revision=0)[0], "BAD_FINAL_REVISION", "Version"),
        invalid("revision 2", final_ack(8, revision=2)[0], "BAD_FINAL_REVISION", "Version"),
        invalid(
            "revision written big-endian (00 01 = 256)",
            frame(FINAL_ACK, b"\x00\x01" + body[2:]),
            "BAD_FINAL_REVISION",
            "Version",
        ),
        header_error("len 9", FINAL_ACK, 9, "BAD_FRAME_LENGTH", "ExactSize", body=body[:9]),
        header_error(
            "len 11: a trailing byte",
            FINAL_ACK,
            11,
            "BAD_FRAME_LENGTH",
            "ExactSize",
            body=body + b"\x00",
        ),
        header_error("len 2^63", FINAL_ACK, 1 << 63, "BAD_FRAME_LENGTH", "ExactSize", "HugeLength"),
    ]
    to_learner = [
        header_error(
            "FINAL_ACK sent to a learner", FINAL_ACK, 10, "WRONG_DIRECTION", "Direction", body=body
        ),
    ]
    return vector_file(
        "FINAL_ACK",
        [
            "FINAL_ACK (type 12, learner -> syncer): revision:u16 (=1),",
            "final_global_step:u64; exactly 10 bytes.",
        ],
        [
            frame_group(S_F32.context("syncer", num_learners=4), tests),
            frame_group(S_F32.context("learner"), to_learner),
        ],
    )


def budget_done_file() -> Json:
    body = budget_done(100)[0][HEADER_SIZE:]
    tests = [
        valid("100 local steps", budget_done(100), "Normal"),
        # tcIds 2 and 3 were valid in earlier releases; a syncer with the context's budget
        # refuses them, as it does tcId 4, so they are acceptable like it (same bytes).
        acceptable(
            "1 local step: the budget is 100", budget_done(1), "BUDGET_MISMATCH", "Boundary"
        ),
        acceptable(
            "2^64-1 local steps: the budget is 100 (a budget is at most 2^32-1, so this never "
            "matches one)",
            budget_done(U64_MAX),
            "BUDGET_MISMATCH",
            "Boundary",
        ),
        acceptable(
            "0 steps: the budget is 100 (a budget is positive, so 0 never matches one)",
            budget_done(0),
            "BUDGET_MISMATCH",
            "Boundary",
        ),
        header_error("len 7", BUDGET_DONE, 7, "BAD_FRAME_LENGTH", "ExactSize", body=body[:7]),
        header_error(
            "len 9: a trailing byte is fatal",
            BUDGET_DONE,
            9,
            "BAD_FRAME_LENGTH",
            "ExactSize",
            body=body + b"\x00",
        ),
        header_error("len 0", BUDGET_DONE, 0, "BAD_FRAME_LENGTH", "ExactSize"),
        header_error(
            "len 2^63", BUDGET_DONE, 1 << 63, "BAD_FRAME_LENGTH", "ExactSize", "HugeLength"
        ),
    ]
    to_learner = [
        header_error(
            "BUDGET_DONE sent to a learner",
            BUDGET_DONE,
            8,
            "WRONG_DIRECTION",
            "Direction",
            body=body,
        ),
    ]
    # The coordinator's verdict on a report depends on the syncer's budget: without one every
    # BUDGET_DONE is BUDGET_NOT_CONFIGURED, with one any other step count is BUDGET_MISMATCH.
    budgeted = S_F32.context("syncer", num_learners=4, learner_budget_steps=100)
    # Added later as groups of their own, so no tcId moves: the step counts at the ends of the
    # budget's range are valid under a budget they match.
    smallest = [valid("1 local step: the budget is 1", budget_done(1), "Boundary")]
    largest = [
        valid(
            "2^32-1 local steps: the budget is 2^32-1, the largest",
            budget_done(U32_MAX),
            "Boundary",
        ),
        acceptable(
            "2^32 local steps: one over the budget 2^32-1 (compared as u64, not cut to u32)",
            budget_done(U32_MAX + 1),
            "BUDGET_MISMATCH",
            "Boundary",
            "IntegerOverflow",
        ),
    ]
    return vector_file(
        "BUDGET_DONE",
        [
            "BUDGET_DONE (type 14, learner -> syncer): exact_local_steps:u64; exactly 8 bytes.",
            "Each syncer group's context gives the syncer's --learner-budget-steps",
            "(learner_budget_steps): a report of exactly that many steps is valid, any other",
            "count is acceptable with BUDGET_MISMATCH.",
        ],
        [
            frame_group(budgeted, tests),
            frame_group(S_F32.context("learner"), to_learner),
            frame_group(S_F32.context("syncer", num_learners=4, learner_budget_steps=1), smallest),
            frame_group(
                S_F32.context("syncer", num_learners=4, learner_budget_steps=U32_MAX), largest
            ),
        ],
    )


# -- CHUNK frames and reassembly -----------------------------------------------------------------


def chunk_file() -> Json:
    inner = push_fragment(S_BF16.push_delta(0, "chunk/inner"))[0]  # 73 bytes
    syncer_tests = [
        valid(
            "the first 16 bytes of a 73-byte inner frame",
            chunk(0, len(inner), 0, inner[:16]),
            "Normal",
        ),
        valid("a middle slice", chunk(0, len(inner), 16, inner[16:32]), "Normal"),
        valid("a whole inner frame in one CHUNK", chunk(1, len(inner), 0, inner), "Normal"),
        valid(
            "msg_id 2^64-1, a one-byte slice",
            chunk(U64_MAX, len(inner), 72, inner[72:]),
            "Boundary",
        ),
        acceptable(
            "offset + len > total_len",
            chunk(0, 20, 10, bytes(11)),
            "CHUNK_OUT_OF_BOUNDS",
        ),
        acceptable(
            "offset 2^64-1 plus one byte wraps to 0 in u64 arithmetic",
            chunk(0, 20, U64_MAX, b"\x01"),
            "CHUNK_OUT_OF_BOUNDS",
            "IntegerOverflow",
        ),
        acceptable(
            "total_len above the session's inner-frame limit (73)",
            chunk(0, 74, 0, bytes(16)),
            "CHUNK_TOTAL_TOO_LARGE",
            "Limit",
        ),
        header_error(
            "len 24: an empty chunk", CHUNK, 24, "CHUNK_EMPTY", body=struct.pack("<QQQ", 0, 73, 0)
        ),
        header_error(
            "len 23: ends inside the envelope",
            CHUNK,
            23,
            "TRUNCATED_PAYLOAD",
            "Truncated",
            body=bytes(23),
        ),
        header_error("len 0", CHUNK, 0, "TRUNCATED_PAYLOAD", "Truncated"),
        header_error(
            "len 24 + 4 MiB + 1",
            CHUNK,
            CHUNK_ENVELOPE + SLICE_SIZE + 1,
            "FRAME_TOO_LARGE",
            "Limit",
            "Boundary",
        ),
        header_error("len 2^63", CHUNK, 1 << 63, "FRAME_TOO_LARGE", "HugeLength"),
        # Added after the first release of this group: at the end, so no tcId moves.
        incomplete(
            "len 24 + 4 MiB exactly (the largest CHUNK), header only: the decoder waits for the "
            "payload",
            HEADER.pack(MAGIC, CHUNK, CHUNK_ENVELOPE + SLICE_SIZE),
            "Limit",
            "Boundary",
        ),
    ]
    bcast = versioned_fragment(BCAST_FRAGMENT, 0, 1, S_BF16.bulk(0, "chunk/bcast"))[0]  # 37 bytes
    learner_tests = [
        valid(
            "CHUNKs go both ways: the first slice of a BCAST",
            chunk(0, len(bcast), 0, bcast[:16]),
            "Normal",
        ),
        valid("the last slice of a BCAST", chunk(0, len(bcast), 32, bcast[32:]), "Normal"),
        valid("a whole BCAST in one CHUNK", chunk(4, len(bcast), 0, bcast), "Normal"),
        header_error(
            "len 24: an empty chunk", CHUNK, 24, "CHUNK_EMPTY", body=struct.pack("<QQQ", 0, 37, 0)
        ),
        header_error(
            "len 24 + 4 MiB + 1",
            CHUNK,
            CHUNK_ENVELOPE + SLICE_SIZE + 1,
            "FRAME_TOO_LARGE",
            "Limit",
            "Boundary",
        ),
        header_error("len 2^62", CHUNK, 1 << 62, "FRAME_TOO_LARGE", "HugeLength"),
        # Added after the first release of this group: at the end, so no tcId moves.
        # Header only: this session's inner limit is far below 4 MiB, so any envelope of a
        # full slice would be CHUNK_TOTAL_TOO_LARGE to a decoder that reassembles as it reads.
        incomplete(
            "len 24 + 4 MiB exactly: the decoder waits for the rest",
            HEADER.pack(MAGIC, CHUNK, CHUNK_ENVELOPE + SLICE_SIZE),
            "Limit",
            "Boundary",
        ),
    ]
    return vector_file(
        "CHUNK",
        [
            "CHUNK (type 9, either direction): msg_id:u64, total_len:u64, offset:u64, then",
            "1 byte to 4 MiB of an inner frame. Frame-level checks only; reassembly is in",
            "chunk_sequences.json.",
        ],
        [
            frame_group(S_BF16.context("syncer", num_learners=4), syncer_tests),
            frame_group(S_BF16.context("learner"), learner_tests),
        ],
    )


def slices(inner: bytes, size: int) -> list[tuple[int, bytes]]:
    return [(offset, inner[offset : offset + size]) for offset in range(0, len(inner), size)]


def chunks_of(msg_id: int, inner: bytes, parts: Sequence[tuple[int, bytes]]) -> list[str]:
    return [chunk(msg_id, len(inner), offset, data)[0].hex() for offset, data in parts]


def sequence(
    comment: str,
    chunks: list[str],
    *flags: str,
    decoded: list[Json] | None = None,
    code: str | None = None,
    slice_size: int | None = None,
    num_data_streams: int = 2,
    completed_before_error: list[Json] | None = None,
) -> Json:
    test: Json = {"comment": comment, "flags": list(flags), "chunks": chunks}
    if code is None:
        assert decoded is not None and completed_before_error is None
        test["result"] = "valid"
        test["decoded"] = decoded
    else:
        test["result"] = "invalid"
        test["code"] = code
        if completed_before_error is not None:
            test["completed_before_error"] = completed_before_error
    if slice_size is not None:
        # Round-robin over the data streams, continuing across messages (spec/striping.md § 3).
        test["slice_size"] = slice_size
        test["num_data_streams"] = num_data_streams
        test["streams"] = [i % num_data_streams for i in range(len(chunks))]
    return test


def chunk_sequences_file() -> Json:
    push_inner, push_json = push_fragment(S_BF16.push_delta(0, "seq/push"))  # 73 bytes: the limit
    init_inner, init_json = init_params(1, S_BF16.bulk(1, "seq/init"))  # 25 bytes
    parts = slices(push_inner, 16)
    order = [3, 0, 4, 2, 1]
    interleaved = [
        chunk(0, 73, 0, push_inner[:16])[0].hex(),
        chunk(1, 25, 16, init_inner[16:])[0].hex(),
        chunk(0, 73, 16, push_inner[16:40])[0].hex(),
        chunk(1, 25, 0, init_inner[:16])[0].hex(),
        chunk(0, 73, 40, push_inner[40:])[0].hex(),
    ]
    many_inits = [init_params(1, S_BF16.bulk(1, f"seq/many/{i}")) for i in range(MAX_PARTIALS)]
    sixty_four = [chunk(i, 25, 0, many_inits[i][0][:10])[0].hex() for i in range(MAX_PARTIALS)]
    sixty_four += [chunk(i, 25, 10, many_inits[i][0][10:])[0].hex() for i in range(MAX_PARTIALS)]
    syncer_valid = [
        sequence(
            "a PUSH in order, 16-byte slices",
            chunks_of(0, push_inner, parts),
            "Normal",
            decoded=[push_json],
            slice_size=16,
        ),
        sequence(
            "the same slices in reverse",
            chunks_of(0, push_inner, parts[::-1]),
            "OutOfOrder",
            decoded=[push_json],
        ),
        sequence(
            "the same slices shuffled",
            chunks_of(0, push_inner, [parts[i] for i in order]),
            "OutOfOrder",
            decoded=[push_json],
        ),
        sequence(
            "an INIT in a single CHUNK",
            chunks_of(0, init_inner, [(0, init_inner)]),
            "Normal",
            decoded=[init_json],
            slice_size=32,
        ),
        sequence(
            "uneven slices: 1, 40 and 32 bytes",
            chunks_of(
                5, push_inner, [(0, push_inner[:1]), (41, push_inner[41:]), (1, push_inner[1:41])]
            ),
            "OutOfOrder",
            decoded=[push_json],
        ),
        sequence(
            "two messages interleaved; the INIT completes first",
            interleaved,
            "Interleaved",
            "OutOfOrder",
            decoded=[init_json, push_json],
        ),
        sequence(
            "two messages from a fresh sender over 3 data streams: the PUSH's 5 CHUNKs on "
            "streams 0, 1, 2, 0, 1, the INIT's 2 go on from there, on 2 and 0",
            chunks_of(0, push_inner, parts) + chunks_of(1, init_inner, slices(init_inner, 16)),
            "Normal",
            decoded=[push_json, init_json],
            slice_size=16,
            num_data_streams=3,
        ),
        sequence(
            "msg_id 2^64-1",
            chunks_of(U64_MAX, init_inner, slices(init_inner, 16)),
            "Boundary",
            decoded=[init_json],
        ),
        sequence(
            "64 partial messages open at once (the maximum), then all completed",
            sixty_four,
            "Boundary",
            "Interleaved",
            decoded=[m[1] for m in many_inits],
        ),
        sequence(
            "msg_id 1 after msg_id 65536: 65,535 below the highest id, within the window: new",
            [
                chunk(MSG_ID_WINDOW, 25, 0, init_inner)[0].hex(),
                chunk(1, 25, 0, init_inner)[0].hex(),
            ],
            "Boundary",
            "OutOfOrder",
            decoded=[init_json, init_json],
        ),
    ]
    first_half = chunk(0, 73, 0, push_inner[:40])[0].hex()

    whole_init = chunk(0, 25, 0, init_inner)[0].hex()

    def bad_inner(mutated: bytes, total: int | None = None) -> list[str]:
        return [chunk(0, len(mutated) if total is None else total, 0, mutated)[0].hex()]

    c_steps_zero = push_fragment(S_BF16.push_delta(0, "seq/push"), c_steps=0)[0]
    heartbeat_inner = heartbeat(1, 2)[0]
    syncer_invalid = [
        sequence(
            "an empty CHUNK after a good one",
            [first_half, frame(CHUNK, struct.pack("<QQQ", 0, 73, 40)).hex()],
            code="CHUNK_EMPTY",
        ),
        sequence(
            "offset + len > total_len",
            [chunk(0, 73, 60, bytes(14))[0].hex()],
            code="CHUNK_OUT_OF_BOUNDS",
        ),
        sequence(
            "offset 2^64-8 plus 16 bytes wraps in u64 arithmetic",
            [chunk(0, 73, U64_MAX - 7, push_inner[:16])[0].hex()],
            "IntegerOverflow",
            code="CHUNK_OUT_OF_BOUNDS",
        ),
        sequence(
            "total_len changes within a message",
            [first_half, chunk(0, 72, 40, push_inner[40:72])[0].hex()],
            code="CHUNK_TOTAL_CHANGED",
        ),
        sequence(
            "total_len 74, one over the inner limit 13 + 60",
            [chunk(0, 74, 0, push_inner[:16])[0].hex()],
            "Limit",
            "Boundary",
            code="CHUNK_TOTAL_TOO_LARGE",
        ),
        sequence(
            "total_len 2^64-1",
            [chunk(0, U64_MAX, 0, push_inner[:16])[0].hex()],
            "Limit",
            "HugeLength",
            code="CHUNK_TOTAL_TOO_LARGE",
        ),
        sequence("a duplicate CHUNK", [first_half, first_half], code="CHUNK_OVERLAP"),
        sequence(
            "a CHUNK overlapping the end of an earlier one",
            [first_half, chunk(0, 73, 39, push_inner[39:])[0].hex()],
            code="CHUNK_OVERLAP",
        ),
        sequence(
            "a CHUNK overlapping the start of an earlier one",
            [
                chunk(0, 73, 40, push_inner[40:])[0].hex(),
                chunk(0, 73, 30, push_inner[30:41])[0].hex(),
            ],
            "OutOfOrder",
            code="CHUNK_OVERLAP",
        ),
        sequence(
            "a CHUNK inside an earlier one",
            [first_half, chunk(0, 73, 8, push_inner[8:9])[0].hex()],
            code="CHUNK_OVERLAP",
        ),
        sequence(
            "a 65th partial message",
            sixty_four[:MAX_PARTIALS] + [chunk(MAX_PARTIALS, 25, 0, init_inner[:10])[0].hex()],
            "Boundary",
            code="TOO_MANY_PARTIALS",
        ),
        sequence("bad inner magic", bad_inner(b"\x00" + push_inner[1:]), code="BAD_INNER_FRAME"),
        sequence(
            "inner len 59 != total_len - 13 (60)",
            bad_inner(push_inner[:5] + struct.pack("<Q", 59) + push_inner[13:]),
            code="BAD_INNER_FRAME",
        ),
        sequence(
            "total_len 12: shorter than a header",
            bad_inner(push_inner[:12]),
            code="BAD_INNER_FRAME",
        ),
        sequence(
            "a HEARTBEAT is never striped", bad_inner(heartbeat_inner), code="BAD_INNER_FRAME"
        ),
        sequence(
            "a CHUNK inside a CHUNK",
            bad_inner(chunk(9, 25, 0, init_inner)[0]),
            code="BAD_INNER_FRAME",
        ),
        sequence(
            "an inner BCAST (syncer -> learner) at the syncer",
            bad_inner(versioned_fragment(BCAST_FRAGMENT, 0, 1, S_BF16.bulk(0, "x"))[0]),
            "Direction",
            code="WRONG_DIRECTION",
        ),
        sequence(
            "an inner INIT over the INIT limit (4 + 12) but within the inner limit",
            bad_inner(init_params(0, bytes(14))[0]),
            "Limit",
            code="FRAME_TOO_LARGE",
        ),
        sequence(
            "an inner INIT with a wrong tensor length",
            bad_inner(init_params(1, bytes(6))[0]),
            "SessionSize",
            code="BAD_TENSOR_LENGTH",
        ),
        sequence(
            "an inner INIT for fragment 2 = F",
            bad_inner(init_params(2, bytes(8))[0]),
            code="BAD_FRAGMENT_ID",
        ),
        sequence(
            "an inner PUSH with c_steps 0",
            [chunk(0, 73, 0, c_steps_zero)[0].hex()],
            code="ZERO_C_STEPS",
        ),
        sequence(
            "a CHUNK of a message that already completed (msg_ids are never reused)",
            [whole_init, chunk(0, 25, 0, init_inner[:10])[0].hex()],
            code="CHUNK_OVERLAP",
            completed_before_error=[init_json],
        ),
        sequence(
            "msg_id 0 after msg_id 65536: 65,536 below the highest id counts as completed",
            [
                chunk(MSG_ID_WINDOW, 25, 0, init_inner)[0].hex(),
                chunk(0, 25, 0, init_inner[:10])[0].hex(),
            ],
            "Boundary",
            "OutOfOrder",
            code="CHUNK_OVERLAP",
            completed_before_error=[init_json],
        ),
    ]
    # Several rules broken at once: the order of spec/striping.md § 4 decides the code.
    check_order = [
        sequence(
            "an empty CHUNK at an offset past total_len: empty (rule 1) before out of bounds",
            [frame(CHUNK, struct.pack("<QQQ", 0, 73, 80)).hex()],
            "CheckOrder",
            code="CHUNK_EMPTY",
        ),
        sequence(
            "a first CHUNK past the end of a total_len over the inner limit: out of bounds "
            "(rule 2) before too large (rule 3)",
            [chunk(0, 74, 70, push_inner[:16])[0].hex()],
            "CheckOrder",
            code="CHUNK_OUT_OF_BOUNDS",
        ),
        sequence(
            "a completed msg_id again, past the end of its total_len: out of bounds (rule 2) "
            "before the completed id",
            [whole_init, chunk(0, 25, 20, init_inner[:10])[0].hex()],
            "CheckOrder",
            code="CHUNK_OUT_OF_BOUNDS",
            completed_before_error=[init_json],
        ),
        sequence(
            "a completed msg_id again, with a total_len over the inner limit: the completed id "
            "(an overlap) before too large (rule 3)",
            [whole_init, chunk(0, 74, 0, push_inner[:16])[0].hex()],
            "CheckOrder",
            code="CHUNK_OVERLAP",
            completed_before_error=[init_json],
        ),
        sequence(
            "a completed msg_id again, with another total_len: an overlap, not a changed total "
            "(nothing of the message is kept)",
            [whole_init, chunk(0, 30, 0, init_inner[:10])[0].hex()],
            "CheckOrder",
            code="CHUNK_OVERLAP",
            completed_before_error=[init_json],
        ),
        sequence(
            "64 partial messages open, then a first CHUNK over the inner limit: too large "
            "(rule 3) before too many partials (rule 5)",
            sixty_four[:MAX_PARTIALS] + [chunk(MAX_PARTIALS, 74, 0, push_inner[:16])[0].hex()],
            "CheckOrder",
            code="CHUNK_TOTAL_TOO_LARGE",
        ),
        sequence(
            "64 partial messages open, then a first CHUNK of total_len 12: shorter than a "
            "header (rule 4) before too many partials (rule 5)",
            sixty_four[:MAX_PARTIALS] + [chunk(MAX_PARTIALS, 12, 0, push_inner[:12])[0].hex()],
            "CheckOrder",
            code="BAD_INNER_FRAME",
        ),
        sequence(
            "a later CHUNK repeating received bytes under another total_len: changed total "
            "(rule 7) before overlap (rule 8)",
            [first_half, chunk(0, 72, 0, push_inner[:40])[0].hex()],
            "CheckOrder",
            code="CHUNK_TOTAL_CHANGED",
        ),
        sequence(
            "a later CHUNK ending at 78, within its own total_len 80 but past the message's "
            "73: rule 2 reads the CHUNK's total_len, rule 7 refuses it",
            [first_half, chunk(0, 80, 70, bytes(8))[0].hex()],
            "CheckOrder",
            code="CHUNK_TOTAL_CHANGED",
        ),
        sequence(
            "a later CHUNK with total_len 2^64-1: changed total (rule 7); the inner limit "
            "(rule 3) is checked on first CHUNKs only",
            [first_half, chunk(0, U64_MAX, 40, push_inner[40:])[0].hex()],
            "CheckOrder",
            "HugeLength",
            code="CHUNK_TOTAL_CHANGED",
        ),
        # Added after the first release of this group: at the end, so no tcId moves.
        sequence(
            "an inner PULL_REQ (syncer -> learner) at the syncer: never striped (rule 12) "
            "before its direction (rule 13)",
            bad_inner(pull_req(0, 1, 0)[0]),
            "CheckOrder",
            "Direction",
            code="BAD_INNER_FRAME",
        ),
        sequence(
            "partial msg 0, then a first CHUNK of msg 70000 (the highest id yet: a new partial), "
            "then the rest of msg 0: a message already partial completes whatever its id, though "
            "0 is now 70,000 below the highest",
            [
                chunk(0, 25, 0, init_inner[:10])[0].hex(),
                chunk(70000, 25, 0, init_inner[:10])[0].hex(),
                chunk(0, 25, 10, init_inner[10:])[0].hex(),
            ],
            "Boundary",
            "OutOfOrder",
            decoded=[init_json],
        ),
        sequence(
            "as before, then a first CHUNK of msg 1: 69,999 below the highest id, outside the "
            "window, so it names a completed message",
            [
                chunk(0, 25, 0, init_inner[:10])[0].hex(),
                chunk(70000, 25, 0, init_inner[:10])[0].hex(),
                chunk(0, 25, 10, init_inner[10:])[0].hex(),
                chunk(1, 25, 0, init_inner)[0].hex(),
            ],
            "OutOfOrder",
            code="CHUNK_OVERLAP",
            completed_before_error=[init_json],
        ),
        sequence(
            "an inner BCAST at the syncer, a 60-byte payload over the BCAST limit of 24 (12 + 12) "
            "but within the inner limit: its direction (rule 13) before its type's limit (rule 14)",
            bad_inner(versioned_fragment(BCAST_FRAGMENT, 0, 1, bytes(48))[0]),
            "CheckOrder",
            "Direction",
            "Limit",
            code="WRONG_DIRECTION",
        ),
        sequence(
            "64 partial messages open, then a single CHUNK carrying a whole message: it would "
            "complete at once, yet it is a 65th message's first CHUNK (rule 5 counts before it)",
            sixty_four[:MAX_PARTIALS] + [chunk(MAX_PARTIALS, 25, 0, init_inner)[0].hex()],
            "Boundary",
            code="TOO_MANY_PARTIALS",
        ),
    ]
    bcast_inner, bcast_json = versioned_fragment(
        BCAST_FRAGMENT, 1, 2, S_BF16.bulk(1, "seq/bcast")
    )  # 33
    final_inner, final_json = versioned_fragment(
        FINAL_FRAGMENT, 0, 2, S_BF16.final(0, "seq/final")
    )  # 49
    learner_tests = [
        sequence(
            "a BCAST in order",
            chunks_of(0, bcast_inner, slices(bcast_inner, 16)),
            "Normal",
            decoded=[bcast_json],
            slice_size=16,
        ),
        sequence(
            "a FINAL_FRAGMENT (at the inner limit 13 + 36) in reverse",
            chunks_of(3, final_inner, slices(final_inner, 16)[::-1]),
            "OutOfOrder",
            "Boundary",
            decoded=[final_json],
        ),
        sequence(
            "total_len 50, one over the learner's inner limit",
            [chunk(0, 50, 0, final_inner[:16])[0].hex()],
            "Limit",
            "Boundary",
            code="CHUNK_TOTAL_TOO_LARGE",
        ),
        sequence(
            "an inner INIT (learner -> syncer) at a learner",
            bad_inner(init_params(1, S_BF16.bulk(1, "x"))[0]),
            "Direction",
            code="WRONG_DIRECTION",
        ),
        sequence(
            "an inner FINAL_FRAGMENT with bf16 bytes",
            bad_inner(versioned_fragment(FINAL_FRAGMENT, 1, 2, S_BF16.bulk(1, "x"))[0]),
            "SessionSize",
            code="BAD_TENSOR_LENGTH",
        ),
        # Added after the first release of this group: at the end, so no tcId moves.
        sequence(
            "an inner HEARTBEAT (learner -> syncer) at a learner: never striped (rule 12) "
            "before its direction (rule 13)",
            bad_inner(heartbeat_inner),
            "CheckOrder",
            "Direction",
            code="BAD_INNER_FRAME",
        ),
    ]
    wide_inner, _ = push_fragment(S_WIDE.push_delta(0, "seq/wide"))
    one_byte_ranges = [  # every other byte: each CHUNK opens a new separate range
        chunk(0, len(wide_inner), offset, wide_inner[offset : offset + 1])[0].hex()
        for offset in range(0, 2 * MAX_CHUNK_RANGES + 1, 2)
    ]
    fragmented = [
        sequence(
            "4,097 one-byte CHUNKs with a gap after each: one separate range too many",
            one_byte_ranges,
            "Limit",
            code="CHUNK_TOO_FRAGMENTED",
        ),
        sequence(
            "4,096 separate one-byte ranges (the most), a CHUNK extending the last of them "
            "(no new range: accepted), then a duplicate: overlap (rule 8) before the range "
            "count (rule 9)",
            one_byte_ranges[:-1]
            + [
                chunk(0, len(wide_inner), 8191, wide_inner[8191:8192])[0].hex(),
                one_byte_ranges[0],
            ],
            "CheckOrder",
            "Limit",
            code="CHUNK_OVERLAP",
        ),
    ]
    # A q4 session: the syncer's inner limit follows the bf16 INIT (13 + 4 + 2N = 531), not the
    # q4 PUSH (13 + 48 + 264 = 325) (spec/striping.md § 4.1).
    q4_init, q4_init_json = init_params(0, S_Q4.bulk(0, "seq/q4/init"))
    q4_push, q4_push_json = push_fragment(S_Q4.push_delta(0, "seq/q4/push"))
    assert len(q4_init) == 531 and len(q4_push) == 325
    q4_tests = [
        sequence(
            "a q4 session's INIT of fragment 0: 531 bytes, exactly the inner limit "
            "13 + 4 + 2 * 257, in 256-byte slices",
            chunks_of(0, q4_init, slices(q4_init, 256)),
            "Boundary",
            "Limit",
            decoded=[q4_init_json],
            slice_size=256,
        ),
        sequence(
            "a q4 PUSH of fragment 0 (325 bytes), then the INIT (531): both within the limit",
            chunks_of(0, q4_push, slices(q4_push, 256))
            + chunks_of(1, q4_init, slices(q4_init, 256)),
            "Normal",
            decoded=[q4_push_json, q4_init_json],
            slice_size=256,
        ),
        sequence(
            "total_len 532, one over the inner limit 13 + 4 + 2 * 257 of a q4 session",
            [chunk(0, 532, 0, q4_init[:256])[0].hex()],
            "Limit",
            "Boundary",
            code="CHUNK_TOTAL_TOO_LARGE",
        ),
    ]
    return vector_file(
        "chunk_sequences",
        [
            "CHUNK reassembly: each test is a list of CHUNK frames received by one connection",
            "group, and either the inner messages they complete (in completion order) or the",
            "error that the last CHUNK of the list must raise (every earlier CHUNK is accepted).",
        ],
        [
            {
                "type": "ChunkSequenceTest",
                "context": S_BF16.context("syncer", num_learners=4),
                "tests": syncer_valid + syncer_invalid + check_order,
            },
            {
                "type": "ChunkSequenceTest",
                "context": S_BF16.context("learner"),
                "tests": learner_tests,
            },
            {
                "type": "ChunkSequenceTest",
                "context": S_WIDE.context("syncer", num_learners=4),
                "tests": fragmented,
            },
            {
                "type": "ChunkSequenceTest",
                "context": S_Q4.context("syncer", num_learners=4),
                "tests": q4_tests,
            },
        ],
    )


# -- header-level rules across all types ---------------------------------------------------------


def header_file() -> Json:
    push_body = push_fragment(S_BF16.push_delta(0, "hdr"))[0][HEADER_SIZE:]
    fresh = (
        [
            invalid(
                "magic 0",
                frame(HELLO, BASE_HELLO.payload(), magic=0),
                "BAD_MAGIC",
                fail_after=HEADER_SIZE,
            ),
            invalid(
                "magic byte-swapped (big-endian on the wire)",
                frame(HELLO, BASE_HELLO.payload(), magic=0xDEC070D1),
                "BAD_MAGIC",
                fail_after=HEADER_SIZE,
            ),
            invalid(
                "magic 0xD170C0DF",
                frame(HELLO, BASE_HELLO.payload(), magic=0xD170C0DF),
                "BAD_MAGIC",
                fail_after=HEADER_SIZE,
            ),
            invalid(
                "an HTTP request",
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                "BAD_MAGIC",
                fail_after=HEADER_SIZE,
            ),
            invalid(
                "bad magic and an unknown type: magic first",
                HEADER.pack(0x12345678, 99, 1 << 63),
                "BAD_MAGIC",
                "CheckOrder",
                fail_after=HEADER_SIZE,
            ),
        ]
        + [
            header_error(
                f"{TYPE_NAMES[t]} as the first frame",
                t,
                length,
                "INVALID_FIRST_FRAME",
                "FirstFrame",
            )
            for t, length in (
                (INIT_PARAMS, 16),
                (PUSH_FRAGMENT, 60),
                (HEARTBEAT, 12),
                (CHUNK, 40),
                (FINAL_ACK, 10),
                (BUDGET_DONE, 8),
                (PULL_REQ, 16),
                (ERROR, 4),
            )
        ]
        + [
            header_error(
                f"unknown type {t} as the first frame", t, 16, "INVALID_FIRST_FRAME", "FirstFrame"
            )
            for t in (0, 15, 255)
        ]
        + [
            header_error(
                "HELLO of 16 MiB + 1",
                HELLO,
                FIRST_FRAME_LIMIT + 1,
                "FRAME_TOO_LARGE",
                "FirstFrame",
                "Boundary",
            ),
            header_error(
                "HELLO of 2^62 bytes", HELLO, 1 << 62, "FRAME_TOO_LARGE", "FirstFrame", "HugeLength"
            ),
            header_error(
                "HELLO of 2^63 bytes", HELLO, 1 << 63, "FRAME_TOO_LARGE", "FirstFrame", "HugeLength"
            ),
            header_error(
                "DATA_HELLO of 2^63 bytes",
                DATA_HELLO,
                1 << 63,
                "BAD_FRAME_LENGTH",
                "FirstFrame",
                "HugeLength",
            ),
            header_error(
                "first frame INIT declaring 2^63 bytes: the first-frame rule decides",
                INIT_PARAMS,
                1 << 63,
                "INVALID_FIRST_FRAME",
                "FirstFrame",
                "CheckOrder",
            ),
            valid("a proper first frame", BASE_HELLO.built(), "Normal"),
        ]
    )
    at_syncer = (
        [
            valid("HEARTBEAT", heartbeat(1, 9), "Normal"),
            valid("a CHUNK", chunk(0, 73, 0, push_body[:8]), "Normal"),
            valid("BUDGET_DONE", budget_done(64), "Normal"),
            invalid(
                "bad magic",
                frame(HEARTBEAT, heartbeat(1, 9)[0][13:], magic=0),
                "BAD_MAGIC",
                fail_after=HEADER_SIZE,
            ),
        ]
        + [
            header_error(f"unknown type {t}", t, 12, "UNKNOWN_FRAME_TYPE")
            for t in (0, 15, 128, 255)
        ]
        + [
            header_error(
                f"{TYPE_NAMES[t]} comes from the syncer", t, length, "WRONG_DIRECTION", "Direction"
            )
            for t, length in (
                (PULL_REQ, 16),
                (BCAST_FRAGMENT, 24),
                (SHUTDOWN, 0),
                (ERROR, 4),
                (FINAL_MANIFEST, 30),
                (FINAL_FRAGMENT, 36),
            )
        ]
        + [
            header_error("HELLO after the first frame", HELLO, 100, "UNEXPECTED_HELLO"),
            header_error("DATA_HELLO after the first frame", DATA_HELLO, 16, "UNEXPECTED_HELLO"),
            header_error("HEARTBEAT of 11 bytes", HEARTBEAT, 11, "BAD_FRAME_LENGTH", "ExactSize"),
            header_error("FINAL_ACK of 9 bytes", FINAL_ACK, 9, "BAD_FRAME_LENGTH", "ExactSize"),
            header_error("BUDGET_DONE of 9 bytes", BUDGET_DONE, 9, "BAD_FRAME_LENGTH", "ExactSize"),
            header_error(
                "INIT_PARAMS of 2^63 bytes", INIT_PARAMS, 1 << 63, "FRAME_TOO_LARGE", "HugeLength"
            ),
            header_error(
                "PUSH_FRAGMENT of 2^62 bytes",
                PUSH_FRAGMENT,
                1 << 62,
                "FRAME_TOO_LARGE",
                "HugeLength",
            ),
            header_error("CHUNK of 2^63 bytes", CHUNK, 1 << 63, "FRAME_TOO_LARGE", "HugeLength"),
            header_error(
                "HEARTBEAT of 2^63 bytes",
                HEARTBEAT,
                1 << 63,
                "BAD_FRAME_LENGTH",
                "ExactSize",
                "HugeLength",
            ),
            header_error(
                "INIT_PARAMS one byte over its limit (4 + 12 + 1)",
                INIT_PARAMS,
                17,
                "FRAME_TOO_LARGE",
                "Limit",
                "Boundary",
            ),
            header_error(
                "PUSH_FRAGMENT one byte over its limit (48 + 12 + 1)",
                PUSH_FRAGMENT,
                61,
                "FRAME_TOO_LARGE",
                "Limit",
                "Boundary",
            ),
            header_error(
                "unknown type with a 2^63 length: type first",
                200,
                1 << 63,
                "UNKNOWN_FRAME_TYPE",
                "CheckOrder",
            ),
            header_error(
                "wrong direction with a 2^63 length: direction first",
                BCAST_FRAGMENT,
                1 << 63,
                "WRONG_DIRECTION",
                "CheckOrder",
                "Direction",
            ),
            header_error(
                "wrong direction with a wrong exact size: direction first",
                PULL_REQ,
                3,
                "WRONG_DIRECTION",
                "CheckOrder",
                "Direction",
            ),
        ]
    )
    at_learner = (
        [
            valid("PULL_REQ", pull_req(0, 1, 1), "Normal"),
            valid("SHUTDOWN", shutdown(), "Normal"),
            valid("a CHUNK", chunk(2, 37, 0, bytes(37)), "Normal"),
            invalid(
                "bad magic",
                frame(SHUTDOWN, b"", magic=0xC0DED170),
                "BAD_MAGIC",
                fail_after=HEADER_SIZE,
            ),
        ]
        + [header_error(f"unknown type {t}", t, 16, "UNKNOWN_FRAME_TYPE") for t in (0, 15, 255)]
        + [
            header_error(
                f"{TYPE_NAMES[t]} comes from a learner", t, length, "WRONG_DIRECTION", "Direction"
            )
            for t, length in (
                (HELLO, 100),
                (INIT_PARAMS, 16),
                (PUSH_FRAGMENT, 60),
                (HEARTBEAT, 12),
                (DATA_HELLO, 16),
                (FINAL_ACK, 10),
                (BUDGET_DONE, 8),
            )
        ]
        + [
            header_error("PULL_REQ of 15 bytes", PULL_REQ, 15, "BAD_FRAME_LENGTH", "ExactSize"),
            header_error("PULL_REQ of 17 bytes", PULL_REQ, 17, "BAD_FRAME_LENGTH", "ExactSize"),
            header_error("SHUTDOWN of 1 byte", SHUTDOWN, 1, "BAD_FRAME_LENGTH", "ExactSize"),
            header_error(
                "FINAL_MANIFEST of 22 bytes in a 2-fragment session",
                FINAL_MANIFEST,
                22,
                "BAD_FRAME_LENGTH",
                "ExactSize",
            ),
            header_error(
                "BCAST_FRAGMENT of 2^63 bytes",
                BCAST_FRAGMENT,
                1 << 63,
                "FRAME_TOO_LARGE",
                "HugeLength",
            ),
            header_error(
                "FINAL_FRAGMENT of 2^63 bytes",
                FINAL_FRAGMENT,
                1 << 63,
                "FRAME_TOO_LARGE",
                "HugeLength",
            ),
            header_error("ERROR of 2^62 bytes", ERROR, 1 << 62, "FRAME_TOO_LARGE", "HugeLength"),
            header_error("CHUNK of 2^63 bytes", CHUNK, 1 << 63, "FRAME_TOO_LARGE", "HugeLength"),
            header_error(
                "BCAST_FRAGMENT one byte over its limit (12 + 12 + 1)",
                BCAST_FRAGMENT,
                25,
                "FRAME_TOO_LARGE",
                "Limit",
                "Boundary",
            ),
            header_error(
                "FINAL_FRAGMENT one byte over its limit (12 + 24 + 1)",
                FINAL_FRAGMENT,
                37,
                "FRAME_TOO_LARGE",
                "Limit",
                "Boundary",
            ),
        ]
    )
    return vector_file(
        "header",
        [
            "Header rules for every type: magic:u32 = 0xD170C0DE | type:u8 | len:u64,",
            "little-endian.",
            "Magic, the first-frame rule, the type, its direction and its limit are all checked",
            "from the 13 header bytes, before any payload byte is read or allocated.",
        ],
        [
            frame_group(fresh_syncer(), fresh),
            frame_group(S_BF16.context("syncer", num_learners=4), at_syncer),
            frame_group(S_BF16.context("learner"), at_learner),
        ],
    )


# -- dtype codecs --------------------------------------------------------------------------------


def f32_hex_of_bits(*bits: int) -> str:
    return struct.pack(f"<{len(bits)}I", *bits).hex()


def bf16_test(
    comment: str, op: str, f32_bits: Sequence[int], *flags: str, result: str = "valid"
) -> Json:
    values = np.array(f32_bits, dtype=np.uint32).view(np.float32)
    return {
        "comment": comment,
        "flags": list(flags),
        "op": op,
        "f32": f32_hex_of_bits(*f32_bits),
        "bf16": bf16_from_f32(values).tobytes().hex(),
        "result": result,
    }


def bf16_decode_test(comment: str, halves: Sequence[int], *flags: str) -> Json:
    bf16 = struct.pack(f"<{len(halves)}H", *halves)
    return {
        "comment": comment,
        "flags": list(flags),
        "op": "decode",
        "bf16": bf16.hex(),
        "f32": f32_from_bf16(np.array(halves, dtype=np.uint16)).tobytes().hex(),
        "result": "valid",
    }


def q4_encode_test(comment: str, values: Sequence[float] | F32Array, *flags: str) -> Json:
    array = np.asarray(values, dtype=np.float32)
    return {
        "comment": comment,
        "flags": list(flags),
        "op": "encode",
        "numel": len(array),
        "f32": array.astype("<f4").tobytes().hex(),
        "q4": q4_encode(array).hex(),
        "result": "valid",
    }


def q4_block(scale: bytes, nibbles: Sequence[int]) -> bytes:
    """One 132-byte block from a raw scale and up to 256 nibbles (element 2i in the low nibble)."""
    padded = list(nibbles) + [0] * (Q4_BLOCK_VALUES - len(nibbles))
    return scale + bytes(lo | (hi << 4) for lo, hi in zip(padded[0::2], padded[1::2], strict=True))


def q4_decode_test(
    comment: str, data: bytes, numel: int, *flags: str, code: str | None = None
) -> Json:
    test: Json = {
        "comment": comment,
        "flags": list(flags),
        "op": "decode",
        "numel": numel,
        "q4": data.hex(),
    }
    if code is None:
        test["f32"] = q4_decode(data, numel).astype("<f4").tobytes().hex()
        test["result"] = "valid"
    else:
        test["result"] = "invalid"
        test["code"] = code
    return test


def q4_subnormal_decode_tests() -> list[Json]:
    """Products m * scale that land below 2^-126: exact, or rounded to nearest even, never
    flushed to zero. Each expectation is checked here against its hand-derived f32 bits."""

    def scale_bits(bits: int) -> bytes:
        return struct.pack("<I", bits)

    cases = [
        (
            "a subnormal scale 2^-140: levels 1..7 and their negatives decode to the exact "
            "subnormals +-2^-146 .. +-2^-140 (a decoder that flushes subnormals gives zeros)",
            0x00000200,
            [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15],
            [0x008 << (i - 1) for i in range(1, 8)]
            + [0x80000000 | (0x008 << (i - 1)) for i in range(1, 8)],
        ),
        (
            "scale 3 * 2^-149: 1.5, 0.75 and 0.375 units of 2^-149 round to nearest even "
            "(2, 1 and 0 units), with the sign of m",
            0x00000003,
            [6, 5, 4, 14, 13, 12],
            [0x00000002, 0x00000001, 0x00000000, 0x80000002, 0x80000001, 0x80000000],
        ),
        (
            "scale 2^-149, the smallest subnormal: level 7 keeps it; level 6 is half a unit, "
            "a tie that rounds to the even 0 (+0.0, and -0.0 with the sign)",
            0x00000001,
            [7, 6, 14, 1],
            [0x00000001, 0x00000000, 0x80000000, 0x00000000],
        ),
        (
            "a normal scale, 2^-126 plus one ulp: halved it is 2^-127 plus half a unit, a tie "
            "that rounds to the even 2^-127; quartered, a quarter unit that rounds down",
            0x00800001,
            [7, 6, 5],
            [0x00800001, 0x00400000, 0x00200000],
        ),
    ]
    tests = []
    for comment, scale, nibbles, expected in cases:
        data = q4_block(scale_bits(scale), nibbles)
        got = q4_decode(data, len(nibbles)).astype("<f4").view("<u4").tolist()
        assert got == expected, (comment, [hex(b) for b in got])
        tests.append(q4_decode_test(comment, data, len(nibbles), "Boundary", "Subnormal"))
    return tests


def q4_level(ratio_bits: int) -> int:
    """The level the reference encoder gives a ratio |x|/scale (as f32 bits) in (0, 1]."""
    ratio = np.array([ratio_bits], dtype=np.uint32).view(np.float32)
    return int(q4_encode(np.concatenate([np.array([1.0], dtype=np.float32), ratio]))[4] >> 4)


def q4_level_threshold(level: int) -> int:
    """The smallest f32 ratio (as bits) whose level is at least ``level``: a binary search."""
    low, high = 1, 0x3F800000  # level(low) < level <= level(high = 1.0) = 7
    while high - low > 1:
        middle = (low + high) // 2
        if q4_level(middle) >= level:
            high = middle
        else:
            low = middle
    return high


def codecs_file() -> Json:
    bf16 = [
        bf16_test(
            "exact values: 1, -2, 0.5, 0, -0",
            "encode",
            [0x3F800000, 0xC0000000, 0x3F000000, 0, 0x80000000],
            "Normal",
        ),
        bf16_test(
            "pi and e are rounded to nearest", "encode", [0x40490FDB, 0x402DF854], "Rounding"
        ),
        bf16_test(
            "ties go to even: 0x3f808000 -> 0x3f80, 0x3f818000 -> 0x3f82, -0x3f808000 -> 0xbf80",
            "encode",
            [0x3F808000, 0x3F818000, 0xBF808000],
            "Tie",
        ),
        bf16_test(
            "just below and just above a tie", "encode", [0x3F807FFF, 0x3F808001], "Rounding"
        ),
        bf16_test(
            "rounding carries into the exponent: 0x3fffffff -> 0x4000 (2.0)",
            "encode",
            [0x3FFFFFFF, 0x3FFF8000],
            "Rounding",
            "Tie",
        ),
        bf16_test(
            "overflow rounds to infinity: f32 max -> +inf, and a tie at the top with an odd lsb",
            "encode",
            [0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF],
            "Rounding",
            "Boundary",
        ),
        bf16_test("infinities stay infinite", "encode", [0x7F800000, 0xFF800000], "Boundary"),
        bf16_test(
            "subnormals: ties to even at the bottom of the range",
            "encode",
            [0x00000001, 0x00008000, 0x00018000, 0x80008001, 0x007FFFFF],
            "Tie",
            "Boundary",
        ),
        bf16_test("the canonical quiet NaN stays 0x7fc0", "encode", [0x7FC00000], "NaN"),
        bf16_test(
            "a signalling NaN with only low payload bits becomes a quiet NaN, not infinity",
            "encode",
            [0x7F800001],
            "NaN",
        ),
        bf16_test(
            "negative NaN and NaNs with payload: yeto keeps the sign and the top of the payload"
            " and sets the quiet bit",
            "encode",
            [0xFFC00000, 0x7FA12345, 0xFF800001],
            "NaN",
            result="acceptable",
        ),
        bf16_decode_test(
            "decode is bits << 16: 1, -2, 0.5, 0, -0",
            [0x3F80, 0xC000, 0x3F00, 0x0000, 0x8000],
            "Normal",
        ),
        bf16_decode_test(
            "infinities, NaN and the smallest subnormal",
            [0x7F80, 0xFF80, 0x7FC0, 0x0001],
            "Boundary",
            "NaN",
        ),
        bf16_decode_test("an empty tensor", [], "Boundary"),
        {
            "comment": "an odd number of bytes is not bf16",
            "flags": ["SessionSize"],
            "op": "decode",
            "bf16": "803f00",
            "result": "invalid",
            "code": "BAD_TENSOR_LENGTH",
        },
    ]
    thresholds = [q4_level_threshold(level) for level in range(1, 8)]
    at_threshold = [1.0] + [float(np.uint32(t).view(np.float32)) for t in thresholds]
    below = [1.0] + [float(np.uint32(t - 1).view(np.float32)) for t in thresholds]
    q4_values_300 = sample_values("codec/q4/300", 300)
    q4_values_256 = sample_values("codec/q4/256", 256)
    golden = q4_encode(np.array([1.0, -0.5, 0.25, 0.0], dtype=np.float32))
    assert golden[:6] == bytes.fromhex("0000803fe705") and golden[6:] == bytes(126)
    q4 = [
        q4_encode_test(
            "golden: [1, -0.5, 0.25, 0] -> scale 1.0, bytes e7 05, then zero padding",
            [1.0, -0.5, 0.25, 0.0],
            "Normal",
            "Padding",
        ),
        q4_encode_test(
            "the scale is the absmax even when that value is negative",
            [-4.0, 2.0, 1.0, 0.5],
            "Normal",
            "Padding",
        ),
        q4_encode_test(
            "an all-zero block (with -0.0) has scale 0 and zero nibbles",
            [0.0, -0.0, 0.0],
            "Boundary",
            "Padding",
        ),
        q4_encode_test(
            "tiny values clamp to level 0 without a sign bit: 2^-8 and 2^-7 -> 0, -2^-6 -> 0x9",
            [1.0, -0.00390625, 0.0078125, -0.015625],
            "Boundary",
            "Padding",
        ),
        q4_encode_test(
            "rounding happens in log2 space: 0.70 -> level 6 (0.5), 0.71 -> level 7 (1.0)",
            [1.0, 0.70, 0.71, 0.36],
            "Rounding",
            "Padding",
        ),
        q4_encode_test(
            "each level threshold exactly (log2 lands on k + 0.5 for some; half to even)",
            at_threshold,
            "Tie",
            "Rounding",
            "Padding",
        ),
        q4_encode_test(
            "one f32 ulp below each level threshold", below, "Tie", "Rounding", "Padding"
        ),
        q4_encode_test(
            "a subnormal scale: the absmax is 2^-149, the smallest subnormal",
            [1.4e-45, 0.0, -1.4e-45],
            "Boundary",
            "Padding",
        ),
        q4_encode_test(
            "magnitudes near f32 max", [3.0e38, -3.0e38, 1.0e38, 1.0], "Boundary", "Padding"
        ),
        q4_encode_test("exactly one block (256 values, no padding)", q4_values_256, "Normal"),
        q4_encode_test(
            "300 values: two blocks, the second padded", q4_values_300, "Normal", "Padding"
        ),
        q4_encode_test("a single value", [-0.125], "Boundary", "Padding"),
        {
            "comment": "a NaN cannot be encoded: its block would need a NaN scale",
            "flags": ["NaN"],
            "op": "encode",
            "numel": 3,
            "f32": f32_hex_of_bits(0x3F800000, 0x7FC00000, 0),
            "result": "invalid",
            "code": "NON_FINITE_VALUE",
        },
        {
            "comment": "an infinity cannot be encoded: its block would need an infinite scale",
            "flags": ["Boundary"],
            "op": "encode",
            "numel": 2,
            "f32": f32_hex_of_bits(0xFF800000, 0x3F800000),
            "result": "invalid",
            "code": "NON_FINITE_VALUE",
        },
    ]
    nibbles = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15]
    two_blocks = q4_block(f32_bytes([0.5]), [7, 15, 1]) + q4_block(f32_bytes([3.0]), [6, 14])
    q4 += [
        q4_decode_test("golden block -> [1, -0.5, 0.25, 0]", golden, 4, "Normal", "Padding"),
        q4_decode_test(
            "scale 2.0: levels 0..7, then sign with levels 1..7",
            q4_block(f32_bytes([2.0]), nibbles),
            len(nibbles),
            "Normal",
            "Padding",
        ),
        q4_decode_test("257 values over two blocks", two_blocks, 257, "Normal", "Padding"),
        q4_decode_test("an all-zero block", bytes(Q4_BLOCK_BYTES), 5, "Boundary", "Padding"),
        q4_decode_test(
            "nibble 8 (the sign with level 0) decodes as +0.0, like nibble 0",
            q4_block(f32_bytes([2.0]), [8, 0]),
            2,
            "Boundary",
            "Padding",
        ),
        q4_decode_test(
            "scale -0.0 is accepted; each value is the f32 product m * scale: signed zeros",
            q4_block(f32_bytes([-0.0]), [0, 1, 8, 9]),
            4,
            "Boundary",
            "Padding",
        ),
        q4_decode_test(
            "300 encoded values decode", q4_encode(q4_values_300), 300, "Normal", "Padding"
        ),
        q4_decode_test(
            "scale NaN", q4_block(bytes.fromhex("0000c07f"), [7]), 1, "NaN", code="BAD_Q4_SCALE"
        ),
        q4_decode_test(
            "scale +inf", q4_block(bytes.fromhex("0000807f"), [7]), 1, code="BAD_Q4_SCALE"
        ),
        q4_decode_test(
            "scale -inf", q4_block(bytes.fromhex("000080ff"), [7]), 1, code="BAD_Q4_SCALE"
        ),
        q4_decode_test(
            "scale -1.0", q4_block(bytes.fromhex("000080bf"), [7]), 1, code="BAD_Q4_SCALE"
        ),
        q4_decode_test(
            "scale: the negative smallest subnormal",
            q4_block(bytes.fromhex("01000080"), [7]),
            1,
            "Boundary",
            code="BAD_Q4_SCALE",
        ),
        q4_decode_test(
            "the second block's scale is NaN",
            q4_block(f32_bytes([1.0]), [7]) + q4_block(bytes.fromhex("ffffffff"), [7]),
            257,
            "NaN",
            code="BAD_Q4_SCALE",
        ),
        q4_decode_test(
            "131 bytes for 4 values", golden[:-1], 4, "SessionSize", code="BAD_TENSOR_LENGTH"
        ),
        q4_decode_test(
            "two blocks for 256 values",
            golden + golden,
            256,
            "SessionSize",
            code="BAD_TENSOR_LENGTH",
        ),
        q4_decode_test(
            "one block for 257 values", golden, 257, "SessionSize", code="BAD_TENSOR_LENGTH"
        ),
        # Added after the first release of this group: at the end, so no tcId moves.
        *q4_subnormal_decode_tests(),
    ]
    return vector_file(
        "codecs",
        [
            "Tensor codecs. bf16: round to nearest even from f32 (a NaN stays a quiet NaN);",
            "decode is bits << 16. q4: blocks of 256 values, each scale:f32 (absmax) then 128",
            "bytes of nibbles (element 2i low);",
            "L = clamp(round_half_even(log2(|x|/scale)) + 7, 0, 7), computed in f32.",
            "Tensors are little-endian hex. For acceptable bf16 tests any quiet NaN is allowed.",
        ],
        [
            {"type": "Bf16CodecTest", "tests": bf16},
            {"type": "Q4CodecTest", "tests": q4},
        ],
    )


# -- session admission ---------------------------------------------------------------------------

#: The syncers admission.json runs against: spec/identity.md § 3's worked example (``--learners 4
#: --total-steps 1000``), the same with ``--require-profile-binding``, and a one-learner syncer.
OPEN_SYNCER = Profile(learners=4, total_steps=1000)
BOUND_SYNCER = replace(OPEN_SYNCER, require_profile_binding=True)
SOLO_SYNCER = Profile(learners=1, total_steps=1000)
#: A profile hash no syncer of the file has: --total-steps 999.
FOREIGN_PROFILE = replace(OPEN_SYNCER, total_steps=999).digest()


def admission_group(syncer: Profile, tests: list[Json]) -> Json:
    return {
        "type": "HelloAdmissionTest",
        "context": {
            "num_learners": syncer.learners,
            "require_profile_binding": syncer.require_profile_binding,
            "syncer_profile": syncer.as_json(),
            "syncer_profile_hash": syncer.digest().hex(),
        },
        "tests": tests,
    }


def admission(
    comment: str,
    accepted: Sequence[HelloFields],
    hello: HelloFields,
    code: str | None,
    *flags: str,
    closed: Sequence[int] = (),
    refused_before: Sequence[tuple[HelloFields, str]] = (),
    evicts: Sequence[int] = (),
) -> Json:
    """``accepted`` HELLOs are admitted in order (groups ``closed`` close after them), each of
    ``refused_before`` is refused with its code, then ``hello`` is admitted (``code`` None),
    closing the groups of ``accepted`` listed in ``evicts`` without ERROR, or refused with
    ``code``."""
    assert not evicts or code is None
    test: Json = {
        "comment": comment,
        "flags": list(flags),
        "accepted": [frame(HELLO, h.payload()).hex() for h in accepted],
        "hello": frame(HELLO, hello.payload()).hex(),
        "result": "admitted" if code is None else "refused",
    }
    if code is not None:
        test["code"] = code
    if closed:
        test["closed"] = list(closed)
    if refused_before:
        test["refused_before"] = [
            {"hello": frame(HELLO, h.payload()).hex(), "code": c} for h, c in refused_before
        ]
    if evicts:
        test["evicts"] = list(evicts)
    return test


def admission_file() -> Json:
    def f32(learner_id: int, generation: int, **changes: Any) -> HelloFields:
        """The f32 session's HELLO from another learner or generation, with ``changes``."""
        return replace(S_F32.hello, learner_id=learner_id, generation=generation, **changes)

    first = f32(0, 1)
    own = OPEN_SYNCER.digest()
    bound = BOUND_SYNCER.digest()
    fragments = S_F32.hello.fragments  # avg [4, 1], rda [3]
    avg, rda = fragments
    # Same numbers, other names or shapes: fc.weight (2, 2) stored flat as (4,), and a renaming.
    reshaped = layout(
        (AVG, [("fc.weight", (4,)), ("fc.bias", (1,))]), (RDA, [("head.weight", (3,))])
    ).fingerprint()
    renamed = layout(
        (AVG, [("encoder.weight", (2, 2)), ("encoder.bias", (1,))]),
        (RDA, [("decoder.weight", (3,))]),
    ).fingerprint()
    wider = layout(
        (AVG, [("fc.weight", (2, 4)), ("fc.bias", (2,))]), (RDA, [("head.weight", (3,))])
    )
    other_contract = digest_of("conformance contract: another run")
    three = S_THREE.hello  # bf16: avg [8], rda [2, 2], iso [6, 6] as 3x2 and 2x3
    iso = three.fragments[2]

    open_tests = [
        admission("the first HELLO fixes the session", [], first, None, "Normal"),
        admission(
            "a second learner of the same session (generation numbers are per learner)",
            [first],
            f32(1, 1),
            None,
            "Normal",
        ),
        admission(
            "a new generation of an admitted learner (a redial)",
            [first],
            f32(0, 2),
            None,
            "NewGeneration",
        ),
        admission("learner M-1 = 3, generation 2^64-1", [first], f32(3, U64_MAX), None, "Boundary"),
        admission(
            "num_streams is not part of the session: 0 data streams where the first had 2",
            [first],
            f32(1, 1, num_streams=0),
            None,
            "Normal",
        ),
        admission(
            "a generation need not be larger than the last: 3 after 5 was never admitted",
            [f32(0, 5)],
            f32(0, 3),
            None,
            "NewGeneration",
        ),
        admission(
            "a first HELLO carrying this syncer's own profile hash binds the session",
            [],
            f32(0, 1, profile=own),
            None,
            "ProfileHash",
        ),
        admission(
            "a second learner of a profile-bound session, with the same hash",
            [f32(0, 1, profile=own)],
            f32(1, 1, profile=own),
            None,
            "ProfileHash",
        ),
        admission(
            "the iso session: a second learner with the same iso shapes",
            [three],
            replace(three, learner_id=2),
            None,
            "Iso",
        ),
        admission(
            "learner_id 4 = M on the first HELLO",
            [],
            f32(4, 1),
            "LEARNER_ID_OUT_OF_RANGE",
            "Boundary",
        ),
        admission(
            "learner_id 4 = M and the wrong dtype: the learner id is checked first (row 1)",
            [first],
            f32(4, 1, dtype=BF16),
            "LEARNER_ID_OUT_OF_RANGE",
            "CheckOrder",
        ),
        admission(
            "a first HELLO whose profile hash is not this syncer's (--total-steps 999)",
            [],
            f32(0, 1, profile=FOREIGN_PROFILE),
            "SESSION_PROFILE_MISMATCH",
            "ProfileHash",
        ),
        admission(
            "a foreign profile hash and the wrong dtype: the syncer's own hash (row 3) comes "
            "before the session (row 4)",
            [first],
            f32(1, 1, dtype=BF16, profile=FOREIGN_PROFILE),
            "SESSION_PROFILE_MISMATCH",
            "CheckOrder",
            "ProfileHash",
        ),
        admission(
            "bf16 in an f32 session, the layout unchanged",
            [first],
            f32(1, 1, dtype=BF16),
            "SESSION_DTYPE_MISMATCH",
            "Normal",
        ),
        admission(
            "bf16 in a q4 session: INIT and BCAST are bf16 in both, still another session",
            [S_Q4.hello],
            replace(S_Q4.hello, learner_id=1, dtype=BF16),
            "SESSION_DTYPE_MISMATCH",
            "Normal",
        ),
        admission(
            "the wrong dtype and another layout: dtype (row 4) before layout (row 5)",
            [first],
            f32(1, 1, dtype=Q4, fragments=(avg, WireFragment(RDA, (4,)))),
            "SESSION_DTYPE_MISMATCH",
            "CheckOrder",
        ),
        admission(
            "fragment 1 has numel 4 instead of 3 (fingerprint and contract as the session's)",
            [first],
            f32(1, 1, fragments=(avg, WireFragment(RDA, (4,)))),
            "SESSION_LAYOUT_MISMATCH",
            "Normal",
        ),
        admission(
            "fragment 1 is avg instead of rda",
            [first],
            f32(1, 1, fragments=(avg, WireFragment(AVG, (3,)))),
            "SESSION_LAYOUT_MISMATCH",
            "SameLimits",
        ),
        admission(
            "fragment 0 holds one tensor of 5 instead of tensors of 4 and 1",
            [first],
            f32(1, 1, fragments=(WireFragment(AVG, (5,)), rda)),
            "SESSION_LAYOUT_MISMATCH",
            "SameLimits",
        ),
        admission(
            "fragment 0's tensors in the other order: numels 1, 4",
            [first],
            f32(1, 1, fragments=(WireFragment(AVG, (1, 4)), rda)),
            "SESSION_LAYOUT_MISMATCH",
            "SameLimits",
        ),
        admission(
            "the two fragments in the other order",
            [first],
            f32(1, 1, fragments=(rda, avg)),
            "SESSION_LAYOUT_MISMATCH",
            "Normal",
        ),
        admission(
            "fragment 1 left out",
            [first],
            f32(1, 1, fragments=(avg,)),
            "SESSION_LAYOUT_MISMATCH",
            "Normal",
        ),
        admission(
            "a third fragment appended",
            [first],
            f32(1, 1, fragments=(avg, rda, WireFragment(AVG, (2,)))),
            "SESSION_LAYOUT_MISMATCH",
            "Normal",
        ),
        admission(
            "iso shapes transposed: 2x3 and 3x2 where the session has 3x2 and 2x3",
            [three],
            replace(
                three,
                learner_id=1,
                fragments=(*three.fragments[:2], WireFragment(ISO, iso.numels, ((2, 3), (3, 2)))),
            ),
            "SESSION_LAYOUT_MISMATCH",
            "Iso",
            "SameLimits",
        ),
        admission(
            "the iso fragment declared avg with the same numels",
            [three],
            replace(
                three,
                learner_id=1,
                fragments=(*three.fragments[:2], WireFragment(AVG, iso.numels)),
            ),
            "SESSION_LAYOUT_MISMATCH",
            "Iso",
            "SameLimits",
        ),
        admission(
            "another model: its own layout and fingerprint; the layout (row 5) is checked first",
            [first],
            f32(1, 1, fragments=wider.wire(), fingerprint=wider.fingerprint()),
            "SESSION_LAYOUT_MISMATCH",
            "CheckOrder",
        ),
        admission(
            "the same numbers with fc.weight stored as (4,) instead of (2, 2): another fingerprint",
            [first],
            f32(1, 1, fingerprint=reshaped),
            "SESSION_FINGERPRINT_MISMATCH",
            "Normal",
        ),
        admission(
            "renamed tensors and another contract: the fingerprint (row 6) comes first",
            [first],
            f32(1, 1, fingerprint=renamed, contract=other_contract),
            "SESSION_FINGERPRINT_MISMATCH",
            "CheckOrder",
        ),
        admission(
            "another session contract (another run of the same model)",
            [first],
            f32(1, 1, contract=other_contract),
            "SESSION_CONTRACT_MISMATCH",
            "Normal",
        ),
        admission(
            "another contract and a profile hash the session lacks: contract (row 7) first",
            [first],
            f32(1, 1, contract=other_contract, profile=own),
            "SESSION_CONTRACT_MISMATCH",
            "CheckOrder",
            "ProfileHash",
        ),
        admission(
            "the syncer's own profile hash in a session fixed without one (row 8)",
            [first],
            f32(1, 1, profile=own),
            "SESSION_PROFILE_MISMATCH",
            "ProfileHash",
        ),
        admission(
            "no profile hash in a session fixed with one (binding not required; row 8)",
            [f32(0, 1, profile=own)],
            f32(1, 1),
            "SESSION_PROFILE_MISMATCH",
            "ProfileHash",
        ),
        admission(
            "the same learner and generation again, byte for byte",
            [first],
            first,
            "DUPLICATE_GENERATION",
            "Normal",
        ),
        admission(
            "a generation admitted before, now with 0 data streams",
            [first, f32(1, 1)],
            f32(1, 1, num_streams=0),
            "DUPLICATE_GENERATION",
            "Normal",
        ),
        admission(
            "generation 1 again after generation 2 of the same learner",
            [first, f32(0, 2)],
            first,
            "DUPLICATE_GENERATION",
            "NewGeneration",
        ),
        admission(
            "a duplicate generation with the wrong dtype: the session (row 4) comes first",
            [first],
            f32(0, 1, dtype=BF16),
            "SESSION_DTYPE_MISMATCH",
            "CheckOrder",
        ),
        admission(
            "a duplicate generation with a profile hash the session lacks: row 8 before row 9",
            [first],
            f32(0, 1, profile=own),
            "SESSION_PROFILE_MISMATCH",
            "CheckOrder",
            "ProfileHash",
        ),
        admission(
            "the group of generation 1 closed: generation 1 was still admitted before",
            [first],
            first,
            "DUPLICATE_GENERATION",
            "ClosedGroups",
            closed=[0],
        ),
        admission(
            "the group of generation 1 closed: generation 2 redials",
            [first],
            f32(0, 2),
            None,
            "ClosedGroups",
            "NewGeneration",
            closed=[0],
        ),
        admission(
            "every group closed: the session stays fixed (bf16 is refused)",
            [first, f32(1, 1)],
            f32(2, 1, dtype=BF16),
            "SESSION_DTYPE_MISMATCH",
            "ClosedGroups",
            closed=[1, 0],
        ),
        admission(
            "learner 0's generation 7 was refused for its bf16 dtype: a refused HELLO records no "
            "generation, so generation 7 in f32 is admitted",
            [f32(1, 1)],
            f32(0, 7),
            None,
            "RefusedBefore",
            refused_before=[(f32(0, 7, dtype=BF16), "SESSION_DTYPE_MISMATCH")],
        ),
        admission(
            "the first HELLO, learner_id 4 = M, was refused: it fixed no session, so a bf16 "
            "HELLO is admitted and fixes it",
            [],
            f32(0, 1, dtype=BF16),
            None,
            "RefusedBefore",
            refused_before=[(f32(4, 1), "LEARNER_ID_OUT_OF_RANGE")],
        ),
        admission(
            "learner 0's generations 1 to 4 are open; admitting generation 5 makes five, so the "
            "syncer closes the oldest, generation 1, without ERROR",
            [first, f32(0, 2), f32(0, 3), f32(0, 4)],
            f32(0, 5),
            None,
            "GroupCap",
            "NewGeneration",
            evicts=[0],
        ),
        admission(
            "learner 0's generations 1 to 4 were admitted and generation 2 closed: generation 5 "
            "makes four open groups, and none is closed",
            [first, f32(0, 2), f32(0, 3), f32(0, 4)],
            f32(0, 5),
            None,
            "ClosedGroups",
            "GroupCap",
            "NewGeneration",
            closed=[1],
        ),
    ]
    bound_tests = [
        admission(
            "a first HELLO with this syncer's profile hash",
            [],
            f32(0, 1, profile=bound),
            None,
            "ProfileHash",
        ),
        admission(
            "a second learner with the same hash",
            [f32(0, 1, profile=bound)],
            f32(1, 1, profile=bound),
            None,
            "ProfileHash",
        ),
        admission(
            "a first HELLO without a profile hash",
            [],
            first,
            "PROFILE_BINDING_REQUIRED",
            "Normal",
        ),
        admission(
            "no profile hash in a bound session: binding (row 2) before the session (row 8)",
            [f32(0, 1, profile=bound)],
            f32(1, 1),
            "PROFILE_BINDING_REQUIRED",
            "CheckOrder",
        ),
        admission(
            "no profile hash and the wrong dtype: binding (row 2) before dtype (row 4)",
            [f32(0, 1, profile=bound)],
            f32(1, 1, dtype=BF16),
            "PROFILE_BINDING_REQUIRED",
            "CheckOrder",
        ),
        admission(
            "learner_id 4 = M without a profile hash: the learner id (row 1) comes first",
            [],
            f32(4, 1),
            "LEARNER_ID_OUT_OF_RANGE",
            "CheckOrder",
        ),
        admission(
            "the hash of the same flags without --require-profile-binding: the hash covers it",
            [],
            f32(0, 1, profile=own),
            "SESSION_PROFILE_MISMATCH",
            "ProfileHash",
        ),
        admission(
            "a foreign profile hash and another contract: row 3 before row 7",
            [f32(0, 1, profile=bound)],
            f32(1, 1, profile=FOREIGN_PROFILE, contract=other_contract),
            "SESSION_PROFILE_MISMATCH",
            "CheckOrder",
            "ProfileHash",
        ),
        admission(
            "the same learner and generation again, with the hash",
            [f32(0, 1, profile=bound)],
            f32(0, 1, profile=bound),
            "DUPLICATE_GENERATION",
            "ProfileHash",
        ),
    ]
    solo_tests = [
        admission("learner 0 of one", [], first, None, "Boundary"),
        admission("learner 0, generation 2", [first], f32(0, 2), None, "NewGeneration"),
        admission(
            "learner_id 1 = M = 1", [first], f32(1, 1), "LEARNER_ID_OUT_OF_RANGE", "Boundary"
        ),
    ]
    return vector_file(
        "admission",
        [
            "Session admission (spec/identity.md § 4): a syncer with the context's settings",
            "admits the HELLOs of accepted in order (the first fixes the session), closes the",
            "groups listed in closed, then admits hello or refuses it with code. Every HELLO",
            "passes the frame checks of spec/wire.md § 5.2 except, where code says so,",
            "learner_id < M, which the frame decoder may refuse first.",
        ],
        [
            admission_group(OPEN_SYNCER, open_tests),
            admission_group(BOUND_SYNCER, bound_tests),
            admission_group(SOLO_SYNCER, solo_tests),
        ],
    )


# -- attaching data sockets ----------------------------------------------------------------------

#: The syncer attach_sequences.json runs against: M = 4 (a DATA_HELLO or HELLO needs
#: learner_id < M); every HELLO is the f32 session's, from the learner and generation named.
ATTACH_LEARNERS = 4
#: Every wait of the connection table lasts 10 s (spec/wire.md § 5.4). A script never lands
#: exactly on a deadline: it looks a quarter second before it (nothing yet) and a quarter
#: second after (done), so whether a deadline is due at the very instant it is reached is left
#: to the implementation. Both numbers are exact in binary floating point.
BEFORE_DEADLINE = 9.75
OVER_DEADLINE = 0.5
ATTACH_EFFECT_ORDER = {"error": 0, "close": 1, "ready": 2}


def attach_error(code: str, socket: int | None = None) -> Json:
    """ERROR ``<code>: …`` on ``socket`` (None: the step's own socket), which then closes."""
    return {"effect": "error", "socket": socket, "code": code}


def attach_close(socket: int) -> Json:
    """``socket`` closes without ERROR (its group closed because of another socket)."""
    return {"effect": "close", "socket": socket}


def attach_ready(learner_id: int, generation: int) -> Json:
    return {"effect": "ready", "id": learner_id, "generation": generation}


class AttachScript:
    """The steps of one AttachSequenceTest; sockets are numbered 1, 2, … as they open."""

    def __init__(self) -> None:
        self.steps: list[Json] = []
        self.sockets = 0

    def _effects(self, socket: int | None, effects: Sequence[Json]) -> list[Json]:
        out = []
        for effect in effects:
            if effect.get("socket", 0) is None:
                assert socket is not None, "an effect on the step's socket needs a socket"
                effect = {**effect, "socket": socket}
            out.append(effect)
        return sorted(
            out,
            key=lambda e: (
                ATTACH_EFFECT_ORDER[e["effect"]],
                e.get("socket", 0),
                e.get("id", 0),
                e.get("generation", 0),
            ),
        )

    def open(self) -> int:
        self.sockets += 1
        self.steps.append({"step": "open", "socket": self.sockets, "effects": []})
        return self.sockets

    def hello(
        self,
        learner_id: int,
        generation: int,
        num_streams: int,
        *effects: Json,
        refuse: str | None = None,
        contract: bytes | None = None,
        socket: int | None = None,
    ) -> int:
        """A HELLO on ``socket`` (None: a new one), admitted, or refused with ``refuse``."""
        if socket is None:
            socket = self.open()
        fields = replace(
            S_F32.hello, learner_id=learner_id, generation=generation, num_streams=num_streams
        )
        if contract is not None:
            fields = replace(fields, contract=contract)
        step: Json = {
            "step": "hello",
            "socket": socket,
            "hex": frame(HELLO, fields.payload()).hex(),
            "learner_id": learner_id,
            "generation": generation,
            "num_streams": num_streams,
            "decision": "admit" if refuse is None else "refuse",
        }
        if refuse is not None:
            step["code"] = refuse
        step["effects"] = self._effects(socket, effects)
        self.steps.append(step)
        return socket

    def data_hello(
        self,
        learner_id: int,
        generation: int,
        stream_idx: int,
        *effects: Json,
        socket: int | None = None,
    ) -> int:
        """A DATA_HELLO on ``socket`` (None: a new one)."""
        if socket is None:
            socket = self.open()
        self.steps.append(
            {
                "step": "data_hello",
                "socket": socket,
                "hex": data_hello(learner_id, generation, stream_idx)[0].hex(),
                "learner_id": learner_id,
                "generation": generation,
                "stream_idx": stream_idx,
                "effects": self._effects(socket, effects),
            }
        )
        return socket

    def advance(self, seconds: float, *effects: Json) -> None:
        self.steps.append(
            {"step": "advance", "seconds": seconds, "effects": self._effects(None, effects)}
        )

    def test(self, comment: str, *flags: str) -> Json:
        return {"comment": comment, "flags": list(flags), "steps": self.steps}


def attach_group(tests: list[Json]) -> Json:
    return {
        "type": "AttachSequenceTest",
        "context": {"num_learners": ATTACH_LEARNERS},
        "tests": tests,
    }


def attach_tests() -> list[Json]:
    """Data sockets joining admitted groups."""
    tests = []

    s = AttachScript()
    s.hello(0, 1, 2)
    s.data_hello(0, 1, 0)
    s.data_hello(0, 1, 1, attach_ready(0, 1))
    tests.append(s.test("two data streams attach in index order: ready with the last", "Normal"))

    s = AttachScript()
    s.hello(2, 5, 3)
    s.data_hello(2, 5, 2)
    s.data_hello(2, 5, 0)
    s.data_hello(2, 5, 1, attach_ready(2, 5))
    tests.append(s.test("three data streams attach out of index order", "Normal"))

    s = AttachScript()
    s.hello(0, 1, 0, attach_ready(0, 1))
    tests.append(s.test("a HELLO with no data streams: ready as it is admitted", "Boundary"))

    s = AttachScript()
    s.hello(0, 1, 1)
    s.hello(1, 1, 1)
    s.data_hello(1, 1, 0, attach_ready(1, 1))
    s.data_hello(0, 1, 0, attach_ready(0, 1))
    tests.append(s.test("two learners' groups attach interleaved, each on its own", "Normal"))

    s = AttachScript()
    s.hello(0, 1, 1)
    other_generation = s.data_hello(0, 2, 0)
    other_learner = s.data_hello(1, 1, 0)
    s.data_hello(0, 1, 0, attach_ready(0, 1))
    s.advance(BEFORE_DEADLINE)
    s.advance(
        OVER_DEADLINE,
        attach_error("UNKNOWN_GROUP", other_generation),
        attach_error("UNKNOWN_GROUP", other_learner),
    )
    tests.append(
        s.test(
            "a DATA_HELLO joins only the group of its own learner_id and generation: "
            "another generation's or another learner's waits for its own group, then "
            "UNKNOWN_GROUP",
            "Deadline",
        )
    )
    return tests


def stream_index_tests() -> list[Json]:
    """DUPLICATE_STREAM and BAD_STREAM_INDEX: only the DATA_HELLO's socket is refused."""
    tests = []

    s = AttachScript()
    s.hello(0, 1, 2)
    s.data_hello(0, 1, 0)
    s.data_hello(0, 1, 0, attach_error("DUPLICATE_STREAM"))
    s.data_hello(0, 1, 1, attach_ready(0, 1))
    tests.append(
        s.test(
            "stream 0 twice: the second socket only is refused; the group stays and gets ready",
            "Normal",
        )
    )

    s = AttachScript()
    s.hello(3, 9, 1)
    s.data_hello(3, 9, 0, attach_ready(3, 9))
    s.data_hello(3, 9, 0, attach_error("DUPLICATE_STREAM"))
    tests.append(s.test("an index again after the group is ready: only that socket", "Normal"))

    s = AttachScript()
    s.data_hello(0, 1, 1)
    s.hello(0, 1, 2)
    s.data_hello(0, 1, 1, attach_error("DUPLICATE_STREAM"))
    s.data_hello(0, 1, 0, attach_ready(0, 1))
    tests.append(
        s.test(
            "an index that attached while it waited for the HELLO is taken: a second one is "
            "DUPLICATE_STREAM",
            "BeforeHello",
        )
    )

    s = AttachScript()
    s.hello(0, 1, 1)
    s.hello(0, 2, 1)
    s.data_hello(0, 1, 0, attach_ready(0, 1))
    s.data_hello(0, 2, 0, attach_ready(0, 2))
    tests.append(
        s.test("the same index in another generation of the learner is no duplicate", "Normal")
    )

    s = AttachScript()
    s.hello(0, 1, 2)
    s.data_hello(0, 1, 2, attach_error("BAD_STREAM_INDEX"))
    s.data_hello(0, 1, 0)
    s.data_hello(0, 1, 1, attach_ready(0, 1))
    tests.append(
        s.test(
            "stream_idx = num_streams: only that socket is refused; the group gets ready",
            "Boundary",
        )
    )

    s = AttachScript()
    s.hello(1, 4, 2)
    s.data_hello(1, 4, 0)
    s.data_hello(1, 4, 255, attach_error("BAD_STREAM_INDEX"))
    s.data_hello(1, 4, 1, attach_ready(1, 4))
    tests.append(s.test("stream_idx 255 in a group of 2 data streams", "Boundary"))

    s = AttachScript()
    s.hello(0, 1, 0, attach_ready(0, 1))
    s.data_hello(0, 1, 0, attach_error("BAD_STREAM_INDEX"))
    tests.append(s.test("a DATA_HELLO to a group without data streams", "Boundary"))

    s = AttachScript()
    waiting = s.data_hello(0, 1, 2)
    s.hello(0, 1, 2, attach_error("BAD_STREAM_INDEX", waiting))
    s.data_hello(0, 1, 0)
    s.data_hello(0, 1, 1, attach_ready(0, 1))
    tests.append(
        s.test(
            "stream_idx = num_streams before the HELLO: it waits, and is refused when the "
            "group is admitted",
            "BeforeHello",
            "Boundary",
        )
    )

    s = AttachScript()
    s.data_hello(0, 1, 256, attach_error("BAD_STREAM_INDEX"))
    s.data_hello(2, 3, U16_MAX, attach_error("BAD_STREAM_INDEX"))
    tests.append(
        s.test(
            "stream_idx 256 or more fits no group: refused at once, without waiting for one",
            "Boundary",
        )
    )

    s = AttachScript()
    s.data_hello(0, 1, 255)
    s.advance(BEFORE_DEADLINE)
    s.advance(OVER_DEADLINE, attach_error("UNKNOWN_GROUP", 1))
    tests.append(
        s.test(
            "stream_idx 255 may fit a group: it waits for one, then UNKNOWN_GROUP",
            "Boundary",
            "Deadline",
        )
    )
    return tests


def waiting_tests() -> list[Json]:
    """A DATA_HELLO before its group's HELLO: attached, or UNKNOWN_GROUP."""
    tests = []

    s = AttachScript()
    s.data_hello(0, 1, 0)
    s.advance(BEFORE_DEADLINE)
    s.hello(0, 1, 1, attach_ready(0, 1))
    tests.append(
        s.test(
            "a DATA_HELLO 9.75 s before its HELLO attaches as the group is admitted",
            "BeforeHello",
            "Deadline",
        )
    )

    s = AttachScript()
    s.data_hello(0, 1, 0)
    s.advance(BEFORE_DEADLINE)
    s.hello(0, 1, 2)
    s.advance(BEFORE_DEADLINE)
    s.data_hello(0, 1, 1, attach_ready(0, 1))
    tests.append(
        s.test(
            "once attached, a data socket waits no more: the group's own 10 s run from its "
            "admission",
            "BeforeHello",
            "Deadline",
        )
    )

    s = AttachScript()
    s.data_hello(0, 1, 0)
    s.advance(BEFORE_DEADLINE)
    s.advance(OVER_DEADLINE, attach_error("UNKNOWN_GROUP", 1))
    tests.append(s.test("no HELLO within 10 s: UNKNOWN_GROUP at the deadline", "Deadline"))

    s = AttachScript()
    early = s.data_hello(1, 2, 0)
    s.advance(5.0)
    late = s.data_hello(1, 2, 1)
    s.advance(BEFORE_DEADLINE - 5.0)
    s.advance(OVER_DEADLINE, attach_error("UNKNOWN_GROUP", early))
    s.advance(5.0 - OVER_DEADLINE)
    s.advance(OVER_DEADLINE, attach_error("UNKNOWN_GROUP", late))
    tests.append(
        s.test("each DATA_HELLO waits 10 s from its own arrival", "BeforeHello", "Deadline")
    )

    s = AttachScript()
    quiet = s.open()
    s.advance(BEFORE_DEADLINE)
    s.data_hello(0, 1, 0, socket=quiet)
    s.advance(BEFORE_DEADLINE)
    s.advance(OVER_DEADLINE, attach_error("UNKNOWN_GROUP", quiet))
    tests.append(
        s.test(
            "a DATA_HELLO sent 9.75 s after its socket opened still waits 10 s for its group",
            "Deadline",
        )
    )

    s = AttachScript()
    s.hello(1, 1, 0, attach_ready(1, 1))
    waiting = s.data_hello(0, 1, 0)
    s.hello(
        0,
        1,
        1,
        attach_error("SESSION_CONTRACT_MISMATCH"),
        attach_error("UNKNOWN_GROUP", waiting),
        refuse="SESSION_CONTRACT_MISMATCH",
        contract=digest_of("conformance contract: another run"),
    )
    tests.append(
        s.test(
            "the HELLO is refused (another contract than learner 1's): its waiting data "
            "socket gets UNKNOWN_GROUP at once; learner 1's group is untouched",
            "BeforeHello",
            "RefusedHello",
        )
    )

    s = AttachScript()
    s.hello(1, 1, 0, attach_ready(1, 1))
    first = s.data_hello(0, 3, 0)
    second = s.data_hello(0, 3, 1)
    s.data_hello(0, 4, 0)
    s.hello(
        0,
        3,
        2,
        attach_error("SESSION_CONTRACT_MISMATCH"),
        attach_error("UNKNOWN_GROUP", first),
        attach_error("UNKNOWN_GROUP", second),
        refuse="SESSION_CONTRACT_MISMATCH",
        contract=digest_of("conformance contract: another run"),
    )
    s.hello(0, 4, 1, attach_ready(0, 4))
    tests.append(
        s.test(
            "a refused HELLO refuses every data socket waiting for its group, and only those",
            "BeforeHello",
            "RefusedHello",
        )
    )
    return tests


def group_deadline_tests() -> list[Json]:
    """An admitted group whose data sockets are not all in within 10 s (HANDSHAKE_TIMEOUT)."""
    tests = []

    s = AttachScript()
    control = s.hello(0, 1, 2)
    data = s.data_hello(0, 1, 0)
    s.advance(BEFORE_DEADLINE)
    s.advance(OVER_DEADLINE, attach_error("HANDSHAKE_TIMEOUT", control), attach_close(data))
    tests.append(
        s.test(
            "one of two data streams attached in 10 s: HANDSHAKE_TIMEOUT on stream 0, and "
            "the attached data socket closes with its group",
            "Deadline",
        )
    )

    s = AttachScript()
    control = s.hello(0, 1, 1)
    s.advance(BEFORE_DEADLINE)
    s.advance(OVER_DEADLINE, attach_error("HANDSHAKE_TIMEOUT", control))
    tests.append(s.test("no data stream attached in 10 s", "Deadline"))

    s = AttachScript()
    s.hello(0, 1, 2)
    s.data_hello(0, 1, 1)
    s.advance(BEFORE_DEADLINE)
    s.data_hello(0, 1, 0, attach_ready(0, 1))
    s.advance(OVER_DEADLINE)
    s.advance(60.0)
    tests.append(s.test("the last data stream 9.75 s after admission: ready, for good", "Deadline"))

    s = AttachScript()
    early = s.hello(0, 1, 1)
    s.advance(5.0)
    s.hello(1, 1, 1)
    s.advance(BEFORE_DEADLINE - 5.0)
    s.advance(OVER_DEADLINE, attach_error("HANDSHAKE_TIMEOUT", early))
    s.data_hello(1, 1, 0, attach_ready(1, 1))
    tests.append(
        s.test(
            "each group has 10 s from its own admission: the earlier one times out alone",
            "Deadline",
        )
    )

    s = AttachScript()
    quiet = s.open()
    s.advance(BEFORE_DEADLINE)
    s.advance(OVER_DEADLINE, attach_error("HANDSHAKE_TIMEOUT", quiet))
    tests.append(s.test("a socket that sends no first frame in 10 s", "Deadline"))
    return tests


def attach_sequences_file() -> Json:
    return vector_file(
        "attach_sequences",
        [
            "The syncer's connection table (spec/wire.md § 5.4): data sockets attaching to",
            "connection groups by DATA_HELLO, and the waits around it. Each test is a sequence",
            "of steps on numbered sockets (open, HELLO with the coordinator's decision,",
            "DATA_HELLO, the clock advancing) with exactly the effects each step has: ERROR",
            "and close of a socket, a socket closed with its group, a group ready.",
        ],
        [
            attach_group(attach_tests()),
            attach_group(stream_index_tests()),
            attach_group(waiting_tests()),
            attach_group(group_deadline_tests()),
        ],
    )


# -- PUSH acceptance -----------------------------------------------------------------------------

#: The syncer push_acceptance.json runs against: two learners, quorum 2 (so an attempt's K is
#: always its member count and no grace window opens), pipeline 2, --max-base-lag 2.
PUSH_SYNCER = Profile(learners=2, total_steps=1000, quorum=2, max_base_lag=2)
#: The same syncer with --learner-budget-steps 100, for the BUDGET_DONE rules.
BUDGET_SYNCER = replace(PUSH_SYNCER, learner_budget_steps=100)
#: The same with quorum 1 < M: an attempt's K-th response opens a grace window.
GRACE_SYNCER = replace(PUSH_SYNCER, quorum=1)
#: Its session: S_F32's layout (F = 2: avg [4, 1] and rda [3]), HELLOs without data streams.
PUSH_NUMELS = S_F32.numels


def member_hello(learner_id: int, generation: int) -> Json:
    return {"event": "hello", "hex": S_F32.hello_frame(learner_id, generation, 0).hex()}


def frame_event(learner_id: int, generation: int, built: bytes) -> Json:
    """A script event: the frame ``built`` from that learner's connection."""
    return {"event": "frame", "id": learner_id, "generation": generation, "hex": built.hex()}


def init_event(fragment_id: int, generation: int = 1) -> Json:
    """Learner 0's INIT of ``fragment_id`` from its generation ``generation``."""
    data = S_F32.bulk(fragment_id, f"push acceptance: INIT of fragment {fragment_id}")
    return frame_event(0, generation, init_params(fragment_id, data)[0])


def round_push(
    data: bytes, learner_id: int, fragment: int, step: int, *, attempt: int = 1, base: int = 0
) -> bytes:
    """A scripted learner's PUSH for round ``step``: 24 local steps of 512 tokens a round,
    ``local_step`` 24·step."""
    built, _ = push_fragment(
        data,
        learner_id=learner_id,
        fragment_id=fragment,
        global_step=step,
        round_attempt=attempt,
        base_version=base,
        local_step=24 * step,
        c_steps=24,
        c_tokens=24 * 512,
    )
    return built


def acceptance_push(
    learner_id: int,
    generation: int,
    step: int,
    *,
    fragment: int | None = None,
    attempt: int = 1,
    base: int = 0,
    claimed_id: int | None = None,
    nan: bool = False,
) -> bytes:
    """The PUSH learner ``learner_id`` (generation ``generation``) sends for round ``step``:
    fragment ``(step − 1) mod F`` unless named, ``c_steps`` 24, ``local_step`` 24·step."""
    fragment = (step - 1) % len(PUSH_NUMELS) if fragment is None else fragment
    values = sample_values(
        f"push acceptance: learner {learner_id}/{generation}, step {step}", PUSH_NUMELS[fragment]
    )
    data = f32_bytes(values)
    if nan:
        data = struct.pack("<I", 0x7FC00000) + data[4:]
    claimed = learner_id if claimed_id is None else claimed_id
    return round_push(data, claimed, fragment, step, attempt=attempt, base=base)


def push_event(learner_id: int, generation: int, step: int, **kwargs: Any) -> Json:
    return frame_event(
        learner_id, generation, acceptance_push(learner_id, generation, step, **kwargs)
    )


def close_event(learner_id: int, generation: int) -> Json:
    return {"event": "close", "id": learner_id, "generation": generation}


def deadline_event(step: int) -> Json:
    return {"event": "quorum_deadline", "step": step}


def commit(step: int) -> list[Json]:
    """Both first generations answer round ``step``, completing it."""
    return commit_based(step, 0)


def commit_based(step: int, base: int) -> list[Json]:
    """Both first generations answer round ``step`` with ``base_version`` ``base``."""
    return [push_event(0, 1, step, base=base), push_event(1, 1, step, base=base)]


#: Learners 0 and 1 (generation 1) connect and learner 0 initializes both fragments: the session
#: starts and rounds 1 (fragment 0) and 2 (fragment 1) launch at version 0, attempt 1, with
#: members (0, 1) and (1, 1).
START = [member_hello(0, 1), member_hello(1, 1), init_event(0), init_event(1)]


def scripted_test(
    comment: str,
    script: list[Json],
    sender: tuple[int, int],
    field: str,
    built: bytes,
    outcome: str,
    flags: tuple[str, ...],
    code: str | None,
) -> Json:
    """A test that runs ``script``, then sends ``built`` (under ``field``) from ``sender``."""
    test: Json = {
        "comment": comment,
        "flags": list(flags),
        "script": script,
        "sender": {"id": sender[0], "generation": sender[1]},
        field: built.hex(),
        "result": outcome,
    }
    if code is not None:
        test["code"] = code
    return test


def acceptance(
    comment: str,
    script: list[Json],
    sender: tuple[int, int],
    push: bytes,
    outcome: str,
    *flags: str,
    code: str | None = None,
    staleness: int | None = None,
) -> Json:
    test = scripted_test(comment, script, sender, "push", push, outcome, flags, code)
    if staleness is not None:
        test["staleness"] = staleness
    return test


# -- what the syncer sends (sends) ---------------------------------------------------------------

#: The syncer of the sends groups: PUSH_SYNCER with an outer step that is exact by construction.
#: --outer-lr 1, --outer-momentum 0, --delta-correction none, --learner-weight equal: with both
#: learners pushing the same delta d, the avg merge is Δ = f32(0.5·(−d)) + f32(0.5·(−d)) = −d
#: exactly, buf' = 0·buf + Δ = Δ, and Θ' = Θ − 1·(0·buf' + Δ) = f32(Θ + d): one f32 addition.
SENDS_SYNCER = replace(
    PUSH_SYNCER, outer_lr=1.0, outer_momentum=0.0, delta_correction="none", learner_weight="equal"
)


def init_values(fragment_id: int) -> F32Array:
    """The values init_event(fragment_id) carries."""
    return sample_values(
        f"push acceptance: INIT of fragment {fragment_id}", PUSH_NUMELS[fragment_id]
    )


def round_delta(step: int) -> F32Array:
    """The delta d every learner pushes for round ``step`` in the sends groups."""
    fragment = (step - 1) % len(PUSH_NUMELS)
    return sample_values(
        f"sends: the delta of round {step}, the same from every learner", PUSH_NUMELS[fragment]
    )


def same_push(learner_id: int, generation: int, step: int, *, attempt: int = 1) -> bytes:
    """Learner ``learner_id``'s PUSH for round ``step`` (base_version 0) carrying round_delta."""
    del generation  # the frame does not name it; the script event does
    fragment = (step - 1) % len(PUSH_NUMELS)
    return round_push(f32_bytes(round_delta(step)), learner_id, fragment, step, attempt=attempt)


def same_push_event(learner_id: int, generation: int, step: int, **kwargs: Any) -> Json:
    return frame_event(learner_id, generation, same_push(learner_id, generation, step, **kwargs))


def round_1_params() -> F32Array:
    """Fragment 0 after round 1 commits in a sends group: f32(Θ + d), computed here in f32."""
    values: F32Array = (init_values(0) + round_delta(1)).astype(np.float32)
    assert values.dtype == np.float32 and np.isfinite(values).all()
    return values


def bcast(fragment_id: int, version: int, values: F32Array) -> str:
    return versioned_fragment(BCAST_FRAGMENT, fragment_id, version, f32_bytes(values))[0].hex()


def final_fragment(fragment_id: int, version: int, values: F32Array) -> str:
    return versioned_fragment(FINAL_FRAGMENT, fragment_id, version, f32_bytes(values))[0].hex()


def pull(step: int, attempt: int = 1) -> str:
    return pull_req((step - 1) % len(PUSH_NUMELS), step, attempt)[0].hex()


def sends(per_group: dict[tuple[int, int], list[str]]) -> list[Json]:
    """The sends field: per destination group, the frames it is queued, in order."""
    return [
        {"id": key[0], "generation": key[1], "frames": frames}
        for key, frames in sorted(per_group.items())
    ]


def with_sends(event_or_test: Json, per_group: dict[tuple[int, int], list[str]]) -> Json:
    """``event_or_test`` with its sends field (a copy: scripts share their events)."""
    return {**event_or_test, "sends": sends(per_group)}


#: Both learners' BCASTs of every fragment at version 0, then the PULLs of rounds 1 and 2.
START_SENDS = [bcast(0, 0, init_values(0)), bcast(1, 0, init_values(1)), pull(1), pull(2)]


def sends_tests() -> list[Json]:
    """Commit BCASTs, launch PULLs and catch-up BCASTs under SENDS_SYNCER (total_steps 1000)."""
    theta = round_1_params()
    committed = [bcast(0, 1, theta), pull(3)]
    superseded = [
        *START,
        with_sends(member_hello(0, 2), {(0, 2): START_SENDS[:2]}),
        same_push_event(0, 1, 1),
    ]
    return [
        with_sends(
            acceptance(
                "learner 1 completes round 1: the commit BCASTs fragment 0 at version 1 "
                "(f32(Θ + d)) to both learners, then round 3 launches and PULLs both",
                [*START, same_push_event(0, 1, 1)],
                (1, 1),
                same_push(1, 1, 1),
                "accepted",
                "Sends",
                staleness=0,
            ),
            {(0, 1): committed, (1, 1): committed},
        ),
        with_sends(
            acceptance(
                "learner 0's PUSH for round 1 is accepted, learner 1's is awaited: nothing is sent",
                START,
                (0, 1),
                same_push(0, 1, 1),
                "accepted",
                "Sends",
                staleness=0,
            ),
            {},
        ),
        with_sends(
            acceptance(
                "generation 2 of learner 0 became ready (its catch-up BCASTs), the superseded "
                "(0, 1) answered round 1, learner 1 completes it: the commit BCAST and round 3's "
                "PULL go to the current generations (0, 2) and (1, 1), none to (0, 1)",
                superseded,
                (1, 1),
                same_push(1, 1, 1),
                "accepted",
                "Sends",
                "NewGeneration",
                staleness=0,
            ),
            {(0, 2): committed, (1, 1): committed},
        ),
        with_sends(
            acceptance(
                "learner 1 completes round 2 while round 1 is in flight: round 2 waits for its "
                "commit, nothing is sent",
                [*START, same_push_event(0, 1, 2)],
                (1, 1),
                same_push(1, 1, 2),
                "accepted",
                "Sends",
                "Pipeline",
                staleness=0,
            ),
            {},
        ),
        with_sends(
            acceptance(
                "generation 2 of learner 0 became ready, then round 1's quorum deadline passed "
                "with no answer: attempt 2 PULLs its members (0, 2) and (1, 1), not (0, 1); "
                "(0, 2)'s answer to attempt 2 sends nothing",
                [
                    *START,
                    with_sends(member_hello(0, 2), {(0, 2): START_SENDS[:2]}),
                    with_sends(deadline_event(1), {(0, 2): [pull(1, 2)], (1, 1): [pull(1, 2)]}),
                ],
                (0, 2),
                same_push(0, 2, 1, attempt=2),
                "accepted",
                "Sends",
                "Retry",
                "NewGeneration",
                staleness=0,
            ),
            {},
        ),
        with_sends(
            acceptance(
                "round 1 committed, then generation 2 of learner 0 became ready: its catch-up "
                "BCASTs carry fragment 0 at version 1 and fragment 1 at version 0; learner 1's "
                "answer to round 2 sends nothing",
                [
                    *START,
                    same_push_event(0, 1, 1),
                    same_push_event(1, 1, 1),
                    with_sends(member_hello(0, 2), {(0, 2): [bcast(0, 1, theta), START_SENDS[1]]}),
                ],
                (1, 1),
                same_push(1, 1, 2),
                "accepted",
                "Sends",
                "NewGeneration",
                staleness=0,
            ),
            {},
        ),
    ]


def final_sends_tests() -> list[Json]:
    """The final cut's frames under SENDS_SYNCER with total_steps 1."""
    theta = round_1_params()
    cut = [
        final_fragment(0, 1, theta),
        final_fragment(1, 0, init_values(1)),
        final_manifest(1, [1, 0])[0].hex(),
    ]
    start = [*START_SENDS[:2], pull(1)]  # total_steps 1: round 1 is the only round
    started = [*START[:3], with_sends(START[3], {(0, 1): start, (1, 1): start})]
    committed = [bcast(0, 1, theta), *cut]
    return [
        with_sends(
            acceptance(
                "--total-steps 1: the session start PULLs round 1 only; learner 1 completes it: "
                "the commit BCAST, then the final cut's FINAL_FRAGMENTs and FINAL_MANIFEST, to "
                "both learners",
                [*started, same_push_event(0, 1, 1)],
                (1, 1),
                same_push(1, 1, 1),
                "accepted",
                "Sends",
                "Final",
                staleness=0,
            ),
            {(0, 1): committed, (1, 1): committed},
        ),
        with_sends(
            acceptance(
                "after the final cut generation 2 of learner 0 (a frozen learner) became ready: "
                "its catch-up BCASTs, then the cut; its PUSH for the committed round 1 is out of "
                "round",
                [
                    *started,
                    same_push_event(0, 1, 1),
                    same_push_event(1, 1, 1),
                    with_sends(
                        member_hello(0, 2),
                        {(0, 2): [bcast(0, 1, theta), START_SENDS[1], *cut]},
                    ),
                ],
                (0, 2),
                same_push(0, 2, 1),
                "rejected",
                "Sends",
                "Final",
                "NewGeneration",
                code="PUSH_OUT_OF_ROUND",
            ),
            {},
        ),
    ]


# -- sends in bf16 and q4 sessions, rda and iso commits ------------------------------------------

#: The rda tensors' delta: RDA_SCALE·(2, −2, 1, 0, …). ‖d‖ = 3·RDA_SCALE and every f64 sum of
#: squares the rda merge forms is exact in any order, so the merge is exact by construction; and
#: f32(0.5/‖d‖)·f32(‖d‖/‖dir‖) ≠ 1 for this scale, so rda's result differs from avg's (−d).
RDA_SCALE = np.float32(0.1)
#: The iso tensors' delta: −diag(0.75, −0.25, …). G = −d is diagonal, so its SVD is exact in any
#: solver: σ̄ = 0.5 and Δ = 0.5·diag(1, −1) (spec/syncer.md § 7's golden, scaled).
ISO_DIAGONAL = (0.75, -0.25)
#: A zero outer momentum and a unit outer lr (SENDS_SYNCER), as the outer step reads them.
MU, LR = np.float32(0.0), np.float32(1.0)


def exact_delta(session: Session, step: int) -> F32Array:
    """The delta every learner pushes for round ``step`` of ``session``: sample values in an avg
    fragment, the structured deltas above in rda and iso fragments (exact in the PUSH dtype)."""
    index = (step - 1) % len(session.numels)
    fragment = session.layout.fragments[index]
    if fragment.mode == AVG:
        if session == S_F32:
            return round_delta(step)  # what same_push carries
        return sample_values(
            f"sends {session.name}: the delta of round {step}", session.numels[index]
        )
    parts = []
    for tensor in fragment.tensors:
        values = np.zeros(tensor.numel, dtype=np.float32)
        if fragment.mode == RDA:
            pattern = np.array([2, -2, 1][: tensor.numel], dtype=np.float32) * RDA_SCALE
            values[: len(pattern)] = pattern
        else:
            rows, cols = tensor.shape[0], tensor.numel // tensor.shape[0]
            grid = values.reshape(rows, cols)
            for i, sigma in enumerate(ISO_DIAGONAL[: min(rows, cols)]):
                grid[i, i] = -sigma
        parts.append(values)
    return np.concatenate(parts).astype(np.float32)


def pushed(session: Session, delta: F32Array) -> F32Array:
    """What the syncer decodes from ``session.push_of(delta)``."""
    if session.dtype == Q4:
        return q4_decode(q4_encode(delta), len(delta))
    return session.bulk_decoded(delta)


def exact_sum_of_squares(values: F32Array) -> float:
    """Σ values² in f64, checked to be the same in every summation order (the spec leaves the
    order open, so the vectors use only sums that every order computes exactly)."""
    squares = [float(v) * float(v) for v in values]
    assert len(squares) <= 6, "orders are checked for short tensors only"
    exact = math.fsum(squares)
    for order in itertools.permutations(squares):
        total = 0.0
        for square in order:
            total += square
        assert total == exact, "the sum of squares depends on its order"
    return exact


def merged_delta(fragment: Fragment, delta: F32Array) -> F32Array:
    """Δ of a round where both learners (equal weights) pushed ``delta`` (spec/syncer.md § 7)."""
    negated = (-delta).astype(np.float32)
    half = np.float32(1.0 / 2.0)  # c_m = f32(w_m / S)
    avg: F32Array = (np.zeros_like(negated) + half * negated) + half * negated
    assert avg.dtype == np.float32 and np.array_equal(avg, negated), "avg: exactly −d"
    if fragment.mode == AVG:
        return avg
    out: F32Array = np.empty_like(avg)
    start = 0
    for tensor in fragment.tensors:
        part, stop = negated[start : start + tensor.numel], start + tensor.numel
        if fragment.mode == RDA:
            norm = math.sqrt(exact_sum_of_squares(part))
            radial = (1.0 * norm + 1.0 * norm) / 2.0
            coefficient = np.float32(1.0 / 2.0 / norm)
            direction = (np.zeros_like(part) + coefficient * part) + coefficient * part
            direction_norm = math.sqrt(exact_sum_of_squares(direction))
            assert direction_norm >= 1e-12
            out[start:stop] = direction * np.float32(radial / direction_norm)
        else:
            rows, cols = tensor.shape[0], tensor.numel // tensor.shape[0]
            grid = avg[start:stop].reshape(rows, cols).astype(np.float64)
            diagonal = np.diag(grid)
            assert np.array_equal(grid, np.diag(diagonal)) and np.all(diagonal != 0), "diagonal G"
            mean = float(np.abs(diagonal).sum()) / min(rows, cols)
            out[start:stop] = np.diag(mean * np.sign(diagonal)).astype(np.float32).reshape(-1)
        start = stop
    assert not np.array_equal(out, avg), "the vector tells this merge mode from avg"
    return out


class ExactRun:
    """The global state of a sends group whose rounds commit exactly (SENDS_SYNCER: outer lr 1,
    momentum 0, no correction, equal weights; both learners push exact_delta)."""

    def __init__(
        self,
        session: Session,
        params: Sequence[F32Array],
        momentum: Sequence[F32Array] | None = None,
        versions: Sequence[int] | None = None,
    ) -> None:
        self.session = session
        self.params = [p.astype(np.float32) for p in params]
        self.momentum = (
            [np.zeros_like(p) for p in self.params]
            if momentum is None
            else [m.astype(np.float32) for m in momentum]
        )
        self.versions = [0] * len(params) if versions is None else list(versions)

    def commit(self, step: int) -> None:
        fragment = (step - 1) % len(self.params)
        delta = merged_delta(
            self.session.layout.fragments[fragment],
            pushed(self.session, exact_delta(self.session, step)),
        )
        buf = MU * self.momentum[fragment] + delta
        theta = self.params[fragment] - LR * (MU * buf + delta)
        assert theta.dtype == np.float32 and np.isfinite(theta).all() and np.isfinite(buf).all()
        self.params[fragment], self.momentum[fragment] = theta, buf
        self.versions[fragment] = step

    def bcast(self, fragment: int) -> str:
        """The BCAST of the fragment's current version, in the session's bulk dtype."""
        data = self.session.bulk_of(self.params[fragment])
        return versioned_fragment(BCAST_FRAGMENT, fragment, self.versions[fragment], data)[0].hex()

    def bcasts(self) -> list[str]:
        return [self.bcast(fragment) for fragment in range(len(self.params))]

    def cut(self, final_step: int) -> list[str]:
        """Every FINAL_FRAGMENT (f32, whatever the session dtype), then FINAL_MANIFEST."""
        finals = [
            final_fragment(fragment, self.versions[fragment], self.params[fragment])
            for fragment in range(len(self.params))
        ]
        return [*finals, final_manifest(final_step, self.versions)[0].hex()]


def session_hello(session: Session, learner_id: int, generation: int) -> Json:
    return {"event": "hello", "hex": session.hello_frame(learner_id, generation, 0).hex()}


def session_init_values(session: Session, fragment_id: int) -> F32Array:
    return sample_values(
        f"sends {session.name}: INIT of fragment {fragment_id}", session.numels[fragment_id]
    )


def session_init_event(session: Session, fragment_id: int) -> Json:
    data = session.bulk_of(session_init_values(session, fragment_id))
    return frame_event(0, 1, init_params(fragment_id, data)[0])


def initialized(session: Session) -> ExactRun:
    """The state after learner 0's INITs: what the syncer decoded, at version 0."""
    return ExactRun(
        session,
        [session.bulk_decoded(session_init_values(session, f)) for f in range(len(session.numels))],
    )


def exact_push(
    session: Session, learner_id: int, step: int, *, base: int = 0, attempt: int = 1
) -> bytes:
    """Learner ``learner_id``'s PUSH for round ``step`` carrying exact_delta in the PUSH dtype."""
    data = session.push_of(exact_delta(session, step))
    fragment = (step - 1) % len(session.numels)
    return round_push(data, learner_id, fragment, step, attempt=attempt, base=base)


def exact_push_event(
    session: Session, learner_id: int, generation: int, step: int, **kwargs: Any
) -> Json:
    return frame_event(learner_id, generation, exact_push(session, learner_id, step, **kwargs))


def pull_of(session: Session, step: int, attempt: int = 1) -> str:
    return pull_req((step - 1) % len(session.numels), step, attempt)[0].hex()


def both(frames: list[str]) -> dict[tuple[int, int], list[str]]:
    """The same frames to (0, 1) and (1, 1)."""
    return {(0, 1): frames, (1, 1): frames}


def dtype_sends_tests(session: Session) -> list[Json]:
    """--total-steps 2 in a bf16 or q4 session: the start, round 1's commit (avg), round 2's
    commit (fragment 1: iso in S_BF16, rda in S_Q4) with the final cut, and a frozen learner's
    new generation after it. BCASTs carry the session's bulk dtype (bf16, also in a q4 session),
    FINAL_FRAGMENTs f32 (spec/dtypes.md § 1)."""
    run = initialized(session)
    dtype = DTYPE_NAMES[session.dtype]
    mode = MODE_NAMES[session.layout.fragments[1].mode]
    started = [
        session_hello(session, 0, 1),
        session_hello(session, 1, 1),
        session_init_event(session, 0),
        with_sends(
            session_init_event(session, 1),
            both([*run.bcasts(), pull_of(session, 1), pull_of(session, 2)]),
        ),
    ]
    run.commit(1)
    committed_1 = both([run.bcast(0)])
    round_1 = [
        with_sends(exact_push_event(session, 0, 1, 1), {}),
        with_sends(exact_push_event(session, 1, 1, 1), committed_1),
    ]
    run.commit(2)
    cut = run.cut(2)
    round_2 = [
        with_sends(exact_push_event(session, 0, 1, 2), {}),
        with_sends(exact_push_event(session, 1, 1, 2), both([run.bcast(1), *cut])),
    ]
    flags = ("Sends", "Iso") if mode == "iso" else ("Sends",)
    return [
        with_sends(
            acceptance(
                f"a {dtype} session: the start's BCASTs carry the INITs' values in bf16; learner "
                "1 completes round 1: the commit BCASTs f32(Θ + d) rounded to bf16 (nearest, ties "
                "to even) at version 1; rounds 1 and 2 are all of --total-steps 2, so no PULL",
                [*started, round_1[0]],
                (1, 1),
                exact_push(session, 1, 1),
                "accepted",
                *flags,
                staleness=0,
            ),
            committed_1,
        ),
        with_sends(
            acceptance(
                f"a {dtype} session: learner 1 completes round 2 ({mode} fragment 1): the "
                "commit's BCAST in bf16, then the final cut: FINAL_FRAGMENTs in f32 (the exact "
                "f32 state, not its bf16 BCAST) and FINAL_MANIFEST",
                [*started, *round_1, round_2[0]],
                (1, 1),
                exact_push(session, 1, 2),
                "accepted",
                *flags,
                "Final",
                staleness=0,
            ),
            both([run.bcast(1), *cut]),
        ),
        with_sends(
            acceptance(
                f"a {dtype} session after the final cut: generation 2 of learner 0 (frozen) "
                "gets its catch-up BCASTs in bf16, then the cut in f32; its PUSH for round 2 is "
                "out of round",
                [
                    *started,
                    *round_1,
                    *round_2,
                    with_sends(session_hello(session, 0, 2), {(0, 2): [*run.bcasts(), *cut]}),
                ],
                (0, 2),
                exact_push(session, 0, 2),
                "rejected",
                *flags,
                "Final",
                "NewGeneration",
                code="PUSH_OUT_OF_ROUND",
            ),
            {},
        ),
    ]


# -- sends around the budget cutoff and after a resume -------------------------------------------

#: SENDS_SYNCER with --learner-budget-steps 100 (the cutoff never completes in its tests).
BUDGET_SENDS_SYNCER = replace(SENDS_SYNCER, learner_budget_steps=100)


def budget_sends_tests() -> list[Json]:
    """What the first accepted BUDGET_DONE sends (nothing: its rounds are cancelled, none
    launches) and what a group that becomes ready after it gets (catch-up BCASTs, no PULL)."""
    run = ExactRun(S_F32, [init_values(0), init_values(1)])  # START's INITs
    run.commit(1)
    report = frame_event(0, 1, budget_done(100)[0])
    return [
        with_sends(
            acceptance(
                "round 2 is complete and waits for round 1, which learner 0 answered; then "
                "learner 0's BUDGET_DONE cancelled both (nothing is sent, no round launches) and "
                "generation 2 of learner 1 became ready (its catch-up BCASTs at version 0; the "
                "cancelled round 2 does not commit): the superseded (1, 1)'s answer to round 1 "
                "is out of round, and nothing commits",
                [
                    *START,
                    with_sends(same_push_event(0, 1, 2), {}),
                    with_sends(same_push_event(1, 1, 2), {}),
                    with_sends(same_push_event(0, 1, 1), {}),
                    with_sends(report, {}),
                    with_sends(member_hello(1, 2), {(1, 2): START_SENDS[:2]}),
                ],
                (1, 1),
                same_push(1, 1, 1),
                "rejected",
                "Sends",
                "Budget",
                "Pipeline",
                code="PUSH_OUT_OF_ROUND",
            ),
            {},
        ),
        with_sends(
            acceptance(
                "round 1 committed (round 3 launched), then learner 0's BUDGET_DONE cancelled "
                "rounds 2 and 3; generation 2 of learner 1 became ready: its catch-up BCASTs "
                "(fragment 0 at version 1, fragment 1 at version 0) and no PULL, since issuance "
                "is closed; learner 0's answer to the cancelled round 3 is out of round",
                [
                    *START,
                    same_push_event(0, 1, 1),
                    with_sends(same_push_event(1, 1, 1), both([run.bcast(0), pull(3)])),
                    with_sends(report, {}),
                    with_sends(member_hello(1, 2), {(1, 2): run.bcasts()}),
                ],
                (0, 1),
                same_push(0, 1, 3),
                "rejected",
                "Sends",
                "Budget",
                "NewGeneration",
                code="PUSH_OUT_OF_ROUND",
            ),
            {},
        ),
    ]


#: The cutoff syncer of the closure: SENDS_SYNCER with a budget and --checkpoint-path.
CUTOFF_SYNCER = replace(BUDGET_SENDS_SYNCER, checkpoint_enabled=True)


def cutoff_sends_tests() -> list[Json]:
    """The report that completes the cutoff sends nothing (spec/closure.md § 3 item 4)."""
    return [
        with_sends(
            session_test(
                "round 1 committed, then learner 0 reported its budget (rounds 2 and 3 "
                "cancelled); learner 1's report completes the cutoff: the unmarked recovery "
                "checkpoint at step 1, exit 0, and no FINAL_FRAGMENT, FINAL_MANIFEST or SHUTDOWN",
                [
                    *START,
                    *commit_same(1),
                    with_sends(frame_event(0, 1, budget_done(100)[0]), {}),
                ],
                (1, 1),
                budget_done(100)[0],
                "cutoff",
                "Sends",
                "Budget",
            ),
            {},
        ),
    ]


def commit_same(step: int) -> list[Json]:
    """Both first generations push round_delta for round ``step`` (base_version 0)."""
    return [same_push_event(0, 1, step), same_push_event(1, 1, step)]


def after_cut_sends_tests() -> list[Json]:
    """--total-steps 1 with a budget: the ordinary rounds ran out first (closure.md § 3 item 6)."""
    return [
        with_sends(
            session_test(
                "--total-steps 1: round 1 committed and the final cut was taken; learner 0's "
                "BUDGET_DONE is then ignored: no tape line, nothing sent (no cut again, no "
                "SHUTDOWN)",
                [*START, *commit_same(1)],
                (0, 1),
                budget_done(100)[0],
                "ignored",
                "Sends",
                "Budget",
                "Final",
            ),
            {},
        ),
    ]


# -- resume --------------------------------------------------------------------------------------

#: The checkpoint the resume groups start from: S_F32 after round C = 3 (F = 2: fragment 0 at
#: version 3, fragment 1 at version 2), with momentum and a ledger of its own. C is odd, so round
#: C + 1 targets fragment 1: a syncer that counted rounds from the resume would pick fragment 0.
RESUME_STEP = 3
RESUME_VERSIONS = (3, 2)


def resume_state() -> ExactRun:
    params = [
        sample_values(f"sends resume: params of fragment {f}", n)
        for f, n in enumerate(S_F32.numels)
    ]
    momentum = [
        sample_values(f"sends resume: momentum of fragment {f}", n)
        for f, n in enumerate(S_F32.numels)
    ]
    return ExactRun(S_F32, params, momentum, RESUME_VERSIONS)


def checkpoint_v3(run: ExactRun, global_step: int) -> bytes:
    """``run``'s state as a V3 checkpoint file (spec/checkpoint.md § 1) of its session: iso
    backend scalar, the session's fingerprint and contract, both learners in the ledger."""
    fingerprint = run.session.layout.fingerprint()
    out = struct.pack("<IB", 0xD1705A80, 0) + fingerprint + struct.pack("<Q", global_step)
    out += struct.pack("<I", len(run.params))
    for version, params, momentum in zip(run.versions, run.params, run.momentum, strict=True):
        out += struct.pack("<QQ", version, len(params)) + f32_bytes(params) + f32_bytes(momentum)
    ledger = [
        (learner, global_step, 24 * global_step, 24 * 512 * global_step) for learner in (0, 1)
    ]
    out += struct.pack("<I", len(ledger)) + b"".join(struct.pack("<IQQQ", *e) for e in ledger)
    return out + fingerprint + struct.pack("<I", 0x52544353) + run.session.hello.contract


#: SENDS_SYNCER started with --resume from the checkpoint (--checkpoint-path set).
RESUME_SYNCER = replace(SENDS_SYNCER, checkpoint_enabled=True, resume=True)


def resumed_start() -> list[Json]:
    """Learners 0 and 1 connect to the resumed syncer: the first gets the checkpoint's fragments
    at once (catch-up), and the second's arrival starts the session: BCASTs of what each was not
    sent yet, then the PULLs of rounds C+1 and C+2."""
    run = resume_state()
    pulls = [pull(RESUME_STEP + 1), pull(RESUME_STEP + 2)]
    return [
        with_sends(member_hello(0, 1), {(0, 1): run.bcasts()}),
        with_sends(member_hello(1, 1), {(0, 1): pulls, (1, 1): [*run.bcasts(), *pulls]}),
    ]


def resume_session_tests() -> list[Json]:
    return [
        with_sends(
            session_test(
                "the syncer resumed at global step 3 (versions 3 and 2): each learner gets the "
                "checkpoint's fragments at their versions, and the start PULLs rounds 4 "
                "(fragment 1) and 5 (fragment 0); "
                "learner 0's INIT of a resumed fragment is ignored and sends nothing",
                resumed_start(),
                (0, 1),
                bytes.fromhex(init_event(0)["hex"]),
                "ignored",
                "Sends",
                "Resume",
            ),
            {},
        ),
        with_sends(
            session_test(
                "after the resumed start, generation 2 of learner 0 became ready: its catch-up "
                "BCASTs carry the checkpoint's fragments at versions 3 and 2, no PULL; its "
                "HEARTBEAT sends nothing",
                [
                    *resumed_start(),
                    with_sends(member_hello(0, 2), {(0, 2): resume_state().bcasts()}),
                ],
                (0, 2),
                heartbeat(0, 5)[0],
                "ignored",
                "Sends",
                "Resume",
                "NewGeneration",
            ),
            {},
        ),
    ]


#: The consolidation syncer of spec/closure.md § 5: resumed at C, --total-steps C + F, quorum M.
CONSOLIDATION_SYNCER = replace(RESUME_SYNCER, total_steps=RESUME_STEP + len(S_F32.numels))


def consolidation_sends_tests() -> list[Json]:
    """Rounds C+1 (rda, fragment 1) and C+2 (avg, fragment 0) after the resume, then the cut."""
    run = resume_state()
    c = RESUME_STEP
    first = [with_sends(exact_push_event(S_F32, 0, 1, c + 1, base=2), {})]
    run.commit(c + 1)
    commit_first = both([run.bcast(1)])
    first.append(with_sends(exact_push_event(S_F32, 1, 1, c + 1, base=2), commit_first))
    run.commit(c + 2)
    cut = run.cut(c + 2)
    return [
        with_sends(
            acceptance(
                "resumed at step 3 with --total-steps 5: learner 1 completes round 4 (rda "
                "fragment 1, launched at the checkpoint's version 2): the commit BCASTs the rda "
                "step at version 4 to both, and no PULL (rounds 4 and 5 are all there is)",
                [*resumed_start(), first[0]],
                (1, 1),
                exact_push(S_F32, 1, c + 1, base=2),
                "accepted",
                "Sends",
                "Resume",
                staleness=0,
            ),
            commit_first,
        ),
        with_sends(
            acceptance(
                "resumed at step 3 with --total-steps 5: learner 1 completes round 5 (avg "
                "fragment 0, launched at the checkpoint's version 3): the commit's BCAST of "
                "f32(Θ + d), then the cut at step 5: FINAL_FRAGMENTs at versions 5 and 4, "
                "FINAL_MANIFEST",
                [
                    *resumed_start(),
                    *first,
                    with_sends(exact_push_event(S_F32, 0, 1, c + 2, base=3), {}),
                ],
                (1, 1),
                exact_push(S_F32, 1, c + 2, base=3),
                "accepted",
                "Sends",
                "Resume",
                "Final",
                staleness=0,
            ),
            both([run.bcast(0), *cut]),
        ),
    ]


def push_acceptance_file() -> Json:
    superseded = [*START, member_hello(0, 2)]
    rounds_1_to_3 = [*START, *commit(1), *commit(2), *commit(3)]
    tests = [
        acceptance(
            "a member's first PUSH for round 1, base_version = launch version 0",
            START,
            (0, 1),
            acceptance_push(0, 1, 1),
            "accepted",
            "Normal",
            staleness=0,
        ),
        acceptance(
            "round 3 (fragment 0) launched at version 1; base_version 0: staleness 1 <= 2",
            [*START, *commit(1)],
            (1, 1),
            acceptance_push(1, 1, 3),
            "accepted",
            "Normal",
            staleness=1,
        ),
        acceptance(
            "round 5 (fragment 0) launched at version 3; base_version 1: staleness 2 = "
            "--max-base-lag",
            rounds_1_to_3,
            (0, 1),
            acceptance_push(0, 1, 5, base=1),
            "accepted",
            "Boundary",
            staleness=2,
        ),
        acceptance(
            "a superseded generation still answers the attempt that captured it",
            superseded,
            (0, 1),
            acceptance_push(0, 1, 1),
            "accepted",
            "NewGeneration",
            staleness=0,
        ),
        acceptance(
            "round 3 was never launched (pipeline 2: rounds 1 and 2 are in flight)",
            START,
            (0, 1),
            acceptance_push(0, 1, 3),
            "rejected",
            "Normal",
            code="PUSH_OUT_OF_ROUND",
        ),
        acceptance(
            "global_step 0: rounds start at 1",
            START,
            (0, 1),
            acceptance_push(0, 1, 0, fragment=0),
            "rejected",
            "Boundary",
            code="PUSH_OUT_OF_ROUND",
        ),
        acceptance(
            "round 1 is committed",
            [*START, *commit(1)],
            (0, 1),
            acceptance_push(0, 1, 1),
            "rejected",
            "Normal",
            code="PUSH_OUT_OF_ROUND",
        ),
        acceptance(
            "round 1 gathers fragment 0; the PUSH names fragment 1",
            START,
            (0, 1),
            acceptance_push(0, 1, 1, fragment=1),
            "rejected",
            "Normal",
            code="PUSH_OUT_OF_ROUND",
        ),
        acceptance(
            "round 2 is complete, waiting for round 1 to commit; learner 0 pushes again: the "
            "complete round (row 5) comes before the duplicate (row 9)",
            [*START, *commit(2)],
            (0, 1),
            acceptance_push(0, 1, 2),
            "rejected",
            "CheckOrder",
            "Pipeline",
            code="PUSH_OUT_OF_ROUND",
        ),
        acceptance(
            "fragment 1 for round 1 at attempt 2: the fragment (row 5) before the attempt (row 7)",
            START,
            (0, 1),
            acceptance_push(0, 1, 1, fragment=1, attempt=2),
            "rejected",
            "CheckOrder",
            code="PUSH_OUT_OF_ROUND",
        ),
        acceptance(
            "round 1 is at attempt 1; the PUSH names attempt 2",
            START,
            (0, 1),
            acceptance_push(0, 1, 1, attempt=2),
            "rejected",
            "Normal",
            code="PUSH_WRONG_ATTEMPT",
        ),
        acceptance(
            "attempt 1 of round 1 was discarded at its quorum deadline and attempt 2 launched at "
            "once (both learners connected); a late answer to attempt 1",
            [*START, deadline_event(1)],
            (1, 1),
            acceptance_push(1, 1, 1),
            "rejected",
            "Retry",
            code="PUSH_WRONG_ATTEMPT",
        ),
        acceptance(
            "learner 1 left and attempt 1 of round 1 was discarded: the round waits for a retry "
            "(1 learner connected, K was 2); a PUSH for attempt 1",
            [*START, close_event(1, 1), deadline_event(1)],
            (0, 1),
            acceptance_push(0, 1, 1),
            "rejected",
            "Retry",
            code="PUSH_WRONG_ATTEMPT",
        ),
        acceptance(
            "the same waiting round; a PUSH for attempt 2, which has not launched",
            [*START, close_event(1, 1), deadline_event(1)],
            (0, 1),
            acceptance_push(0, 1, 1, attempt=2),
            "rejected",
            "Retry",
            code="PUSH_WRONG_ATTEMPT",
        ),
        acceptance(
            "generation 2 of learner 0 connected after round 1 launched: not a member",
            superseded,
            (0, 2),
            acceptance_push(0, 2, 1),
            "rejected",
            "NewGeneration",
            code="PUSH_WRONG_GENERATION",
        ),
        acceptance(
            "round 3 captured generation 2 of learner 0; superseded generation 1 pushes for it",
            [*superseded, *commit(1)],
            (0, 1),
            acceptance_push(0, 1, 3),
            "rejected",
            "NewGeneration",
            code="PUSH_WRONG_GENERATION",
        ),
        acceptance(
            "a non-member with attempt 2: the attempt (row 7) before the generation (row 8)",
            superseded,
            (0, 2),
            acceptance_push(0, 2, 1, attempt=2),
            "rejected",
            "CheckOrder",
            "NewGeneration",
            code="PUSH_WRONG_ATTEMPT",
        ),
        acceptance(
            "a non-member with base_version 5: the generation (row 8) before the base (row 10)",
            superseded,
            (0, 2),
            acceptance_push(0, 2, 1, base=5),
            "rejected",
            "CheckOrder",
            "NewGeneration",
            code="PUSH_WRONG_GENERATION",
        ),
        acceptance(
            "learner 0 already answered attempt 1 of round 1",
            [*START, push_event(0, 1, 1)],
            (0, 1),
            acceptance_push(0, 1, 1),
            "rejected",
            "Normal",
            code="PUSH_DUPLICATE",
        ),
        acceptance(
            "a repeat with base_version 9: the duplicate (row 9) before the base (row 10)",
            [*START, push_event(0, 1, 1)],
            (0, 1),
            acceptance_push(0, 1, 1, base=9),
            "rejected",
            "CheckOrder",
            code="PUSH_DUPLICATE",
        ),
        acceptance(
            "a repeat carrying a NaN: judged (row 9) before decoded (row 13), the connection "
            "stays open",
            [*START, push_event(0, 1, 1)],
            (0, 1),
            acceptance_push(0, 1, 1, nan=True),
            "rejected",
            "CheckOrder",
            "NaN",
            code="PUSH_DUPLICATE",
        ),
        acceptance(
            "round 1 launched at version 0; base_version 1",
            START,
            (0, 1),
            acceptance_push(0, 1, 1, base=1),
            "rejected",
            "Boundary",
            code="PUSH_FUTURE_BASE",
        ),
        acceptance(
            "round 5 launched at version 3; base_version 0: staleness 3 > --max-base-lag 2",
            rounds_1_to_3,
            (1, 1),
            acceptance_push(1, 1, 5),
            "rejected",
            "Boundary",
            code="PUSH_TOO_STALE",
        ),
        acceptance(
            "group (1, 1) sends a PUSH naming learner 0",
            START,
            (1, 1),
            acceptance_push(1, 1, 1, claimed_id=0),
            "fatal",
            "Normal",
            code="LEARNER_ID_MISMATCH",
        ),
        acceptance(
            "learner 0's id from group (1, 1) for round 7, never launched: the identity (row 1) "
            "before the round (row 4)",
            START,
            (1, 1),
            acceptance_push(1, 1, 7, claimed_id=0),
            "fatal",
            "CheckOrder",
            code="LEARNER_ID_MISMATCH",
        ),
        acceptance(
            "a PUSH the round would accept carries a NaN",
            START,
            (0, 1),
            acceptance_push(0, 1, 1, nan=True),
            "fatal",
            "NaN",
            code="NON_FINITE_VALUE",
        ),
        acceptance(
            "learner 0 initialized every fragment, but learner 1 never connected: the session "
            "has not started, so round 1 was never launched",
            [member_hello(0, 1), init_event(0), init_event(1)],
            (0, 1),
            acceptance_push(0, 1, 1),
            "rejected",
            "Normal",
            code="PUSH_OUT_OF_ROUND",
        ),
        acceptance(
            "round 2 is complete but round 1 is not: nothing commits, so round 3 was never "
            "launched",
            [*START, *commit(2)],
            (0, 1),
            acceptance_push(0, 1, 3),
            "rejected",
            "Pipeline",
            code="PUSH_OUT_OF_ROUND",
        ),
        acceptance(
            "round 2 completed first, then round 1: both commit in one event and rounds 3 and 4 "
            "launch; round 3 (fragment 0) launched at fragment 0's version 1, not at "
            "global_step 2",
            [*START, *commit(2), *commit(1)],
            (0, 1),
            acceptance_push(0, 1, 3, base=2),
            "rejected",
            "Pipeline",
            code="PUSH_FUTURE_BASE",
        ),
        acceptance(
            "round 4 (fragment 1) launched at version 2 when round 2 committed; round 3 has since "
            "committed (global_step 3); base_version 0: staleness is 2 - 0, not 3 - 0",
            [*START, *commit(1), *commit(2), *commit_based(3, 1)],
            (1, 1),
            acceptance_push(1, 1, 4),
            "accepted",
            "Boundary",
            staleness=2,
        ),
        acceptance(
            "attempt 1 of round 1 was discarded at its quorum deadline with both learners "
            "connected: attempt 2 launched at once, and takes an answer",
            [*START, deadline_event(1)],
            (0, 1),
            acceptance_push(0, 1, 1, attempt=2),
            "accepted",
            "Retry",
            staleness=0,
        ),
        acceptance(
            "learner 0 answered attempt 1 of round 1, which was then discarded: its response "
            "went with it, so its answer to attempt 2 is no duplicate",
            [*START, push_event(0, 1, 1), deadline_event(1)],
            (0, 1),
            acceptance_push(0, 1, 1, attempt=2),
            "accepted",
            "Retry",
            staleness=0,
        ),
        acceptance(
            "learner 0 connected as generation 5 (which initialized), then as generation 3: "
            "generation 3, admitted later, is current and round 3 captures it",
            [
                member_hello(0, 5),
                member_hello(1, 1),
                init_event(0, 5),
                init_event(1, 5),
                member_hello(0, 3),
                push_event(0, 5, 1),
                push_event(1, 1, 1),
            ],
            (0, 3),
            acceptance_push(0, 3, 3),
            "accepted",
            "NewGeneration",
            staleness=1,
        ),
        acceptance(
            "generation 2 of learner 0 superseded generation 1 and then closed: learner 0 has no "
            "current generation, so round 3 captured only learner 1; generation 1 pushes for it",
            [*START, member_hello(0, 2), close_event(0, 2), *commit(1)],
            (0, 1),
            acceptance_push(0, 1, 3),
            "rejected",
            "NewGeneration",
            code="PUSH_WRONG_GENERATION",
        ),
    ]
    pipeline_3 = [
        acceptance(
            "--pipeline 3 with F = 2 fragments: D = min(3, F) = 2, so round 3 was never launched",
            START,
            (0, 1),
            acceptance_push(0, 1, 3),
            "rejected",
            "Pipeline",
            code="PUSH_OUT_OF_ROUND",
        ),
    ]
    budgeted = [
        acceptance(
            "learner 0's BUDGET_DONE was accepted: it cancelled rounds 1 and 2, so learner 1's "
            "PUSH for round 1 is out of round",
            [*START, frame_event(0, 1, budget_done(100)[0])],
            (1, 1),
            acceptance_push(1, 1, 1),
            "rejected",
            "Budget",
            code="PUSH_OUT_OF_ROUND",
        ),
    ]
    graced = [
        acceptance(
            "quorum 1: learner 0's answer reached K and opened a grace window (no step-time "
            "estimate yet: --grace-ms, 1 s), which is still open; learner 1 answers within it",
            [*START, push_event(0, 1, 1)],
            (1, 1),
            acceptance_push(1, 1, 1),
            "accepted",
            "Grace",
            staleness=0,
        ),
        acceptance(
            "quorum 1, the grace window open; the quorum deadline passed after K was reached and "
            "changed nothing",
            [*START, push_event(0, 1, 1), deadline_event(1)],
            (1, 1),
            acceptance_push(1, 1, 1),
            "accepted",
            "Grace",
            staleness=0,
        ),
    ]
    no_grace = [
        acceptance(
            "quorum 1 and --grace-ms 0: learner 0's answer reached K, the window is 0, so round 1 "
            "completed at once",
            [*START, push_event(0, 1, 1)],
            (1, 1),
            acceptance_push(1, 1, 1),
            "rejected",
            "Grace",
            code="PUSH_OUT_OF_ROUND",
        ),
    ]
    return vector_file(
        "push_acceptance",
        [
            "PUSH acceptance (spec/syncer.md § 6): a syncer with the context's settings runs the",
            "script's events in order (every one is handled normally: no HELLO is refused, no",
            "group is closed, no PUSH is rejected), then receives push from sender: accepted,",
            "rejected with code (dropped, a push_rejected tape line, the connection stays open),",
            "or fatal with code (ERROR on the sender's group, which closes). Time stands still.",
            "Where a test or a script event has sends, the syncer queues exactly those frames in",
            "response to it (the PUSH, or that event), in that order per group, and nothing else.",
        ],
        [
            push_acceptance_group(PUSH_SYNCER, tests),
            push_acceptance_group(replace(PUSH_SYNCER, pipeline=3), pipeline_3),
            push_acceptance_group(BUDGET_SYNCER, budgeted),
            push_acceptance_group(GRACE_SYNCER, graced),
            push_acceptance_group(replace(GRACE_SYNCER, grace_ms=0), no_grace),
            push_acceptance_group(SENDS_SYNCER, sends_tests()),
            push_acceptance_group(replace(SENDS_SYNCER, total_steps=1), final_sends_tests()),
            push_acceptance_group(replace(SENDS_SYNCER, total_steps=2), dtype_sends_tests(S_BF16)),
            push_acceptance_group(replace(SENDS_SYNCER, total_steps=2), dtype_sends_tests(S_Q4)),
            push_acceptance_group(BUDGET_SENDS_SYNCER, budget_sends_tests()),
            push_acceptance_group(
                CONSOLIDATION_SYNCER,
                consolidation_sends_tests(),
                checkpoint=checkpoint_v3(resume_state(), RESUME_STEP),
            ),
        ],
    )


def push_acceptance_group(
    syncer: Profile, tests: list[Json], *, checkpoint: bytes | None = None
) -> Json:
    return {
        "type": "PushAcceptanceTest",
        "context": scripted_context(syncer, checkpoint),
        "tests": tests,
    }


def scripted_context(syncer: Profile, checkpoint: bytes | None) -> Json:
    """The syncer's profile, and the checkpoint file it resumes from (``--resume``), if any."""
    context: Json = {"syncer_profile": syncer.as_json()}
    if checkpoint is not None:
        assert syncer.resume and syncer.checkpoint_enabled
        context["checkpoint"] = checkpoint.hex()
    return context


# -- syncer session rules ------------------------------------------------------------------------


def session_init(fragment_id: int, seed: str, *, nan: bool = False) -> bytes:
    """An INIT_PARAMS of ``fragment_id`` with values of its own (NaN first if ``nan``)."""
    data = S_F32.bulk(fragment_id, f"syncer session: {seed}")
    if nan:
        data = struct.pack("<I", 0x7FC00000) + data[4:]
    return init_params(fragment_id, data)[0]


def session_test(
    comment: str,
    script: list[Json],
    sender: tuple[int, int],
    built: bytes,
    outcome: str,
    *flags: str,
    code: str | None = None,
) -> Json:
    return scripted_test(comment, script, sender, "frame", built, outcome, flags, code)


def syncer_session_file() -> Json:
    both = [member_hello(0, 1), member_hello(1, 1)]
    reconnected = [*both, close_event(0, 1), member_hello(0, 2)]
    reported = [*START, frame_event(0, 1, budget_done(100)[0])]
    rules = [
        session_test(
            "learner 0 initializes fragment 0; both learners connected, nothing held yet",
            both,
            (0, 1),
            session_init(0, "first INIT of fragment 0"),
            "accepted",
            "Normal",
        ),
        session_test(
            "learner 0 initializes fragment 0 before learner 1 connects",
            [member_hello(0, 1)],
            (0, 1),
            session_init(0, "first INIT of fragment 0"),
            "accepted",
            "Normal",
        ),
        session_test(
            "learner 0 initializes the last fragment: every fragment is held, the session starts",
            [*both, init_event(0)],
            (0, 1),
            session_init(1, "first INIT of fragment 1"),
            "accepted",
            "Normal",
        ),
        session_test(
            "generation 2 of learner 0 initializes fragment 0: the rule names the learner id, "
            "not the generation",
            reconnected,
            (0, 2),
            session_init(0, "first INIT of fragment 0"),
            "accepted",
            "NewGeneration",
        ),
        session_test(
            "learner 0 sends INIT of fragment 0 again, with other values: the fragment is held",
            START,
            (0, 1),
            session_init(0, "a repeated INIT of fragment 0"),
            "ignored",
            "Normal",
        ),
        session_test(
            "a repeated INIT of a held fragment carrying a NaN: the held fragment (row 3) comes "
            "before the values (row 5), so it is dropped undecoded and the connection stays open",
            START,
            (0, 1),
            session_init(0, "a repeated INIT of fragment 0", nan=True),
            "ignored",
            "CheckOrder",
            "NaN",
        ),
        session_test(
            "a repeated INIT from a new generation of learner 0 after the session started",
            [*START, member_hello(0, 2)],
            (0, 2),
            session_init(1, "a repeated INIT of fragment 1"),
            "ignored",
            "NewGeneration",
        ),
        session_test(
            "learner 1 sends INIT of fragment 0, which nothing holds yet",
            both,
            (1, 1),
            session_init(0, "INIT from learner 1"),
            "fatal",
            "Normal",
            code="INIT_NOT_ALLOWED",
        ),
        session_test(
            "learner 1 sends INIT of fragment 0, already held: the sender (row 1) before the "
            "held fragment (row 3)",
            START,
            (1, 1),
            session_init(0, "INIT from learner 1"),
            "fatal",
            "CheckOrder",
            code="INIT_NOT_ALLOWED",
        ),
        session_test(
            "learner 1 sends INIT carrying a NaN: the sender (row 1) before the values (row 5)",
            both,
            (1, 1),
            session_init(0, "INIT from learner 1", nan=True),
            "fatal",
            "CheckOrder",
            "NaN",
            code="INIT_NOT_ALLOWED",
        ),
        session_test(
            "FINAL_ACK for step 1000 (--total-steps) while rounds 1 and 2 are in flight",
            START,
            (0, 1),
            final_ack(1000)[0],
            "fatal",
            "Normal",
            code="UNEXPECTED_FINAL_ACK",
        ),
        session_test(
            "FINAL_ACK for step 0 before the session has started (learner 1 not connected)",
            [member_hello(0, 1)],
            (0, 1),
            final_ack(0)[0],
            "fatal",
            "Boundary",
            code="UNEXPECTED_FINAL_ACK",
        ),
        session_test(
            "FINAL_ACK for step 1 from learner 1 after round 1 committed",
            [*START, *commit(1)],
            (1, 1),
            final_ack(1)[0],
            "fatal",
            "Normal",
            code="UNEXPECTED_FINAL_ACK",
        ),
        session_test(
            "BUDGET_DONE with 100 steps; the syncer has no --learner-budget-steps",
            START,
            (0, 1),
            budget_done(100)[0],
            "fatal",
            "Normal",
            code="BUDGET_NOT_CONFIGURED",
        ),
        session_test(
            "BUDGET_DONE before the session has started; the syncer has no budget",
            [member_hello(0, 1)],
            (0, 1),
            budget_done(1)[0],
            "fatal",
            "Boundary",
            code="BUDGET_NOT_CONFIGURED",
        ),
        session_test(
            "group (1, 1) sends a HEARTBEAT naming learner 0",
            START,
            (1, 1),
            heartbeat(0, 5)[0],
            "fatal",
            "Normal",
            code="LEARNER_ID_MISMATCH",
        ),
        session_test(
            "group (1, 1) sends a HEARTBEAT naming learner 1: a step-time report, nothing more",
            START,
            (1, 1),
            heartbeat(1, 5)[0],
            "ignored",
            "Normal",
        ),
    ]
    budgeted = [
        session_test(
            "learner 0's report was accepted; it reports again on the same generation",
            reported,
            (0, 1),
            budget_done(100)[0],
            "fatal",
            "Normal",
            code="DUPLICATE_BUDGET_DONE",
        ),
        session_test(
            "learner 0's report was accepted, then its group closed; generation 2 reports again",
            [*reported, close_event(0, 1), member_hello(0, 2)],
            (0, 2),
            budget_done(100)[0],
            "fatal",
            "NewGeneration",
            code="DUPLICATE_BUDGET_DONE",
        ),
        # Added after the first release of this group: at the end, so no tcId moves.
        session_test(
            "BUDGET_DONE with 99 steps; the budget is 100",
            START,
            (0, 1),
            budget_done(99)[0],
            "fatal",
            "Normal",
            code="BUDGET_MISMATCH",
        ),
        session_test(
            "BUDGET_DONE with 0 steps before the session has started; the budget is 100",
            [member_hello(0, 1)],
            (0, 1),
            budget_done(0)[0],
            "fatal",
            "Boundary",
            code="BUDGET_MISMATCH",
        ),
        session_test(
            "learner 0's report was accepted; it reports again with 101 steps: the step count "
            "(closure.md § 2, second row) is checked before the duplicate (third row)",
            reported,
            (0, 1),
            budget_done(101)[0],
            "fatal",
            "CheckOrder",
            code="BUDGET_MISMATCH",
        ),
    ]
    final_cut = [*START, *commit(1), *commit(2)]
    finalizing = [
        session_test(
            "rounds 1 and 2 committed and the final cut was taken at step 2 (--total-steps 2); "
            "learner 0 acknowledges step 1",
            final_cut,
            (0, 1),
            final_ack(1)[0],
            "fatal",
            "Final",
            code="UNEXPECTED_FINAL_ACK",
        ),
        session_test(
            "the final cut was taken at step 2; learner 0 acknowledges step 3",
            final_cut,
            (0, 1),
            final_ack(3)[0],
            "fatal",
            "Final",
            code="UNEXPECTED_FINAL_ACK",
        ),
        session_test(
            "the final cut was taken at step 2 and learner 1 acknowledged it; learner 0's ACK "
            "for step 2 is the last one awaited",
            [*final_cut, frame_event(1, 1, final_ack(2)[0])],
            (0, 1),
            final_ack(2)[0],
            "finalized",
            "Final",
        ),
    ]
    return vector_file(
        "syncer_session",
        [
            "Syncer session rules (spec/syncer.md § 1, § 12; spec/closure.md § 2): a syncer with",
            "the context's settings runs the script's events in order (every one is handled",
            "normally, as in push_acceptance.json), then receives frame from sender: accepted",
            "(it takes effect), ignored (nothing changes), finalized (the last FINAL_ACK awaited:",
            "SHUTDOWN to every group whose ACK stands, exit 0), or fatal with code (ERROR on the",
            "sender's group, which closes). Time stands still. Where a test or a script event has",
            "sends, the syncer queues exactly those frames in response to it (the frame, or that",
            "event), in that order per group, and nothing else.",
        ],
        [
            syncer_session_group(PUSH_SYNCER, rules),
            syncer_session_group(BUDGET_SYNCER, budgeted),
            syncer_session_group(replace(PUSH_SYNCER, total_steps=2), finalizing),
            syncer_session_group(PUSH_SYNCER, session_sends_tests()),
            syncer_session_group(CUTOFF_SYNCER, cutoff_sends_tests()),
            syncer_session_group(
                replace(BUDGET_SENDS_SYNCER, total_steps=1), after_cut_sends_tests()
            ),
            syncer_session_group(
                RESUME_SYNCER,
                resume_session_tests(),
                checkpoint=checkpoint_v3(resume_state(), RESUME_STEP),
            ),
        ],
    )


def session_sends_tests() -> list[Json]:
    """The session start's and the catch-up BCASTs and PULLs, and INITs that send nothing."""
    hello_0, hello_1 = member_hello(0, 1), member_hello(1, 1)
    init_1 = bytes.fromhex(init_event(1)["hex"])
    return [
        with_sends(
            session_test(
                "both learners are connected and fragment 0 is held; the INIT of fragment 1 "
                "starts the session: every fragment at version 0 to both, then the PULLs of "
                "rounds 1 and 2",
                [hello_0, hello_1, init_event(0)],
                (0, 1),
                init_1,
                "accepted",
                "Sends",
            ),
            {(0, 1): START_SENDS, (1, 1): START_SENDS},
        ),
        with_sends(
            session_test(
                "learner 1 became ready after fragment 0 was initialized and received it as a "
                "catch-up; at the start it gets only fragment 1, learner 0 both",
                [hello_0, init_event(0), with_sends(hello_1, {(1, 1): START_SENDS[:1]})],
                (0, 1),
                init_1,
                "accepted",
                "Sends",
            ),
            {(0, 1): START_SENDS, (1, 1): START_SENDS[1:]},
        ),
        with_sends(
            session_test(
                "an INIT before the session starts sends nothing, even to groups already ready",
                [hello_0, with_sends(hello_1, {})],
                (0, 1),
                bytes.fromhex(init_event(0)["hex"]),
                "accepted",
                "Sends",
            ),
            {},
        ),
        with_sends(
            session_test(
                "every fragment was held when learner 1 became ready: its catch-up BCASTs, and "
                "the start (all M connected) sends learner 0 both fragments and the PULLs to "
                "both; learner 1's HEARTBEAT then sends nothing",
                [
                    hello_0,
                    init_event(0),
                    init_event(1),
                    with_sends(hello_1, {(0, 1): START_SENDS, (1, 1): START_SENDS}),
                ],
                (1, 1),
                heartbeat(1, 5)[0],
                "ignored",
                "Sends",
            ),
            {},
        ),
        with_sends(
            session_test(
                "a repeated INIT of a held fragment after the start sends nothing",
                START,
                (0, 1),
                session_init(0, "a repeated INIT of fragment 0"),
                "ignored",
                "Sends",
            ),
            {},
        ),
        with_sends(
            session_test(
                "generation 2 of learner 0 became ready after the start: its catch-up BCASTs of "
                "both fragments at version 0, no PULL (rounds 1 and 2 fill the pipeline); its "
                "HEARTBEAT sends nothing",
                [*START, with_sends(member_hello(0, 2), {(0, 2): START_SENDS[:2]})],
                (0, 2),
                heartbeat(0, 5)[0],
                "ignored",
                "Sends",
                "NewGeneration",
            ),
            {},
        ),
    ]


def syncer_session_group(
    syncer: Profile, tests: list[Json], *, checkpoint: bytes | None = None
) -> Json:
    return {
        "type": "SyncerSessionTest",
        "context": scripted_context(syncer, checkpoint),
        "tests": tests,
    }


# -- learner session -----------------------------------------------------------------------------

#: α of spec/learner.md § 3 (the default): how the scripts' learner blends a BCAST into its
#: parameters. It only shapes the script's inputs; the session never sees it.
ALPHA = np.float32(0.5)
#: The learner of most scripts; learner 0 would also send INIT_PARAMS (spec/learner.md § 2).
SCRIPT_LEARNER = 1
#: The budget B of the frozen-mode group (spec/learner.md § 10).
LEARNER_BUDGET = 3

Anchor = tuple[int, F32Array]  # (version, decoded f32 values) of a raw anchor


def send(built: bytes) -> Json:
    """Expected effect: the learner sends this frame."""
    return {"effect": "send", "hex": built.hex()}


def apply_broadcast(fragment: int, version: int, values: F32Array) -> Json:
    """Expected effect: blend the decoded global values of BCAST ``version`` into the fragment."""
    return {
        "effect": "apply_broadcast",
        "fragment": fragment,
        "version": version,
        "f32": f32_bytes(values).hex(),
    }


def apply_final(final_global_step: int, fragments: Sequence[F32Array]) -> Json:
    """Expected effect: overwrite every fragment with its final values (no blending)."""
    return {
        "effect": "apply_final",
        "final_global_step": final_global_step,
        "f32": [f32_bytes(values).hex() for values in fragments],
    }


SHUTDOWN_RECEIVED: Json = {"effect": "shutdown"}


def with_value(values: F32Array, at: int, value: float) -> F32Array:
    """``values`` with element ``at`` replaced (a NaN or an infinity, say)."""
    out = values.copy()
    out[at] = value
    return out


class LearnerScript:
    """One LearnerSessionTest under construction: its events and the learner's parameters.

    The parameters are the script's own inputs (what training and blending make of them). Every
    expected effect is stated by the case, from the spec; this class only encodes its tensors.
    """

    def __init__(self, session: Session, seed: str, learner_id: int = SCRIPT_LEARNER) -> None:
        self.session = session
        self.learner_id = learner_id
        self.seed = seed
        self.draws = 0
        self.params = [self.values(numel) for numel in session.numels]
        self.initial = [f32_bytes(values).hex() for values in self.params]
        self.events: list[Json] = []
        #: The raw anchors the case says the learner holds, for the PUSHes it expects.
        self.anchors: dict[int, Anchor] = {}
        self.final_cut: list[F32Array] = []

    def values(self, count: int) -> F32Array:
        """Fresh reproducible values: every call draws new ones."""
        self.draws += 1
        return sample_values(f"learner session: {self.seed} #{self.draws}", count)

    def fragment_values(self, fragment: int) -> F32Array:
        return self.values(self.session.numels[fragment])

    # -- frames the syncer sends ---------------------------------------------------------------
    def bcast(self, fragment: int, version: int, values: F32Array) -> bytes:
        data = self.session.bulk_of(values)
        return versioned_fragment(BCAST_FRAGMENT, fragment, version, data)[0]

    @staticmethod
    def final(fragment: int, version: int, values: F32Array) -> bytes:
        return versioned_fragment(FINAL_FRAGMENT, fragment, version, f32_bytes(values))[0]

    # -- events --------------------------------------------------------------------------------
    def add(self, event: str, effects: Sequence[Json] | None = None, **fields: Any) -> None:
        entry: Json = {"event": event, **fields}
        if effects is not None:
            entry["effects"] = list(effects)
        self.events.append(entry)

    def connect(self, generation: int, num_streams: int = 0, *, init: Sequence[int] = ()) -> None:
        """A new connection group: HELLO, a DATA_HELLO per data stream, learner 0's INITs of
        the fragments ``init`` (those the case says it holds no anchor of), in that order."""
        sent = [self.session.hello_frame(self.learner_id, generation, num_streams)]
        sent += [data_hello(self.learner_id, generation, i)[0] for i in range(num_streams)]
        sent += [init_params(p, self.session.bulk_of(self.params[p]))[0] for p in init]
        effects = [send(built) for built in sent]
        self.add("connect", effects, generation=generation, num_streams=num_streams)

    def receive(self, built: bytes, *effects: Json) -> None:
        self.add("receive", effects, hex=built.hex())

    def broadcast(
        self, fragment: int, version: int, values: F32Array | None = None, *, blend: bool = True
    ) -> F32Array:
        """A BCAST the learner accepts: it becomes the anchor and, with ``blend``, is handed out
        for blending and blended in (``applied``). The decoded anchor is returned."""
        values = self.fragment_values(fragment) if values is None else values
        anchor = self.session.bulk_decoded(values)
        self.anchors[fragment] = (version, anchor)
        if not blend:
            self.receive(self.bcast(fragment, version, values))
            return anchor
        self.receive(
            self.bcast(fragment, version, values), apply_broadcast(fragment, version, anchor)
        )
        self.applied(fragment, version)
        return anchor

    def applied(self, fragment: int, version: int) -> None:
        """The application blended BCAST ``version`` in: θ ← α·θ + (1 − α)·Θ, in f32."""
        theta = self.params[fragment]
        blended = ALPHA * theta + (np.float32(1) - ALPHA) * self.anchors[fragment][1]
        self.params[fragment] = blended.astype(np.float32)
        self.add(
            "applied",
            fragment=fragment,
            version=version,
            params=f32_bytes(self.params[fragment]).hex(),
        )

    def train(self, *tokens: int, params: Sequence[F32Array] | None = None) -> None:
        """``len(tokens)`` local steps; the parameters then hold new values."""
        if params is None:
            params = [self.fragment_values(p) for p in range(len(self.params))]
        self.params = [np.asarray(values, dtype=np.float32) for values in params]
        self.add("train", tokens=list(tokens), params=[f32_bytes(v).hex() for v in self.params])

    def pull(self, fragment: int, step: int, attempt: int = 1) -> None:
        self.receive(pull_req(fragment, step, attempt)[0])

    def push(
        self,
        fragment: int,
        step: int,
        *,
        base: int,
        local_step: int,
        c_steps: int,
        c_tokens: int,
        attempt: int = 1,
    ) -> Json:
        """The PUSH answering PULL (fragment, step, attempt): ``local − raw anchor`` in f32,
        encoded in the PUSH dtype; ``base`` is the version of the anchor the case expects."""
        version, anchor = self.anchors[fragment]
        assert version == base, f"the script's anchor of fragment {fragment} is {version}"
        delta = np.subtract(self.params[fragment], anchor, dtype=np.float32)
        built, _ = push_fragment(
            self.session.push_of(delta),
            learner_id=self.learner_id,
            fragment_id=fragment,
            global_step=step,
            round_attempt=attempt,
            base_version=base,
            local_step=local_step,
            c_steps=c_steps,
            c_tokens=c_tokens,
        )
        return send(built)

    def answer(self, *pushes: Json) -> None:
        self.add("answer_pulls", pushes)

    def apply_final(self, final_global_step: int, fragments: Sequence[F32Array]) -> Json:
        self.final_cut = list(fragments)
        return apply_final(final_global_step, fragments)

    def final_applied(self, final_global_step: int, *, ack: bool = True) -> None:
        """The parameters hold the final cut; the FINAL_ACK goes out unless ``ack`` is False."""
        self.params = list(self.final_cut)
        effects = [send(final_ack(final_global_step)[0])] if ack else []
        self.add("final_applied", effects, final_global_step=final_global_step)

    def connection_lost(self) -> None:
        self.add("connection_lost")

    def heartbeat(self, local_step: int) -> None:
        self.add("heartbeat", [send(heartbeat(self.learner_id, local_step)[0])])

    def budget_done(self, steps: int) -> None:
        self.add("budget_done", [send(budget_done(steps)[0])])

    # -- the test ------------------------------------------------------------------------------
    def completed(self, comment: str, *flags: str) -> Json:
        """Every event happens with exactly its effects."""
        return self._test(comment, flags, "completed")

    def fails(self, comment: str, event: Json, code: str, *flags: str) -> Json:
        """The script runs, then ``event`` (without effects) stops the learner with ``code``."""
        assert "effects" not in event
        test = self._test(comment, flags, "fatal")
        test["event"] = event
        test["code"] = code
        return test

    def fails_on(self, comment: str, built: bytes, code: str, *flags: str) -> Json:
        """The script runs, then receiving ``built`` stops the learner with ``code``."""
        return self.fails(comment, {"event": "receive", "hex": built.hex()}, code, *flags)

    def _test(self, comment: str, flags: tuple[str, ...], result: str) -> Json:
        return {
            "comment": comment,
            "flags": list(flags),
            "params": self.initial,
            "script": self.events,
            "result": result,
        }


def started(session: Session, seed: str, learner_id: int = SCRIPT_LEARNER) -> LearnerScript:
    """Generation 1 is up (no data streams) and the first BCAST of every fragment, version 0,
    was accepted and blended in (learner 0 INITs every fragment first)."""
    script = LearnerScript(session, seed, learner_id)
    init = range(len(session.numels)) if learner_id == 0 else ()
    script.connect(1, init=init)
    for fragment in range(len(session.numels)):
        script.broadcast(fragment, 0)
    return script


def finalized(seed: str) -> tuple[LearnerScript, list[F32Array]]:
    """An f32 learner that received the final cut of step 8 (versions 7 and 8), applied it and
    sent its FINAL_ACK on generation 1; the cut's values are returned."""
    script = started(S_F32, seed)
    cut = [script.fragment_values(0), script.fragment_values(1)]
    script.receive(script.final(0, 7, cut[0]))
    script.receive(script.final(1, 8, cut[1]))
    script.receive(final_manifest(8, [7, 8])[0], script.apply_final(8, cut))
    script.final_applied(8)
    return script, cut


def learner_broadcast_tests() -> list[Json]:
    """spec/learner.md § 3 and § 4 in an f32 session (learner 1; fragments of 5 and 3 values)."""
    tests = []

    s = started(S_F32, "first")
    tests.append(
        s.completed(
            "§ 3: the first BCAST of each fragment is accepted; the learner is handed the decoded "
            "f32 values to blend (the raw anchor) and confirms the blend",
            "Normal",
        )
    )

    s = started(S_F32, "higher")
    s.broadcast(0, 3)
    s.train(100)
    s.pull(0, 4)
    s.answer(s.push(0, 4, base=3, local_step=1, c_steps=1, c_tokens=100))
    tests.append(
        s.completed(
            "§ 3: a higher version is accepted and becomes the anchor; § 5: the PUSH's "
            "base_version is the anchor's version and its delta local − raw anchor (not the "
            "blended value)",
            "Normal",
        )
    )

    s = started(S_F32, "lower")
    s.broadcast(0, 3)
    s.receive(s.bcast(0, 2, s.fragment_values(0)))
    s.train(64)
    s.pull(0, 4)
    s.answer(s.push(0, 4, base=3, local_step=1, c_steps=1, c_tokens=64))
    tests.append(
        s.completed(
            "§ 3 table: a lower version is dropped silently; the anchor stays at version 3",
            "Replay",
        )
    )

    s = started(S_F32, "equal")
    theta = s.fragment_values(0)
    s.broadcast(0, 3, theta)
    s.train(10, 20)
    s.receive(s.bcast(0, 3, theta))
    s.train(30)
    s.pull(0, 4)
    s.answer(s.push(0, 4, base=3, local_step=3, c_steps=3, c_tokens=60))
    tests.append(
        s.completed(
            "§ 3 table: the same version with identical bytes changes nothing: not handed out "
            "again, and (§ 4) the window is not reset",
            "Replay",
        )
    )

    s = started(S_F32, "conflict")
    theta = s.fragment_values(0)
    s.broadcast(0, 3, theta)
    tests.append(
        s.fails_on(
            "§ 3 table: the same version with different bytes is fatal",
            s.bcast(0, 3, with_value(theta, 4, 0.125)),
            "BCAST_CONFLICT",
            "Normal",
        )
    )

    s = started(S_F32, "nan")
    tests.append(
        s.fails_on(
            "§ 3: a NaN in a higher BCAST stops the learner; it is never applied",
            s.bcast(0, 1, with_value(s.fragment_values(0), 2, math.nan)),
            "NON_FINITE_VALUE",
            "NonFinite",
        )
    )

    s = LearnerScript(S_F32, "inf")
    s.connect(1)
    tests.append(
        s.fails_on(
            "§ 3: an infinity in the first BCAST of a fragment stops the learner",
            s.bcast(1, 0, with_value(s.fragment_values(1), 0, -math.inf)),
            "NON_FINITE_VALUE",
            "NonFinite",
        )
    )

    s = started(S_F32, "stale nan")
    s.broadcast(0, 3)
    s.receive(s.bcast(0, 2, with_value(s.fragment_values(0), 0, math.nan)))
    tests.append(
        s.completed(
            "§ 3: the finite check runs when the tensor is decoded, so a lower version that is "
            "dropped is not checked: a NaN in it goes unnoticed",
            "NonFinite",
            "Replay",
        )
    )

    s = started(S_F32, "window")
    s.train(10, 20)
    theta = s.fragment_values(0)
    s.anchors[0] = (1, theta)
    s.receive(s.bcast(0, 1, theta), apply_broadcast(0, 1, theta))
    s.train(30)
    s.applied(0, 1)
    s.train(40)
    s.pull(1, 3)
    s.pull(0, 2)
    s.answer(
        s.push(0, 2, base=1, local_step=4, c_steps=1, c_tokens=40),
        s.push(1, 3, base=0, local_step=4, c_steps=4, c_tokens=100),
    )
    tests.append(
        s.completed(
            "§ 4: every step counts in every fragment's window; applying a BCAST resets that "
            "fragment's window only, and a step taken while it was not yet blended in is not "
            "counted; local_step is cumulative. § 5 item 5: the oldest global_step goes first",
            "Normal",
        )
    )
    return tests


def learner_pull_tests() -> list[Json]:
    """spec/learner.md § 4 and § 5 in the f32 session."""
    tests = []

    s = started(S_F32, "push")
    s.train(100, 120)
    s.pull(0, 1)
    s.answer(s.push(0, 1, base=0, local_step=2, c_steps=2, c_tokens=220))
    tests.append(
        s.completed(
            "§ 5 item 3: PULL_REQ answered with PUSH_FRAGMENT: step and attempt echoed, "
            "base_version of the anchor, cumulative local_step, the window's c_steps and tokens",
            "Normal",
        )
    )

    s = started(S_F32, "once")
    s.train(50)
    s.pull(1, 2)
    s.answer(s.push(1, 2, base=0, local_step=1, c_steps=1, c_tokens=50))
    s.answer()
    s.train(60)
    s.pull(1, 4, 2)
    s.answer(s.push(1, 4, base=0, local_step=2, c_steps=2, c_tokens=110, attempt=2))
    tests.append(
        s.completed(
            "§ 5 item 5: a pull is answered once; § 4: a PUSH does not reset the window, so the "
            "next PUSH (same anchor) covers both steps",
            "Normal",
        )
    )

    s = LearnerScript(S_F32, "overtaken")
    s.connect(1)
    s.train(8)
    s.pull(0, 1)
    s.answer()
    theta = s.fragment_values(0)
    s.anchors[0] = (0, theta)
    s.receive(s.bcast(0, 0, theta), apply_broadcast(0, 0, theta))
    s.answer()
    s.applied(0, 0)
    s.answer()
    s.train(9)
    s.answer(s.push(0, 1, base=0, local_step=2, c_steps=1, c_tokens=9))
    tests.append(
        s.completed(
            "§ 5 item 2: a PULL for a fragment without an anchor waits, then while its BCAST is "
            "not blended in, then while c_steps is 0; it is answered after the next step",
            "Deferred",
        )
    )

    s = started(S_F32, "superseded")
    s.pull(0, 5, 1)
    s.pull(0, 5, 2)
    s.train(7)
    s.answer(s.push(0, 5, base=0, local_step=1, c_steps=1, c_tokens=7, attempt=2))
    tests.append(
        s.completed(
            "§ 5 item 1: a later PULL of the same fragment (a retry, attempt 2) replaces the "
            "pending one: only attempt 2 is answered",
            "Deferred",
        )
    )

    s = started(S_F32, "order")
    s.train(5)
    s.pull(1, 6)
    s.pull(0, 5)
    s.answer(
        s.push(0, 5, base=0, local_step=1, c_steps=1, c_tokens=5),
        s.push(1, 6, base=0, local_step=1, c_steps=1, c_tokens=5),
    )
    tests.append(
        s.completed(
            "§ 5 item 5: two answerable pulls, the lower global_step first whatever their "
            "arrival order",
            "Normal",
        )
    )

    s = started(S_F32, "non-finite delta")
    s.train(4, params=[with_value(s.fragment_values(0), 1, math.inf), s.fragment_values(1)])
    s.pull(0, 2)
    tests.append(
        s.fails(
            "§ 5 item 4: a delta that is not finite is never sent: the learner stops instead",
            {"event": "answer_pulls"},
            "NON_FINITE_VALUE",
            "NonFinite",
        )
    )
    return tests


def learner_final_tests() -> list[Json]:
    """spec/learner.md § 7 in the f32 session."""
    tests = []

    s, _ = finalized("final")
    s.receive(shutdown()[0], SHUTDOWN_RECEIVED)
    tests.append(
        s.completed(
            "§ 7: FINAL_FRAGMENTs, then FINAL_MANIFEST: the cut is handed out (no blending), the "
            "FINAL_ACK goes out once it is applied, and SHUTDOWN after the ACK ends the run",
            "Normal",
        )
    )

    s = started(S_F32, "manifest first")
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(final_manifest(8, [7, 8])[0])
    s.receive(s.final(1, 8, cut[1]))
    s.receive(s.final(0, 7, cut[0]), s.apply_final(8, cut))
    s.final_applied(8)
    tests.append(
        s.completed(
            "§ 7: the manifest and the fragments arrive in any order: the cut is handed out when "
            "the last of them arrives",
            "Normal",
        )
    )

    s = started(S_F32, "final versions")
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(s.final(0, 6, s.fragment_values(0)))
    s.receive(s.final(1, 8, cut[1]))
    s.receive(final_manifest(8, [7, 8])[0])
    s.receive(s.final(0, 5, s.fragment_values(0)))
    s.receive(s.final(1, 8, cut[1]))
    s.receive(s.final(0, 7, cut[0]), s.apply_final(8, cut))
    tests.append(
        s.completed(
            "§ 7 items 1, 3: the cut needs exactly the expected version of every fragment; a "
            "lower FINAL_FRAGMENT is dropped, an identical one is a replay",
            "Replay",
        )
    )

    s = started(S_F32, "final conflict")
    held = s.fragment_values(0)
    s.receive(s.final(0, 7, held))
    tests.append(
        s.fails_on(
            "§ 7 item 1: two FINAL_FRAGMENTs of one fragment and version with different bytes",
            s.final(0, 7, with_value(held, 0, -0.0)),
            "FINAL_CONFLICT",
            "Normal",
        )
    )

    s = started(S_F32, "final nan")
    tests.append(
        s.fails_on(
            "§ 3: a NaN in a FINAL_FRAGMENT stops the learner; it is never applied",
            s.final(1, 8, with_value(s.fragment_values(1), 2, math.nan)),
            "NON_FINITE_VALUE",
            "NonFinite",
        )
    )

    s = started(S_F32, "bcast vs final")
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(s.final(0, 7, cut[0]))
    s.broadcast(0, 7, with_value(cut[0], 0, 1.5))
    s.broadcast(1, 8, cut[1])
    s.receive(final_manifest(8, [7, 8])[0])
    s.receive(s.final(1, 8, cut[1]), s.apply_final(8, cut))
    tests.append(
        s.completed(
            "§ 7 item 1: a BCAST neither conflicts with the final cache (fragment 0, version 7, "
            "other bytes) nor satisfies it (fragment 1, version 8, the same bytes)",
            "Normal",
        )
    )

    s = started(S_F32, "manifest beyond")
    tests.append(
        s.fails_on(
            "§ 7 item 2: an expected version above final_global_step",
            final_manifest(8, [7, 9])[0],
            "BAD_MANIFEST",
            "Boundary",
        )
    )

    s = started(S_F32, "manifests")
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(s.final(0, 9, cut[0]))
    s.receive(s.final(1, 10, cut[1]))
    s.receive(final_manifest(8, [7, 8])[0])
    s.receive(final_manifest(10, [9, 10])[0], s.apply_final(10, cut))
    s.receive(final_manifest(8, [7, 8])[0])
    s.receive(final_manifest(10, [9, 10])[0])
    s.final_applied(10)
    tests.append(
        s.completed(
            "§ 7 item 2: a higher final_global_step replaces the held manifest; a lower one is "
            "dropped and an equal one with the same versions is a replay",
            "Replay",
        )
    )

    s = started(S_F32, "manifest conflict")
    s.receive(final_manifest(8, [7, 8])[0])
    tests.append(
        s.fails_on(
            "§ 7 item 2: two manifests of one final_global_step with different versions",
            final_manifest(8, [8, 8])[0],
            "FINAL_CONFLICT",
            "Normal",
        )
    )

    s = started(S_F32, "early shutdown")
    tests.append(
        s.fails_on(
            "§ 7 item 5: SHUTDOWN before any final cut",
            shutdown()[0],
            "UNEXPECTED_SHUTDOWN",
            "Normal",
        )
    )

    s = started(S_F32, "shutdown before ack")
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(s.final(0, 7, cut[0]))
    s.receive(s.final(1, 8, cut[1]))
    s.receive(final_manifest(8, [7, 8])[0], s.apply_final(8, cut))
    tests.append(
        s.fails_on(
            "§ 7 items 4, 5: SHUTDOWN after the cut was handed out but before it was applied and "
            "ACKed",
            shutdown()[0],
            "UNEXPECTED_SHUTDOWN",
            "Normal",
        )
    )

    s, _ = finalized("replaced manifest")
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(s.final(0, 10, cut[0]))
    s.receive(s.final(1, 10, cut[1]))
    s.receive(final_manifest(10, [10, 10])[0], s.apply_final(10, cut))
    tests.append(
        s.fails_on(
            "§ 7 item 5: the ACK must be for the exact held manifest: after a higher manifest "
            "replaced the ACKed one, SHUTDOWN before its cut is applied and ACKed is fatal",
            shutdown()[0],
            "UNEXPECTED_SHUTDOWN",
            "Normal",
        )
    )

    s, _ = finalized("late bcast")
    s.broadcast(0, 9, blend=False)
    s.receive(shutdown()[0], SHUTDOWN_RECEIVED)
    tests.append(
        s.completed(
            "§ 3: once the final cut was handed to the parameters, a later BCAST is not blended",
            "Normal",
        )
    )

    s, _ = finalized("late conflict")
    tests.append(
        s.fails_on(
            "§ 3: after the final cut, a BCAST is still checked: version 0 with other bytes",
            s.bcast(1, 0, s.fragment_values(1)),
            "BCAST_CONFLICT",
            "Normal",
        )
    )

    s, _ = finalized("after shutdown")
    s.receive(shutdown()[0], SHUTDOWN_RECEIVED)
    s.receive(s.bcast(0, 9, s.fragment_values(0)))
    s.receive(pull_req(0, 10, 1)[0])
    tests.append(
        s.completed(
            "§ 7 item 5: after SHUTDOWN the run is complete; what still arrives is ignored",
            "Normal",
        )
    )
    return tests


def learner_reconnect_tests() -> list[Json]:
    """spec/learner.md § 8 (with § 3's first BCAST per connection and § 7 item 6)."""
    tests = []

    s = started(S_F32, "redial")
    s.pull(0, 1)
    s.train(10)
    s.connection_lost()
    s.connect(2, 2)
    s.receive(s.bcast(0, 0, s.anchors[0][1]))
    s.receive(s.bcast(1, 0, s.anchors[1][1]))
    s.answer()
    s.heartbeat(1)
    s.pull(0, 2)
    s.answer(s.push(0, 2, base=0, local_step=1, c_steps=1, c_tokens=10))
    tests.append(
        s.completed(
            "§ 8: the redial's HELLO differs only in generation and num_streams (§ 1), and a "
            "DATA_HELLO goes out per data stream; the pending pull died with the group; the "
            "anchor, window and local_step are kept, and a replay at the held version is "
            "idempotent",
            "Reconnect",
            "Replay",
        )
    )

    s = started(S_F32, "restarted syncer")
    s.broadcast(0, 3)
    s.train(10)
    s.connection_lost()
    s.connect(2)
    s.pull(0, 3)
    s.answer()
    s.broadcast(0, 2)
    s.train(20)
    s.answer(s.push(0, 3, base=2, local_step=2, c_steps=1, c_tokens=20))
    tests.append(
        s.completed(
            "§ 3, § 8: on a new connection a fragment's PULLs wait for its first BCAST, which "
            "replaces the anchor even when lower (a syncer restarted from an older checkpoint)",
            "Reconnect",
            "Deferred",
        )
    )

    s = started(S_F32, "redone version")
    s.connection_lost()
    s.connect(2)
    s.broadcast(1, 0)
    s.train(3)
    s.pull(1, 1)
    s.answer(s.push(1, 1, base=0, local_step=1, c_steps=1, c_tokens=3))
    tests.append(
        s.completed(
            "§ 3: the first BCAST on a new connection at the held version with other bytes "
            "(the syncer redid the round) is accepted, not a conflict",
            "Reconnect",
        )
    )

    s = started(S_F32, "table again")
    s.broadcast(0, 3)
    s.connection_lost()
    s.connect(2)
    s.broadcast(0, 2)
    s.receive(s.bcast(0, 1, s.fragment_values(0)))
    s.train(6)
    s.pull(0, 3)
    s.answer(s.push(0, 3, base=2, local_step=1, c_steps=1, c_tokens=6))
    tests.append(
        s.completed(
            "§ 3: after the connection's first BCAST of a fragment, the table applies again: a "
            "lower version is dropped",
            "Reconnect",
            "Replay",
        )
    )

    s = started(S_F32, "conflict again")
    s.connection_lost()
    s.connect(2)
    theta = s.broadcast(0, 0)
    tests.append(
        s.fails_on(
            "§ 3: a second BCAST of the new connection with the same version and other bytes",
            s.bcast(0, 0, with_value(theta, 3, 0.5)),
            "BCAST_CONFLICT",
            "Reconnect",
        )
    )

    s = started(S_F32, "used generation")
    s.connection_lost()
    tests.append(
        s.fails(
            "§ 1 item 1: every dial uses a generation the learner never used in the run",
            {"event": "connect", "generation": 1, "num_streams": 0},
            "DUPLICATE_GENERATION",
            "Reconnect",
        )
    )

    s, cut = finalized("ack again")
    s.connection_lost()
    s.connect(2)
    s.receive(s.final(0, 7, cut[0]))
    s.receive(s.final(1, 8, cut[1]))
    s.receive(final_manifest(8, [7, 8])[0], send(final_ack(8)[0]))
    s.receive(shutdown()[0], SHUTDOWN_RECEIVED)
    tests.append(
        s.completed(
            "§ 7 item 6: an ACK counts for one generation: after a reconnect the learner ACKs "
            "again once that generation's manifest arrived, without applying the cut again",
            "Reconnect",
            "Replay",
        )
    )

    s, cut = finalized("shutdown on new generation")
    s.connection_lost()
    s.connect(2)
    s.receive(s.final(0, 7, cut[0]))
    tests.append(
        s.fails_on(
            "§ 7 item 5: SHUTDOWN on a new connection before its manifest arrived (the ACK of "
            "generation 1 does not count)",
            shutdown()[0],
            "UNEXPECTED_SHUTDOWN",
            "Reconnect",
        )
    )

    s = started(S_F32, "lost before ack")
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(s.final(0, 7, cut[0]))
    s.receive(s.final(1, 8, cut[1]))
    s.receive(final_manifest(8, [7, 8])[0], s.apply_final(8, cut))
    s.connection_lost()
    s.connect(2)
    s.final_applied(8, ack=False)
    s.receive(final_manifest(8, [7, 8])[0], send(final_ack(8)[0]))
    tests.append(
        s.completed(
            "§ 7 items 4, 6: the group died before the cut was applied: no ACK on the new group "
            "until its manifest arrives, and then without a second apply",
            "Reconnect",
        )
    )

    s = started(S_F32, "cache kept")
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(s.final(0, 7, cut[0]))
    s.receive(s.final(1, 8, cut[1]))
    s.connection_lost()
    s.connect(2)
    s.receive(final_manifest(8, [7, 8])[0], s.apply_final(8, cut))
    tests.append(
        s.completed(
            "§ 8: the final cache survives a reconnect: the new connection's manifest completes "
            "the cut with the fragments of the old one",
            "Reconnect",
        )
    )

    s = started(S_F32, "manifest here")
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(final_manifest(8, [7, 8])[0])
    s.receive(s.final(0, 7, cut[0]))
    s.connection_lost()
    s.connect(2)
    s.receive(s.final(1, 8, cut[1]))
    s.receive(final_manifest(8, [7, 8])[0], s.apply_final(8, cut))
    tests.append(
        s.completed(
            "§ 7 item 3: the manifest must have arrived on the current connection: one held "
            "from the old connection does not complete the cut",
            "Reconnect",
        )
    )
    return tests


def learner_misc_tests() -> list[Json]:
    """What a learner never receives (§ 1 item 5), and ERROR (§ 9)."""
    s = started(S_F32, "error")
    tests = [
        s.fails_on(
            "§ 9: ERROR from the syncer is fatal: the learner stops and does not redial",
            error_frame("HANDSHAKE_TIMEOUT: data streams did not attach")[0],
            "SYNCER_ERROR",
            "Normal",
        )
    ]
    # One of each kind (the frame files pin every type's direction): a handshake, a bulk and
    # a finalization frame.
    foreign: list[tuple[str, bytes]] = [
        ("HELLO", S_F32.hello_frame(0, 7, 0)),
        ("PUSH_FRAGMENT", push_fragment(S_F32.push_delta(0, "learner session: PUSH"))[0]),
        ("FINAL_ACK", final_ack(8)[0]),
    ]
    for name, built in foreign:
        s = LearnerScript(S_F32, f"never {name}")
        s.connect(1)
        tests.append(
            s.fails_on(
                f"§ 1 item 5: a learner never receives {name}",
                built,
                "WRONG_DIRECTION",
                "Direction",
            )
        )
    # Appended here, after the other groups' tests, so that earlier tcIds keep their meaning.
    s = started(S_F32, "equal nan")
    theta = s.fragment_values(0)
    s.broadcast(0, 3, theta)
    tests.append(
        s.fails_on(
            "§ 3: the same version again with a NaN: the tensor is decoded and checked before "
            "its bytes are compared, so NON_FINITE_VALUE, not BCAST_CONFLICT",
            s.bcast(0, 3, with_value(theta, 1, math.nan)),
            "NON_FINITE_VALUE",
            "NonFinite",
            "CheckOrder",
        )
    )
    tests += learner_gap_tests()  # appended, likewise
    return tests


def learner_gap_tests() -> list[Json]:
    """Rules an independent learner written from the spec could break without any earlier
    vector noticing."""
    tests = []

    s = started(S_F32, "pull then cut")
    s.train(7)
    s.pull(0, 9)  # answerable now, but not answered before the cut arrives
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(s.final(0, 7, cut[0]))
    s.receive(s.final(1, 8, cut[1]))
    s.receive(final_manifest(8, [7, 8])[0], s.apply_final(8, cut))
    s.final_applied(8)
    s.pull(1, 10)  # after the cut, with steps in fragment 1's window
    s.answer()
    tests.append(
        s.completed(
            "§ 7 item 4: once the final cut is applied the learner answers no PULL: neither one "
            "answerable before the cut nor one arriving after it (every round ended before "
            "the cut)",
            "Normal",
        )
    )

    s = started(S_F32, "older generation")
    s.connection_lost()
    s.connect(2)
    s.connection_lost()
    tests.append(
        s.fails(
            "§ 1 item 2: a generation is never reused, not only the one just before",
            {"event": "connect", "generation": 1, "num_streams": 0},
            "DUPLICATE_GENERATION",
            "Reconnect",
        )
    )

    s, _ = finalized("lower manifest")
    s.receive(final_manifest(6, [5, 6])[0])
    s.receive(shutdown()[0], SHUTDOWN_RECEIVED)
    tests.append(
        s.completed(
            "§ 7 item 2: after the ACK a lower manifest is dropped (it does not replace the "
            "held one), so SHUTDOWN still completes the run",
            "Replay",
        )
    )

    s, _ = finalized("manifest replay")
    s.receive(final_manifest(8, [7, 8])[0])
    tests.append(
        s.completed(
            "§ 7 item 2: the held manifest again on the connection that ACKed it: a replay, no "
            "second FINAL_ACK",
            "Replay",
        )
    )

    s, _ = finalized("bad lower manifest")
    tests.append(
        s.fails_on(
            "§ 7 item 2: a manifest is checked before the monotonic rule: a lower one listing a "
            "version above its own step is BAD_MANIFEST, not dropped",
            final_manifest(6, [7, 6])[0],
            "BAD_MANIFEST",
            "CheckOrder",
        )
    )

    s = started(S_F32, "cut handed out")
    s.train(7)
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(s.final(0, 7, cut[0]))
    s.receive(s.final(1, 8, cut[1]))
    s.receive(final_manifest(8, [7, 8])[0], s.apply_final(8, cut))
    s.broadcast(0, 9, blend=False)  # recorded as the anchor, never handed out for blending
    s.pull(1, 10)
    s.answer()
    s.final_applied(8)
    tests.append(
        s.completed(
            "§ 3, § 7 items 3-4: from the moment the cut is handed to the parameters (before "
            "its apply is confirmed) a BCAST is not blended and a PULL is not answered",
            "Normal",
        )
    )

    s, _ = finalized("final after redial")
    s.connection_lost()
    s.connect(2)
    tests.append(
        s.fails_on(
            "§ 3, § 7 item 1: the first-BCAST-per-connection exception is for BCAST only: a "
            "FINAL_FRAGMENT at a held version with other bytes is FINAL_CONFLICT on a new "
            "connection too (a syncer never changes a cut it sent)",
            s.final(0, 7, s.fragment_values(0)),
            "FINAL_CONFLICT",
            "Reconnect",
        )
    )

    s = started(S_F32, "two blends")
    older, newer = s.fragment_values(0), s.fragment_values(0)
    s.receive(s.bcast(0, 1, older), apply_broadcast(0, 1, S_F32.bulk_decoded(older)))
    s.anchors[0] = (2, S_F32.bulk_decoded(newer))
    s.receive(s.bcast(0, 2, newer), apply_broadcast(0, 2, S_F32.bulk_decoded(newer)))
    s.applied(0, 1)
    s.train(5)
    s.pull(0, 3)
    s.answer()
    s.applied(0, 2)
    s.train(6)
    s.answer(s.push(0, 3, base=2, local_step=2, c_steps=1, c_tokens=6))
    tests.append(
        s.completed(
            "§ 5: with two BCASTs of a fragment handed out, confirming the older one restarts "
            "the window, but a pull waits until the newer one (the anchor) is blended in",
            "Deferred",
        )
    )

    s, _ = finalized("after shutdown")
    s.receive(shutdown()[0], SHUTDOWN_RECEIVED)
    s.receive(s.bcast(0, 9, with_value(s.fragment_values(0), 0, math.nan)))
    s.receive(final_manifest(8, [8, 8])[0])
    s.receive(error_frame("late")[0])
    tests.append(
        s.completed(
            "§ 7 item 5, § 9: whatever arrives after SHUTDOWN is ignored, violations (a NaN BCAST, "
            "a conflicting manifest) and ERROR included",
            "NonFinite",
        )
    )
    return tests


def learner_bf16_tests() -> list[Json]:
    """bf16 (fragments of 6 and 4 values): BCAST decodes as bits << 16, PUSH rounds (§ 6)."""
    s = LearnerScript(S_BF16, "bf16")
    s.connect(1)
    anchor = np.array([1.0, -2.0, 0.5, 0.0, 3.0, -0.25], dtype=np.float32)
    s.broadcast(0, 0, anchor)
    s.broadcast(1, 0)  # sample values: rounded to bf16, decoded exactly
    # Deltas: two exact ties (round half to even: down to 1.0, up to 1.015625), values that
    # round, and one that bf16 holds exactly.
    delta = np.array([1.00390625, 1.01171875, 0.1, -0.3, 1e-3, 0.75], dtype=np.float32)
    local = np.add(anchor, delta, dtype=np.float32)
    assert np.array_equal(np.subtract(local, anchor, dtype=np.float32)[:2], delta[:2])
    s.train(100, 28, params=[local, s.fragment_values(1)])
    s.pull(0, 1)
    s.pull(1, 2)
    s.answer(
        s.push(0, 1, base=0, local_step=2, c_steps=2, c_tokens=128),
        s.push(1, 2, base=0, local_step=2, c_steps=2, c_tokens=128),
    )
    tests = [
        s.completed(
            "§ 3, § 6: a bf16 BCAST is decoded as bits << 16 (the anchor); the PUSH delta "
            "local − anchor is computed in f32 and rounded to bf16, ties to even",
            "Rounding",
            "Tie",
        )
    ]

    s = LearnerScript(S_BF16, "bf16 inf")
    s.connect(1)
    data = bf16_from_f32(s.fragment_values(1))
    data[3] = 0x7F80  # +inf
    tests.append(
        s.fails_on(
            "§ 3: a bf16 BCAST holding +inf (0x7f80) stops the learner",
            versioned_fragment(BCAST_FRAGMENT, 1, 0, data.tobytes())[0],
            "NON_FINITE_VALUE",
            "NonFinite",
        )
    )

    s = started(S_BF16, "bf16 final")
    cut = [s.fragment_values(0), s.fragment_values(1)]
    s.receive(s.final(0, 4, cut[0]))
    s.receive(s.final(1, 3, cut[1]))
    s.receive(final_manifest(4, [4, 3])[0], s.apply_final(4, cut))
    s.final_applied(4)
    tests.append(
        s.completed(
            "§ 6: FINAL_FRAGMENT is f32 even in a bf16 session; the cut is applied as sent",
            "Normal",
        )
    )
    return tests


def learner_q4_tests() -> list[Json]:
    """q4 (fragments of 257 and 4 values): BCAST in bf16, PUSH in q4 blocks (§ 6)."""
    s = LearnerScript(S_Q4, "q4")
    s.connect(1)
    s.broadcast(1, 2)
    s.train(12, 13, 14)
    s.pull(1, 3)
    s.answer(s.push(1, 3, base=2, local_step=3, c_steps=3, c_tokens=39))
    return [
        s.completed(
            "§ 6: in a q4 session the BCAST is bf16 and the PUSH carries local − anchor as q4 "
            "blocks (one 132-byte block, zero-padded)",
            "Padding",
        )
    ]


def learner_init_tests() -> list[Json]:
    """Learner 0 in the bf16 session: INIT_PARAMS (§ 2)."""
    s = LearnerScript(S_BF16, "init", learner_id=0)
    s.connect(1, init=[0, 1])
    s.broadcast(0, 0)
    s.connection_lost()
    s.train(5)
    s.connect(2, init=[1])
    tests = [
        s.completed(
            "§ 2: after its HELLO, learner 0 sends INIT_PARAMS of every fragment it holds no "
            "anchor of, its local values in the bulk dtype (bf16); on a redial only those still "
            "without an anchor",
            "Reconnect",
            "Rounding",
        )
    ]
    s = LearnerScript(S_BF16, "init nan", learner_id=0)
    s.params[1] = with_value(s.params[1], 0, math.nan)
    s.initial = [f32_bytes(values).hex() for values in s.params]
    tests.append(
        s.fails(
            "§ 2: an INIT must be finite: a learner 0 holding a NaN does not send it",
            {"event": "connect", "generation": 1, "num_streams": 0},
            "NON_FINITE_VALUE",
            "NonFinite",
        )
    )
    return tests


def learner_budget_tests() -> list[Json]:
    """spec/learner.md § 10 with B = 3 in the f32 session."""
    s = LearnerScript(S_F32, "budget")
    s.connect(1)
    s.train(5)
    s.broadcast(0, 0)
    s.broadcast(1, 0)
    s.train(10, 20)
    s.pull(0, 2)
    s.budget_done(LEARNER_BUDGET)
    s.answer()
    s.broadcast(0, 1, blend=False)
    s.connection_lost()
    s.connect(2)
    s.pull(0, 5)
    s.pull(1, 6)
    s.answer()
    s.broadcast(0, 4, blend=False)
    s.answer(s.push(0, 5, base=4, local_step=3, c_steps=3, c_tokens=35))
    tests = [
        s.completed(
            "§ 10: after exactly B steps, BUDGET_DONE(B); pending pulls are dropped and BCASTs "
            "are no longer blended; a dropped group drops the anchors, so after the redial a "
            "pull waits for the restarted syncer's BCAST, and the frozen PUSH carries "
            "frozen − anchor, local_step = c_steps = B and every token of the B steps",
            "Frozen",
            "Reconnect",
            "Deferred",
        )
    ]
    s = LearnerScript(S_F32, "budget same connection")
    s.connect(1)
    s.broadcast(0, 0)
    s.broadcast(1, 0)
    s.train(10, 20, 30)
    s.budget_done(LEARNER_BUDGET)
    s.pull(0, 4)
    s.answer()
    tests.append(
        s.completed(
            "§ 10 (choice): a PULL that reaches a frozen learner on the connection that carried "
            "its BUDGET_DONE is not answered",
            "Frozen",
        )
    )
    return tests


def learner_session_file() -> Json:
    f32_tests = [
        *learner_broadcast_tests(),
        *learner_pull_tests(),
        *learner_final_tests(),
        *learner_reconnect_tests(),
        *learner_misc_tests(),
    ]
    learner = S_F32.context("learner", learner_id=SCRIPT_LEARNER)
    return vector_file(
        "learner_session",
        [
            "The learner's protocol behaviour (spec/learner.md): a learner with the context's",
            "identity (its HELLO) runs the script's events in order, each with exactly the effects",
            "listed; a fatal test then runs one more event, which stops the learner with code.",
        ],
        [
            learner_group(learner, f32_tests),
            learner_group(
                S_BF16.context("learner", learner_id=SCRIPT_LEARNER), learner_bf16_tests()
            ),
            learner_group(S_Q4.context("learner", learner_id=SCRIPT_LEARNER), learner_q4_tests()),
            learner_group(S_BF16.context("learner", learner_id=0), learner_init_tests()),
            learner_group(
                S_F32.context(
                    "learner", learner_id=SCRIPT_LEARNER, learner_budget_steps=LEARNER_BUDGET
                ),
                learner_budget_tests(),
            ),
            learner_group(S_Q4.context("learner", learner_id=0), learner_q4_init_tests()),
        ],
    )


def learner_q4_init_tests() -> list[Json]:
    """Learner 0 of the q4 session: INIT_PARAMS is in the bulk dtype (bf16), never q4."""
    s = started(S_Q4, "q4 init", learner_id=0)
    return [
        s.completed(
            "§ 2, § 6: learner 0's INIT_PARAMS of a q4 session carry bf16 values (the BCAST "
            "dtype); only PUSH is q4",
            "Normal",
        )
    ]


def learner_group(context: Json, tests: list[Json]) -> Json:
    return {"type": "LearnerSessionTest", "context": context, "tests": tests}


# -- identity ------------------------------------------------------------------------------------

NAMED_LAYOUTS: list[tuple[str, NamedLayout, tuple[str, ...]]] = [
    ("the f32 conformance session", S_F32.layout, ("Normal",)),
    ("the bf16 conformance session (with iso)", S_BF16.layout, ("Iso",)),
    ("the q4 conformance session", S_Q4.layout, ("Normal",)),
    ("the three-fragment conformance session", S_THREE.layout, ("Iso",)),
    (
        "a scalar tensor (shape [], numel 1) and a 4-D convolution kernel under iso",
        layout((AVG, [("temperature", ())]), (ISO, [("conv.weight", (8, 3, 3, 3))])),
        ("Iso", "Boundary"),
    ),
    (
        "non-ASCII tensor names are hashed as UTF-8",
        layout((RDA, [("blöck.wëight", (2, 3)), ("层.偏置", (3,))])),
        ("Unicode",),
    ),
    (
        "two tensors of one fragment in one order ...",
        layout((AVG, [("a.weight", (2, 3)), ("b.weight", (3, 2))])),
        ("Normal",),
    ),
    (
        "... and the same sizes reordered: equal numels, a different fingerprint",
        layout((AVG, [("b.weight", (3, 2)), ("a.weight", (2, 3))])),
        ("Normal",),
    ),
    (
        "a shape change that keeps the numel (2x3 -> 3x2) changes the fingerprint",
        layout((AVG, [("a.weight", (3, 2)), ("b.weight", (3, 2))])),
        ("Normal",),
    ),
]


def identity_file() -> Json:
    fingerprints = [
        {
            "comment": comment,
            "flags": list(flags),
            "layout": named.file_json(),
            "canonical_hex": named.canonical().hex(),
            "fingerprint": named.fingerprint().hex(),
            "result": "valid",
        }
        for comment, named, flags in NAMED_LAYOUTS
    ]
    profile_comments = [
        "defaults for two learners and 100 steps",
        "four learners, quorum 3, profile binding required",
        "every field away from its default",
        "optional fields present with value 0 (a tag of 1, then 0)",
        "maxima of the integer fields",
    ]
    profiles = [
        {
            "comment": comment,
            "flags": ["Boundary"] if "maxima" in comment or "value 0" in comment else ["Normal"],
            "profile": p.as_json(),
            "canonical_hex": p.canonical().hex(),
            "digest": p.digest().hex(),
            "result": "valid",
        }
        for comment, p in zip(profile_comments, PROFILES, strict=True)
    ]
    body = S_F32.hello.payload()

    def mac_test(
        comment: str, key: bytes, body: bytes, mac: bytes, *flags: str, ok: bool = True
    ) -> Json:
        test: Json = {
            "comment": comment,
            "flags": ["HelloMac", *flags],
            "key": key.hex(),
            "body": body.hex(),
            "mac": mac.hex(),
            "result": "valid" if ok else "invalid",
        }
        if not ok:
            test["code"] = "HELLO_AUTH_FAILED"
        return test

    long_key = bytes(range(100))
    macs = [
        mac_test(
            "the f32 session HELLO body, a 32-byte key",
            HELLO_KEY,
            body,
            hello_mac(HELLO_KEY, body),
            "Normal",
        ),
        mac_test("a one-byte key", b"k", body, hello_mac(b"k", body), "Boundary"),
        mac_test(
            "a 100-byte key (longer than the SHA-256 block: hashed first)",
            long_key,
            body,
            hello_mac(long_key, body),
            "Boundary",
        ),
        mac_test(
            "the bf16 session HELLO body with a profile hash",
            HELLO_KEY,
            replace(S_BF16.hello, profile=PROFILES[1].digest()).payload(),
            hello_mac(HELLO_KEY, replace(S_BF16.hello, profile=PROFILES[1].digest()).payload()),
            "ProfileHash",
        ),
        mac_test(
            "MAC without the domain string",
            HELLO_KEY,
            body,
            hmac.new(HELLO_KEY, body, hashlib.sha256).digest(),
            ok=False,
        ),
        mac_test("MAC under another key", HELLO_KEY, body, hello_mac(OTHER_KEY, body), ok=False),
        mac_test(
            "last byte of the MAC flipped",
            HELLO_KEY,
            body,
            hello_mac(HELLO_KEY, body)[:-1] + bytes([hello_mac(HELLO_KEY, body)[-1] ^ 0x80]),
            ok=False,
        ),
        mac_test(
            "plain SHA-256 of domain and body instead of HMAC",
            HELLO_KEY,
            body,
            hashlib.sha256(HELLO_MAC_DOMAIN + body).digest(),
            ok=False,
        ),
    ]
    return vector_file(
        "identity",
        [
            "Session identity: layout fingerprints of named layouts, syncer profile hashes of",
            "configurations, and HELLO MACs. canonical_hex is the exact SHA-256 preimage.",
            "Layout files (spec/checkpoint.md § 6): the file's bytes, then its fingerprint or",
            "CKPT_BAD_LAYOUT.",
        ],
        [
            {"type": "LayoutFingerprintTest", "tests": fingerprints},
            {"type": "ProfileHashTest", "tests": profiles},
            {"type": "HelloMacTest", "tests": macs},
            {"type": "LayoutFileTest", "tests": layout_file_tests()},
        ],
    )


def layout_file_tests() -> list[Json]:
    """Layout files as `yeto checkpoint export` reads them: strict types, no coercion."""
    named = S_THREE.layout
    good = named.file_json()
    fingerprint = named.fingerprint().hex()
    first, *rest = good["fragments"]

    def text(document: Any) -> bytes:
        return json.dumps(document, indent=2, ensure_ascii=False).encode("utf-8")

    def with_fragments(*fragments: Json) -> Json:
        return {"format": "yeto-layout-v1", "fragments": list(fragments)}

    def with_tensor(**changes: Any) -> Json:
        """``good`` with the first tensor of its first fragment changed."""
        tensors = [{**first["tensors"][0], **changes}, *first["tensors"][1:]]
        return with_fragments({**first, "tensors": tensors}, *rest)

    def ok(comment: str, data: bytes, named_layout: NamedLayout, *flags: str) -> Json:
        return {
            "comment": comment,
            "flags": list(flags),
            "hex": data.hex(),
            "fingerprint": named_layout.fingerprint().hex(),
            "result": "valid",
        }

    def bad(comment: str, data: bytes, *flags: str) -> Json:
        return {
            "comment": comment,
            "flags": list(flags),
            "hex": data.hex(),
            "result": "invalid",
            "code": "CKPT_BAD_LAYOUT",
        }

    scalar = layout((AVG, [("t", ())]))
    deep = layout((AVG, [("t", (1,) * 64)]))
    widest = layout((AVG, [("t", ((1 << 64) - 1,))]))
    annotated = [
        {**f, "x": [], "tensors": [{**t, "dtype": "f32"} for t in f["tensors"]]}
        for f in good["fragments"]
    ]
    wrong_digit = fingerprint[:-1] + ("0" if fingerprint[-1] != "0" else "1")
    first_shape = first["tensors"][0]["shape"]
    head, *tail = named.fragments
    renamed = Tensor("w\U0001f600", head.tensors[0].shape)
    pair = NamedLayout((Fragment(head.mode, (renamed, *head.tensors[1:])), *tail))

    def with_dimension_token(token: bytes) -> bytes:
        """``good`` whose first tensor's first dimension is written as ``token`` verbatim."""
        shape = ["DIMENSION", *first_shape[1:]]
        return text(with_tensor(shape=shape)).replace(b'"DIMENSION"', token)

    return [
        ok("as yeto writes it", text({**good, "fingerprint": fingerprint}), named, "Normal"),
        ok("without the optional fingerprint", text(good), named, "Normal"),
        ok("fingerprint null counts as absent", text({**good, "fingerprint": None}), named),
        ok(
            "unknown keys are ignored at every level",
            text({**with_fragments(*annotated), "note": 1}),
            named,
        ),
        ok("a scalar tensor: shape []", text(scalar.file_json()), scalar, "Boundary"),
        ok("64 dimensions (the most)", text(deep.file_json()), deep, "Boundary"),
        ok("a dimension of 2^64-1", text(widest.file_json()), widest, "Boundary"),
        bad("not JSON", b"{format: yeto-layout-v1}"),
        bad("an empty file", b""),
        bad(
            "a name that is not UTF-8 (Latin-1 \u00e9)",
            text(with_tensor(name="caf\u00e9")).replace("caf\u00e9".encode(), b"caf\xe9"),
        ),
        bad("a JSON array", text([good])),
        bad("another format", text({**good, "format": "yeto-layout-v2"})),
        bad("no format", text({"fragments": good["fragments"]})),
        bad("no fragments", text(with_fragments())),
        bad(
            "merge_mode AVG (names are lower case)",
            text(with_fragments({**first, "merge_mode": "AVG"}, *rest)),
        ),  # fmt: skip
        bad("a fragment without tensors", text(with_fragments({**first, "tensors": []}, *rest))),
        bad("a number as a name", text(with_tensor(name=5))),
        bad(
            "a lone surrogate as a name (the JSON escape \\ud800)",
            json.dumps(with_tensor(name="\ud800")).encode("ascii"),
        ),
        bad("a dimension 4.9 (never cut to 4)", text(with_tensor(shape=[4.9]))),
        bad("a dimension 4.0", text(with_tensor(shape=[4.0]))),
        bad('a dimension "4"', text(with_tensor(shape=["4"]))),
        bad("a dimension true", text(with_tensor(shape=[True]))),
        bad("a dimension 0", text(with_tensor(shape=[0, 4])), "Boundary"),
        bad("a dimension 2^64", text(with_tensor(shape=[1 << 64])), "Boundary"),
        bad("65 dimensions", text(with_tensor(shape=[1] * 65)), "Boundary"),
        bad("numel over 2^64-1", text(with_tensor(shape=[1 << 32, 1 << 32])), "IntegerOverflow"),
        bad(
            "a name used twice",
            text(
                with_fragments(
                    *good["fragments"], {"merge_mode": "avg", "tensors": first["tensors"][:1]}
                )
            ),
        ),  # fmt: skip
        bad(
            "an iso tensor of one dimension",
            text(with_fragments({"merge_mode": "iso", "tensors": [{"name": "a", "shape": [4]}]})),
        ),  # fmt: skip
        bad(
            "a fingerprint that is not the fragments' (last digit changed)",
            text({**good, "fingerprint": wrong_digit}),
        ),
        bad("the fingerprint in upper case", text({**good, "fingerprint": fingerprint.upper()})),
        # Added after the first release of this group: at the end, so no tcId moves. A
        # dimension is judged by its token: an exponent form is a defect even when its value
        # is a whole number in range.
        bad("a dimension 4e0 (an exponent, value 4)", with_dimension_token(b"4e0")),
        bad("a dimension 1E1 (an exponent, value 10)", with_dimension_token(b"1E1")),
        bad("a dimension 40e-1 (a negative exponent, value 4)", with_dimension_token(b"40e-1")),
        bad("a dimension -0", with_dimension_token(b"-0"), "Boundary"),
        ok(
            "a name spelled with a surrogate pair escape (\\ud83d\\ude00 is U+1F600)",
            json.dumps(with_tensor(name="w\U0001f600")).encode("ascii"),
            pair,
        ),
        # Strict RFC 8259 (spec/checkpoint.md § 6): a repeated key and the NaN, Infinity and
        # -Infinity tokens are defects wherever they stand, in ignored keys too.
        bad(
            'the key "format" twice, with the same value',
            text(good).replace(b"{", b'{\n  "format": "yeto-layout-v1",', 1),
        ),
        bad(
            'a tensor with the key "shape" twice',
            with_dimension_token(b'1, 1], "shape": [1'),
        ),
        bad(
            "a key repeated inside an ignored object",
            text({**good, "note": "NOTE"}).replace(b'"NOTE"', b'{"a": 1, "a": 1}'),
        ),
        bad(
            "NaN as the value of an ignored key",
            text({**good, "note": "NOTE"}).replace(b'"NOTE"', b"NaN"),
        ),
        bad(
            "Infinity in an ignored list of a fragment",
            text(with_fragments({**first, "x": "X"}, *rest)).replace(b'"X"', b"[Infinity]"),
        ),
        bad("a dimension -Infinity", with_dimension_token(b"-Infinity")),
        bad("an empty name", text(with_tensor(name="")), "Boundary"),
    ]


# -- output --------------------------------------------------------------------------------------

FILES: dict[str, Callable[[], Json]] = {
    "hello.json": hello_file,
    "hello_variants.json": hello_variants_file,
    "admission.json": admission_file,
    "attach_sequences.json": attach_sequences_file,
    "push_acceptance.json": push_acceptance_file,
    "syncer_session.json": syncer_session_file,
    "learner_session.json": learner_session_file,
    "data_hello.json": data_hello_file,
    "init_params.json": init_params_file,
    "pull_req.json": pull_req_file,
    "push_fragment.json": push_fragment_file,
    "bcast_fragment.json": bcast_fragment_file,
    "heartbeat.json": heartbeat_file,
    "shutdown.json": shutdown_file,
    "chunk.json": chunk_file,
    "error.json": error_file,
    "final_manifest.json": final_manifest_file,
    "final_ack.json": final_ack_file,
    "final_fragment.json": final_fragment_file,
    "budget_done.json": budget_done_file,
    "header.json": header_file,
    "chunk_sequences.json": chunk_sequences_file,
    "codecs.json": codecs_file,
    "identity.json": identity_file,
}


def render(doc: Json) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in FILES.items():
        path = out_dir / name
        path.write_text(render(build()), encoding="utf-8")
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "vectors",
        help="directory to write the vector files into (default: conformance/vectors)",
    )
    args = parser.parse_args(argv)
    total = 0
    for path in write_all(args.out):
        count = json.loads(path.read_text(encoding="utf-8"))["numberOfTests"]
        total += count
        print(f"{path.name:24} {count:4} tests")
    print(f"{'total':24} {total:4} tests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
