"""Map a checkpoint's flat fragments back to named, shaped tensors, after proving the layout.

Nothing is guessed. V3 proves its layout: the layout file's fingerprint must equal the one in
the checkpoint. V1 and V2 cannot: the caller supplies the historical layout, and for a grouped
layout (a fragment with several tensors) also the audited original fingerprint; V1 always
needs the original iso backend as well. Every check runs before a single tensor is produced.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..constants import IsoBackend
from ..errors import CheckpointError, ErrorCode, ProtocolError
from ..layout import Layout
from .atomic import io_error, read_capped
from .model import Checkpoint, CheckpointFormat, F32Array, iso_backend_name


@dataclass(frozen=True, slots=True)
class LegacyIdentity:
    """What a V1/V2 export needs from outside the file (``None`` = not supplied)."""

    fingerprint: bytes | None = None
    iso_backend: IsoBackend | None = None


@dataclass(frozen=True, slots=True, eq=False)
class ExportedTensors:
    #: Name -> shaped view into the checkpoint's params (no copies), in layout order.
    tensors: dict[str, F32Array]
    #: String metadata describing where the tensors came from.
    metadata: dict[str, str]


#: The largest layout file read. ``Layout.to_json()`` takes some 150 to 220 bytes a tensor with
#: names such as ``model.layers.17.mlp.down_proj.weight``, so this holds 300,000 tensors or more,
#: far beyond any model; it keeps ``--layout`` naming a checkpoint from being read whole.
MAX_LAYOUT_FILE_BYTES = 64 * 1024 * 1024


def load_layout(path: str | os.PathLike[str]) -> Layout:
    """Read a layout JSON file (``Layout.to_json()``); any defect is ``CKPT_BAD_LAYOUT``.

    Only a regular file or a pipe is read (a device such as /dev/zero would never end), and
    one over :data:`MAX_LAYOUT_FILE_BYTES` is refused.
    """
    name = os.fspath(path)
    try:
        data = read_capped(name, MAX_LAYOUT_FILE_BYTES)
    except OSError as exc:
        raise io_error(name, exc, section="layout") from None
    if data is None:
        raise _layout_error(name, f"larger than {MAX_LAYOUT_FILE_BYTES} bytes: not a layout file")
    try:
        return Layout.from_json(data.decode("utf-8"))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        # json.JSONDecodeError and UnicodeDecodeError are ValueErrors; the others come from
        # a document of the wrong shape.
        raise _layout_error(name, f"{type(exc).__name__}: {exc}") from None
    except ProtocolError as exc:  # Layout's own validation (empty shape, repeated names, ...)
        raise _layout_error(name, str(exc)) from None


def _layout_error(name: str, reason: str) -> CheckpointError:
    reason = json.dumps(reason)[1:-1]  # keep the message on one line
    return CheckpointError(ErrorCode.CKPT_BAD_LAYOUT, f"{reason} (file {name})", section="layout")


def _mismatch(reason: str) -> CheckpointError:
    return CheckpointError(ErrorCode.CKPT_LAYOUT_MISMATCH, reason, section="layout")


def _required(reason: str) -> CheckpointError:
    return CheckpointError(ErrorCode.CKPT_IDENTITY_REQUIRED, reason, section="identity")


def verify_identity(
    checkpoint: Checkpoint, layout: Layout, legacy: LegacyIdentity = LegacyIdentity()
) -> IsoBackend | None:
    """Raise unless ``layout`` is proven (V3) or vouched for (V1/V2); returns the iso backend."""
    layout_fp = layout.fingerprint()
    if legacy.fingerprint is not None and legacy.fingerprint != layout_fp:
        raise _mismatch(
            f"--legacy-fingerprint {legacy.fingerprint.hex()} is not the layout's {layout_fp.hex()}"
        )
    if (
        legacy.iso_backend is not None
        and checkpoint.iso_backend is not None
        and legacy.iso_backend is not checkpoint.iso_backend
    ):
        raise _mismatch(
            f"--iso-backend {iso_backend_name(legacy.iso_backend)} but the checkpoint records "
            f"{iso_backend_name(checkpoint.iso_backend)}"
        )
    if checkpoint.fingerprint is not None and checkpoint.fingerprint != layout_fp:
        where = "prefix" if checkpoint.fingerprint_confirmed else "trailer"
        raise _mismatch(
            f"layout fingerprint {layout_fp.hex()} is not the checkpoint's ({where}) "
            f"{checkpoint.fingerprint.hex()}"
        )
    if checkpoint.format is not CheckpointFormat.V3:
        grouped = any(len(f.tensors) > 1 for f in layout.fragments)
        if grouped and legacy.fingerprint is None:
            raise _required(
                f"{checkpoint.format.name} with a grouped layout needs --legacy-fingerprint "
                "(the audited original fingerprint); it is never guessed"
            )
        if checkpoint.format is CheckpointFormat.V1 and legacy.iso_backend is None:
            raise _required("V1 does not record its iso backend; pass --iso-backend")
    if checkpoint.num_fragments != len(layout.fragments):
        raise _mismatch(
            f"checkpoint has {checkpoint.num_fragments} fragments, the layout "
            f"{len(layout.fragments)}"
        )
    for index, (fragment, spec) in enumerate(
        zip(checkpoint.fragments, layout.fragments, strict=True)
    ):
        if fragment.numel != spec.numel:
            raise _mismatch(f"fragment {index} has numel {fragment.numel}, the layout {spec.numel}")
    return checkpoint.iso_backend if checkpoint.iso_backend is not None else legacy.iso_backend


def export_tensors(
    checkpoint: Checkpoint, layout: Layout, legacy: LegacyIdentity = LegacyIdentity()
) -> ExportedTensors:
    """Named parameter tensors of ``checkpoint`` under ``layout`` (views, no copies)."""
    iso_backend = verify_identity(checkpoint, layout, legacy)
    tensors: dict[str, F32Array] = {}
    for fragment, placed in zip(checkpoint.fragments, layout.offsets(), strict=True):
        for spec, offset in placed:
            tensors[spec.name] = fragment.params[offset : offset + spec.numel].reshape(spec.shape)
    metadata = {
        "yeto_checkpoint_format": checkpoint.format.name,
        "global_step": str(checkpoint.global_step),
        "layout_fingerprint": layout.fingerprint().hex(),
        "iso_backend": iso_backend_name(iso_backend) if iso_backend is not None else "",
        "session_contract": checkpoint.contract.hex() if checkpoint.contract else "",
    }
    return ExportedTensors(tensors=tensors, metadata=metadata)
