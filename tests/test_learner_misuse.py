"""What a learner does when its user gets something wrong: a clear error at the first moment it
can tell, never silently lost training.

Each case here once failed silently or with an unrelated message: a parameter replaced after
the Learner was built, an interrupt while a broadcast was being blended, finish() called before
the final cut, a retry after a syncer that was not up yet, a key given as text, a sharded,
complex, empty or doubled (two objects, one memory) parameter, a merge that needs more
fragments, rank 0 failing under torchrun.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from syncer_process import REPO, SyncerProcess, child_env, free_port, running_syncer

from yeto_learn import (
    FinishStuck,
    FinishTimeout,
    Learner,
    LearnerError,
    NonFiniteParameters,
    SyncerRefused,
    SyncerUnreachable,
)
from yeto_learn import learner as learner_module
from yeto_learn.learner import RUN_ID_FILE
from yeto_learn.session import Phase
from yeto_learn.transport import GroupUp
from yeto_proto import ErrorCode, PullReq


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))


def train_steps(learner: Learner, model: torch.nn.Module, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.step(tokens=8)
        time.sleep(0.002)


@contextlib.contextmanager
def one_learner(
    tmp_path: Path, total_steps: int, extra: Sequence[str] = (), **options: Any
) -> Iterator[tuple[SyncerProcess, torch.nn.Module, Learner]]:
    """A syncer for one learner, and that learner on a fresh small model (closed after)."""
    with running_syncer(
        tmp_path / "syncer", learners=1, total_steps=total_steps, extra=extra
    ) as syncer:
        model = small_model()
        learner = Learner(model, syncer=syncer.address, learner_id=0, num_learners=1,
                          fragments=2, streams=1, connect_timeout=30, **options)  # fmt: skip
        try:
            yield syncer, model, learner
        finally:
            learner.close()


def test_step_needs_a_token_count() -> None:
    # With 0 tokens a learner weighs nothing in any merge (c_tokens² / c_steps): a default of 0
    # let a whole run train for nothing.
    with pytest.raises(TypeError):
        Learner.step(object.__new__(Learner))  # type: ignore[call-arg]


def test_a_token_count_beyond_int64_is_refused_under_torchrun_before_any_collective() -> None:
    # The ranks sum their counts as torch int64: rank-local, the conversion raised inside the
    # collective's setup and left the other ranks waiting in the all-reduce.
    top = (1 << 64) - 1
    assert learner_module._checked_tokens(top) == top
    assert learner_module._checked_tokens((1 << 63) - 1, 2) == (1 << 63) - 1
    with pytest.raises(ValueError, match=r"0\.\.2\^63-1 under torchrun"):
        learner_module._checked_tokens(1 << 63, 2)


def test_close_from_another_thread_ends_a_waiting_finish(tmp_path: Path) -> None:
    failures: list[BaseException] = []

    def finish() -> None:
        try:
            learner.finish(timeout=60)
        except BaseException as exc:
            failures.append(exc)

    with one_learner(tmp_path, 1000) as (syncer, model, learner):
        train_steps(learner, model, 2)
        waiting = threading.Thread(target=finish)
        waiting.start()
        time.sleep(0.3)  # finish() is waiting for a final cut this syncer is far from
        learner.close()
        waiting.join(5)
        assert not waiting.is_alive(), "finish() waited on after close()"
    assert len(failures) == 1 and isinstance(failures[0], LearnerError), failures
    assert "close() was called" in str(failures[0])


def test_a_replaced_parameter_is_refused_at_the_next_check(tmp_path: Path) -> None:
    with one_learner(tmp_path, 4) as (syncer, model, learner):
        train_steps(learner, model, 3)
        model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
        with pytest.raises(LearnerError, match="'0.weight' was replaced in the model"):
            learner.finish(timeout=5)


@pytest.mark.parametrize("replaced", ["parameter", "module"])
def test_a_replaced_parameter_stops_the_learner_before_its_next_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replaced: str
) -> None:
    # Checked only every 32 steps, it let PUSHes read from the dead tensors reach the syncer
    # (which merged them) meanwhile. A whole module swapped in holds new parameters too.
    monkeypatch.setattr(learner_module, "_OWNERSHIP_CHECK_STEPS", 1 << 30)  # step 0's only
    extra = ["--sync-interval-steps", "1"]
    with one_learner(tmp_path, 1000, extra) as (syncer, model, learner):
        deadline = time.monotonic() + 30
        while learner.stats.pushes == 0:
            assert time.monotonic() < deadline, "no pull was answered"
            train_steps(learner, model, 1)
        pushed = learner.stats.pushes
        if replaced == "parameter":
            model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
        else:
            model[0] = copy.deepcopy(model[0])
        with pytest.raises(LearnerError, match="'0.weight' was replaced in the model"):
            while time.monotonic() < deadline:  # until the next pull is to be answered
                train_steps(learner, model, 1)
        assert learner.stats.pushes == pushed


def test_a_parameter_unfrozen_after_the_learner_was_built_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A progressive unfreeze trained the layer on without ever syncing it, without a word.
    with running_syncer(tmp_path / "syncer", learners=1, total_steps=1000) as syncer:
        model = small_model()
        model[0].weight.requires_grad_(False)
        learner = Learner(model, syncer=syncer.address, learner_id=0, num_learners=1,
                          fragments=2, streams=0, connect_timeout=30)  # fmt: skip
        try:
            model[0].weight.requires_grad_(True)
            with caplog.at_level(logging.WARNING, logger="yeto_learn"):
                train_steps(learner, model, 2 * learner_module._OWNERSHIP_CHECK_STEPS + 1)
        finally:
            learner.close()
    (record,) = [r for r in caplog.records if "not synced" in r.getMessage()]
    text = record.getMessage()
    assert text.startswith("yeto learner 0: '0.weight' now requires grad but is not synced")
    assert "fixed when the Learner is built" in text


def test_diverged_parameters_stop_the_learner_with_a_learner_error_saying_so(
    tmp_path: Path,
) -> None:
    # It was yeto_proto's LocalProtocolError: `except LearnerError` missed it.
    extra = ["--sync-interval-steps", "2"]
    with one_learner(tmp_path, 50, extra) as (syncer, model, learner):
        with torch.no_grad():
            model[1].bias.fill_(float("nan"))
        deadline = time.monotonic() + 30
        with pytest.raises(NonFiniteParameters) as caught:
            while time.monotonic() < deadline:  # until a pull is answered
                learner.step(tokens=8)
                time.sleep(0.002)
        assert isinstance(caught.value, LearnerError)
        assert caught.value.code is ErrorCode.NON_FINITE_VALUE
        assert "PUSH delta of fragment" in str(caught.value)
        assert "parameters hold NaN or infinity" in str(caught.value)
        with pytest.raises(LearnerError, match="failed earlier"):
            learner.step(tokens=8)


def test_a_learner_whose_rounds_stopped_says_so_in_its_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A duplicate learner_id, or a learner lost under --quorum M, left one training alone
    # for ten minutes without a word on its side.
    extra = ["--sync-interval-steps", "1000000"]  # the first rounds, then none for long
    with one_learner(tmp_path, 8, extra) as (syncer, model, learner):
        with caplog.at_level(logging.WARNING, logger="yeto_learn"):
            train_steps(learner, model, 30)
            assert not caplog.records
            # How long is unusual follows the gaps seen between pulls (rounds may be paced
            # minutes apart), never less than NO_ROUND_WARNING_S.
            assert learner._pulls_seen >= 1
            limit = learner._no_round_limit()
            assert limit >= learner_module.NO_ROUND_WARNING_S
            assert limit >= 3 * learner._longest_pull_gap
            learner._last_pull_at -= limit  # as if the last pull were that long ago
            learner._no_round_check_at = 0.0
            train_steps(learner, model, 5)
            train_steps(learner, model, 5)  # said once, not at every step
        (record,) = [r for r in caplog.records if "pulled nothing" in r.getMessage()]
        text = record.getMessage()
        assert text.startswith(f"yeto learner 0: the syncer at {syncer.address} has pulled")
        assert "--quorum-timeout-s" in text and "learner_id 0" in text


def test_a_learner_cut_off_from_its_syncer_does_not_blame_the_rounds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # While it redials (the loss is logged already) "its rounds may wait for a learner that
    # left … see the syncer's log" pointed at a syncer that may be gone.
    extra = ["--sync-interval-steps", "1000000"]
    with one_learner(tmp_path, 8, extra) as (syncer, model, learner):
        train_steps(learner, model, 30)
        syncer.process.kill()
        syncer.wait()
        deadline = time.monotonic() + 10
        while learner._leader_session().phase is Phase.CONNECTED:
            assert time.monotonic() < deadline, "the learner never noticed the loss"
            train_steps(learner, model, 1)
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="yeto_learn"):
            learner._last_pull_at -= learner._no_round_limit()
            learner._no_round_check_at = 0.0
            train_steps(learner, model, 3)
        assert not [r for r in caplog.records if "pulled nothing" in r.getMessage()]


def test_the_time_without_pulls_counts_from_a_reconnect() -> None:
    # After a two-minute redial the first step warned that the syncer "pulled nothing for
    # 130 s", counting the time the learner itself was cut off.
    learner = Learner.__new__(Learner)  # only the bookkeeping of a new group
    learner._session = SimpleNamespace(hello=lambda *args, **kwargs: None)  # type: ignore[assignment]
    learner.learner_id, learner._epoch, learner._final = 1, 1, None
    learner._unsent_budget_epoch, learner._budget_due = None, False
    learner._last_pull_at = time.monotonic() - 130.0
    learner._plan([GroupUp(epoch=2, generation=7, num_streams=0)])
    assert time.monotonic() - learner._last_pull_at < 5.0


def test_how_long_without_a_pull_is_unusual_follows_the_runs_own_pace() -> None:
    pacing = Learner.__new__(Learner)  # only the bookkeeping of pulls, no session
    pacing._pulls_seen, pacing._longest_pull_gap = 0, 0.0
    assert pacing._no_round_limit() == learner_module.NO_ROUND_WARNING_S  # never pulled
    pacing._pulls_seen = 1
    assert pacing._no_round_limit() == 600.0  # one pull: no pace known yet
    pacing._pulls_seen, pacing._longest_pull_gap = 5, 250.0  # rounds paced 250 s apart
    assert pacing._no_round_limit() == 750.0
    pacing._longest_pull_gap = 2.0
    assert pacing._no_round_limit() == learner_module.NO_ROUND_WARNING_S


def test_load_state_dict_with_assign_is_caught_at_the_first_step(tmp_path: Path) -> None:
    with one_learner(tmp_path, 4) as (syncer, model, learner):
        model.load_state_dict(small_model().state_dict(), assign=True)
        with pytest.raises(LearnerError, match="load_state_dict"):
            learner.step(tokens=8)


def test_an_interrupt_while_blending_ends_the_learner(tmp_path: Path) -> None:
    extra = ["--sync-interval-steps", "2"]
    with one_learner(tmp_path, 50, extra) as (syncer, model, learner):

        def interrupted(*_: object) -> None:
            raise KeyboardInterrupt

        learner._params.apply = interrupted  # type: ignore[method-assign]
        deadline = time.monotonic() + 30
        with pytest.raises(KeyboardInterrupt):
            while time.monotonic() < deadline:  # until a broadcast is blended
                train_steps(learner, model, 1)
        # Half-blended parameters must not be pushed as if whole: the learner is over.
        with pytest.raises(LearnerError, match="failed earlier"):
            learner.step(tokens=8)


def test_finish_before_final_ready_says_what_to_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    extra = ["--sync-interval-steps", "8", "--quorum-timeout-s", "5"]
    with one_learner(tmp_path, 20, extra) as (syncer, model, learner):
        train_steps(learner, model, 20)
        assert not learner.final_ready
        with (
            caplog.at_level(logging.WARNING, logger="yeto_learn"),
            pytest.raises(FinishTimeout, match="keep calling step\\(\\) until final_ready"),
        ):
            learner.finish(timeout=6)
        assert any("waiting in finish()" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("budget_steps", "advice"),
    [(None, "until final_ready is True"), (40, "until learner.budget_reached is True")],
)
def test_the_advice_for_a_starved_pull_follows_what_ends_the_run(
    budget_steps: int | None, advice: str
) -> None:
    # A learner with a step budget was told to train until final_ready, which in a closure
    # comes only after every learner's budget.
    learner = Learner.__new__(Learner)  # only the note's inputs
    learner.budget_steps = budget_steps
    learner._pulls_awaiting_a_step = lambda: [1]  # type: ignore[method-assign]
    note = learner._starved_pulls_note()
    assert note.startswith("; the syncer still pulls fragments [1]") and note.endswith(advice)


def test_finish_stop_when_stuck_returns_control_instead_of_waiting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop that stopped on purpose (a step cap) hears at once that the cut cannot come, with
    no advice to keep calling step(), and may still go on training after it."""
    extra = ["--sync-interval-steps", "8", "--quorum-timeout-s", "5"]
    with one_learner(tmp_path, 20, extra) as (syncer, model, learner):
        train_steps(learner, model, 20)
        assert not learner.final_ready
        # Each pull is read on a turn of its own, after finish() looked for a stuck one and
        # after its once-a-second warning check came due: the race that let "keep calling
        # step()" out before FinishStuck.
        read_items = learner._client_items
        held: list[Any] = []

        def pull_read_late(wait: float) -> list[Any]:
            if held:
                time.sleep(1.1)
                items = held.copy()
                held.clear()
                return items
            items = read_items(wait)
            pulls = [isinstance(getattr(item, "message", None), PullReq) for item in items]
            first_pull = pulls.index(True) if True in pulls else len(items)
            held.extend(items[first_pull:])
            return items[:first_pull]

        learner._client_items = pull_read_late  # type: ignore[method-assign]
        started = time.monotonic()
        with (
            caplog.at_level(logging.WARNING, logger="yeto_learn"),
            pytest.raises(FinishStuck, match="answers only with further local steps"),
        ):
            learner.finish(timeout=30, stop_when_stuck=True)
        assert time.monotonic() - started < 15
        assert not any("waiting in finish()" in r.getMessage() for r in caplog.records)
        train_steps(learner, model, 1)  # still usable, as after a timeout


