"""Write V3 checkpoints: streamed from the per-fragment arrays, replaced atomically.

Each fragment's params and momentum go to the file straight from the caller's arrays (a
zero-copy ``memoryview``), so writing needs the arrays plus a small buffer, never a second copy
of the checkpoint. The file is always V3 with the full 68-byte trailer.
"""

from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from ..constants import DIGEST_SIZE, U32_MAX, U64_MAX, IsoBackend
from ..errors import ErrorCode, LocalProtocolError
from .atomic import atomic_replace, io_error
from .model import F32, Checkpoint, CheckpointFormat, F32Array, LedgerEntry
from .schema import (
    CONTRACT_TAG,
    FRAGMENT_HEADER,
    LEDGER_DTYPE,
    MAX_CHECKPOINT_NUMEL,
    PREFIXES,
    ContractTrailer,
    FingerprintTrailer,
    FragmentCount,
    LedgerCount,
)


def _bad(detail: str) -> LocalProtocolError:
    return LocalProtocolError(ErrorCode.CKPT_BAD_FIELD, f"refusing to write: {detail}")


def _check_u(value: int, limit: int, what: str) -> int:
    # An integer of any kind (numpy's too), never a float or bool that would be cut or coerced.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _bad(f"{what} must be an integer, got {type(value).__name__}")
    if not 0 <= value <= limit:
        raise _bad(f"{what} {value} is out of range")
    return int(value)


def _check_digest(value: bytes, what: str) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise _bad(f"{what} must be bytes, got {type(value).__name__}")
    if len(value) != DIGEST_SIZE:
        raise _bad(f"{what} must be {DIGEST_SIZE} bytes, got {len(value)}")
    return bytes(value)


def _check_array(array: F32Array, what: str) -> F32Array:
    if not isinstance(array, np.ndarray):
        raise _bad(f"{what} must be a numpy array, got {type(array).__name__}")
    if array.dtype != F32 or not array.flags.c_contiguous:
        raise _bad(f"{what} must be a C-contiguous little-endian float32 array")
    return array


def _byte_view(array: F32Array) -> memoryview:
    """The array's bytes, without copying (the array is C-contiguous)."""
    return array.reshape(-1).view(np.uint8).data


