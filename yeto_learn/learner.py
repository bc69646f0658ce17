"""A torch model as a YETO v4 learner.

::

    learner = yeto_learn.Learner(model, syncer="host:port", learner_id=i, num_learners=M,
                                 fragments=8, wire_dtype="q4", out_dir="run/learner-0")
    for batch in data:
        loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
        learner.step(tokens=batch_tokens)   # applies broadcasts, answers pulls; never blocks
        if learner.final_ready:             # the syncer finished its rounds: stop training
            break
    learner.finish()                        # final state applied, FINAL_ACK sent, artifact saved

Construction builds the layout from the model's named trainable parameters, derives the
session contract, starts the network client in a background thread, and returns once every
fragment holds the syncer's global state (its initial one, or the current one for a learner
that joins later; the session itself may still wait for other learners to join, and training
meanwhile is local), or once the whole final cut is in (a learner restarted after it:
``final_ready`` is then True, and ``finish()`` applies it). It raises once nothing has moved
to or from the syncer for ``connect_timeout`` seconds, so a large model on a slow link may
take longer. ``step`` never waits on the network: the client thread and this one meet in
thread-safe queues, and the protocol rules live in
:class:`~yeto_learn.session.LearnerSession`, which this class drives.

With ``out_dir``, the learner's artifact (``layout.json``, ``summary.json``, ``model.pt``) is
written inside ``finish()`` as soon as the final state is applied and its FINAL_ACK queued, not
after the syncer's SHUTDOWN: a process killed while the syncer waits for the other learners'
ACKs still leaves the syncer's final state on disk.

Under ``torchrun`` (an initialized ``torch.distributed`` process group of 2+ ranks) only rank 0
talks to the syncer; see :mod:`yeto_learn.distributed`. ``step`` and ``finish`` are then
collective: every rank calls them.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import itertools
import json
import logging
import math
import operator
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import numpy as np
import torch
from numpy.typing import NDArray

from yeto_proto import (
    BcastFragment,
    BudgetDone,
    ErrorMessage,
    Hello,
    Layout,
    MergeMode,
    ProtocolError,
    PullReq,
    WireDtype,
)
from yeto_proto.checkpoint import atomic_replace, write_bytes_atomically
from yeto_proto.constants import I64_MAX, MAX_STREAMS, U32_MAX, U64_MAX
from yeto_proto.errors import CheckpointError, ErrorCode, LocalProtocolError

from .artifact_files import LAYOUT_FILE, RUN_ID_FILE, STATE_FILE, SUMMARY_FILE
from .distributed import Apply, ApplyKind, LeaderFailed, Plan, PlanStatus, RankLink, rank_link
from .model_layout import (
    FragmentPattern,
    build_layout,
    most_fragments,
    normalize_name,
    session_contract,
)
from .session import (
    AnchorRecorded,
    ApplyBroadcast,
    ApplyFinal,
    Effect,
    LearnerSession,
    Phase,
    SendMessage,
    ShutdownReceived,
    SyncerFailed,
)
from .transport import (
    ClientConfig,
    ClientFailed,
    FinishStuck,
    FinishTimeout,
    GroupLost,
    GroupUp,
    InboxItem,
    LearnerError,
    NonFiniteParameters,
    Received,
    SyncerClient,
    SyncerProtocolViolation,
    SyncerRefused,
    SyncerSilent,
    Undelivered,
    parse_address,
)
from .transport.quiet import QuietDeadline

_log = logging.getLogger("yeto_learn")

#: Fragments when the caller names none (fewer when the model allows fewer).
DEFAULT_FRAGMENTS = 8

#: Steps between checks that the model still holds the tracked parameter objects (the check
#: walks every module, about 1 ms for 300 modules); finish() always checks. A turn that reads
#: the parameters for an INIT or a PUSH first looks them up where they are held (cheap).
_OWNERSHIP_CHECK_STEPS = 32

RUN_ID_ENV = "YETO_RUN_ID"
#: How long the waiting loops (start, finish) block on the inbox per turn.
_POLL_S = 0.05
#: Training on this long without a PULL makes the learner say why rounds may have stopped
#: (again after :data:`_NO_ROUND_REPEAT_S` while it lasts). Once pulls have come, the wait
#: must also pass 3x the longest gap seen between two of them (a syncer may pace rounds
#: minutes apart), and 10 minutes while only one has come (no gap seen yet).
NO_ROUND_WARNING_S = 120.0
_NO_ROUND_GAP_FACTOR = 3.0
_NO_ROUND_AFTER_ONE_PULL_S = 600.0
_NO_ROUND_REPEAT_S = 600.0


@dataclass(frozen=True, slots=True)
class LearnerStats:
    """Counters for progress displays (read from the training thread)."""

    local_step: int
    tokens: int
    pushes: int
    broadcasts_applied: int
    #: The highest fragment version applied so far: the syncer's newest committed round seen.
    global_step: int
    bytes_sent: int
    bytes_received: int
    generations: int


class _FragmentParams:
    """The trainable parameters seen as flat f32 fragments in layout order (torch views)."""

    def __init__(
        self, layout: Layout, params: Mapping[str, torch.nn.Parameter], model: torch.nn.Module
    ) -> None:
        self.numels = layout.wire().numels
        self._tracked = dict(params)
        #: Where each tracked parameter is held: (module, attribute, parameter).
        self._holders: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        #: Every (parent, name, child) link of the module tree.
        self._links: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
        self.find_holders(model)
        self._members: list[list[tuple[torch.nn.Parameter, int, int]]] = []
        for placed in layout.offsets():
            self._members.append([(params[t.name], at, t.numel) for t, at in placed])
        self._scratch = [_wire_buffer(n) for n in self.numels]
        #: Unsynced parameters already reported as trainable (each is reported once).
        self._reported_unsynced: set[str] = set()

    def check_still_in(self, model: torch.nn.Module) -> list[str]:
        """Refuse to go on once ``model`` no longer holds the parameter objects the layout
        was built from: blends, pushes and the final state would all go to dead tensors.

        Returns the parameters outside the layout that now require grad (unfrozen, or added,
        after the Learner was built), each once: they train, but are never synced.
        """
        current = {normalize_name(n): p for n, p in model.named_parameters()}
        for name, param in self._tracked.items():
            if current.get(name) is not param:
                what = "is gone from" if name not in current else "was replaced in"
                raise LearnerError(
                    f"parameter {name!r} {what} the model after the Learner was built "
                    "(load_state_dict(..., assign=True), a new nn.Parameter, a resize): its "
                    "updates would never reach the syncer. Load weights in place (copy_, or "
                    "load_state_dict without assign), or build the Learner afterwards."
                )
        unsynced = [
            name
            for name, param in current.items()
            if param.requires_grad
            and param.numel()  # an empty one has nothing to sync
            and name not in self._tracked
            and name not in self._reported_unsynced
        ]
        self._reported_unsynced.update(unsynced)
        return unsynced

    def find_holders(self, model: torch.nn.Module) -> None:
        """Record where each tracked parameter is held, and the module links that lead there."""
        tracked = {id(param) for param in self._tracked.values()}
        modules = list(model.modules())
        self._holders = [
            (module, attribute, param)
            for module in modules
            for attribute, param in module._parameters.items()
            if param is not None and id(param) in tracked
        ]
        self._links = [
            (parent, name, child)
            for parent in modules
            for name, child in parent._modules.items()
            if child is not None
        ]

    def holders_unchanged(self) -> bool:
        """Whether every module still holds its submodules and tracked parameters as recorded:
        a dictionary lookup per module and parameter, where :meth:`check_still_in` walks the
        whole tree (13-15 ms for 1,600 modules). It catches ``load_state_dict(...,
        assign=True)``, a new ``nn.Parameter`` or a new submodule set in place of an old one."""
        return all(
            module._parameters.get(name) is param for module, name, param in self._holders
        ) and all(parent._modules.get(name) is child for parent, name, child in self._links)

    def read(self, fragment_id: int) -> NDArray[np.float32]:
        """Fragment values in a reusable buffer (valid until the next read of the fragment)."""
        return self._gather(fragment_id, self._scratch[fragment_id])

    def read_copy(self, fragment_id: int) -> NDArray[np.float32]:
        """Fragment values in a fresh array (INIT keeps a view of it until it is sent)."""
        return self._gather(fragment_id, _wire_buffer(self.numels[fragment_id]))

    def _gather(self, fragment_id: int, out: torch.Tensor) -> NDArray[np.float32]:
        with torch.no_grad():
            for param, at, numel in self._members[fragment_id]:
                out[at : at + numel].copy_(param.detach().reshape(-1))
        result: NDArray[np.float32] = out.numpy()
        return result

    def apply(self, item: Apply, values: torch.Tensor, alpha: float) -> None:
        """Carry out one plan item with flat f32 ``values`` of the fragment."""
        with torch.no_grad():
            for param, at, numel in self._members[item.fragment_id]:
                theta = values[at : at + numel].view(param.shape)
                if theta.device != param.device:
                    theta = theta.to(param.device)
                if item.kind is not ApplyKind.BLEND:
                    param.copy_(theta)  # casts to the parameter's dtype
                elif param.dtype == torch.float32:
                    param.mul_(alpha).add_(theta, alpha=1.0 - alpha)
                else:  # blend in f32, then round once to the parameter's dtype
                    param.copy_(param.float().mul_(alpha).add_(theta, alpha=1.0 - alpha))


def _wire_buffer(numel: int) -> torch.Tensor:
    """Room for ``numel`` wire values, read as numpy: f32 on the CPU whatever torch's default
    dtype and device are (``set_default_dtype``/``set_default_device`` would change both)."""
    return torch.empty(numel, dtype=torch.float32, device="cpu")


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Named trainable parameters with wrapper components (DDP ``module.``…) removed."""
    return {normalize_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP and ``torch.compile`` wrappers (their ``module``/``_orig_mod``)."""
    while True:
        inner = (
            model.module
            if isinstance(model, torch.nn.parallel.DistributedDataParallel)
            else (getattr(model, "_orig_mod", None))
        )
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def synced_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters a learner syncs: all but empty ones (nothing to sync).

    Refuses what it cannot sync, naming the parameter: meta tensors (no values yet),
    DTensors (FSDP2, tensor parallel: each rank holds a shard, while the ranks of a learner
    must hold full replicas, as under DDP), any dtype that is not real floating point (the
    wire carries real values: a complex parameter's imaginary part would be dropped, and the
    first broadcast would zero it in the model), and two Parameter objects over the same
    memory (each would be synced, and every broadcast applied to that memory twice).
    """
    params: dict[str, torch.nn.Parameter] = {}
    for name, param in trainable_parameters(model).items():
        if param.is_meta:
            raise ValueError(
                f"parameter {name!r} is on the meta device: materialize the model (to_empty() "
                "and initialize, or load weights) before building the Learner"
            )
        if _is_dtensor(param):
            raise ValueError(
                f"parameter {name!r} is a DTensor (FSDP2 or tensor parallel): the ranks of a "
                "learner must hold full replicas (plain or DDP); sharded models are not "
                "supported"
            )
        if param.layout is not torch.strided:
            raise ValueError(
                f"parameter {name!r} is a {param.layout} tensor: only dense (strided) "
                "parameters can be synced"
            )
        if not param.is_floating_point():
            raise ValueError(
                f"parameter {name!r} is {param.dtype}: only real floating-point parameters can "
                "be synced; hold a complex one as a real Parameter (torch.view_as_real) and "
                "view it as complex (torch.view_as_complex) in forward"
            )
        if param.numel():
            params[name] = param
    if not params:
        raise ValueError("the model has no trainable parameter with values to sync")
    if shared := _sharing_memory(params):
        first, second = shared
        raise ValueError(
            f"parameters {first!r} and {second!r} are two Parameter objects over the same "
            "memory (nn.Parameter(w.detach()), or .data = another's): both would be synced, "
            "and each broadcast applied to that memory twice; tie them as one Parameter "
            f"object (give {second!r} the very Parameter {first!r} holds, as tied weights are)"
        )
    return params


def _sharing_memory(params: Mapping[str, torch.Tensor]) -> tuple[str, str] | None:
    """Two of ``params`` (non-empty, strided), in model order, that surely share memory: the
    same view twice (``nn.Parameter(w.detach())``), two dense ones whose byte ranges overlap,
    or a strided view whose first or last element lies in a dense one. Strided views whose
    ranges overlap may still be disjoint (the column halves of one matrix): those are let
    through, as telling would take an element walk.
    """
    names = list(params)
    views: dict[tuple[Any, ...], int] = {}
    dense: list[tuple[str, int, int, int]] = []  # device, first byte, end, model order
    ends: list[tuple[str, int, int]] = []  # a strided view's first and last element
    for order, param in enumerate(params.values()):
        try:
            first = int(param.data_ptr())  # absolute: two storages over one buffer compare
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            continue
        device, size = str(param.device), param.element_size()
        view = (device, first, param.dtype, tuple(param.shape), tuple(param.stride()))
        if (seen := views.setdefault(view, order)) != order:
            return names[seen], names[order]
        reach = sum((n - 1) * stride for n, stride in zip(param.shape, param.stride(), strict=True))
        if int(reach) + 1 == param.numel():  # no gaps: contiguous, channels_last, transposed
            dense.append((device, first, first + param.numel() * size, order))
        else:
            ends += [(device, first, order), (device, first + int(reach) * size, order)]
    # Sorted by start, a dense range that overlaps any later one overlaps the next one.
    dense.sort()
    for (device, _, end, order), (next_device, next_start, _, next_order) in itertools.pairwise(
        dense
    ):
        if device == next_device and next_start < end:
            return names[min(order, next_order)], names[max(order, next_order)]
    # The dense ranges are disjoint now: at most one can hold a given byte.
    for device, at, order in ends:
        index = bisect.bisect_right(dense, (device, at, math.inf, math.inf)) - 1
        if index >= 0 and dense[index][0] == device and at < dense[index][2]:
            other = dense[index][3]
            return names[min(order, other)], names[max(order, other)]
    return None


_E = TypeVar("_E", bound=enum.Enum)


def _is_dtensor(param: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has none
        return False
    return isinstance(param, DTensor) or isinstance(param.data, DTensor)


def _choice(kind: type[_E], value: str | _E, what: str) -> _E:
    """An enum member, from itself or its name in any case; else a ValueError naming the
    choices."""
    if isinstance(value, kind):
        return value
    for member in kind:
        if str(value).lower() == member.name.lower():
            return member
    choices = ", ".join(member.name.lower() for member in kind)
    raise ValueError(f"{what} must be one of {choices}, got {value!r}")


def _wire_dtype(value: str | WireDtype) -> WireDtype:
    if isinstance(value, WireDtype):
        return value
    try:
        return WireDtype[str(value).upper()]
    except KeyError:
        raise ValueError(f"wire_dtype must be f32, bf16 or q4, got {value!r}") from None


def resolve_run_id(
    run_id: str | None, *, out_dir: Path | None, resume: bool, num_learners: int
) -> str:
    """The run id behind the session contract (every learner of a run must share it).

    Explicit ``run_id`` > the one persisted in ``out_dir`` when resuming > ``$YETO_RUN_ID`` > a
    fresh one for a single learner. A fresh run must never reuse a contract by accident, so a
    resumed run reads the id it persisted, and several learners must be given one id.
    """
    persisted = None
    if out_dir is not None and (out_dir / RUN_ID_FILE).exists():
        persisted = (out_dir / RUN_ID_FILE).read_text(encoding="utf-8").strip()
    if resume:
        if persisted is None:
            raise ValueError(f"resume=True but {out_dir} holds no {RUN_ID_FILE} to resume")
        if run_id is not None and run_id != persisted:
            raise ValueError(f"resume=True with run_id {run_id!r}, but {out_dir} ran {persisted!r}")
        return persisted
    chosen = run_id or os.environ.get(RUN_ID_ENV)
    if chosen is None:
        if num_learners > 1:
            raise ValueError(
                f"{num_learners} learners must share one run id: pass run_id= (or set "
                f"{RUN_ID_ENV}); yeto launch does this for you"
            )
        chosen = uuid.uuid4().hex
    if persisted is not None and persisted == chosen:
        raise ValueError(
            f"{out_dir} already ran {chosen!r}; pass resume=True to continue it on purpose, "
            "or use a fresh run id / output directory"
        )
    return chosen


class Learner:
    """One logical YETO learner around a torch model (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        syncer: str,
        learner_id: int,
        num_learners: int,
        fragments: int | None = None,
        wire_dtype: str | WireDtype = "f32",
        fragment_pattern: str | FragmentPattern = FragmentPattern.BALANCED,
        matrix_merge: str | MergeMode = MergeMode.AVG,
        merge_alpha: float = 0.5,
        streams: int = 4,
        out_dir: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        resume: bool = False,
        experiment: Mapping[str, Any] | None = None,
        profile_hash: bytes | None = None,
        hello_key: bytes | str | None = None,
        connect_timeout: float = 60.0,
        reconnect_timeout: float = 120.0,
        finish_timeout: float = 600.0,
        budget_steps: int | None = None,
        adopt_first_broadcast: bool = True,
        process_group: Any = None,
    ) -> None:
        if not 0 <= learner_id < num_learners:
            raise ValueError(f"learner_id {learner_id} outside 0..{num_learners - 1}")
        if budget_steps is not None and not 1 <= budget_steps <= U32_MAX:
            raise ValueError(f"budget_steps must be in 1..2^32-1, got {budget_steps}")
        if not 0.0 <= merge_alpha <= 1.0:
            raise ValueError(f"merge_alpha must be in [0, 1], got {merge_alpha}")
        if not 0 <= streams <= MAX_STREAMS:
            raise ValueError(f"streams must be in 0..{MAX_STREAMS}, got {streams}")
        if isinstance(hello_key, str):  # as yeto-sync reads $YETO_ISLAND_HMAC_KEY: its UTF-8
            hello_key = hello_key.encode("utf-8")
        self.model = model
        self.learner_id = learner_id
        self.num_learners = num_learners
        self.merge_alpha = float(merge_alpha)
        self.dtype = _wire_dtype(wire_dtype)
        self.syncer_address = syncer
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.finish_timeout = finish_timeout
        self.adopt_first_broadcast = adopt_first_broadcast
        #: Benchmark closure (spec/closure.md): train exactly this many steps, then freeze.
        self.budget_steps = budget_steps
        self.budget_reported = False
        #: The epoch of a BUDGET_DONE that came back unsent (no byte of it was written).
        self._unsent_budget_epoch: int | None = None
        #: report_budget() was called: BUDGET_DONE goes out at the end of the next plan.
        self._budget_due = False

        params = synced_parameters(model)
        pattern = _choice(FragmentPattern, fragment_pattern, "fragment_pattern")
        merge = _choice(MergeMode, matrix_merge, "matrix_merge")
        shapes = [(name, tuple(p.shape)) for name, p in params.items()]
        # The session contract keeps naming what was asked for (8 by default): a run started
        # before the default fitted the model must still resume (spec/checkpoint.md § 4).
        requested = DEFAULT_FRAGMENTS if fragments is None else fragments
        if fragments is None:
            fragments = min(DEFAULT_FRAGMENTS, most_fragments(shapes, merge, pattern))
        self.layout = build_layout(shapes, fragments=fragments, pattern=pattern, matrix_merge=merge)
        self._params = _FragmentParams(self.layout, params, model)
        identity = {
            "fragments": requested,
            "fragment_pattern": pattern.value,
            "matrix_merge": MergeMode(merge).name.lower(),
            "merge_alpha": self.merge_alpha,
            "num_learners": num_learners,
            "experiment": dict(experiment or {}),
        }
        if budget_steps is not None:
            identity["budget_steps"] = budget_steps
        self._link: RankLink = rank_link(self._params.numels, process_group)
        self.is_leader = self._link.is_leader
        self.run_id = ""
        self.contract = b""
        #: What this learner's contract covers besides the layout and dtype, for a refusal.
        self._contract_inputs = ""
        self._session: LearnerSession | None = None
        self._client: SyncerClient | None = None
        self._client_closed = False
        self._epoch = 0
        self._adopted = [False] * len(self._params.numels)
        self._final: ApplyFinal | None = None
        #: (fragment, version) of broadcasts in the plan being applied, confirmed afterwards.
        self._confirm: list[tuple[int, int]] = []
        self._shutdown = False
        self._finished = False
        self._failed: BaseException | None = None
        #: Held by the thread inside step/finish/report_budget (finish calls report_budget).
        self._calls = threading.RLock()
        self.final_ready = False
        self.final_global_step: int | None = None
        #: The final step whose artifact is on disk (rank 0, with out_dir), and the seconds
        #: the current finish() spent writing it (they do not count against its timeout).
        self._saved_step: int | None = None
        self._saving_s = 0.0
        self._pushes = 0
        self._starved_warned = False
        self._starved_check_at = 0.0
        #: When the last PULL arrived (the start counts as one), and when the lack of them
        #: was last looked at and reported.
        self._last_pull_at = time.monotonic()
        self._steps_at_last_pull = 0
        self._pulls_seen = 0
        self._longest_pull_gap = 0.0
        self._no_round_check_at = 0.0
        self._no_round_warned_at = -math.inf
        self._applied = 0
        self._global_step = 0
        self._tokens = 0
        self._local_step = 0

        if self.is_leader:
            try:
                # Identity and the network are rank 0's; other ranks learn everything from plans.
                self.run_id = resolve_run_id(
                    run_id, out_dir=self.out_dir, resume=resume, num_learners=num_learners
                )
                if self.out_dir is not None:
                    self.out_dir.mkdir(parents=True, exist_ok=True)
                self.contract = session_contract(
                    self.layout, self.dtype, run_id=self.run_id, experiment=identity
                )
                self._contract_inputs = ", ".join(
                    f"{name}={value!r}"
                    for name, value in {"run_id": self.run_id, **identity}.items()
                    if value != {}
                )
                wire = self.layout.wire()
                fingerprint = self.layout.fingerprint()
                self._session = LearnerSession(
                    wire,
                    self.dtype,
                    learner_id,
                    layout_fingerprint=fingerprint,
                    session_contract=self.contract,
                    profile_hash=profile_hash,
                    budget_steps=budget_steps,
                )
                host, port = parse_address(syncer)
                hello = Hello(
                    learner_id=learner_id,
                    generation=1,  # replaced by a fresh generation for every dial
                    dtype=self.dtype,
                    layout=wire,
                    layout_fingerprint=fingerprint,
                    session_contract=self.contract,
                    num_streams=streams,
                    profile_hash=profile_hash,
                )
                config = ClientConfig(
                    host,
                    port,
                    num_streams=streams,
                    connect_timeout=connect_timeout,
                    reconnect_timeout=reconnect_timeout,
                    hello_key=hello_key,
                )
                self._client = SyncerClient(config, hello, self._session.limits)
                self._client.start()
            except BaseException as exc:
                # The other ranks already wait in the first shared plan: they fail with it
                # (rather than hang until this process leaves the group).
                self._run(Plan(PlanStatus.FAILED, error=_failure_text(exc)), exc)
        # A large model over a slow link takes longer than connect_timeout to arrive (and
        # learner 0's INIT to go out): the wait gives up only when nothing moves for that long.
        # (Other torchrun ranks have no client: rank 0's verdict reaches them.)
        deadline: float | Callable[[], float] = time.monotonic() + connect_timeout
        if self._client is not None:
            deadline = QuietDeadline(self._client.counters, connect_timeout).deadline
        try:
            self._service_until(self._started, deadline, self._start_timeout_error)
        except BaseException:
            self._close_client()
            raise
        self._last_pull_at = time.monotonic()  # the start counts as one

    def _started(self) -> bool:
        """Rank 0: whether the session started here, recording the run id once it did.

        Only a started session makes ``out_dir`` one that "ran" the id: a learner that never
        reached its syncer may be started again with the same command. Written inside the
        shared wait, so a failed write fails every rank, not rank 0 alone.
        """
        # The final cut is whole on its own: restarted after it, a learner may have it
        # complete before the last catch-up BCAST (streams reorder), which it then ignores.
        if not (all(self._adopted) or self.final_ready):
            return False
        if self.out_dir is not None:
            try:
                _write_text_atomically(self.out_dir / RUN_ID_FILE, self.run_id + "\n")
            except CheckpointError as exc:
                raise LearnerError(
                    f"the run id was not saved: {_write_failure(exc, self.out_dir)}"
                ) from exc
        return True

    def _start_timeout_error(self) -> LearnerError:
        assert self._client is not None
        if self._epoch == 0:  # no connection group was ever opened
            return self._client.unreachable()
        quiet = self._client.config.connect_timeout
        arrived = sum(self._adopted)
        if arrived:
            return SyncerSilent(
                f"the session with the syncer at {self.syncer_address} started, then nothing "
                f"moved for {quiet:g} s with {arrived} of {len(self._adopted)} fragments "
                "received"
            )
        return SyncerSilent(
            f"no session started with the syncer at {self.syncer_address}: nothing moved for "
            f"{quiet:g} s; is it a yeto-sync, did all {self.num_learners} learners join, and "
            "has learner 0 finished sending the initial model?"
        )

    # -- the training loop's API -----------------------------------------------------------
    def step(self, tokens: int) -> None:
        """Record one local optimizer step over ``tokens`` raw units; apply what arrived.

        ``tokens`` weighs this learner's pushes (``c_tokens² / c_steps`` by default), so it has
        no default: a learner reporting 0 tokens contributes nothing to any merge. Never waits
        on the network. Under torchrun it is collective (every rank calls it with its own
        tokens; they are summed).
        """
        with self._one_caller():
            self._usable()
            # Checked before any collective: a rank that raises here alone and retries meets
            # the others in the same collective.
            tokens = _checked_tokens(tokens, self._link.world_size)
            if self._local_step % _OWNERSHIP_CHECK_STEPS == 0:  # a module walk: not every step
                self._check_model_on_every_rank()
            if self.budget_reached:
                raise LearnerError(
                    f"the budget of {self.budget_steps} local steps is reached: call finish()"
                )
            if self.final_global_step is not None:  # refused before anything changes
                raise LearnerError(
                    f"the final state of global step {self.final_global_step} is applied: "
                    "training is over; call finish() to wait for the syncer's SHUTDOWN, or "
                    "close()"
                )
            total = self._link.sum_tokens(tokens)
            self._turn(lambda session: session.record_step(total))
            self._local_step += 1
            self._tokens += total
            self._warn_if_no_rounds()

    def _note_pull(self) -> None:
        now = time.monotonic()
        if self._pulls_seen:
            self._longest_pull_gap = max(self._longest_pull_gap, now - self._last_pull_at)
        self._pulls_seen += 1
        self._last_pull_at = now
        self._steps_at_last_pull = self._local_step

    def _no_round_limit(self) -> float:
        """How long without a pull is unusual for this run so far."""
        if not self._pulls_seen:
            return NO_ROUND_WARNING_S  # the first round launches as the session starts
        if not self._longest_pull_gap:
            return max(NO_ROUND_WARNING_S, _NO_ROUND_AFTER_ONE_PULL_S)
        return max(NO_ROUND_WARNING_S, _NO_ROUND_GAP_FACTOR * self._longest_pull_gap)

    def _warn_if_no_rounds(self) -> None:
        """A learner whose rounds stopped trains on alone without an error (a learner that
        left holds a --quorum > 1 round until --quorum-timeout-s; a session waits for a
        learner that never joined; a second process with this learner_id took its place):
        say so, in its own log, rather than leave the user to find it in the syncer's."""
        now = time.monotonic()
        if not self.is_leader or self.final_ready or now < self._no_round_check_at:
            return
        self._no_round_check_at = now + 1.0
        quiet = now - self._last_pull_at
        if quiet < self._no_round_limit() or now - self._no_round_warned_at < _NO_ROUND_REPEAT_S:
            return
        if self._leader_session().phase is not Phase.CONNECTED:
            # Cut off from the syncer: the client logged the loss ("lost the syncer …
            # redialing") and fails when its redial deadline passes; no round could reach us.
            return
        self._no_round_warned_at = now
        _log.warning(
            "yeto learner %d: the syncer at %s has pulled nothing for %.0f s while this learner "
            "trained on (%d local steps since its last pull): its rounds may wait for a learner "
            "that left (a --quorum above 1 holds a round until --quorum-timeout-s) or never "
            "joined, or another process may use learner_id %d; see the syncer's log",
            self.learner_id,
            self.syncer_address,
            quiet,
            self._local_step - self._steps_at_last_pull,
            self.learner_id,
        )

    def _turn(self, first: Callable[[LearnerSession], None] = lambda session: None) -> None:
        """One turn on every rank, without waiting: rank 0 does ``first``, takes in what
        arrived and plans; every rank applies the plan."""
        plan: Plan | None = None
        error: BaseException | None = None
        if self.is_leader:
            try:
                first(self._leader_session())
                plan = self._plan(self._client_items(0.0))
            except BaseException as exc:  # every rank must hear of it before anyone raises
                error = exc
                plan = Plan(PlanStatus.FAILED, error=_failure_text(exc))
        self._run(plan, error)

    def finish(self, timeout: float | None = None, *, stop_when_stuck: bool = False) -> None:
        """Wait for the final state, apply it, ACK it, save the learner's artifact, and wait
        for the syncer's SHUTDOWN.

        Keeps answering pulls meanwhile. The artifact (with ``out_dir``; rank 0 under
        torchrun) is written as soon as the final state is applied and its FINAL_ACK queued,
        while the syncer may still wait for other learners' ACKs; it is not written again
        after the SHUTDOWN. Raises :class:`FinishTimeout` if the syncer's final cut (or its
        SHUTDOWN after our ACK) does not arrive within ``timeout`` seconds (default
        ``finish_timeout``; writing the artifact does not count); nothing local is ever saved
        in place of a missing cut. When ``finish`` fails after the cut was applied (the syncer
        stopped or fell silent before its SHUTDOWN), the error's note names the saved file.
        The learner stays usable after that timeout: call ``finish()`` again to wait longer,
        or ``close()``. An artifact that cannot be written (a full disk) does not stop the
        protocol: the learner ACKs and waits for the SHUTDOWN all the same, tries the write
        once more, and then raises :class:`LearnerError` naming the file.

        ``stop_when_stuck`` is for a loop that stopped training before ``final_ready`` and
        will not go on (a step cap): instead of warning and waiting, ``finish`` raises
        :class:`FinishStuck` as soon as the syncer pulls a fragment that only another
        ``step()`` could answer (the learner stays usable, as after a timeout; under torchrun
        the other ranks raise :class:`FinishTimeout` with its text). Pulls its windows can
        still answer are answered first, so a run whose last rounds need nothing more from
        this learner still ends normally.
        """
        with self._one_caller():
            self._usable()
            self._check_model_on_every_rank()
            if self.budget_reached and not self.budget_reported:
                self.report_budget()
            limit = self.finish_timeout if timeout is None else timeout
            started = time.monotonic()
            self._saving_s = 0.0
            self._starved_warned = False  # once per call
            try:
                self._service_until(
                    lambda: self._shutdown,
                    lambda: started + limit + self._saving_s,
                    lambda: FinishTimeout(
                        f"the syncer at {self.syncer_address} did not complete finalization "
                        f"within {limit:g} s (final state "
                        f"{'missing' if self.final_global_step is None else 'applied'})"
                        + self._starved_pulls_note()
                    ),
                    finishing=True,
                    stop_when_stuck=stop_when_stuck,
                )
            except LearnerError as exc:
                if self.final_global_step is None and (note := self._cut_off_note()):
                    exc.add_note(note)  # at the finish deadline or the redial one, whichever first
                self._keep_applied_final_state(exc)
                raise
            self._finished = True
            if self.is_leader:
                self._close_client()
                self._save_unsaved_cut()

    @property
    def budget_reached(self) -> bool:
        """A budget was given and exactly that many local steps are done: stop training."""
        return self.budget_steps is not None and self._local_step >= self.budget_steps

    def report_budget(self) -> None:
        """Send BUDGET_DONE and freeze (``finish`` does this itself once the budget is reached).

        Call only after optimizer and data work stopped. From now on broadcasts only move the
        anchors; pulls of the cutoff syncer are not answered; after the reconnect each pull is
        answered with ``frozen − anchor`` and ``c_steps = local_step = budget``. Under torchrun
        it is collective, like ``step``.
        """
        with self._one_caller():
            self._usable()
            if not self.budget_reached or self.budget_reported:
                raise LearnerError(
                    f"BUDGET_DONE needs exactly {self.budget_steps} local steps, sent once "
                    f"(at {self._local_step}, {'already' if self.budget_reported else 'not'} sent)"
                )
            # Sent at the end of this turn's plan, once what arrived meanwhile says which group
            # is current: queued on a group already lost (its loss still unread), it could
            # come back only after a pull of the next group was answered with a frozen PUSH
            # (spec/learner.md § 10: that group's pulls stay unanswered).
            self._budget_due = self.is_leader
            self.budget_reported = True
            self._turn()

    @contextlib.contextmanager
    def _one_caller(self) -> Iterator[None]:
        """Refuse a second thread while one is inside step/finish/report_budget.

        They read and write the model, the session and the plan being applied: two threads at
        once send PUSHes built from half-blended parameters without any error.
        """
        if not self._calls.acquire(blocking=False):
            raise LearnerError(
                "Learner is not thread-safe: step(), finish() and report_budget() were called "
                "from two threads at once"
            )
        try:
            yield
        finally:
            self._calls.release()

    def close(self) -> None:
        """Stop the network client without finalizing (e.g. on an error in the training loop).

        A ``finish()`` waiting in another thread then raises :class:`LearnerError` at once.
        """
        self._finished = True
        self._close_client()

    @property
    def stats(self) -> LearnerStats:
        counters = self._client.counters if self._client is not None else None
        return LearnerStats(
            local_step=self._local_step,
            tokens=self._tokens,
            pushes=self._pushes,
            broadcasts_applied=self._applied,
            global_step=self._global_step,
            bytes_sent=counters.bytes_sent if counters else 0,
            bytes_received=counters.bytes_received if counters else 0,
            generations=len(self._client.generations) if self._client else 0,
        )

    @property
    def generations(self) -> list[int]:
        """Every connection generation this learner dialed (rank 0 only)."""
        return list(self._client.generations) if self._client is not None else []

    def _pulls_awaiting_a_step(self) -> list[int]:
        return self._session.pulls_awaiting_a_step() if self._session is not None else []

    def _starved_pulls_note(self) -> str:
        if not (starved := self._pulls_awaiting_a_step()):
            return ""
        if self.budget_steps is not None:  # the cut comes only after every learner's budget
            advice = (
                f"finish() was called before the budget of {self.budget_steps} local steps was "
                "reached, so keep calling step() until learner.budget_reached is True"
            )
        else:
            advice = (
                "finish() was called before learner.final_ready, so keep calling step() until "
                "final_ready is True"
            )
        return (
            f"; the syncer still pulls fragments {starved}, which this learner cannot answer "
            f"without training: {advice}"
        )

    @property
    def cut_off_since(self) -> float | None:
        """When (``time.monotonic()``) this learner lost the syncer, while it has not heard from
        it again; None while connected (rank 0 only)."""
        return self._client.cut_off_since if self._client is not None else None

    def _cut_off_note(self) -> str:
        """Why a learner still cut off when ``finish`` fails may never get the cut: the syncer
        freezes only the learners connected at its final cut (spec/learner.md § 7 item 8)."""
        since = self.cut_off_since
        if since is None or self._client is None:
            return ""
        return (
            f"this learner has been cut off from the syncer for the last "
            f"{time.monotonic() - since:.0f} s (last error: {self._client.last_error or 'none'})"
            ": if the syncer took its final cut meanwhile, the cut does not include this "
            "learner and the syncer finishes without it (its checkpoint, if it keeps one, "
            "holds the final model); otherwise the syncer may have stopped: see its log"
        )

    def _warn_of_starved_pulls(self) -> None:
        """Once per finish(): a learner that stopped training too early stalls the rounds
        (with --quorum M, every learner's); say so now rather than at the timeout. Looked at
        once a second at most: the scan covers every fragment."""
        now = time.monotonic()
        if self._starved_warned or now < self._starved_check_at:
            return
        self._starved_check_at = now + 1.0
        if not (note := self._starved_pulls_note()):
            return
        self._starved_warned = True
        _log.warning("yeto learner %d: waiting in finish()%s", self.learner_id, note)

    # -- one turn of the protocol -----------------------------------------------------------
    def _service_until(
        self,
        done: Callable[[], bool],
        deadline: float | Callable[[], float],
        on_timeout: Callable[[], LearnerError],
        *,
        finishing: bool = False,
        stop_when_stuck: bool = False,
    ) -> None:
        """Serve the syncer (wait, apply, answer) until ``done()`` holds on rank 0; with
        ``stop_when_stuck``, stop (as at the deadline) with :class:`FinishStuck` once a pull
        waits for a local step."""
        while True:
            plan: Plan | None = None
            error: BaseException | None = None
            if self.is_leader:
                try:
                    left = (deadline() if callable(deadline) else deadline) - time.monotonic()
                    if done():
                        plan = Plan(PlanStatus.DONE)
                    elif self._client_closed:  # by close() from another thread: nothing comes
                        raise LearnerError("close() was called while this learner waited")
                    elif left <= 0:
                        error = on_timeout()
                        plan = Plan(PlanStatus.TIMED_OUT, error=str(error))
                    elif stop_when_stuck and (stuck := self._pulls_awaiting_a_step()):
                        error = FinishStuck(self.syncer_address, stuck)
                        plan = Plan(PlanStatus.TIMED_OUT, error=str(error))
                    else:
                        items = self._client_items(min(_POLL_S, left))
                        plan = self._plan(items)
                        if finishing and self._final is not None:
                            plan.applies += self._final_applies(self._final)
                            plan.final_global_step = self._final.final_global_step
                        elif finishing and not stop_when_stuck:  # the next turn raises instead
                            self._warn_of_starved_pulls()
                except BaseException as exc:
                    error = exc
                    plan = Plan(PlanStatus.FAILED, error=_failure_text(exc))
            plan = self._run(plan, error)
            if plan.final_global_step is not None:  # applied on every rank, FINAL_ACK queued
                self._save_applied_cut()
            if plan.status is PlanStatus.DONE:
                return
            if plan.status is PlanStatus.TIMED_OUT:
                # Nothing is lost by waiting longer: the learner stays usable (finish() again).
                raise (
                    error
                    if error is not None
                    else (FinishTimeout if finishing else SyncerSilent)(plan.error)
                )

    def _run(self, plan: Plan | None, error: BaseException | None) -> Plan:
        """Share ``plan`` with every rank, apply it, then let rank 0 confirm and answer.

        Any failure on the way (a plan that failed on rank 0, an interrupt while the
        parameters were half blended, rank 0 failing to answer) ends the learner on every
        rank: what it holds no longer matches what the session believes.
        """
        if plan is not None:
            plan.global_step = self._global_step
        try:
            plan = self._link.run_plan(plan, self._apply, self._after_apply)
        except LeaderFailed as exc:
            self._fail(_rank_zero_failure(f"rank 0 of this learner failed: {exc}"))
        except BaseException as exc:
            self._fail(exc)
        self._global_step = plan.global_step
        if plan.status is PlanStatus.FAILED:
            self._fail(error if error is not None else _rank_zero_failure(plan.error))
        if plan.status is PlanStatus.FINAL_READY:
            self.final_ready = True
        if plan.final_global_step is not None:  # every rank now holds the final cut
            self.final_global_step = plan.final_global_step
        return plan

    def _fail(self, failure: BaseException) -> NoReturn:
        self._failed = failure
        self._close_client()
        raise failure

    def _check_model(self) -> None:
        """Refuse a model whose synced parameters were replaced; say once of each parameter
        that became trainable outside the layout (a progressive unfreeze): it would silently
        train on without ever being synced."""
        unsynced = self._params.check_still_in(self.model)
        if unsynced and self.is_leader:  # every rank holds the same model: rank 0 says it
            _log.warning(
                "yeto learner %d: %s now require%s grad but %s not synced: the synced "
                "parameters are fixed when the Learner is built; build it after unfreezing "
                "(or keep the parameters trainable from the start) to sync them",
                self.learner_id,
                ", ".join(repr(name) for name in unsynced),
                "s" if len(unsynced) == 1 else "",
                "is" if len(unsynced) == 1 else "are",
            )

    def _check_model_on_every_rank(self) -> None:
        """``_check_model`` on each rank, then every rank stops if any rank's failed: under
        torchrun one rank's model can change alone (``load_state_dict(..., assign=True)`` on
        rank 0 only), and a rank raising alone would leave the others waiting in the step's
        collectives."""
        problem: Exception | None = None
        try:
            self._check_model()
        except Exception as exc:  # every rank hears of it before this one raises it
            problem = exc
        failed = self._link.failed_ranks(problem is not None)
        if problem is not None:
            raise problem
        if failed:
            raise LearnerError(
                f"the model check failed on rank{'s' if len(failed) > 1 else ''} "
                f"{', '.join(map(str, failed))} of this learner (see that rank's error: a "
                "parameter replaced after the Learner was built, say): every rank stops with it"
            )

    def _owned(
        self, read: Callable[[int], NDArray[np.float32]]
    ) -> Callable[[int], NDArray[np.float32]]:
        """``read``, checking once before its first read that the modules still hold the
        tracked parameters: no INIT or PUSH is built from one replaced in place (dead), as
        it could be between two periodic walks of the whole model."""
        checked = False

        def read_owned(fragment_id: int) -> NDArray[np.float32]:
            nonlocal checked
            if not checked:
                if not self._params.holders_unchanged():
                    self._check_model()  # raises, naming the parameter, if it is gone
                    self._params.find_holders(self.model)  # only moved: held elsewhere now
                checked = True
            return read(fragment_id)

        return read_owned

    def _apply(self, item: Apply, values: torch.Tensor) -> None:
        self._params.apply(item, values, self.merge_alpha)

    def _client_items(self, wait: float) -> list[InboxItem]:
        assert self._client is not None
        items = self._client.poll()
        if not items and wait > 0:
            item = self._client.wait(wait)
            if item is not None:
                items = [item, *self._client.poll()]
        return items

    def _plan(self, items: list[InboxItem]) -> Plan:
        """Feed the client's items to the session; collect what every rank must apply."""
        session = self._leader_session()
        applies: list[Apply] = []
        for item in items:
            match item:
                case GroupUp():
                    self._epoch = item.epoch
                    session.hello(item.num_streams, generation=item.generation)
                    # Time cut off is no round's fault: "pulled nothing for" counts from here.
                    self._last_pull_at = max(self._last_pull_at, time.monotonic())
                    if self.learner_id == 0:
                        with _own_values_checked():
                            inits = session.init_messages(self._owned(self._params.read_copy))
                        for init in inits:
                            self._send(init)
                case GroupLost():
                    if item.epoch == self._epoch:
                        session.connection_lost()
                case Received():
                    if isinstance(item.message, PullReq):
                        self._note_pull()
                    applies += self._receive(session, item)
                case Undelivered(message=BudgetDone()):
                    # The syncer never saw it: it still gets it, once, on a newer group.
                    self._unsent_budget_epoch = item.epoch
                case Undelivered():
                    pass  # pulls, pushes and acks die with their group
                case ClientFailed():
                    raise item.error
        if self._unsent_budget_epoch is not None and self._unsent_budget_epoch < self._epoch:
            self._send(session.budget_done_resent())
            self._unsent_budget_epoch = None
        if self._budget_due:
            self._budget_due = False
            self._send(session.budget_done())
        status = PlanStatus.FINAL_READY if self._final is not None else PlanStatus.RUNNING
        return Plan(status, applies)

    def _receive(self, session: LearnerSession, item: Received) -> list[Apply]:
        try:
            effects = session.receive(item.message)
        except ProtocolError as exc:
            if isinstance(item.message, ErrorMessage):
                raise self._refused(item.message.text) from None
            raise SyncerProtocolViolation(self.syncer_address, exc) from None
        if isinstance(item.message, BcastFragment):
            self._global_step = max(self._global_step, item.message.version)
        return [a for effect in effects if (a := self._carry_out(effect)) is not None]

    def _refused(self, text: str) -> SyncerRefused:
        signed = self._client is not None and self._client.config.hello_key is not None
        if signed and not self._applied and text.startswith(_MISREAD_MAC_REFUSALS):
            # A syncer without the key reads the MAC as part of the HELLO and refuses it for
            # what that breaks (the MAC read as the HELLO's tail), never for the key.
            text += (
                " (this learner signs its HELLO with a key: was the syncer started with the "
                "same --hello-hmac-key-file or YETO_ISLAND_HMAC_KEY?)"
            )
        if text.startswith(f"{ErrorCode.SESSION_CONTRACT_MISMATCH.value}: "):
            # The syncer holds only a hash: say what went into ours, to compare across learners.
            text += f" (this learner's contract covers {self._contract_inputs})"
        return SyncerRefused(self.syncer_address, text)

    def _carry_out(self, effect: Effect) -> Apply | None:
        match effect:
            case ApplyBroadcast():
                p = effect.fragment_id
                adopt = self.adopt_first_broadcast and not self._adopted[p]
                kind = ApplyKind.ADOPT if adopt else ApplyKind.BLEND
                self._confirm.append((p, effect.version))
                return Apply(kind, p, effect.global_params)
            case ApplyFinal():
                self._final = effect
                self.final_ready = True
            case SendMessage():
                self._send(effect.message)
            case SyncerFailed():
                raise self._refused(effect.text)
            case ShutdownReceived():
                self._shutdown = True
            case AnchorRecorded():
                pass
        return None

    def _final_applies(self, final: ApplyFinal) -> list[Apply]:
        return [Apply(ApplyKind.FINAL, p, values) for p, values in enumerate(final.fragments)]

    def _after_apply(self, plan: Plan) -> None:
        """Rank 0, after every rank applied ``plan``: confirm to the session, then answer."""
        if plan.status is PlanStatus.FAILED:
            return
        session = self._leader_session()
        for p, version in self._confirm:
            session.broadcast_applied(p, version)
            self._adopted[p] = True
            self._applied += 1
        self._confirm.clear()
        final = self._final
        if final is not None and any(a.kind is ApplyKind.FINAL for a in plan.applies):
            self._final = None
            ack = session.final_applied(final.final_global_step)
            if ack is not None:
                self._send(ack)
        with _own_values_checked():
            pushes = session.answer_pulls(self._owned(self._params.read))
        for push in pushes:
            self._send(push)
            self._pushes += 1
        assert self._client is not None
        self._client.local_step = session.local_step

    def _send(self, message: Any) -> None:
        assert self._client is not None
        self._client.send(self._epoch, message)

    # -- helpers -----------------------------------------------------------------------------
    def _leader_session(self) -> LearnerSession:
        if self._session is None:
            raise RuntimeError("only the leading rank holds the protocol session")
        return self._session

    def _usable(self) -> None:
        if self._failed is not None:
            raise LearnerError(f"the learner failed earlier: {self._failed}") from self._failed
        if self._finished:
            raise LearnerError("the learner finished; build a new one for another run")

    def _close_client(self) -> None:
        # Once: a failure closes it before the caller's cleanup does, and each close of a
        # client whose thread will not end waits for it again.
        if self._client is not None and not self._client_closed:
            self._client_closed = True
            self._client.close()

    def _save_applied_cut(self) -> None:
        """Rank 0, right after a final cut was applied (and its FINAL_ACK, if due, queued):
        save the artifact now, on the thread that owns the model, rather than after the
        SHUTDOWN, which may come much later or never (spec/learner.md § 7 item 7). A save
        that fails (a full disk) is only logged here: the syncer still needs this learner
        until its SHUTDOWN, and ``finish`` tries again then, raising what fails."""
        if not self.is_leader or self.out_dir is None:
            return
        started = time.monotonic()
        try:
            self._save_artifact()
        except Exception as exc:  # an interrupt still stops finish(); nothing else may
            _log.warning(
                "yeto learner %d: saving the artifact at the final cut failed (finish() tries "
                "again once the syncer ends the run): %s",
                self.learner_id,
                exc,
            )
        finally:
            self._saving_s += time.monotonic() - started

    def _save_unsaved_cut(self) -> None:
        """Save the artifact unless the applied cut's is already on disk: nothing in it
        changes after the cut (no step is allowed after it, and a newer cut is saved as it is
        applied), so it is written again only when its write at the cut failed."""
        if self._saved_step != self.final_global_step:
            self._save_artifact()

    def _keep_applied_final_state(self, exc: LearnerError) -> None:
        """``finish`` failed after the final cut was applied (its SHUTDOWN never came: the
        syncer fell silent or stopped while it waited for another learner's ACK): the
        parameters hold the syncer's final state all the same, saved as the cut was applied
        (or now, if that write failed), and the error says so. Nothing is saved without the
        cut (spec/learner.md § 7 item 7)."""
        if self.final_global_step is None or not self.is_leader or self.out_dir is None:
            return
        try:
            self._save_unsaved_cut()
        except LearnerError as failed:
            exc.add_note(f"the applied final state could not be saved either: {failed}")
            return
        note = (
            f"the final state of global step {self.final_global_step} was applied and saved "
            f"to {self.out_dir / STATE_FILE}; the syncer never confirmed the run complete"
        )
        exc.add_note(note)
        _log.warning("%s (%s)", note, exc)

    def _save_artifact(self) -> None:
        """The learner-owned artifact: layout JSON, a summary and the state dict, each atomic.

        ``model.pt`` is written last, so it exists only once the whole artifact does. A write
        that fails (a full disk) leaves no temporary file and raises :class:`LearnerError`
        naming the file.
        """
        if self.out_dir is None:
            return
        # The wrapped model's own names: normalizing every key would also rename a real
        # submodule called "module" (and could merge a buffer into a parameter's name).
        state = {k: v.detach().cpu() for k, v in unwrapped(self.model).state_dict().items()}
        summary = {
            "learner_id": self.learner_id,
            "run_id": self.run_id,
            "wire_dtype": self.dtype.name.lower(),
            "final_global_step": self.final_global_step,
            "layout_fingerprint": self.layout.fingerprint().hex(),
            "session_contract": self.contract.hex(),
            "local_steps": self._local_step,
            "tokens": self._tokens,
            "state_dict": STATE_FILE,
            "layout": LAYOUT_FILE,
        }
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            _write_text_atomically(self.out_dir / LAYOUT_FILE, self.layout.to_json())
            _write_text_atomically(
                self.out_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n"
            )
            # Into an open file: torch then reports a failed write as the OSError it is.
            with atomic_replace(self.out_dir / STATE_FILE) as staging, open(staging, "xb") as file:
                torch.save(state, file)
        except (OSError, CheckpointError) as exc:
            raise LearnerError(
                "the final state was applied and acknowledged, but the learner's artifact was "
                f"not saved: {_write_failure(exc, self.out_dir)}"
            ) from exc
        self._saved_step = self.final_global_step


def _failure_text(exc: BaseException) -> str:
    """What the other ranks are told of rank 0's failure (an interrupt has no message)."""
    return str(exc) or f"{type(exc).__name__} on rank 0"


_NON_FINITE_PREFIX = f"{ErrorCode.NON_FINITE_VALUE.value}: "
#: What a syncer without the HELLO key makes of the 32-byte MAC after a signed HELLO's tail:
#: a tail of the wrong length, a stream count or a profile hash taken from the MAC's bytes.
_MISREAD_MAC_REFUSALS = tuple(
    f"{code.value}: "
    for code in (
        ErrorCode.BAD_HELLO_TAIL,
        ErrorCode.TOO_MANY_STREAMS,
        ErrorCode.SESSION_PROFILE_MISMATCH,
        ErrorCode.TRUNCATED_PAYLOAD,
    )
)


@contextlib.contextmanager
def _own_values_checked() -> Iterator[None]:
    """Where the session encodes this learner's own values (an INIT, a PUSH): its refusal of a
    NaN or infinity becomes :class:`NonFiniteParameters`, the error the training loop sees
    (and, as its text, the other ranks)."""
    try:
        yield
    except LocalProtocolError as exc:
        if exc.code is not ErrorCode.NON_FINITE_VALUE:
            raise
        raise NonFiniteParameters(
            f"{_NON_FINITE_PREFIX}{exc.detail}: this learner's parameters hold NaN or infinity "
            "(did local training diverge?); nothing was sent to the syncer"
        ) from exc


def _rank_zero_failure(text: str) -> LearnerError:
    """What the other ranks raise for rank 0's failure ``text``: the same kind where the text
    says it (a NaN on rank 0 is every rank's)."""
    kind = NonFiniteParameters if _NON_FINITE_PREFIX in text else LearnerError
    return kind(text)


def _checked_tokens(tokens: int, world_size: int = 1) -> int:
    """A step's token count, refused before anything changes when it could not be one.

    Anything with an exact integer value is taken (numpy and 0-d torch integers included); a
    bool, or a float such as 2.9 that would quietly become 2, is not.
    """
    try:
        value = operator.index(tokens)
    except TypeError:
        value = None
    if isinstance(tokens, bool) or value is None:
        raise ValueError(f"tokens must be an integer, got {type(tokens).__name__}")
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"tokens must be in 0..2^64-1, got {value}")
    if world_size > 1 and value > I64_MAX:  # the ranks sum their counts as torch int64
        raise ValueError(f"tokens must be in 0..2^63-1 under torchrun, got {value}")
    return value


def _write_text_atomically(path: Path, text: str) -> None:
    write_bytes_atomically(path, text.encode("utf-8"))


def _write_failure(exc: OSError | CheckpointError, directory: Path) -> str:
    """``<errno text> (file <path>)`` for a failed artifact write."""
    if isinstance(exc, CheckpointError):  # the atomic writer's CKPT_IO already says both
        return exc.reason
    return f"{exc.strerror or exc} (file {exc.filename or directory})"