def test_a_learner_that_never_started_may_be_started_again(tmp_path: Path) -> None:
    out = tmp_path / "learner-0"
    options: dict[str, Any] = {"out_dir": out, "run_id": "my-run", "connect_timeout": 0.5}
    for _ in range(2):  # the second attempt used to be refused: "already ran 'my-run'"
        with pytest.raises(SyncerUnreachable):
            Learner(small_model(), syncer=f"127.0.0.1:{free_port()}", learner_id=0,
                    num_learners=2, fragments=2, **options)  # fmt: skip
    assert not (out / RUN_ID_FILE).exists()


def test_a_signed_hello_refused_by_a_syncer_without_the_key_says_so(tmp_path: Path) -> None:
    # The syncer misreads the MAC as HELLO fields: its own error says nothing about keys.
    with pytest.raises(SyncerRefused, match="signs its HELLO with a key") as refused:
        with one_learner(tmp_path, 2, hello_key="a shared secret") as (syncer, model, learner):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                train_steps(learner, model, 1)
    assert "HELLO authentication failed" not in str(refused.value)


@pytest.mark.parametrize(
    "refusal, hinted",
    [
        ("TOO_MANY_STREAMS: HELLO: > 256", True),
        ("BAD_HELLO_TAIL: HELLO: after the contract exactly 2 or 34 bytes must remain", True),
        ("SESSION_LAYOUT_MISMATCH: HELLO layout differs from the session", False),
        ("LEARNER_ID_OUT_OF_RANGE: HELLO: learner_id 2 outside 0..1 (M = 2)", False),
        ("HELLO authentication failed: HELLO MAC does not verify", False),
    ],
)
def test_only_a_refusal_a_misread_mac_can_cause_asks_about_the_key(
    refusal: str, hinted: bool
) -> None:
    # The key hint was added to every refusal of a signed HELLO (a layout or learner id
    # mismatch with the right key too), sending users after the wrong setting.
    learner = Learner.__new__(Learner)
    learner.syncer_address = "127.0.0.1:29400"
    learner._applied = 0
    learner._client = SimpleNamespace(config=SimpleNamespace(hello_key=b"k"))  # type: ignore[assignment]
    text = str(learner._refused(refusal))
    assert refusal in text
    assert ("signs its HELLO with a key" in text) is hinted


