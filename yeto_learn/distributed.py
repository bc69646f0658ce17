"""A learner spread over torchrun ranks: rank 0 talks to the syncer, every rank applies.

Under ``torchrun`` the ranks of one logical learner hold identical replicas (data parallel
inside the learner). Only global rank 0 runs the syncer client and the protocol session. At
every :meth:`Learner.step` the ranks meet twice:

1. ``sum_tokens``: an all-reduce (SUM) of the tokens each rank consumed in the step. The ranks
   take the optimizer step together, so the step counts once with the summed tokens.
2. ``run_plan``: rank 0 broadcasts a small header (status, what to apply, an error text) and
   then, fragment by fragment, the f32 values to apply; every rank applies them in the same
   order with the same torch ops, so the replicas stay bit-identical. Rank 0 then answers the
   syncer from the applied state (``after``) and broadcasts whether that failed, so that a
   failure there (a non-finite delta, say) reaches every rank in the same step instead of
   leaving the others blocked in the next collective.

``SoloLink`` is the same contract for a single process (no collectives).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from numpy.typing import NDArray


class ApplyKind(enum.IntEnum):
    #: θ ← α·θ + (1−α)·Θ
    BLEND = 0
    #: θ ← Θ: the first global state a learner receives (it never held one before)
    ADOPT = 1
    #: θ ← the authoritative final state (no blending; cast to the parameter dtype)
    FINAL = 2


@dataclass(frozen=True, slots=True)
class Apply:
    kind: ApplyKind
    fragment_id: int
    #: The flat f32 values; set on the leader only (other ranks receive them).
    values: NDArray[np.float32] | None = field(default=None, repr=False)


class PlanStatus(enum.IntEnum):
    RUNNING = 0
    #: The syncer's final cut is complete: training further is wasted work.
    FINAL_READY = 1
    #: The loop that is waiting (start, finish) is over.
    DONE = 2
    #: Rank 0 failed; every rank raises with the plan's error text.
    FAILED = 3
    #: The wait (finish) ran out of time; every rank raises, and may wait again.
    TIMED_OUT = 4


@dataclass(slots=True)
class Plan:
    status: PlanStatus
    applies: list[Apply] = field(default_factory=list)
    error: str = ""
    #: The newest global step rank 0 has seen (so every rank reports the same).
    global_step: int = 0
    #: With FINAL applies: the final cut's global step (every rank reports it).
    final_global_step: int | None = None


ApplyFn = Callable[[Apply, torch.Tensor], None]
#: Rank 0's work after every rank applied the plan (confirm blends, answer pulls).
AfterFn = Callable[[Plan], None]


class LeaderFailed(Exception):
    """Raised on the other ranks when rank 0 failed after applying a plan (its error text)."""


class RankLink(Protocol):
    rank: int
    world_size: int

    @property
    def is_leader(self) -> bool: ...

    def sum_tokens(self, tokens: int) -> int: ...

    def failed_ranks(self, failed: bool) -> list[int]: ...

    def run_plan(self, plan: Plan | None, apply: ApplyFn, after: AfterFn) -> Plan: ...


def readonly_tensor(values: NDArray[np.float32]) -> torch.Tensor:
    """A torch view of a read-only f32 array, used only as a source of copies."""
    with warnings.catch_warnings():
        # torch warns that writes through the view would be undefined; we never write.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(values)


class SoloLink:
    """One process is the whole learner."""

    rank = 0
    world_size = 1

    @property
    def is_leader(self) -> bool:
        return True

    def sum_tokens(self, tokens: int) -> int:
        return tokens

    def failed_ranks(self, failed: bool) -> list[int]:
        return [0] if failed else []

    def run_plan(self, plan: Plan | None, apply: ApplyFn, after: AfterFn) -> Plan:
        assert plan is not None, "the leader always has a plan"
        for item in plan.applies:
            assert item.values is not None
            apply(item, readonly_tensor(item.values))
        after(plan)
        return plan


#: status, number of applies, error text length in bytes, global step, final step + 1 (0: none)
_HEADER = 5
_MAX_ERROR_BYTES = 4096


class TorchDistributedLink:
    """The ranks of a ``torch.distributed`` process group; global rank 0 leads."""

    def __init__(self, numels: tuple[int, ...], group: Any = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized")
        self._dist = dist
        self._group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(group)
        self._group_rank = dist.get_rank(group)
        backend = str(dist.get_backend(group))
        # NCCL moves device tensors only; gloo (and the rest) CPU tensors.
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self._numels = numels
        self._staging: dict[int, torch.Tensor] = {}
        self._leader_rank = self._global_rank(0)

    @property
    def is_leader(self) -> bool:
        return self.rank == self._leader_rank

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._dist.broadcast(tensor, src=self._leader_rank, group=self._group)

    def _buffer(self, fragment_id: int) -> torch.Tensor:
        buffer = self._staging.get(fragment_id)
        if buffer is None:
            numel = self._numels[fragment_id]
            buffer = torch.empty(numel, dtype=torch.float32, device=self.device)
            self._staging[fragment_id] = buffer
        return buffer

    def sum_tokens(self, tokens: int) -> int:
        total = torch.tensor([tokens], dtype=torch.int64, device=self.device)
        self._dist.all_reduce(total, op=self._dist.ReduceOp.SUM, group=self._group)
        summed = int(total.item())
        if summed < 0:  # wrapped past 2^63 - 1: every rank sees the same sum and raises
            raise ValueError("the ranks' token counts of this step sum past 2^63-1")
        return summed

    def failed_ranks(self, failed: bool) -> list[int]:
        """The ranks of the group that report ``failed``, on every rank: a check that one
        rank fails alone must not leave the others waiting in the next collective."""
        flags = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        flags[self._group_rank] = int(failed)
        self._dist.all_reduce(flags, op=self._dist.ReduceOp.SUM, group=self._group)
        return [self._global_rank(member) for member, flag in enumerate(flags.tolist()) if flag]

    def _global_rank(self, group_rank: int) -> int:
        if self._group is None:
            return group_rank
        return int(self._dist.get_global_rank(self._group, group_rank))

    def run_plan(self, plan: Plan | None, apply: ApplyFn, after: AfterFn) -> Plan:
        result = self._share_and_apply(plan, apply)
        failure: BaseException | None = None
        error = b""
        if self.is_leader:
            try:
                after(result)
            except BaseException as exc:  # every rank hears of it before rank 0 raises it
                failure = exc
                error = (str(exc) or type(exc).__name__).encode("utf-8")[:_MAX_ERROR_BYTES]
        outcome = torch.tensor(
            [int(failure is not None), len(error)], dtype=torch.int64, device=self.device
        )
        self._broadcast(outcome)
        failed, error_len = (int(v) for v in outcome.tolist())
        text = self._broadcast_text(error, error_len)
        if failure is not None:
            raise failure
        if failed:
            raise LeaderFailed(text)
        return result

    def _broadcast_text(self, text: bytes, length: int) -> str:
        """Rank 0's ``text`` of ``length`` bytes on every rank."""
        if not length:
            return ""
        buffer = torch.zeros(length, dtype=torch.uint8, device=self.device)
        if self.is_leader:
            buffer[:] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self._broadcast(buffer)
        return bytes(buffer.cpu().numpy().tobytes()).decode("utf-8", "replace")

    def _share_and_apply(self, plan: Plan | None, apply: ApplyFn) -> Plan:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        error = b""
        if self.is_leader:
            assert plan is not None, "the leader always has a plan"
            error = plan.error.encode("utf-8")[:_MAX_ERROR_BYTES]
            header[0], header[1], header[2] = int(plan.status), len(plan.applies), len(error)
            header[3] = plan.global_step
            header[4] = 0 if plan.final_global_step is None else plan.final_global_step + 1
        self._broadcast(header)
        status, count, error_len, global_step, final_step = (int(v) for v in header.tolist())
        items = torch.zeros((count, 2), dtype=torch.int64, device=self.device)
        if self.is_leader and plan is not None and count:
            items[:] = torch.tensor(
                [[int(a.kind), a.fragment_id] for a in plan.applies],
                dtype=torch.int64,
                device=self.device,
            )
        if count:
            self._broadcast(items)
        received = Plan(
            PlanStatus(status),
            error=self._broadcast_text(error, error_len),
            global_step=global_step,
            final_global_step=final_step - 1 if final_step else None,
        )
        for kind, fragment_id in items.tolist():
            buffer = self._buffer(fragment_id)
            item = Apply(ApplyKind(kind), fragment_id)
            if self.is_leader and plan is not None:
                source = plan.applies[len(received.applies)]
                assert source.values is not None
                buffer.copy_(readonly_tensor(source.values))
                item = source
            self._broadcast(buffer)
            apply(item, buffer)
            received.applies.append(item)
        return plan if self.is_leader and plan is not None else received


def rank_link(numels: tuple[int, ...], group: Any = None) -> RankLink:
    """``TorchDistributedLink`` under an initialized process group of 2+ ranks, else solo."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        return TorchDistributedLink(numels, group)
    return SoloLink()
