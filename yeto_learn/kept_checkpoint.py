"""What a command stopped or failed part-way says about the checkpoint it leaves behind."""

from __future__ import annotations

import shlex
from pathlib import Path

from yeto_proto.checkpoint import marker_state, read_checkpoint
from yeto_proto.errors import ProtocolError


def checkpoint_use(checkpoint: Path, layout: Path, export: Path, command: str) -> str:
    """The commands that use a kept ``checkpoint``, to copy (`` (... )`` or "" without a file):
    ``command`` cannot resume it, so the line says what it is good for."""
    if not checkpoint.exists():
        return ""
    # Quoted for a shell, so a folder with a space in its name still copies and runs.
    quoted = shlex.quote(str(checkpoint))
    use = f"`yeto checkpoint inspect {quoted}`"
    if layout.exists():
        use += (
            f", export its parameters with `yeto checkpoint export {quoted} "
            f"--layout {shlex.quote(str(layout))} --out {shlex.quote(str(export))}`"
        )
    return f" ({command} cannot resume it; read it with {use})"


def describe_kept(checkpoint: Path) -> str:
    """The checkpoint file on disk as a kept state: its step and whether it is marked final."""
    try:
        state = read_checkpoint(checkpoint, mapped=True)
        final = marker_state(checkpoint, state.global_step).is_final
    except ProtocolError as exc:
        if not checkpoint.exists():
            return "no checkpoint (none was written yet)"
        return f"checkpoint {checkpoint}, unreadable ({exc})"
    what = "final checkpoint" if final else "checkpoint (not marked final)"
    return f"{what} {checkpoint} at global_step {state.global_step}"