def test_a_contract_mismatch_says_what_the_contract_covers_and_that_the_session_stays(
    tmp_path: Path,
) -> None:
    # One learner started with num_learners=3 fixed the session of a --learners 2 syncer; the
    # right ones were refused with only "the run id or the experiment settings" to go on.
    with running_syncer(tmp_path / "syncer", learners=2, total_steps=2) as syncer:
        wrong_failed: list[BaseException] = []

        def wrong() -> None:
            try:
                Learner(small_model(), syncer=syncer.address, learner_id=1, num_learners=3,
                        fragments=2, run_id="r", connect_timeout=3)  # fmt: skip
            except BaseException as exc:  # it waits for learner 0, then gives up
                wrong_failed.append(exc)

        first = threading.Thread(target=wrong)
        first.start()
        try:
            deadline = time.monotonic() + 20
            while "group admitted" not in syncer.log.read_text(encoding="utf-8"):
                assert time.monotonic() < deadline, "the first learner was never admitted"
                time.sleep(0.05)
            with pytest.raises(SyncerRefused) as refused:
                Learner(small_model(), syncer=syncer.address, learner_id=0, num_learners=2,
                        fragments=2, run_id="r", connect_timeout=10)  # fmt: skip
        finally:
            first.join(30)
    text = str(refused.value)
    assert "SESSION_CONTRACT_MISMATCH" in text and "fixed by learner 1's HELLO" in text
    assert "the session stays fixed until yeto-sync restarts" in text
    assert "this learner's contract covers run_id='r', fragments=2" in text
    assert "num_learners=2" in text


