"""May the running syncer install this checkpoint? One function, one answer, one reason.

Checks, in order (the first failure is the reason):

1. format: V1 never resumes (its iso backend is unknown);
2. iso backend equals the running syncer's;
3. every params and momentum value is finite;
4. each fragment's version is the one the schedule gives for the checkpoint's global step;
5. identity: V3's fingerprint equals the accepted HELLO fingerprint, even when fragment
   counts and every flat size match; V2 records none, so it resumes only when every fragment
   of the wire layout has exactly one tensor (grouped V2 fails closed), and a fingerprint
   trailer it does carry must equal the HELLO fingerprint;
6. fragment count and each fragment's numel equal the wire layout's;
7. a contract the checkpoint carries equals the session's; V3 must carry one (current writers
   always do), while V2 may lack it, since the source lets legacy V2 resume on the rules above.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..constants import IsoBackend
from ..dtypes import all_finite
from ..layout import WireLayout
from .model import Checkpoint, CheckpointFormat, iso_backend_name


@dataclass(frozen=True, slots=True)
class ResumeRefusal:
    """Why a checkpoint cannot resume: the failing check's number (1..7 above, stable, as in
    spec/checkpoint.md § 4 and the conformance vectors) and a readable reason."""

    check: int
    reason: str

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True, slots=True)
class ResumeDecision:
    eligible: bool
    reason: str
    #: The failing check's number when refused, else None.
    check: int | None = None


def scheduled_version(fragment: int, global_step: int, num_fragments: int) -> int:
    """Version of ``fragment`` after rounds ``1..global_step`` (round t targets (t-1) mod F)."""
    first_round = fragment + 1
    if global_step < first_round:
        return 0
    return first_round + (global_step - first_round) // num_fragments * num_fragments


def refusal_before_hello(checkpoint: Checkpoint, iso_backend: IsoBackend) -> ResumeRefusal | None:
    """Checks 1 to 4, which need no HELLO: the reason this syncer can never resume it, or None.

    A daemon can run them at start; :func:`resume_decision` runs them first.
    """
    if checkpoint.format is CheckpointFormat.V1:
        return ResumeRefusal(1, "V1 checkpoints never resume: they do not record the iso backend")
    if checkpoint.iso_backend is not IsoBackend(iso_backend):
        recorded = checkpoint.iso_backend
        return ResumeRefusal(
            2,
            f"iso backend {iso_backend_name(recorded) if recorded is not None else 'none'} in "
            f"the checkpoint, {iso_backend_name(iso_backend)} running",
        )
    for index, fragment in enumerate(checkpoint.fragments):
        # Non-finite values never reach the global state (a merge refuses them), so a file
        # holding them was damaged or written by something else.
        for name, values in (("params", fragment.params), ("momentum", fragment.momentum)):
            if not all_finite(values):
                return ResumeRefusal(3, f"fragment {index} holds non-finite {name}")
    step, count = checkpoint.global_step, checkpoint.num_fragments
    for index, version in enumerate(checkpoint.versions):
        expected = scheduled_version(index, step, count)
        if version != expected:
            return ResumeRefusal(
                4,
                f"fragment {index} is at version {version}; global_step {step} "
                f"over {count} fragments gives {expected}",
            )
    return None


def refusal_for_every_hello(
    checkpoint: Checkpoint, iso_backend: IsoBackend
) -> ResumeRefusal | None:
    """Why no HELLO could ever resume ``checkpoint``, or None: checks 1 to 4, or check 7's
    refusal of a V3 file without a session contract (every HELLO fails 5, 6 or 7 then).

    A daemon refuses such a file at start, rather than serve and refuse every learner.
    """
    return refusal_before_hello(checkpoint, iso_backend) or _unproven_v3(checkpoint)


def _unproven_v3(checkpoint: Checkpoint) -> ResumeRefusal | None:
    if checkpoint.format is CheckpointFormat.V3 and checkpoint.contract is None:
        return ResumeRefusal(
            7, "the V3 checkpoint carries no session contract, so continuation is unproven"
        )
    return None


def resume_decision(
    checkpoint: Checkpoint,
    *,
    iso_backend: IsoBackend,
    fingerprint: bytes,
    wire_layout: WireLayout,
    session_contract: bytes,
) -> ResumeDecision:
    """Decide whether ``checkpoint`` may seed a session with this backend, HELLO and contract."""
    refusal = refusal_before_hello(checkpoint, iso_backend) or refusal_for_session(
        checkpoint,
        fingerprint=fingerprint,
        wire_layout=wire_layout,
        session_contract=session_contract,
    )
    if refusal is not None:
        return ResumeDecision(eligible=False, reason=refusal.reason, check=refusal.check)
    return ResumeDecision(
        eligible=True,
        reason=f"{checkpoint.format.name} checkpoint at global_step {checkpoint.global_step} "
        "matches backend, schedule, identity, layout and contract",
    )


def refusal_for_session(
    checkpoint: Checkpoint,
    *,
    fingerprint: bytes,
    wire_layout: WireLayout,
    session_contract: bytes,
) -> ResumeRefusal | None:
    """Checks 5 to 7, which need the HELLO: why it cannot continue this session, or None.

    Only meaningful for a checkpoint :func:`refusal_before_hello` accepted (a syncer runs that
    once, at start, and this at each HELLO until one passes).
    """
    fmt = checkpoint.format
    if fmt is CheckpointFormat.V3:
        if checkpoint.fingerprint != fingerprint:
            return ResumeRefusal(
                5, "V3 layout fingerprint differs from the accepted HELLO fingerprint"
            )
    else:
        grouped = [i for i, f in enumerate(wire_layout.fragments) if len(f.numels) != 1]
        if grouped:
            return ResumeRefusal(
                5,
                f"V2 records no fingerprint; fragment {grouped[0]} groups "
                f"{len(wire_layout.fragments[grouped[0]].numels)} tensors, so resume fails closed",
            )
        if checkpoint.fingerprint is not None and checkpoint.fingerprint != fingerprint:
            return ResumeRefusal(
                5, "V2 fingerprint trailer differs from the accepted HELLO fingerprint"
            )

    if checkpoint.num_fragments != len(wire_layout):
        return ResumeRefusal(
            6, f"checkpoint has {checkpoint.num_fragments} fragments, the layout {len(wire_layout)}"
        )
    for index, (have, want) in enumerate(zip(checkpoint.numels, wire_layout.numels, strict=True)):
        if have != want:
            return ResumeRefusal(
                6, f"fragment {index} has numel {have} in the checkpoint, {want} in HELLO"
            )

    if checkpoint.contract is None:
        return _unproven_v3(checkpoint)
    elif checkpoint.contract != session_contract:
        return ResumeRefusal(7, "session contract differs from the checkpoint's")
    return None
