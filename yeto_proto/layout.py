"""Fragment layouts: the numeric layout HELLO carries, and the named layout behind its fingerprint.

``WireLayout`` is what the syncer sees and decodes with. ``Layout`` adds tensor names and full
shapes; the learner derives the HELLO layout and the layout fingerprint from it, and
``yeto checkpoint export`` maps flat fragments back to named tensors with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .constants import U64_MAX, MergeMode
from .errors import ErrorCode, LocalProtocolError

FINGERPRINT_DOMAIN = b"yeto-layout-v1\0"
LAYOUT_FILE_FORMAT = "yeto-layout-v1"


@dataclass(frozen=True, slots=True)
class WireFragment:
    """One fragment as HELLO describes it: merge mode, tensor numels, iso matrix shapes."""

    merge_mode: MergeMode
    numels: tuple[int, ...]
    #: (rows, cols) per tensor for iso fragments; empty otherwise.
    matrix_shapes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if type(self.merge_mode) is not MergeMode:
            object.__setattr__(self, "merge_mode", MergeMode(self.merge_mode))
        if not self.numels:
            raise LocalProtocolError(ErrorCode.EMPTY_FRAGMENT, "a fragment needs a tensor")
        if min(self.numels) <= 0:
            raise LocalProtocolError(ErrorCode.ZERO_NUMEL, "every numel must be in 1..2^64-1")
        if max(self.numels) > U64_MAX or sum(self.numels) > U64_MAX:
            raise LocalProtocolError(ErrorCode.SIZE_OVERFLOW, "fragment numel overflows u64")
        if self.merge_mode is MergeMode.ISO:
            if len(self.matrix_shapes) != len(self.numels):
                raise LocalProtocolError(ErrorCode.BAD_ISO_SHAPE, "iso needs rows, cols per tensor")
            for (rows, cols), numel in zip(self.matrix_shapes, self.numels, strict=True):
                if rows <= 0 or cols <= 0 or rows * cols != numel:
                    raise LocalProtocolError(
                        ErrorCode.BAD_ISO_SHAPE, f"iso {rows}x{cols} does not cover numel {numel}"
                    )
        elif self.matrix_shapes:
            raise LocalProtocolError(ErrorCode.BAD_ISO_SHAPE, "only iso fragments carry shapes")

    @property
    def numel(self) -> int:
        return sum(self.numels)


@dataclass(frozen=True, slots=True)
class WireLayout:
    fragments: tuple[WireFragment, ...]

    def __post_init__(self) -> None:
        if not self.fragments:
            raise LocalProtocolError(ErrorCode.NO_FRAGMENTS, "a layout needs a fragment")

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(f.numel for f in self.fragments)

    @property
    def max_numel(self) -> int:
        return max(self.numels)

    def __len__(self) -> int:
        return len(self.fragments)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d <= 0 for d in self.shape):
            raise LocalProtocolError(ErrorCode.ZERO_NUMEL, f"{self.name}: empty shape {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """Row-major rows x cols used by iso: the first dimension against the rest."""
        if len(self.shape) < 2:
            raise LocalProtocolError(ErrorCode.BAD_ISO_SHAPE, f"{self.name}: iso needs ndim >= 2")
        return self.shape[0], self.numel // self.shape[0]


@dataclass(frozen=True, slots=True)
class FragmentSpec:
    merge_mode: MergeMode
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "merge_mode", MergeMode(self.merge_mode))
        object.__setattr__(self, "tensors", tuple(self.tensors))

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def wire(self) -> WireFragment:
        shapes = (
            tuple(t.matrix_shape for t in self.tensors) if self.merge_mode is MergeMode.ISO else ()
        )
        return WireFragment(self.merge_mode, tuple(t.numel for t in self.tensors), shapes)


@dataclass(frozen=True, slots=True)
class Layout:
    """Named fragments in HELLO order; tensors concatenate in order inside a fragment."""

    fragments: tuple[FragmentSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "fragments", tuple(self.fragments))
        self.wire()  # validates every fragment
        names = [t.name for f in self.fragments for t in f.tensors]
        if len(set(names)) != len(names):
            raise LocalProtocolError(ErrorCode.SESSION_LAYOUT_MISMATCH, "tensor names repeat")

    def wire(self) -> WireLayout:
        return WireLayout(tuple(f.wire() for f in self.fragments))

    def fingerprint(self) -> bytes:
        return layout_fingerprint(self)

    def offsets(self) -> list[list[tuple[TensorSpec, int]]]:
        """Per fragment, each tensor with its element offset inside the flat fragment."""
        out: list[list[tuple[TensorSpec, int]]] = []
        for fragment in self.fragments:
            at = 0
            placed = []
            for tensor in fragment.tensors:
                placed.append((tensor, at))
                at += tensor.numel
            out.append(placed)
        return out

    # -- the layout file (spec/checkpoint.md) -----------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        return {
            "format": LAYOUT_FILE_FORMAT,
            "fingerprint": self.fingerprint().hex(),
            "fragments": [
                {
                    "merge_mode": f.merge_mode.name.lower(),
                    "tensors": [{"name": t.name, "shape": list(t.shape)} for t in f.tensors],
                }
                for f in self.fragments
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), indent=2) + "\n"

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Read a layout document strictly: a value of the wrong type is refused, never coerced.

        Any defect raises ``ValueError`` (a ``LocalProtocolError`` for Layout's own rules).
        """
        if not isinstance(data, Mapping):
            raise ValueError("a layout file is a JSON object")
        if data.get("format") != LAYOUT_FILE_FORMAT:
            raise ValueError(f"layout file format must be {LAYOUT_FILE_FORMAT!r}")
        raw_fragments = data.get("fragments")
        if not isinstance(raw_fragments, list) or not raw_fragments:
            raise ValueError("fragments must be a non-empty list")
        layout = cls(tuple(_fragment_from_json(i, raw) for i, raw in enumerate(raw_fragments)))
        computed = layout.fingerprint().hex()
        declared = data.get("fingerprint")
        if declared is not None and declared != computed:
            raise ValueError("layout file fingerprint does not match its fragments")
        return layout

    @classmethod
    def from_json(cls, text: str) -> Layout:
        """Read a layout file's text as JSON without Python's extensions to RFC 8259: a
        repeated key and the ``NaN``/``Infinity`` tokens are refused (``ValueError``), so that
        every reader of the file sees the same document. (Python's own limits remain: an
        integer of over 4,300 digits or very deep nesting is refused too.)"""
        return cls.from_json_dict(
            json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_not_json)
        )


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice in one object")
        seen[key] = value
    return seen