def test_a_text_hello_key_is_its_utf8_bytes(tmp_path: Path) -> None:
    key = "a shared secret"
    key_file = tmp_path / "hello.key"
    key_file.write_text(key + "\n")
    extra = ["--hello-hmac-key-file", str(key_file)]
    with one_learner(tmp_path, 2, extra, hello_key=key) as (syncer, model, learner):
        while not learner.final_ready:
            train_steps(learner, model, 1)
        learner.finish(timeout=30)
        assert syncer.wait() == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"matrix_merge": "bogus"}, "matrix_merge must be one of avg, rda, iso"),
        ({"fragment_pattern": "random"}, "fragment_pattern must be one of balanced, strided"),
        ({"streams": -1}, "streams must be in 0.."),
        ({"fragments": 9}, "at most 4"),
        ({"fragments": 1, "matrix_merge": "rda"}, "needs fragments >= 2"),
        ({"hello_key": 1234}, "hello_key must be non-empty bytes"),
    ],
)
def test_bad_options_are_refused_with_the_fix(options: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"fragments": 2, **options}
    with pytest.raises(ValueError, match=message):
        Learner(small_model(), syncer=f"127.0.0.1:{free_port()}", learner_id=0,
                num_learners=1, connect_timeout=0.5, **arguments)  # fmt: skip


