"""``yeto bench``: the benchmark closure end to end, its tape check, and a learner that leaves.

The end-to-end runs train the tiny model with two torch learners (threads) against two real
``yeto-sync`` processes on 127.0.0.1: budget, cutoff, restart, F consolidation rounds, the tape
check and the safetensors export, for f32 and q4.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from signal_hooks import ON_FORK, command, processes_naming
from syncer_process import REPO, child_env

from yeto_learn import bench_closure, cli
from yeto_learn.bench_closure import (
    CHECKPOINT_FILE,
    CONSOLIDATION_TAPE,
    CUTOFF_TAPE,
    EXPORT_FILE,
    BenchConfig,
    ClosureFailed,
    check_consolidation_tape,
    run_closure,
)
from yeto_proto import FragmentSpec, Layout, MergeMode, TensorSpec
from yeto_proto.checkpoint import (
    Checkpoint,
    CheckpointFormat,
    FragmentState,
    TrailerKind,
    marker_path,
    marker_state,
    read_checkpoint,
    write_checkpoint,
    write_final_marker,
)
from yeto_proto.constants import IsoBackend

pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


# -- the tape check --------------------------------------------------------------------------------
def merge_line(step: int, fragment: int, ids: list[int]) -> dict[str, Any]:
    return {
        "step": step,
        "fragment": fragment,
        "responded_members": [{"id": i, "generation": 7 + i} for i in ids],
        "responders": [{"id": i, "generation": 7 + i, "c_steps": 5} for i in ids],
    }


def write_tape(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_tape_check_accepts_every_learner_in_every_round(tmp_path: Path) -> None:
    records = [
        {"event": "push_rejected", "step": 11},
        merge_line(11, 2, [0, 1, 2]),
        merge_line(12, 0, [0, 1, 2]),
        merge_line(13, 1, [0, 1, 2]),
        {"event": "final_cut", "step": 13},
    ]
    check = check_consolidation_tape(
        write_tape(tmp_path / "t", records), cutoff_step=10, fragments=3, learners=3
    )
    assert check.ok and check.rounds == 3
    assert "11..13" in check.detail


@pytest.mark.parametrize(
    ("records", "complaint"),
    [
        ([merge_line(11, 0, [0, 1]), merge_line(12, 1, [0])], "round 12: learners [1] missing"),
        ([merge_line(11, 0, [0, 1])], "round 12: 0 merge lines"),
        (
            [merge_line(11, 0, [0, 1]), merge_line(11, 0, [0, 1]), merge_line(12, 1, [0, 1])],
            "round 11: 2 merge lines",
        ),
        ([merge_line(11, 0, [0, 1]), merge_line(12, 0, [0, 1])], "fragments [1] not"),
    ],
    ids=["learner-missing", "round-missing", "round-twice", "fragment-twice"],
)
def test_tape_check_refuses_an_incomplete_consolidation(
    tmp_path: Path, records: list[dict[str, Any]], complaint: str
) -> None:
    check = check_consolidation_tape(
        write_tape(tmp_path / "t", records), cutoff_step=10, fragments=2, learners=2
    )
    assert not check.ok
    assert complaint in check.detail


def test_tape_check_leaves_out_the_lines_a_resume_discarded(tmp_path: Path) -> None:
    """A consolidation syncer stopped after taping step 12 but before its checkpoint: the
    resumed run redoes 12, so its line appears twice, the first before the `resumed` line."""
    records = [
        merge_line(11, 0, [0, 1]),
        merge_line(12, 1, [0, 1]),
        {"event": "resumed", "step": 11, "next_step": 12, "versions": [11, 9]},
        merge_line(12, 1, [0, 1]),
        {"event": "final_cut", "step": 12},
    ]
    tape = write_tape(tmp_path / "t", records)
    check = check_consolidation_tape(tape, cutoff_step=10, fragments=2, learners=2)
    assert check.ok and check.rounds == 2, check.detail
    # A line at or below the resumed step survives the restart: a second one is a defect.
    records[2] = {"event": "resumed", "step": 12, "next_step": 13, "versions": [11, 12]}
    check = check_consolidation_tape(
        write_tape(tmp_path / "t", records), cutoff_step=10, fragments=2, learners=2
    )
    assert not check.ok and "round 12: 2 merge lines" in check.detail


def test_tape_check_refuses_an_unreadable_tape(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("{not json\n", encoding="utf-8")
    check = check_consolidation_tape(tmp_path / "t", cutoff_step=0, fragments=1, learners=1)
    assert not check.ok and "cannot read" in check.detail
    missing = check_consolidation_tape(tmp_path / "absent", cutoff_step=0, fragments=1, learners=1)
    assert not missing.ok


# -- the closure end to end ------------------------------------------------------------------------
def assert_exported_matches_checkpoint(out: Path, final_step: int) -> None:
    checkpoint = read_checkpoint(out / CHECKPOINT_FILE)
    assert checkpoint.global_step == final_step
    tensors = safetensors_numpy.load_file(str(out / EXPORT_FILE))
    layout = json.loads((out / "layout.json").read_text(encoding="utf-8"))
    assert layout  # written next to the export
    flat = np.concatenate([f.params for f in checkpoint.fragments])
    exported = np.concatenate([t.reshape(-1) for t in tensors.values()])
    assert exported.size == flat.size
    assert np.array_equal(np.sort(exported), np.sort(flat))  # same values, named and shaped


@pytest.mark.parametrize("dtype", ["f32", "q4"])
def test_bench_runs_the_closure_and_exports(tmp_path: Path, dtype: str) -> None:
    out = tmp_path / "bench"
    lines: list[str] = []
    config = BenchConfig(
        out=out,
        learners=2,
        fragments=3,
        wire_dtype=dtype,
        budget=40,
        batch_size=16,
        training_timeout=120.0,
        consolidation_timeout=60.0,
    )

    result = run_closure(config, say=lines.append)

    assert result.budget == 40 and result.fragments == 3
    assert result.final_step == result.cutoff_step + 3
    assert result.tape.ok and result.tape.rounds == 3
    assert marker_state(out / CHECKPOINT_FILE, result.final_step).is_final
    assert_exported_matches_checkpoint(out, result.final_step)
    assert np.isfinite(result.eval_loss_final)
    # The cutoff process: reports from both learners, cancelled rounds, one cutoff line.
    cutoff = [json.loads(x) for x in (out / CUTOFF_TAPE).read_text().splitlines()]
    reports = [r for r in cutoff if r.get("event") == "budget_done"]
    assert sorted(r["id"] for r in reports) == [0, 1]
    assert all(r["exact_local_steps"] == 40 for r in reports)
    (summary,) = [r for r in cutoff if r.get("event") == "budget_cutoff"]
    assert summary["complete"] and summary["step"] == result.cutoff_step
    committed = [r["step"] for r in cutoff if "event" not in r]
    assert committed == list(range(1, result.cutoff_step + 1))  # a contiguous prefix
    # The consolidation process: frozen pushes carry the budget and every token.
    merges = [
        json.loads(x)
        for x in (out / CONSOLIDATION_TAPE).read_text().splitlines()
        if '"event"' not in x
    ]
    assert [m["step"] for m in merges] == [result.cutoff_step + i for i in (1, 2, 3)]
    for merge in merges:
        assert [(r["id"], r["c_steps"], r["c_tokens"]) for r in merge["responders"]] == [
            (0, 40, 40 * 16),
            (1, 40, 40 * 16),
        ]
    assert any("tape check : ok" in line for line in lines)
    assert any(str(out / EXPORT_FILE) in line for line in lines)


def test_bench_command_prints_budget_c_f_tape_and_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    code = cli.main(
        ["bench", "--out", str(out), "--budget", "30", "--fragments", "2", "--batch-size", "8"]
    )
    printed = capsys.readouterr().out

    assert code == 0, printed
    last = printed.strip().splitlines()[-1]
    final = read_checkpoint(out / CHECKPOINT_FILE).global_step
    assert "budget B=30" in last and f"C={final - 2}" in last and "F=2" in last
    assert "tape check ok" in last and str(out / EXPORT_FILE) in last
    # The learners' "lost the syncer … redialing" warnings at the restart look like errors.
    cutoff_line = next(line for line in printed.splitlines() if line.startswith("cutoff"))
    assert "redialing' lines are this restart" in cutoff_line, cutoff_line


def test_a_learner_that_misses_the_restart_fails_the_closure(tmp_path: Path) -> None:
    out = tmp_path / "missed"
    config = BenchConfig(
        out=out,
        learners=2,
        fragments=2,
        budget=20,
        batch_size=8,
        training_timeout=120.0,
        consolidation_timeout=6.0,
        miss_restart=frozenset({1}),
    )

    with pytest.raises(ClosureFailed, match="consolidation"):
        run_closure(config, say=lambda line: None)

    assert not (out / EXPORT_FILE).exists()
    assert not marker_path(out / CHECKPOINT_FILE).exists()
    cutoff_step = read_checkpoint(out / CHECKPOINT_FILE).global_step  # the recovery state
    assert not marker_state(out / CHECKPOINT_FILE, cutoff_step).is_final


@pytest.fixture
def no_closure(monkeypatch: pytest.MonkeyPatch) -> list[BenchConfig]:
    """Stands in for the closure: it records its configuration and fails, so a check of the
    command line never starts a process (and one it let through is seen)."""
    runs: list[BenchConfig] = []

    def fake(config: BenchConfig, say: object = None, check: object = None) -> None:
        runs.append(config)
        raise ClosureFailed("the closure is not run in this test")

    monkeypatch.setattr(bench_closure, "run_closure", fake)
    return runs


def test_bench_command_exits_1_when_the_closure_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_closure: list[BenchConfig]
) -> None:
    out = tmp_path / "fresh"
    assert cli.main(["bench", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "nothing exported: the closure is not run in this test; kept: no checkpoint" in err
    assert [config.out for config in no_closure] == [out]


def test_an_earlier_benchs_folder_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_closure: list[BenchConfig]
) -> None:
    out = tmp_path / "occupied"
    out.mkdir()
    (out / CHECKPOINT_FILE).write_bytes(b"not ours")

    assert cli.main(["bench", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and "not empty" in err, err
    assert cli.main(["bench", "--out", str(out), "--budget", "0"]) == 2
    assert not no_closure and (out / CHECKPOINT_FILE).read_bytes() == b"not ours"


def test_two_benches_in_one_second_get_folders_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_closure: list[BenchConfig]
) -> None:
    monkeypatch.chdir(tmp_path)
    now, strftime = time.localtime(), time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, t=None: strftime(fmt, now))
    assert cli.main(["bench"]) == 1
    assert cli.main(["bench"]) == 1
    first = strftime("yeto-bench-%Y%m%d-%H%M%S", now)
    assert [c.out.name for c in no_closure] == [first, f"{first}-2"]
    assert all(c.out.is_dir() and c.out.parent.resolve() == tmp_path.resolve() for c in no_closure)


@pytest.mark.parametrize(
    "flags",
    [
        ["--training-timeout", "nan"],
        ["--consolidation-timeout", "inf"],
        ["--training-timeout", "0"],
        ["--batch-size", "0"],
        ["--streams", "-1"],
        ["--streams", "257"],
        ["--sync-interval", "0"],
        ["--sync-interval", "nan"],
        ["--sync-interval", "4294967296"],
        ["--consolidation-timeout", "1e300"],
        ["--training-timeout", "1000000001"],
        ["--learners", "257"],
        ["--learners", "0"],
        ["--batch-size", "65537"],
        ["--budget", "4294967296"],
        ["--quorum", "3"],
    ],
    ids=[
        "nan",
        "inf",
        "zero",
        "no-batch",
        "streams-negative",
        "streams-high",
        "sync-0",
        "sync-nan",
        "sync-high",
        "consolidation-timeout-huge",
        "training-timeout-high",
        "learners-high",
        "learners-0",
        "batch-high",
        "budget-high",
        "quorum-above-learners",
    ],
)
def test_bad_numbers_are_one_line_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_closure: list[BenchConfig],
    flags: list[str],
) -> None:
    """The line names the flag and its whole range (it used to start a syncer that refused
    the value: exit 1, naming the syncer's flag)."""
    assert cli.main(["bench", "--out", str(tmp_path / "b"), *flags]) == 2
    err = capsys.readouterr().err
    ranges = {
        "--training-timeout": "in (0, 1000000000]",
        "--consolidation-timeout": "in (0, 1000000000]",
        "--sync-interval": "in 1..4294967295",
        "--streams": "in 0..256",
        "--learners": "in 1..256",
        "--batch-size": "in 1..65536",
        "--budget": "in 1..4294967295",
        "--quorum": "in 1..2",
    }
    assert err.count("\n") == 1 and f"{flags[0]} must be" in err and ranges[flags[0]] in err, err
    assert not no_closure and not (tmp_path / "b").exists()


def test_a_timeout_under_a_second_reaches_the_syncer_as_one_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The syncer takes whole seconds, at least 1: 0.5 s used to become 0, which it refused."""
    flags: list[str] = []

    def no_syncer(name: str, given: list[str], *rest: object) -> None:
        flags.extend(given)
        raise ClosureFailed("no syncer is started in this test")

    monkeypatch.setattr(bench_closure, "start_syncer", no_syncer)
    with pytest.raises(ClosureFailed):
        run_closure(BenchConfig(out=tmp_path / "b", consolidation_timeout=0.5))
    assert "--quorum-timeout-s=1" in flags


def test_an_output_directory_that_cannot_be_made_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["bench", "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "Traceback" not in err


def test_a_closed_stdout_does_not_stop_the_bench(tmp_path: Path) -> None:
    """`yeto bench | head -1`: once stdout's reader is gone, its lines go to stderr."""
    out = tmp_path / "piped"
    read_end, write_end = os.pipe()
    os.close(read_end)  # the first line already finds no reader
    try:
        result = subprocess.run(
            [sys.executable, "-m", "yeto_learn.cli", "bench", "--out", str(out),
             "--budget", "20", "--fragments", "2", "--batch-size", "8"],
            cwd=REPO, env=child_env(), stdout=write_end, stderr=subprocess.PIPE, text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Broken pipe" not in result.stderr
    assert "tape check ok" in result.stderr.strip().splitlines()[-1]
    assert (out / EXPORT_FILE).is_file()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_stdout_that_cannot_be_written_ends_the_bench_with_one_line(tmp_path: Path) -> None:
    """`yeto bench > /dev/full`: not a reader gone but a failed write (a full disk)."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "yeto_learn.cli", "bench", "--out", str(tmp_path / "b"),
             "--budget", "20", "--fragments", "2", "--batch-size", "8"],
            cwd=REPO, env=child_env(), stdout=full, stderr=subprocess.PIPE, text=True,
            timeout=120,
        )  # fmt: skip
    assert (result.returncode, result.stderr) == (
        1,
        "yeto bench: cannot write the output: No space left on device\n",
    )


def test_sigterm_stops_the_bench_and_its_syncer(tmp_path: Path) -> None:
    out = tmp_path / "stopped"
    syncers: list[int] = []
    bench = subprocess.Popen(
        [sys.executable, "-m", "yeto_learn.cli", "bench", "--out", str(out),
         "--budget", "100000", "--fragments", "2", "--batch-size", "8"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        log = out / "syncer.log"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "listening" not in _text(log):
            time.sleep(0.1)
        syncers += [pid for pid in _pids_of("yeto_sync") if str(out) in _cmdline(pid)]
        assert syncers, "the cutoff syncer did not start"
        time.sleep(1.0)  # training
        bench.send_signal(signal.SIGTERM)
        _, errors = bench.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_runs(pid, out) for pid in syncers):
            time.sleep(0.1)
        outlived = [pid for pid in syncers if _runs(pid, out)]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in syncers:  # never leave one behind, even when the test fails
            with contextlib.suppress(ProcessLookupError):
                if _runs(pid, out):
                    os.kill(pid, signal.SIGKILL)
    assert not outlived, "a syncer outlived the bench"
    assert bench.returncode == 128 + signal.SIGTERM, errors
    last = errors.strip().splitlines()[-1]
    assert "stopped by SIGTERM; every syncer stopped, nothing exported; kept: " in last, errors
    assert "Traceback" not in errors
    assert not (out / EXPORT_FILE).exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("where", ["before", "after_in_parent"])
def test_sigterm_while_the_bench_forks_its_syncer_stops_it(tmp_path: Path, where: str) -> None:
    """A handler that raised inside the fork had its exception swallowed ("Exception ignored
    in …"): the bench went on and every later signal was only logged."""
    out = tmp_path / "stopped"
    argv = command(
        ON_FORK, [where, "1", str(int(signal.SIGTERM))], "yeto",
        "bench", "--out", str(out), "--budget", "100000", "--fragments", "2", "--batch-size", "8",
    )  # fmt: skip
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60
        )
    finally:
        left = processes_naming(out)
        for pid in left:  # never leave one behind, even when the test fails
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    took = time.monotonic() - started
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "yeto bench: stopped by SIGTERM; every syncer stopped, nothing exported; "
        "kept: no checkpoint (none was written yet)"
    )
    assert took < 30, f"stopping took {took:.1f} s"
    assert not left, f"processes {left} outlived the bench"


def _runs(pid: int, out: Path) -> bool:
    """Whether ``pid`` is still a live syncer of this run (not a reused pid, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and str(out) in _cmdline(pid)


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _pids_of(module: str) -> list[int]:
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and f"-m {module} " in _cmdline(int(entry.name))
    ]


def test_learner_budget_must_fit_c_steps() -> None:
    import torch

    from yeto_learn import Learner

    for budget in (0, 1 << 32):
        with pytest.raises(ValueError, match="budget_steps"):
            Learner(
                torch.nn.Linear(2, 2),
                syncer="127.0.0.1:9",
                learner_id=0,
                num_learners=1,
                budget_steps=budget,
            )


def test_a_bench_that_did_not_finish_names_the_checkpoint_it_kept_and_its_commands(
    tmp_path: Path,
) -> None:
    """Stopped after the consolidation wrote its marked final checkpoint but before the
    export, the bench said only "nothing exported": the state worth keeping went unnamed."""
    layout = Layout((FragmentSpec(MergeMode.AVG, (TensorSpec("w", (4,)),)),))
    checkpoint = tmp_path / CHECKPOINT_FILE
    assert bench_closure._kept(tmp_path) == "no checkpoint (none was written yet)"
    write_checkpoint(
        checkpoint,
        Checkpoint(
            format=CheckpointFormat.V3,
            iso_backend=IsoBackend.SCALAR,
            fingerprint=layout.fingerprint(),
            global_step=9,
            fragments=(FragmentState(9, np.ones(4, np.float32), np.zeros(4, np.float32)),),
            ledger=(),
            contract=bytes(32),
            trailer=TrailerKind.FINGERPRINT_AND_CONTRACT,
        ),
    )
    said = bench_closure._kept(tmp_path)
    assert said.startswith(f"checkpoint (not marked final) {checkpoint} at global_step 9 ("), said
    assert f"`yeto checkpoint inspect {checkpoint}`" in said and "export" not in said, said
    write_final_marker(checkpoint, 9)
    (tmp_path / "learner-0").mkdir()
    (tmp_path / "learner-0" / "layout.json").write_text(layout.to_json(), encoding="utf-8")
    said = bench_closure._kept(tmp_path)
    assert said.startswith(f"final checkpoint {checkpoint} at global_step 9 (yeto bench cannot")
    export = re.search(r"`(yeto checkpoint export [^`]*)`", said)
    assert export is not None, said
    out = tmp_path / EXPORT_FILE
    assert export.group(1) == (
        f"yeto checkpoint export {checkpoint} --layout {tmp_path / 'learner-0' / 'layout.json'} "
        f"--out {out}"
    )
    assert cli.main(export.group(1).split()[1:]) == 0  # the command runs as given
    assert safetensors_numpy.load_file(str(out))["w"].tolist() == [1.0] * 4