def _not_json(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON value")


#: numpy's limit, so that every tensor of the file can be exported as an array.
MAX_TENSOR_DIMS = 64
_JSON_MERGE_MODES = {mode.name.lower(): mode for mode in MergeMode}


def _fragment_from_json(index: int, raw: object) -> FragmentSpec:
    where = f"fragment {index}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not an object")
    mode = raw.get("merge_mode")
    if not isinstance(mode, str) or mode not in _JSON_MERGE_MODES:
        raise ValueError(f"{where}: merge_mode must be one of {sorted(_JSON_MERGE_MODES)}")
    raw_tensors = raw.get("tensors")
    if not isinstance(raw_tensors, list) or not raw_tensors:
        raise ValueError(f"{where}: tensors must be a non-empty list")
    tensors = tuple(_tensor_from_json(f"{where} tensor {i}", t) for i, t in enumerate(raw_tensors))
    return FragmentSpec(_JSON_MERGE_MODES[mode], tensors)


def _tensor_from_json(where: str, raw: object) -> TensorSpec:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not an object")
    name, shape = raw.get("name"), raw.get("shape")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name must be a non-empty string")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: name is not valid Unicode text") from None
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS:
        raise ValueError(f"{where}: shape must be a list of at most {MAX_TENSOR_DIMS} sizes")
    # bool is an int subclass, and a float such as 4.9 must not become 4.
    if not all(type(d) is int and 1 <= d <= U64_MAX for d in shape):
        raise ValueError(f"{where}: every dimension must be an integer in 1..2^64-1")
    if math.prod(shape) > U64_MAX:
        raise ValueError(f"{where}: numel exceeds 2^64-1")
    return TensorSpec(name, tuple(shape))


def layout_fingerprint(layout: Layout) -> bytes:
    """SHA-256 over the canonical encoding pinned in spec/identity.md."""
    h = hashlib.sha256(FINGERPRINT_DOMAIN)
    h.update(struct.pack("<I", len(layout.fragments)))
    for fragment in layout.fragments:
        h.update(struct.pack("<BI", fragment.merge_mode, len(fragment.tensors)))
        for tensor in fragment.tensors:
            name = tensor.name.encode("utf-8")
            h.update(struct.pack("<I", len(name)))
            h.update(name)
            h.update(struct.pack("<QI", tensor.numel, len(tensor.shape)))
            h.update(struct.pack(f"<{len(tensor.shape)}Q", *tensor.shape))
    return h.digest()