@pytest.mark.parametrize("address", ["a..b:29400", f"{'x' * 64}.example:29400", "[a..b]:1"])
def test_a_host_name_no_resolver_takes_is_refused_at_once(address: str) -> None:
    """Its lookup raised UnicodeError in the network thread: a traceback, "thread failed"."""
    with pytest.raises(ValueError, match="not a valid host name"):
        Learner(small_model(), syncer=address, learner_id=0, num_learners=1, fragments=1,
                connect_timeout=0.5)  # fmt: skip


def test_a_meta_model_is_refused_by_name() -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="'weight' is on the meta device"):
        Learner(model, syncer=f"127.0.0.1:{free_port()}", learner_id=0, num_learners=1,
                connect_timeout=0.5)  # fmt: skip


def test_a_complex_parameter_is_refused_by_name() -> None:
    # It was synced as its real part: the first broadcast zeroed the imaginary part in the model.
    model = small_model()
    model.register_parameter("phase", torch.nn.Parameter(torch.randn(8, dtype=torch.cfloat)))
    with pytest.raises(ValueError, match="'phase' is torch.complex64: only real floating-point"):
        Learner(model, syncer=f"127.0.0.1:{free_port()}", learner_id=0, num_learners=1,
                connect_timeout=0.5)  # fmt: skip
    assert model.phase.imag.any()