class CheckpointWriter:
    """Stream one V3 checkpoint to ``path``: the prefix now, then fragments, then the ledger.

    Use as a context manager; :meth:`finish` publishes the file. Leaving the block without
    :meth:`finish` (or with an exception) discards the temporary file and keeps the old one.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        iso_backend: IsoBackend,
        fingerprint: bytes,
        global_step: int,
        num_fragments: int,
        contract: bytes,
        before_replace: Callable[[], object] | None = None,
    ) -> None:
        """``before_replace``: runs once the new file is durable, right before it replaces
        the old one (:func:`~yeto_proto.checkpoint.atomic.atomic_replace`)."""
        self._fingerprint = _check_digest(fingerprint, "fingerprint")
        self._contract = _check_digest(contract, "contract")
        if _check_u(num_fragments, U32_MAX, "F") < 1:
            raise _bad("F 0 is not in 1..2^32-1")
        self._num_fragments = int(num_fragments)
        if isinstance(iso_backend, bool) or iso_backend not in set(IsoBackend):
            raise _bad(f"iso_backend {iso_backend!r} is not 0 (scalar) or 1 (torch-svd)")
        prefix = PREFIXES[CheckpointFormat.V3].build(
            {
                "iso_backend": int(iso_backend),
                "fingerprint": self._fingerprint,
                "global_step": _check_u(global_step, U64_MAX, "global_step"),
            }
        )
        self._path = Path(path)
        self._written = 0
        self._finished = False
        self._stack = contextlib.ExitStack()
        staging = self._stack.enter_context(
            atomic_replace(self._path, before_replace=before_replace)
        )
        try:
            self._file: BinaryIO = self._stack.enter_context(open(staging, "xb"))
        except OSError as exc:
            self.abort()
            raise io_error(self._path, exc) from exc
        self._write(prefix, FragmentCount.build({"num_fragments": num_fragments}))

    def add_fragment(self, version: int, params: F32Array, momentum: F32Array) -> None:
        """Append the next fragment, in fragment order, from its own arrays (no copy)."""
        if self._written >= self._num_fragments:
            raise _bad(f"more than the declared {self._num_fragments} fragments")
        _check_array(params, "params")
        _check_array(momentum, "momentum")
        if params.size != momentum.size or params.size == 0:
            raise _bad(f"params ({params.size}) and momentum ({momentum.size}) sizes")
        if params.size > MAX_CHECKPOINT_NUMEL:
            raise _bad(f"numel {params.size} is too large")
        self._write(
            FRAGMENT_HEADER.pack(_check_u(version, U64_MAX, "version"), int(params.size)),
            _byte_view(params),
            _byte_view(momentum),
        )
        self._written += 1

    def finish(self, ledger: Iterable[LedgerEntry]) -> None:
        """Write the ledger and the full trailer, then durably replace the target file."""
        if self._written != self._num_fragments:
            raise _bad(f"{self._written} of {self._num_fragments} fragments written")
        rows = [
            (
                _check_u(e.learner_id, U32_MAX, "learner_id"),
                _check_u(e.merges, U64_MAX, "merges"),
                _check_u(e.steps, U64_MAX, "steps"),
                _check_u(e.tokens, U64_MAX, "tokens"),
            )
            for e in ledger
        ]
        ids = [row[0] for row in rows]  # compared only once known to be integers
        if any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
            raise _bad("ledger learner ids must strictly ascend")
        records = np.array(rows, dtype=LEDGER_DTYPE)
        self._write(
            LedgerCount.build({"ledger_count": len(rows)}),
            records.tobytes(),
            FingerprintTrailer.build({"fingerprint": self._fingerprint}),
            ContractTrailer.build({"tag": CONTRACT_TAG, "contract": self._contract}),
        )
        self._finished = True
        self._stack.close()  # close, fsync, rename, fsync the directory

    def abort(self) -> None:
        """Discard the temporary file; the target keeps its previous content."""
        if not self._finished:
            self._finished = True
            reason = _bad("checkpoint write aborted")
            self._stack.__exit__(type(reason), reason, None)

    def _write(self, *chunks: bytes | memoryview) -> None:
        try:
            for chunk in chunks:
                self._file.write(chunk)
        except OSError as exc:
            self.abort()
            raise io_error(self._path, exc) from exc

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._finished:
            return
        self.abort()
        if exc_type is None:
            raise _bad("the writer was closed before finish()")


def write_checkpoint(
    path: str | os.PathLike[str],
    checkpoint: Checkpoint,
    *,
    before_replace: Callable[[], object] | None = None,
) -> None:
    """Atomically write ``checkpoint`` as V3 at ``path`` (``before_replace``: as
    :func:`~yeto_proto.checkpoint.atomic.atomic_replace`).

    The value must be a V3 value carrying what V3 records: an iso backend, a fingerprint and a
    contract. A V1/V2 value is refused: writing it as V3 would promote a fingerprint nothing in
    the legacy file confirmed.
    """
    if checkpoint.format is not CheckpointFormat.V3:
        raise _bad(f"only V3 values are written, not {checkpoint.format.name}")
    if checkpoint.iso_backend is None or checkpoint.fingerprint is None:
        raise _bad("a V3 checkpoint needs an iso backend and a fingerprint")
    if checkpoint.contract is None:
        raise _bad("a V3 checkpoint needs a session contract")
    with CheckpointWriter(
        Path(path),
        iso_backend=checkpoint.iso_backend,
        fingerprint=checkpoint.fingerprint,
        global_step=checkpoint.global_step,
        num_fragments=checkpoint.num_fragments,
        contract=checkpoint.contract,
        before_replace=before_replace,
    ) as writer:
        for fragment in checkpoint.fragments:
            writer.add_fragment(fragment.version, fragment.params, fragment.momentum)
        writer.finish(checkpoint.ledger)
