"""From a torch model's trainable parameters to a named fragment layout, and a session contract.

Names are normalized so that the same model wrapped by DDP, FSDP or ``torch.compile`` yields the
same layout (and so the same fingerprint); the learner itself syncs full replicas only (no
sharded DTensors). Matrices (ndim >= 2) can merge with rda or iso; a fragment has one merge
mode, so matrices and the rest are packed into separate fragments. A tensor is never split:
a model of n tensors has at most n fragments.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from yeto_proto import FragmentSpec, Layout, MergeMode, TensorSpec, WireDtype

CONTRACT_DOMAIN = b"yeto-session-contract-v1\0"

#: Path components that wrappers insert and that carry no meaning of the model itself.
WRAPPER_COMPONENTS = frozenset(
    {"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module"}
)
_LAYER_INDEX = re.compile(r"^\d+$")


class FragmentPattern(enum.Enum):
    #: size-balanced bin packing (largest tensor first into the lightest fragment)
    BALANCED = "balanced"
    #: whole layers dealt round-robin: layer k goes to fragment k mod F
    STRIDED = "strided"


def normalize_name(name: str) -> str:
    """Drop wrapper components: ``module._orig_mod.layers.0.w`` → ``layers.0.w``."""
    parts = [p for p in name.split(".") if p not in WRAPPER_COMPONENTS]
    return ".".join(parts) if parts else name


@dataclass(frozen=True, slots=True)
class NamedShape:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        total = 1
        for d in self.shape:
            total *= d
        return total

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) >= 2


def _layer_key(name: str) -> str:
    """The unit strided packing deals: the path up to the first numeric component."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if _LAYER_INDEX.match(part):
            return ".".join(parts[: i + 1])
    return name


def _balanced(tensors: Sequence[NamedShape], bins: int) -> list[list[int]]:
    loads = [0] * bins
    members: list[list[int]] = [[] for _ in range(bins)]
    for index in sorted(range(len(tensors)), key=lambda i: (-tensors[i].numel, i)):
        target = min(range(bins), key=lambda b: (loads[b], b))
        loads[target] += tensors[index].numel
        members[target].append(index)
    return [sorted(m) for m in members]


def _strided(tensors: Sequence[NamedShape], bins: int) -> list[list[int]]:
    units: dict[str, int] = {}
    members: list[list[int]] = [[] for _ in range(bins)]
    for index, tensor in enumerate(tensors):
        unit = units.setdefault(_layer_key(tensor.name), len(units))
        members[unit % bins].append(index)
    return members


def _pack(
    tensors: Sequence[NamedShape], bins: int, pattern: FragmentPattern
) -> list[list[NamedShape]]:
    bins = max(1, min(bins, len(tensors)))
    chosen = (
        _balanced(tensors, bins) if pattern is FragmentPattern.BALANCED else _strided(tensors, bins)
    )
    return [[tensors[i] for i in group] for group in chosen if group]


def _separates_matrices(tensors: Sequence[NamedShape], matrix_merge: MergeMode) -> bool:
    """rda/iso give matrices fragments of their own when there are other parameters too."""
    kinds = {t.is_matrix for t in tensors}
    return MergeMode(matrix_merge) is not MergeMode.AVG and kinds == {True, False}


def _most_fragments(
    tensors: Sequence[NamedShape], matrix_merge: MergeMode, pattern: FragmentPattern
) -> int:
    def units(group: Iterable[NamedShape]) -> int:  # what packing never splits
        if pattern is FragmentPattern.STRIDED:
            return len({_layer_key(t.name) for t in group})
        return len(list(group))

    if _separates_matrices(tensors, matrix_merge):
        return units(t for t in tensors if t.is_matrix) + 1
    return units(tensors)


def most_fragments(
    named_shapes: Iterable[tuple[str, Sequence[int]]],
    matrix_merge: MergeMode = MergeMode.AVG,
    pattern: FragmentPattern = FragmentPattern.BALANCED,
) -> int:
    """The most fragments :func:`build_layout` can make of these tensors: a tensor is never
    split, and the strided pattern never splits a layer."""
    tensors = [NamedShape(normalize_name(n), tuple(int(d) for d in s)) for n, s in named_shapes]
    return _most_fragments(tensors, matrix_merge, pattern)


def build_layout(
    named_shapes: Iterable[tuple[str, Sequence[int]]],
    *,
    fragments: int,
    pattern: FragmentPattern = FragmentPattern.BALANCED,
    matrix_merge: MergeMode = MergeMode.AVG,
) -> Layout:
    """Layout over ``(name, shape)`` pairs in model order (names normalized here)."""
    if fragments < 1:
        raise ValueError("fragments must be >= 1")
    tensors = [NamedShape(normalize_name(n), tuple(int(d) for d in s)) for n, s in named_shapes]
    if not tensors:
        raise ValueError("the model has no trainable parameters")
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise ValueError(f"two parameters normalize to the same name {t.name!r}")
        seen.add(t.name)
    matrix_merge = MergeMode(matrix_merge)
    matrices = [t for t in tensors if t.is_matrix]
    others = [t for t in tensors if not t.is_matrix]
    separate = _separates_matrices(tensors, matrix_merge)
    if separate and fragments == 1:
        raise ValueError(
            f"matrix_merge={matrix_merge.name.lower()} needs fragments >= 2 for this model: its "
            f"{len(others)} non-matrix parameters go into an avg fragment of their own"
        )
    # A tensor is never split, so asking for more fragments than that would silently give
    # fewer (and a schedule planned for the requested F would be wrong).
    most = _most_fragments(tensors, matrix_merge, pattern)
    if fragments > most:
        raise ValueError(
            f"fragments={fragments}, but this model allows at most {most} (it has "
            f"{len(tensors)} trainable tensors; a tensor is never split"
            + (
                ", nor a layer under the strided pattern)"
                if pattern is FragmentPattern.STRIDED
                else ")"
            )
        )
    if not separate:
        mode = matrix_merge if not others else MergeMode.AVG
        groups = [(mode, g) for g in _pack(tensors, fragments, pattern)]
    else:
        # The small non-matrix parameters share one avg fragment; matrices take the rest.
        groups = [(matrix_merge, g) for g in _pack(matrices, fragments - 1, pattern)]
        groups += [(MergeMode.AVG, g) for g in _pack(others, 1, pattern)]
    return Layout(
        tuple(
            FragmentSpec(mode, tuple(TensorSpec(t.name, t.shape) for t in group))
            for mode, group in groups
        )
    )


def session_contract(
    layout: Layout,
    dtype: WireDtype,
    *,
    run_id: str,
    experiment: Mapping[str, Any] | None = None,
) -> bytes:
    """32 bytes binding reconnects and checkpoint recovery to one experiment and run."""
    identity = {
        "layout_fingerprint": layout.fingerprint().hex(),
        "wire_dtype": WireDtype(dtype).name.lower(),
        "run_id": run_id,
        "experiment": dict(experiment or {}),
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(CONTRACT_DOMAIN + canonical.encode("utf-8")).digest()
