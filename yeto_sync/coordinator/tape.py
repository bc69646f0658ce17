"""Event-tape records (JSON Lines objects), PINNED.md § Daemon "Event tape".

A merge line has no ``event`` field and carries at least the pinned fields; every other line
(rejections, discarded attempts, failures, a resume, the final cut) names itself with
``event``.
Members are ``{"id", "generation"}`` objects in ascending order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from yeto_proto.constants import PROTOCOL_VERSION
from yeto_proto.messages import PushFragment

from ..events import GroupKey
from ..merge import RoundMerge
from .rounds import Rejection, Round

DELTA_SEMANTICS: Final = "local_minus_raw_anchor"


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def members(keys: Iterable[GroupKey]) -> list[dict[str, int]]:
    return [{"id": k.learner_id, "generation": k.generation} for k in sorted(keys)]


def merge_record(
    merged_round: Round, merged: RoundMerge, *, sync_s: float, merge_mode: str
) -> dict[str, Any]:
    responders = []
    for response, weight in zip(merged.responses, merged.weights, strict=True):
        accepted = merged_round.accepted[GroupKey(response.learner_id, response.generation)]
        responders.append(
            {
                "id": response.learner_id,
                "generation": response.generation,
                "base_version": accepted.base_version,
                "staleness": accepted.staleness,
                "c_steps": response.c_steps,
                "c_tokens": response.c_tokens,
                "weight": weight,
            }
        )
    return {
        "protocol_version": PROTOCOL_VERSION,
        "delta_semantics": DELTA_SEMANTICS,
        "step": merged_round.step,
        "fragment": merged_round.fragment,
        "attempt": merged_round.attempt,
        "merge_mode": merge_mode,
        "launch_base_version": merged_round.launch_version,
        "version": merged_round.step,
        "expected_members": members(merged_round.members),
        "responded_members": members(merged_round.accepted),
        "missed_members": members(merged_round.missed),
        "quorum": merged_round.quorum,
        "quorum_ms": _ms(merged_round.quorum_s),
        "grace_ms": _ms(merged_round.grace_s or 0.0),
        "sync_ms": _ms(sync_s),
        "gnorm": merged.gnorm,
        "responders": responders,
    }


def rejection_record(push: PushFragment, sender: GroupKey, rejection: Rejection) -> dict[str, Any]:
    return {
        "event": "push_rejected",
        "code": rejection.code.value,
        "reason": rejection.detail,
        "id": sender.learner_id,
        "generation": sender.generation,
        "step": push.global_step,
        "fragment": push.fragment_id,
        "attempt": push.round_attempt,
        "base_version": push.base_version,
        "local_step": push.local_step,
    }


def discard_record(discarded: Round, responded: Iterable[GroupKey]) -> dict[str, Any]:
    return {
        "event": "attempt_discarded",
        "step": discarded.step,
        "fragment": discarded.fragment,
        "attempt": discarded.attempt,
        "quorum": discarded.quorum,
        "expected_members": members(discarded.members),
        "responded_members": members(responded),
    }


def failure_record(failed: Round, reason: str) -> dict[str, Any]:
    return {
        "event": "merge_failed",
        "step": failed.step,
        "fragment": failed.fragment,
        "attempt": failed.attempt,
        "reason": reason,
        "responded_members": members(failed.accepted),
    }


def final_cut_record(
    final_step: int, versions: Iterable[int], frozen: Iterable[int]
) -> dict[str, Any]:
    return {
        "event": "final_cut",
        "step": final_step,
        "versions": list(versions),
        "frozen_learners": sorted(frozen),
    }


def resumed_record(global_step: int, versions: Iterable[int]) -> dict[str, Any]:
    """A resumed run continues the tape: rounds after ``global_step`` may appear a second time."""
    return {
        "event": "resumed",
        "step": global_step,
        "next_step": global_step + 1,
        "versions": list(versions),
    }
