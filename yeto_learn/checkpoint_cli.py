"""``yeto checkpoint inspect|export``: look into a V1/V2/V3 checkpoint, or export its parameters.

Both read through :func:`yeto_proto.checkpoint.read_checkpoint`, so a file is used only after it
validated completely; export proves the layout first and then replaces the output atomically.
Bad input raises a :class:`~yeto_proto.errors.ProtocolError`, which ``yeto`` turns into one line on
stderr and exit code 2; an export that cannot be written (a full disk) is one line and exit 1.
SIGINT, SIGTERM or SIGHUP stops either at once, with one line that says whether the export's
file was written (no temporary file is left), and exit code 128 + the signal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yeto_proto.checkpoint import (
    Checkpoint,
    LegacyIdentity,
    TrailerKind,
    atomic_replace,
    check_name_length,
    export_tensors,
    io_error,
    iso_backend_name,
    load_layout,
    marker_path,
    marker_state,
    read_checkpoint,
    remove_orphaned_temporaries,
    scheduled_version,
)
from yeto_proto.constants import DIGEST_SIZE, IsoBackend
from yeto_proto.dtypes import all_finite
from yeto_proto.errors import CheckpointError, ErrorCode

from . import output
from .process_control import Stopped, stops_raised
from .safetensors_file import METADATA_KEY, write_safetensors

if TYPE_CHECKING:
    from yeto_proto.checkpoint import ExportedTensors

    from .cli import Commands

#: An output that could not be written (a full disk); bad input is 2, as everywhere.
EXIT_WRITE_FAILED = 1
EXIT_BAD_INPUT = 2
ISO_BACKEND_NAMES = {iso_backend_name(backend): backend for backend in IsoBackend}
SAFETENSORS_SUFFIXES = frozenset({".safetensors"})
TORCH_SUFFIXES = frozenset({".pt", ".pth"})
#: What the ledger's numbers are (``--help``); the JSON keys are the file format's names.
LEDGER_NOTE = (
    "The ledger holds per learner the number of its merged PUSHes (JSON 'merges') and the sums "
    "of their c_steps ('steps') and c_tokens ('tokens'); a PUSH's window runs from the "
    "learner's last applied BCAST of its fragment, so a local step counts once per fragment "
    "and again where windows overlap: these are not the learner's step or token totals."
)
_TRAILER_NAMES = {
    TrailerKind.NONE: "none",
    TrailerKind.FINGERPRINT: "fingerprint",
    TrailerKind.FINGERPRINT_AND_CONTRACT: "fingerprint+contract",
}


def register(commands: Commands) -> None:
    checkpoint = commands.add_parser(
        "checkpoint", help="inspect or export syncer checkpoints (V1, V2, V3)"
    )
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION", required=True)

    inspect = actions.add_parser(
        "inspect",
        help="print what a checkpoint holds",
        description="Print what a checkpoint holds: format, identity, global step, final "
        f"marker, each fragment's version, and the ledger. {LEDGER_NOTE}",
    )
    inspect.add_argument("path", type=Path, metavar="PATH")
    inspect.add_argument("--json", action="store_true", help="one JSON object instead of text")
    inspect.set_defaults(handler=run_inspect, command_prog=inspect.prog)

    export = actions.add_parser(
        "export",
        help="write the parameters as named tensors (.safetensors, or .pt/.pth)",
        description="Map flat fragments back to named, shaped tensors. V3 proves the layout by "
        "its fingerprint; V1/V2 need the historical layout, and for grouped layouts the audited "
        "--legacy-fingerprint (V1 always also --iso-backend). Nothing is guessed.",
    )
    export.add_argument("path", type=Path, metavar="PATH")
    export.add_argument("--layout", type=Path, required=True, help="layout JSON file")
    export.add_argument(
        "--out",
        type=_out_path,
        required=True,
        help="output file: *.safetensors, or *.pt or *.pth for a torch state_dict",
    )
    export.add_argument(
        "--legacy-fingerprint",
        type=_fingerprint_arg,
        metavar="HEX",
        help="V1/V2 with a grouped layout: the original layout fingerprint (64 hex digits)",
    )
    export.add_argument(
        "--iso-backend",
        choices=sorted(ISO_BACKEND_NAMES),
        help="V1: the iso backend the checkpoint was written with",
    )
    export.set_defaults(handler=run_export, command_prog=export.prog)


def _fingerprint_arg(text: str) -> bytes:
    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != DIGEST_SIZE:
        raise argparse.ArgumentTypeError(f"expected {2 * DIGEST_SIZE} hex digits, got {text!r}")
    return value


def _out_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() not in SAFETENSORS_SUFFIXES | TORCH_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"must end in .safetensors, .pt or .pth, not {path.name!r}"
        )
    return path


# -- inspect ---------------------------------------------------------------------------------------
def describe(path: Path) -> dict[str, Any]:
    """Everything ``inspect`` reports, as JSON-ready values (array contents excluded)."""
    checkpoint = read_checkpoint(path, mapped=True)
    # The size of the file decoded: a second stat could find the syncer's next checkpoint.
    size = checkpoint.file_size
    marker = marker_state(path, checkpoint.global_step)
    step, count = checkpoint.global_step, checkpoint.num_fragments
    fragments = [
        {
            "id": index,
            "version": fragment.version,
            "numel": fragment.numel,
            "scheduled_version": scheduled_version(index, step, count),
            # A merge never lets NaN or inf into the global state: a file holding one was
            # damaged, and `yeto-sync --resume` refuses it.
            "finite": all_finite(fragment.params) and all_finite(fragment.momentum),
        }
        for index, fragment in enumerate(checkpoint.fragments)
    ]
    return {
        "path": str(path),
        "size_bytes": size,
        "format": checkpoint.format.name,
        "magic": f"0x{checkpoint.format.value:08X}",
        "iso_backend": _or_none_name(checkpoint.iso_backend),
        "fingerprint": checkpoint.fingerprint.hex() if checkpoint.fingerprint else None,
        "fingerprint_source": _fingerprint_source(checkpoint),
        "global_step": step,
        "num_fragments": count,
        "total_numel": sum(checkpoint.numels),
        "fragments": fragments,
        "versions_match_schedule": all(f["version"] == f["scheduled_version"] for f in fragments),
        "all_finite": all(f["finite"] for f in fragments),
        "ledger": [
            {"learner_id": e.learner_id, "merges": e.merges, "steps": e.steps, "tokens": e.tokens}
            for e in checkpoint.ledger
        ],
        "contract": checkpoint.contract.hex() if checkpoint.contract else None,
        "trailer": _TRAILER_NAMES[checkpoint.trailer],
        "trailer_bytes": checkpoint.trailer.value,
        "final_marker": {
            "path": str(marker_path(path)),
            "status": marker.status.value,
            "global_step": marker.marker_step,
            "detail": marker.detail,
        },
    }


def _or_none_name(backend: IsoBackend | None) -> str | None:
    return iso_backend_name(backend) if backend is not None else None


def _fingerprint_source(checkpoint: Checkpoint) -> str | None:
    if checkpoint.fingerprint is None:
        return None
    return "prefix" if checkpoint.fingerprint_confirmed else "trailer (unconfirmed)"


def render_text(info: dict[str, Any]) -> str:
    marker = info["final_marker"]
    lines = [
        f"file          {info['path']} ({info['size_bytes']} bytes)",
        f"format        {info['format']} (magic {info['magic']})",
        f"iso backend   {info['iso_backend'] or 'not recorded'}",
        f"fingerprint   {_or_none(info['fingerprint'])}"
        + (f" [{info['fingerprint_source']}]" if info["fingerprint"] else ""),
        f"global step   {info['global_step']}",
        f"contract      {_or_none(info['contract'])}",
        f"trailer       {info['trailer']} ({info['trailer_bytes']} bytes)",
        f"final marker  {marker['status']}: {marker['detail']}",
        f"fragments     {info['num_fragments']} ({info['total_numel']} values; versions "
        + ("match" if info["versions_match_schedule"] else "DO NOT match")
        + " the schedule"
        + ("" if info["all_finite"] else "; NON-FINITE VALUES, damaged: resume refuses it")
        + ")",
        "  id       version          numel",
    ]
    for fragment in info["fragments"]:
        flag = "" if fragment["version"] == fragment["scheduled_version"] else "  (schedule: "
        flag += f"{fragment['scheduled_version']})" if flag else ""
        flag += "" if fragment["finite"] else "  (non-finite values)"
        lines.append(
            f"  {fragment['id']:<6} {fragment['version']:>9} {fragment['numel']:>14}{flag}"
        )
    lines.append(
        f"ledger        {len(info['ledger'])} entries (sums over merged PUSHes, whose windows "
        "overlap: not step or token totals)"
    )
    if info["ledger"]:
        lines.append("  learner   merged PUSHes   Σ c_steps of them   Σ c_tokens of them")
        for entry in info["ledger"]:
            lines.append(
                f"  {entry['learner_id']:<7} {entry['merges']:>15} {entry['steps']:>19} "
                f"{entry['tokens']:>20}"
            )
    return "\n".join(lines)


def _or_none(value: str | None) -> str:
    return value if value is not None else "none"


def run_inspect(args: argparse.Namespace) -> int:
    try:
        with stops_raised(args.command_prog):
            info = describe(args.path)
            output.out(json.dumps(info, indent=2) if args.json else render_text(info))
    except Stopped as stop:
        print(f"{args.command_prog}: stopped by {stop}; nothing was written", file=sys.stderr)
        return 128 + stop.signum
    return 0


# -- export ----------------------------------------------------------------------------------------
def run_export(args: argparse.Namespace) -> int:
    out: Path = args.out
    before = _file_identity(out)
    try:
        with stops_raised(args.command_prog) as stops:
            return _export(args, out, stops.check)
    except Stopped as stop:
        # The output is replaced by one rename, after the new file is whole: it changed or not.
        if _file_identity(out) != before:
            kept = f"{out} was written"
        elif before is None:
            kept = f"{out} was not written"
        else:
            kept = f"{out} was not replaced"
        print(f"{args.command_prog}: stopped by {stop}; {kept}", file=sys.stderr)
        return 128 + stop.signum


def _replaces(out: Path, given: Path) -> bool:
    """Whether renaming a file to ``out`` replaces the file ``given`` names: the rename replaces
    the name ``out`` itself (a symlink there, not its target; another hard link to the same
    data keeps it), so the input is lost when its real path is that very name, or when ``out``
    is the file's only link under another spelling (a case-insensitive file system, a bind
    mount)."""
    try:
        if given.resolve(strict=True) == out.parent.resolve(strict=True) / out.name:
            return True
        there, read = os.lstat(out), os.stat(given)
    except (OSError, RuntimeError):  # either is missing, or a symlink loop
        return False
    return (there.st_dev, there.st_ino) == (read.st_dev, read.st_ino) and read.st_nlink == 1


def _file_identity(path: Path) -> tuple[int, int] | None:
    """Device and inode of ``path``, or None if there is no such file."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _export(args: argparse.Namespace, out: Path, check: Callable[[], None]) -> int:
    """The export itself. ``check`` raises :class:`Stopped` if a stop signal arrived (one the
    handler's exception was swallowed for): it is asked right before the output is replaced."""
    layout = load_layout(args.layout)
    checkpoint = read_checkpoint(args.path, mapped=True)
    legacy = LegacyIdentity(
        fingerprint=args.legacy_fingerprint,
        iso_backend=ISO_BACKEND_NAMES[args.iso_backend] if args.iso_backend else None,
    )
    try:
        exported = export_tensors(checkpoint, layout, legacy)
    except CheckpointError as exc:  # the pair disagrees: name both files, as every error line does
        raise CheckpointError(
            exc.code, f"{exc.reason} (file {args.path}, layout {args.layout})", section=exc.section
        ) from None
    try:
        if not out.parent.is_dir():
            raise CheckpointError(
                ErrorCode.CKPT_IO, f"no such directory (file {out})", section="write"
            )
        if out.is_dir() and not out.is_symlink():  # bad input, known before anything is written
            # (a link to a folder is replaced by the rename, as any link at --out)
            raise CheckpointError(
                ErrorCode.CKPT_IO, f"is a directory (file {out})", section="write"
            )
    except OSError as exc:  # e.g. a name too long, or a directory that cannot be searched
        raise io_error(out, exc) from None
    check_name_length(out)
    for name, given in (("checkpoint", args.path), ("layout", args.layout)):
        if _replaces(out, Path(given)):
            # Replaced by the export, the input would be gone for good.
            print(
                f"{args.command_prog}: error: --out {out} is the {name} being exported; "
                "nothing was written",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
    safetensors = out.suffix.lower() in SAFETENSORS_SUFFIXES
    if safetensors and METADATA_KEY in exported.tensors:
        # A .safetensors header keeps its metadata under that key: no tensor can have it.
        print(
            f"{args.command_prog}: error: --out {out}: the layout names a tensor "
            f"{METADATA_KEY}, the key .safetensors reserves; export to .pt instead; "
            "nothing was written",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    _remove_unfinished_exports(args.command_prog, out)
    save = _save_safetensors if safetensors else _save_torch
    try:
        # An OSError (a full disk, say) becomes CKPT_IO naming the file; no temp file is left.
        with atomic_replace(out, before_replace=check) as staging:
            try:
                save(exported, staging)
            except RuntimeError as exc:  # torch's own failures
                # A stop signal raised inside torch's writer comes back as torch's error.
                check()
                raise CheckpointError(
                    ErrorCode.CKPT_IO, f"{exc} (file {out})".replace("\n", " "), section="write"
                ) from None
    except CheckpointError as exc:
        check()  # the failure may be a stop signal's, raised inside a write
        # The input was fine: exit 1, not 2, so that a script can tell the two apart.
        print(f"{args.command_prog}: error: {exc}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    damaged = [name for name, tensor in exported.tensors.items() if not all_finite(tensor)]
    if damaged:
        # Exported all the same (the user may want what is left), but never silently; said
        # first, so that a stdout that cannot take the message does not hide it.
        shown = ", ".join(damaged[:5]) + (
            f" and {len(damaged) - 5} more" if len(damaged) > 5 else ""
        )
        print(
            f"{args.command_prog}: warning: non-finite values in {shown}: the checkpoint is "
            "damaged (a merge never lets one in); exported as they are",
            file=sys.stderr,
        )
    total = sum(t.size for t in exported.tensors.values())
    try:
        output.out(f"exported {len(exported.tensors)} tensors ({total} values) to {out}")
    except output.OutputFailed as exc:  # only the message was lost: say the export is whole
        exc.reason += f" (the export itself was written: {out})"
        raise
    return 0


def _remove_unfinished_exports(prog: str, out: Path) -> None:
    """The temporary files of exports to ``out`` whose process is gone (killed, out of memory,
    a SIGBUS from a checkpoint cut short in place), each as large as an export: say so."""
    for orphan, outcome in remove_orphaned_temporaries(out):
        if isinstance(outcome, OSError):
            reason = outcome.strerror or outcome
            print(f"{prog}: warning: cannot remove {orphan}: {reason}", file=sys.stderr)
        else:
            print(
                f"{prog}: removed {orphan} ({outcome} bytes), left by an export that did not "
                "finish",
                file=sys.stderr,
            )


def _save_safetensors(exported: ExportedTensors, staging: Path) -> None:
    write_safetensors(staging, exported.tensors, exported.metadata)


def _save_torch(exported: ExportedTensors, staging: Path) -> None:
    import torch

    with warnings.catch_warnings():
        # The arrays are read-only views of the mapped checkpoint; torch.save only reads them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        state_dict = {name: torch.from_numpy(array) for name, array in exported.tensors.items()}
        # Into an open file: torch then reports a failed write as the OSError it is (given a
        # path, it says "basic_ios::clear: iostream error").
        with open(staging, "xb") as file:
            torch.save(state_dict, file)