def test_two_parameters_over_one_memory_are_refused_by_name() -> None:
    # Both were synced, as two tensors: every broadcast landed in that memory twice, and the
    # learner did not end on the syncer's final state.
    model = small_model()
    model.append(torch.nn.Linear(4, 8))
    model[2].weight = torch.nn.Parameter(model[0].weight.detach())
    with pytest.raises(ValueError, match="'0.weight' and '2.weight' are two Parameter objects"):
        Learner(model, syncer=f"127.0.0.1:{free_port()}", learner_id=0, num_learners=1,
                connect_timeout=0.5)  # fmt: skip


def test_weights_tied_as_one_object_or_apart_in_one_storage_are_synced_once_each() -> None:
    model = small_model()
    model.append(torch.nn.Linear(8, 1))
    model[2].weight = model[1].weight  # tied: named once, under its first name
    flat = torch.zeros(16)  # disjoint views of one buffer (a fused layout) share no memory
    model.register_parameter("low", torch.nn.Parameter(flat[:8]))
    model.register_parameter("high", torch.nn.Parameter(flat[8:]))
    # Interleaved but disjoint: their byte ranges overlap, their elements do not.
    grid = torch.zeros(4, 6)
    model.register_parameter("left", torch.nn.Parameter(grid[:, :3]))
    model.register_parameter("right", torch.nn.Parameter(grid[:, 3:]))
    strip = torch.zeros(10)
    model.register_parameter("even", torch.nn.Parameter(strip[0::2]))
    model.register_parameter("odd", torch.nn.Parameter(strip[1::2]))
    names = list(learner_module.synced_parameters(model))
    assert names == [
        "low", "high", "left", "right", "even", "odd",
        "0.weight", "0.bias", "1.weight", "1.bias", "2.bias",
    ]  # fmt: skip


def test_a_strided_view_into_a_dense_parameter_and_a_sparse_one_are_refused() -> None:
    model = small_model()
    grid = torch.zeros(4, 6)
    model.register_parameter("grid", torch.nn.Parameter(grid))
    model.register_parameter("column", torch.nn.Parameter(grid[:, 2]))
    with pytest.raises(ValueError, match="'grid' and 'column' are two Parameter objects"):
        learner_module.synced_parameters(model)
    model = small_model()
    model.register_parameter("sparse", torch.nn.Parameter(torch.zeros(3, 3).to_sparse()))
    with pytest.raises(ValueError, match="'sparse' is a torch.sparse_coo tensor: only dense"):
        learner_module.synced_parameters(model)


def test_dense_parameters_with_overlapping_memory_are_refused() -> None:
    model = small_model()
    flat = torch.zeros(16)
    model.register_parameter("head", torch.nn.Parameter(flat[:10]))
    model.register_parameter("tail", torch.nn.Parameter(flat[6:].view(2, 5)))
    with pytest.raises(ValueError, match="'head' and 'tail' are two Parameter objects"):
        learner_module.synced_parameters(model)
    # channels_last is dense too: its range is exact.
    model = small_model()
    image = torch.zeros(1, 2, 3, 3).to(memory_format=torch.channels_last)
    model.register_parameter("image", torch.nn.Parameter(image))
    pixels = image.permute(0, 2, 3, 1).reshape(-1)  # a view: permuted, it is contiguous
    model.register_parameter("inside", torch.nn.Parameter(pixels[4:9]))
    with pytest.raises(ValueError, match="'image' and 'inside' are two Parameter objects"):
        learner_module.synced_parameters(model)


def test_empty_parameters_are_not_synced_and_the_default_fragments_fit(tmp_path: Path) -> None:
    model = small_model()
    model.register_parameter("empty", torch.nn.Parameter(torch.zeros(0)))
    with running_syncer(tmp_path / "syncer", learners=1, total_steps=2) as syncer:
        learner = Learner(model, syncer=syncer.address, learner_id=0, num_learners=1,
                          streams=0, connect_timeout=30)  # fmt: skip
        try:
            names = [t.name for f in learner.layout.fragments for t in f.tensors]
            assert "empty" not in names and len(names) == 4
            assert len(learner.layout.fragments) == 4  # the default 8, as many as there are
        finally:
            learner.close()


RANK_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np, torch, torch.distributed as dist
    from yeto_learn.distributed import Apply, ApplyKind, LeaderFailed, Plan, PlanStatus
    from yeto_learn.distributed import TorchDistributedLink
    dist.init_process_group("gloo")
    link = TorchDistributedLink((3,))
    applied = []
    plan = None
    if link.is_leader:
        values = np.arange(3, dtype=np.float32)
        plan = Plan(PlanStatus.RUNNING, [Apply(ApplyKind.BLEND, 0, values)])
    def after(_):
        raise RuntimeError("PUSH delta of fragment 0 is not finite")
    try:
        link.run_plan(plan, lambda item, values: applied.append(values.tolist()), after)
        print("returned")
    except LeaderFailed as exc:
        print("LeaderFailed:", exc, applied)
    except RuntimeError as exc:
        print("RuntimeError:", exc, applied)
    dist.destroy_process_group()
    """
)


def two_gloo_ranks(script: str, *args: str) -> list[tuple[str, str]]:
    """Run ``script`` with ``args`` as ranks 0 and 1 of a gloo group; each rank's (stdout,
    stderr)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args],
            cwd=REPO,
            env={
                **child_env(),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    return [proc.communicate(timeout=60) for proc in procs]


def test_rank_zero_failing_after_a_plan_fails_every_rank_in_that_step() -> None:
    outputs = two_gloo_ranks(RANK_SCRIPT)
    leader, other = (out.strip().splitlines()[-1] for out, _ in outputs)
    assert leader == "RuntimeError: PUSH delta of fragment 0 is not finite [[0.0, 1.0, 2.0]]"
    # Rank 1 used to return normally and then wait in the next collective for a rank 0
    # that had already raised.
    assert other == "LeaderFailed: PUSH delta of fragment 0 is not finite [[0.0, 1.0, 2.0]]"


SETUP_FAILS_ON_RANK_ZERO = textwrap.dedent(
    """
    import os, time, torch, torch.distributed as dist
    from yeto_learn import Learner
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    started = time.monotonic()
    try:  # only rank 0 reads the syncer address
        Learner(torch.nn.Linear(3, 2), syncer="no port here", learner_id=0, num_learners=1,
                fragments=1, run_id="r")
    except BaseException as exc:
        print(f"{type(exc).__name__} {time.monotonic() - started:.1f}: {exc}", flush=True)
    if rank == 0:
        time.sleep(6)  # a script that reports its error and cleans up before it exits
    os._exit(0)
    """
)


def test_a_rank_zero_setup_error_reaches_every_rank_at_once() -> None:
    # Rank 0 raised before the first shared plan; rank 1 waited in it until rank 0's process
    # left the group, then got gloo's "Connection closed by peer".
    outputs = two_gloo_ranks(SETUP_FAILS_ON_RANK_ZERO)
    (leader_kind, leader_s, leader_text), (other_kind, other_s, other_text) = (
        re.fullmatch(r"(\w+) ([\d.]+): (.*)", out.strip().splitlines()[-1]).groups()  # type: ignore[union-attr]
        for out, _ in outputs
    )
    assert (leader_kind, other_kind) == ("ValueError", "LearnerError"), outputs
    assert leader_text in other_text, outputs
    assert float(other_s) < 4.0, outputs  # not after rank 0's 6 s


MODEL_CHANGES_ON_ONE_RANK = textwrap.dedent(
    """
    import os, sys, time, torch, torch.distributed as dist
    from yeto_learn import Learner
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    learner = Learner(model, syncer=sys.argv[1], learner_id=0, num_learners=1, fragments=1,
                      streams=0, connect_timeout=30)
    if rank == int(sys.argv[2]):  # this rank alone loads weights by replacing a parameter
        model.weight = torch.nn.Parameter(model.weight.detach().clone())
    started = time.monotonic()
    try:
        learner.step(tokens=1)
        print("stepped", flush=True)
    except BaseException as exc:
        print(f"{type(exc).__name__} {time.monotonic() - started:.1f}: {exc}", flush=True)
    if rank == int(sys.argv[2]):
        time.sleep(6)  # a script that reports its error and cleans up before it exits
    os._exit(0)
    """
)


@pytest.mark.parametrize("changed_rank", [0, 1])
def test_a_model_changed_on_one_rank_stops_every_rank_in_that_step(
    tmp_path: Path, changed_rank: int
) -> None:
    # The periodic check ran on each rank alone: the rank whose model changed raised, and the
    # others waited in the step's token all-reduce until that rank's process left the group.
    with running_syncer(tmp_path / "syncer", learners=1, total_steps=1000) as syncer:
        outputs = two_gloo_ranks(MODEL_CHANGES_ON_ONE_RANK, syncer.address, str(changed_rank))
    results = [
        re.fullmatch(r"(\w+) ([\d.]+): (.*)", out.strip().splitlines()[-1]) for out, _ in outputs
    ]
    assert all(results), outputs
    changed, other = results[changed_rank], results[1 - changed_rank]
    assert changed and changed.group(1) == "LearnerError", outputs
    assert "parameter 'weight' was replaced in the model" in changed.group(3), outputs
    assert other and other.group(1) == "LearnerError", outputs
    assert f"the model check failed on rank {changed_rank} of this learner" in other.group(3)
    assert float(other.group(2)) < 4.0, outputs  # not after the changed rank's 6 s


class HasModuleChild(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(3, 2)  # a real submodule that happens to be so named
        self.head = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.module(x))
        return out


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own imports
def test_the_saved_state_dict_loads_into_the_same_class(tmp_path: Path) -> None:
    model = HasModuleChild()
    compiled = torch.compile(model)  # a wrapper: its "_orig_mod." prefix goes
    with running_syncer(tmp_path / "syncer", learners=1, total_steps=2) as syncer:
        learner = Learner(compiled, syncer=syncer.address, learner_id=0, num_learners=1,
                          fragments=2, streams=0, out_dir=tmp_path / "out",
                          connect_timeout=30)  # fmt: skip
        try:
            while not learner.final_ready:
                learner.step(tokens=1)
                time.sleep(0.002)
            learner.finish(timeout=30)
        finally:
            learner.close()
    saved = torch.load(tmp_path / "out" / "model.pt")
    assert sorted(saved) == ["head.bias", "head.weight", "module.bias", "module.weight"]
    HasModuleChild().load_state_dict(saved)  # it used to save "weight" for "module.weight"


def test_a_finish_timeout_leaves_the_learner_usable(tmp_path: Path) -> None:
    extra = ["--sync-interval-steps", "4"]
    with one_learner(tmp_path, 8, extra) as (syncer, model, learner):
        train_steps(learner, model, 2)
        with pytest.raises(FinishTimeout):
            learner.finish(timeout=0.3)  # too early: the run goes on
        while not learner.final_ready:  # it used to be closed for good by the timeout
            train_steps(learner, model, 1)
        learner.finish(timeout=30)
        assert syncer.wait() == 0


def test_other_ranks_raise_rank_zeros_non_finite_failure_as_such() -> None:
    # Under torchrun only rank 0 pushes; the other ranks hear its failure as text.
    from yeto_learn.learner import _rank_zero_failure

    text = "rank 0 of this learner failed: NON_FINITE_VALUE: PUSH delta of fragment 1 is not finite"
    failure = _rank_zero_failure(text)
    assert isinstance(failure, NonFiniteParameters) and failure.code is ErrorCode.NON_FINITE_VALUE
    assert str(failure) == text
    other = _rank_zero_failure("rank 0 of this learner failed: KeyboardInterrupt on rank 0")
    assert type(other) is LearnerError
