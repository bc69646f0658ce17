"""yeto_proto.checkpoint: round trips, the atomic streaming writer, resume rules, final marker,
layout proof for export. The byte-level golden cases live in conformance/test_checkpoints.py."""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto_proto.checkpoint import (
    UNSYNCED_RENAME,
    Checkpoint,
    CheckpointFormat,
    CheckpointWriter,
    FragmentState,
    LedgerEntry,
    LegacyIdentity,
    MarkerStatus,
    TrailerKind,
    atomic,
    export_tensors,
    final_marker_bytes,
    is_marked_final,
    load_layout,
    marker_path,
    marker_state,
    orphaned_temporaries,
    read_checkpoint,
    resume_decision,
    scheduled_version,
    verify_identity,
    write_bytes_atomically,
    write_checkpoint,
    write_final_marker,
)
from yeto_proto.checkpoint import reader as reader_module
from yeto_proto.checkpoint.export import MAX_LAYOUT_FILE_BYTES
from yeto_proto.constants import IsoBackend, MergeMode
from yeto_proto.errors import CheckpointError, ErrorCode, LocalProtocolError
from yeto_proto.layout import FragmentSpec, Layout, TensorSpec

FINGERPRINT = bytes(range(32))
CONTRACT = bytes(range(100, 132))


def random_f32(rng: np.random.Generator, numel: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Arbitrary bit patterns (NaN payloads, infinities, subnormals included)."""
    return rng.integers(0, 1 << 32, size=numel, dtype=np.uint32).view("<f4")


def make_checkpoint(
    numels: tuple[int, ...] = (6, 2, 4),
    *,
    global_step: int = 5,
    seed: int = 0,
    fmt: CheckpointFormat = CheckpointFormat.V3,
    iso_backend: IsoBackend | None = IsoBackend.SCALAR,
    fingerprint: bytes | None = FINGERPRINT,
    contract: bytes | None = CONTRACT,
    versions: tuple[int, ...] | None = None,
) -> Checkpoint:
    rng = np.random.default_rng(seed)
    count = len(numels)
    if versions is None:
        versions = tuple(scheduled_version(p, global_step, count) for p in range(count))
    return Checkpoint(
        format=fmt,
        iso_backend=iso_backend,
        fingerprint=fingerprint,
        global_step=global_step,
        fragments=tuple(
            FragmentState(v, random_f32(rng, n), random_f32(rng, n))
            for v, n in zip(versions, numels, strict=True)
        ),
        ledger=(LedgerEntry(0, 3, 30, 900), LedgerEntry(3, 2, 20, 600)),
        contract=contract,
        trailer=TrailerKind.FINGERPRINT_AND_CONTRACT,
    )


def assert_bit_exact(actual: Checkpoint, expected: Checkpoint) -> None:
    assert (actual.format, actual.iso_backend, actual.fingerprint, actual.global_step) == (
        expected.format,
        expected.iso_backend,
        expected.fingerprint,
        expected.global_step,
    )
    assert (actual.ledger, actual.contract, actual.trailer) == (
        expected.ledger,
        expected.contract,
        expected.trailer,
    )
    assert actual.versions == expected.versions
    for have, want in zip(actual.fragments, expected.fragments, strict=True):
        assert have.params.view("<u4").tolist() == want.params.view("<u4").tolist()
        assert have.momentum.view("<u4").tolist() == want.momentum.view("<u4").tolist()


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# -- round trips ---------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    numels=st.lists(st.integers(1, 300), min_size=1, max_size=5).map(tuple),
    global_step=st.integers(0, (1 << 64) - 1),
    seed=st.integers(0, 2**32 - 1),
    backend=st.sampled_from(list(IsoBackend)),
    ledger_ids=st.sets(st.integers(0, (1 << 32) - 1), max_size=6),
    counter=st.integers(0, (1 << 64) - 1),
)
def test_write_then_read_is_bit_exact(
    tmp_path_factory: pytest.TempPathFactory,
    numels: tuple[int, ...],
    global_step: int,
    seed: int,
    backend: IsoBackend,
    ledger_ids: set[int],
    counter: int,
) -> None:
    path = tmp_path_factory.mktemp("rt") / "ckpt.bin"
    original = make_checkpoint(numels, global_step=global_step, seed=seed, iso_backend=backend)
    ledger = tuple(LedgerEntry(i, counter, counter // 2, counter // 3) for i in sorted(ledger_ids))
    original = Checkpoint(**{**_fields(original), "ledger": ledger})
    write_checkpoint(path, original)
    for mapped in (False, True):
        assert_bit_exact(read_checkpoint(path, mapped=mapped), original)
    # Reading and writing again reproduces the file byte for byte.
    again = path.with_name("again.bin")
    write_checkpoint(again, read_checkpoint(path))
    assert again.read_bytes() == path.read_bytes()


def _fields(checkpoint: Checkpoint) -> dict[str, Any]:
    return {name: getattr(checkpoint, name) for name in Checkpoint.__dataclass_fields__}


def test_file_size_is_exactly_the_pinned_layout(tmp_path: Path) -> None:
    checkpoint = make_checkpoint((6, 2, 4))
    write_checkpoint(tmp_path / "c.bin", checkpoint)
    expected = (4 + 1 + 32 + 8) + 4 + sum(16 + 8 * n for n in (6, 2, 4)) + 4 + 2 * 28 + 68
    assert (tmp_path / "c.bin").stat().st_size == expected


def test_loaded_arrays_are_owned_and_mapped_arrays_are_read_only(tmp_path: Path) -> None:
    path = tmp_path / "c.bin"
    write_checkpoint(path, make_checkpoint())
    loaded = read_checkpoint(path)
    mapped = read_checkpoint(path, mapped=True)
    assert all(f.params.flags.writeable and f.params.flags.owndata for f in loaded.fragments)
    assert not any(f.momentum.flags.writeable for f in mapped.fragments)


# -- the writer ----------------------------------------------------------------------------------
def _writer(path: Path, num_fragments: int = 1) -> CheckpointWriter:
    return CheckpointWriter(
        path,
        iso_backend=IsoBackend.SCALAR,
        fingerprint=FINGERPRINT,
        global_step=1,
        num_fragments=num_fragments,
        contract=CONTRACT,
    )


GOOD = np.ones(4, dtype=np.float32)


@pytest.mark.parametrize(
    ("params", "momentum"),
    [
        (np.ones(4, dtype=np.float64), np.ones(4, dtype=np.float64)),
        (np.ones(4, dtype=">f4"), np.ones(4, dtype=">f4")),
        (np.ones(8, dtype=np.float32)[::2], GOOD),
        (GOOD, np.ones(5, dtype=np.float32)),
        (np.ones(0, dtype=np.float32), np.ones(0, dtype=np.float32)),
    ],
    ids=["float64", "big-endian", "strided", "size-mismatch", "empty"],
)
def test_writer_refuses_arrays_it_cannot_stream(
    tmp_path: Path, params: np.ndarray[Any, Any], momentum: np.ndarray[Any, Any]
) -> None:
    target = tmp_path / "c.bin"
    target.write_bytes(b"old")
    with pytest.raises(LocalProtocolError) as caught, _writer(target) as writer:
        writer.add_fragment(1, params, momentum)
    assert caught.value.code is ErrorCode.CKPT_BAD_FIELD
    assert target.read_bytes() == b"old" and leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "change",
    [
        {"fingerprint": b"short"},
        {"contract": bytes(33)},
        {"global_step": -1},
        {"global_step": 1 << 64},
        # Values of the wrong type are refused, never cut or coerced.
        {"global_step": 4.0},
        {"global_step": True},
        {"fingerprint": "ab" * 16},
        {"ledger": (LedgerEntry(0, 1.5, 0, 0),)},  # type: ignore[arg-type]
        {"fragments": (FragmentState(1.0, np.zeros(2, "<f4"), np.zeros(2, "<f4")),)},  # type: ignore[arg-type]
        {"fragments": (FragmentState(1, [0.0, 0.0], np.zeros(2, "<f4")),)},  # type: ignore[arg-type]
        {"fragments": ()},
        {"ledger": (LedgerEntry(2, 0, 0, 0), LedgerEntry(2, 0, 0, 0))},
        {"ledger": (LedgerEntry(1 << 32, 0, 0, 0),)},
        {"ledger": (LedgerEntry(0, -1, 0, 0),)},
        {"ledger": (LedgerEntry(None, 0, 0, 0), LedgerEntry(None, 0, 0, 0))},  # type: ignore[arg-type]
        {"ledger": (LedgerEntry("1", 0, 0, 0), LedgerEntry("2", 0, 0, 0))},  # type: ignore[arg-type]
        {"iso_backend": None},
        {"iso_backend": True},
        {"contract": None},
        {"format": CheckpointFormat.V2},
    ],
    ids=lambda change: next(iter(change)) + "=" + repr(next(iter(change.values())))[:12],
)
def test_writer_refuses_values_v3_cannot_hold(tmp_path: Path, change: dict[str, Any]) -> None:
    target = tmp_path / "c.bin"
    write_checkpoint(target, make_checkpoint(seed=1))
    before = target.read_bytes()
    with pytest.raises(LocalProtocolError) as caught:
        write_checkpoint(target, Checkpoint(**{**_fields(make_checkpoint(seed=2)), **change}))
    assert caught.value.code is ErrorCode.CKPT_BAD_FIELD
    assert target.read_bytes() == before and leftovers(tmp_path) == []


def test_writer_refuses_an_unknown_iso_backend(tmp_path: Path) -> None:
    with pytest.raises(LocalProtocolError) as caught:
        CheckpointWriter(
            tmp_path / "c.bin",
            iso_backend=2,  # type: ignore[arg-type]
            fingerprint=FINGERPRINT,
            global_step=1,
            num_fragments=1,
            contract=CONTRACT,
        )
    assert caught.value.code is ErrorCode.CKPT_BAD_FIELD
    assert list(tmp_path.iterdir()) == []


def test_writer_counts_fragments(tmp_path: Path) -> None:
    with pytest.raises(LocalProtocolError), _writer(tmp_path / "a.bin", 2) as writer:
        writer.add_fragment(1, GOOD, GOOD)
        writer.finish([])
    with pytest.raises(LocalProtocolError), _writer(tmp_path / "b.bin", 1) as writer:
        writer.add_fragment(1, GOOD, GOOD)
        writer.add_fragment(2, GOOD, GOOD)
    assert list(tmp_path.iterdir()) == []


def test_leaving_the_writer_without_finish_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "c.bin"
    write_checkpoint(target, make_checkpoint(seed=1))
    before = target.read_bytes()
    with pytest.raises(LocalProtocolError, match="before finish"), _writer(target) as writer:
        writer.add_fragment(1, GOOD, GOOD)
    with pytest.raises(RuntimeError), _writer(target) as writer:
        writer.add_fragment(1, GOOD, GOOD)
        raise RuntimeError("the caller failed mid-write")
    assert target.read_bytes() == before and leftovers(tmp_path) == []


def test_writer_reports_an_unwritable_directory_as_ckpt_io(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as caught:
        write_checkpoint(tmp_path / "missing" / "c.bin", make_checkpoint())
    assert caught.value.code is ErrorCode.CKPT_IO
    assert "missing" in str(caught.value)


CRASHING_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from yeto_proto.checkpoint import CheckpointWriter, atomic
    from yeto_proto.constants import IsoBackend

    target, point = sys.argv[1], sys.argv[2]

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    real_fsync_path = atomic.fsync_path
    if point == "before_rename":
        os.replace = die
    if point == "before_directory_fsync":
        atomic.fsync_path = lambda p: die() if os.path.isdir(p) else real_fsync_path(p)
    writer = CheckpointWriter(
        target, iso_backend=IsoBackend.SCALAR, fingerprint=bytes(32), global_step=2,
        num_fragments=2, contract=bytes(32),
    )
    if point == "after_prefix":
        die()
    values = np.full(1 << 20, 2.0, dtype=np.float32)
    writer.add_fragment(2, values, values)
    if point == "mid_fragments":
        die()
    writer.add_fragment(1, values, values)
    writer.finish([])
    """
)


@pytest.mark.parametrize(
    ("point", "survivor_step"),
    [
        ("after_prefix", 1),
        ("mid_fragments", 1),
        ("before_rename", 1),
        ("before_directory_fsync", 2),
    ],
)
def test_a_crash_leaves_the_old_or_the_new_file_whole(
    tmp_path: Path, point: str, survivor_step: int
) -> None:
    target = tmp_path / "c.bin"
    old = make_checkpoint((1 << 20, 1 << 20), global_step=1)
    write_checkpoint(target, old)
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_WRITER, str(target), point],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
    )
    assert done.returncode == -9, done.stderr
    survivor = read_checkpoint(target)
    assert survivor.global_step == survivor_step
    if survivor_step == 1:
        assert_bit_exact(survivor, old)
    else:
        assert all(float(f.params[0]) == 2.0 for f in survivor.fragments)


def test_writing_streams_from_the_arrays_without_copying_them(tmp_path: Path) -> None:
    checkpoint = make_checkpoint((1 << 20,) * 4)  # 32 MiB of arrays
    tracemalloc.start()
    try:
        write_checkpoint(tmp_path / "c.bin", checkpoint)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20), f"the writer allocated {peak} bytes"


def test_reading_allocates_the_arrays_once(tmp_path: Path) -> None:
    path = tmp_path / "c.bin"
    write_checkpoint(path, make_checkpoint((1 << 20,) * 4))
    arrays = 4 * 2 * 4 * (1 << 20)
    for mapped, ceiling in ((False, arrays + (1 << 20)), (True, 1 << 20)):
        tracemalloc.start()
        try:
            checkpoint = read_checkpoint(path, mapped=mapped)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < ceiling, (mapped, peak)
        del checkpoint


def test_reader_refuses_a_missing_file_and_a_directory(tmp_path: Path) -> None:
    for path in (tmp_path / "absent.bin", tmp_path):
        with pytest.raises(CheckpointError) as caught:
            read_checkpoint(path)
        assert caught.value.code is ErrorCode.CKPT_IO
        assert caught.value.section == "open" and str(path) in str(caught.value)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.timeout(20)
def test_a_fifo_is_refused_rather_than_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "c.bin"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(fifo)
    assert caught.value.code is ErrorCode.CKPT_IO and "not a regular file" in str(caught.value)
    os.mkfifo(tmp_path / "c.bin.final")
    state = marker_state(fifo, 5)
    assert state.status is MarkerStatus.INVALID and "not a regular file" in state.detail


def test_a_checkpoint_too_large_for_memory_is_a_coded_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.bin"
    write_checkpoint(path, make_checkpoint())

    def no_memory(*args: object, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(reader_module.np, "empty", no_memory)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path)
    assert caught.value.code is ErrorCode.CKPT_IO and "not enough memory" in str(caught.value)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("mapped", [False, True])
def test_a_file_emptied_after_its_size_was_taken_is_truncated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapped: bool
) -> None:
    """mmap refuses an empty file with ValueError: mapped reads let it escape uncoded."""
    path = tmp_path / "c.bin"
    path.write_bytes(b"")
    real_fstat = os.fstat

    def stale_fstat(fd: int) -> os.stat_result:
        fields = list(real_fstat(fd))
        fields[6] = 4096  # st_size as it was before the file was emptied
        return os.stat_result(fields)

    monkeypatch.setattr(reader_module.os, "fstat", stale_fstat)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path, mapped=mapped)
    assert caught.value.code is ErrorCode.CKPT_TRUNCATED and str(path) in str(caught.value)


def test_atomic_small_write_replaces_and_cleans_up(tmp_path: Path) -> None:
    target = tmp_path / "f"
    write_bytes_atomically(target, b"one")
    write_bytes_atomically(target, b"two")
    assert target.read_bytes() == b"two" and leftovers(tmp_path) == []
    with pytest.raises(CheckpointError) as caught:
        write_bytes_atomically(tmp_path / "no" / "f", b"x")
    assert caught.value.code is ErrorCode.CKPT_IO
    assert caught.value.section != UNSYNCED_RENAME  # nothing was replaced


def test_a_write_to_a_read_only_file_system_fails_with_its_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a read-only mount the staging file is never created and removing it fails with
    EROFS, not ENOENT: that second error replaced the write's own, a traceback in every
    command."""

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setattr(atomic, "open", lambda path, *a, **k: read_only(Path(path)), raising=False)
    with pytest.raises(CheckpointError) as caught:
        write_bytes_atomically(tmp_path / "f", b"x")
    assert caught.value.code is ErrorCode.CKPT_IO
    assert "Read-only file system" in str(caught.value), caught.value
    assert f"(file {tmp_path / 'f'})" in str(caught.value), caught.value


def test_a_directory_sync_failing_after_the_rename_says_the_new_file_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "f"
    write_bytes_atomically(target, b"old")
    real_fsync_path = atomic.fsync_path

    def directories_fail(path: Path) -> None:
        if path.is_dir():
            raise OSError(5, "Input/output error")
        real_fsync_path(path)

    monkeypatch.setattr(atomic, "fsync_path", directories_fail)
    with pytest.raises(CheckpointError) as caught:
        write_bytes_atomically(target, b"new")
    assert caught.value.code is ErrorCode.CKPT_IO
    assert caught.value.section == UNSYNCED_RENAME
    assert str(caught.value) == (
        "CKPT_IO: directory sync: Input/output error: the new file replaced the old one, but its"
        " directory could not be synced, so a crash may bring the old one back"
        f" (file {target})"
    )
    assert target.read_bytes() == b"new" and leftovers(tmp_path) == []


# -- final marker --------------------------------------------------------------------------------
def test_final_marker_has_the_pinned_bytes_and_sits_beside_the_checkpoint(tmp_path: Path) -> None:
    checkpoint_path = tmp_path / "run.ckpt"
    written = write_final_marker(checkpoint_path, 1234)
    assert written == marker_path(checkpoint_path) == tmp_path / "run.ckpt.final"
    assert written.read_bytes() == b"YETO_FINAL_V1\nglobal_step=1234\n"
    assert final_marker_bytes(0) == b"YETO_FINAL_V1\nglobal_step=0\n"
    assert leftovers(tmp_path) == []
    with pytest.raises(ValueError):
        final_marker_bytes(-1)


def test_marker_state_says_whether_the_checkpoint_is_marked_final(tmp_path: Path) -> None:
    checkpoint_path = tmp_path / "run.ckpt"
    assert marker_state(checkpoint_path, 8).status is MarkerStatus.ABSENT
    write_final_marker(checkpoint_path, 8)
    state = marker_state(checkpoint_path, 8)
    assert (state.status, state.marker_step, state.is_final) == (MarkerStatus.FINAL, 8, True)
    assert is_marked_final(checkpoint_path, 8)
    # A marker left from another step does not make this checkpoint final.
    stale = marker_state(checkpoint_path, 9)
    assert (stale.status, stale.marker_step, stale.is_final) == (
        MarkerStatus.STEP_MISMATCH,
        8,
        False,
    )
    for junk in (b"YETO_FINAL_V1\nglobal_step=8", b"YETO_FINAL_V1\nglobal_step=8\n" + b" " * 100):
        marker_path(checkpoint_path).write_bytes(junk)
        assert marker_state(checkpoint_path, 8).status is MarkerStatus.INVALID
        assert not is_marked_final(checkpoint_path, 8)


# -- resume --------------------------------------------------------------------------------------
def wire(layout_numels: tuple[tuple[int, ...], ...]) -> Any:
    return Layout(
        tuple(
            FragmentSpec(
                MergeMode.AVG,
                tuple(TensorSpec(f"f{i}.t{j}", (n,)) for j, n in enumerate(numels)),
            )
            for i, numels in enumerate(layout_numels)
        )
    ).wire()


UNGROUPED = wire(((6,), (2,), (4,)))
#: Same fragment count and flat sizes as UNGROUPED, but fragment 0 holds two tensors.
GROUPED = wire(((3, 3), (2,), (4,)))


def with_value(checkpoint: Checkpoint, fragment: int, array: str, value: float) -> Checkpoint:
    """``checkpoint`` with one value of one fragment's params or momentum replaced."""
    changed = getattr(checkpoint.fragments[fragment], array).copy()
    changed[-1] = value
    fragments = list(checkpoint.fragments)
    fragments[fragment] = dataclasses.replace(fragments[fragment], **{array: changed})
    return dataclasses.replace(checkpoint, fragments=tuple(fragments))


def decide(checkpoint: Checkpoint, **overrides: Any) -> Any:
    arguments: dict[str, Any] = {
        "iso_backend": IsoBackend.SCALAR,
        "fingerprint": FINGERPRINT,
        "wire_layout": UNGROUPED,
        "session_contract": CONTRACT,
    }
    return resume_decision(checkpoint, **{**arguments, **overrides})


def legacy(fmt: CheckpointFormat, **kw: Any) -> Checkpoint:
    backend = None if fmt is CheckpointFormat.V1 else IsoBackend.SCALAR
    return make_checkpoint(fmt=fmt, iso_backend=backend, fingerprint=None, **kw)


@pytest.mark.parametrize(
    ("checkpoint", "overrides", "reason", "check"),
    [
        (legacy(CheckpointFormat.V1), {}, "V1 checkpoints never resume", 1),
        (make_checkpoint(), {"iso_backend": IsoBackend.TORCH_SVD}, "iso backend scalar", 2),
        (legacy(CheckpointFormat.V2), {"iso_backend": IsoBackend.TORCH_SVD}, "iso backend", 2),
        (legacy(CheckpointFormat.V2), {"wire_layout": GROUPED}, "fails closed", 5),
        (
            Checkpoint(**{**_fields(legacy(CheckpointFormat.V2)), "fingerprint": bytes(32)}),
            {},
            "V2 fingerprint trailer differs",
            5,
        ),
        # Same count and same flat sizes, another fingerprint: refused all the same.
        (make_checkpoint(), {"fingerprint": bytes(32), "wire_layout": GROUPED}, "fingerprint", 5),
        (make_checkpoint((6, 2)), {}, "2 fragments, the layout 3", 6),
        (make_checkpoint((6, 2, 5)), {}, "fragment 2 has numel 5", 6),
        (make_checkpoint(versions=(5, 2, 4)), {}, "fragment 0 is at version 5", 4),
        (make_checkpoint(global_step=0, versions=(0, 0, 1)), {}, "fragment 2 is at version 1", 4),
        (make_checkpoint(contract=None), {}, "V3 checkpoint carries no session contract", 7),
        (legacy(CheckpointFormat.V2), {"session_contract": bytes(32)}, "contract differs", 7),
        (with_value(make_checkpoint(), 1, "params", np.nan), {}, "fragment 1 holds non-finite", 3),
        (with_value(make_checkpoint(), 2, "momentum", -np.inf), {}, "non-finite momentum", 3),
        (make_checkpoint(), {"session_contract": bytes(32)}, "session contract differs", 7),
    ],
)
def test_resume_is_refused_with_a_reason(
    checkpoint: Checkpoint, overrides: dict[str, Any], reason: str, check: int
) -> None:
    decision = decide(checkpoint, **overrides)
    assert decision.eligible is False
    assert reason in decision.reason
    assert decision.check == check  # the number of spec/checkpoint.md § 4


@pytest.mark.parametrize(
    ("checkpoint", "overrides"),
    [
        (make_checkpoint(), {}),
        (make_checkpoint(), {"wire_layout": GROUPED}),  # V3 proves grouped layouts
        (make_checkpoint(global_step=0), {}),
        (make_checkpoint(global_step=1000, iso_backend=IsoBackend.TORCH_SVD), {"iso_backend": 1}),
        (legacy(CheckpointFormat.V2), {}),
        (legacy(CheckpointFormat.V2, contract=None), {}),  # legacy writers had no contract
    ],
)
def test_resume_is_allowed_when_every_check_passes(
    checkpoint: Checkpoint, overrides: dict[str, Any]
) -> None:
    decision = decide(checkpoint, **overrides)
    assert decision.eligible is True, decision.reason


@settings(max_examples=200, deadline=None)
@given(num_fragments=st.integers(1, 9), global_step=st.integers(0, 60))
def test_scheduled_version_matches_a_simulated_schedule(
    num_fragments: int, global_step: int
) -> None:
    versions = [0] * num_fragments
    for t in range(1, global_step + 1):  # round t commits fragment (t-1) mod F at version t
        versions[(t - 1) % num_fragments] = t
    assert [
        scheduled_version(p, global_step, num_fragments) for p in range(num_fragments)
    ] == versions


# -- export: proving the layout ------------------------------------------------------------------
def named_layout(names: tuple[str, ...] = ("w", "v", "b", "c")) -> Layout:
    return Layout(
        (
            FragmentSpec(MergeMode.ISO, (TensorSpec(names[0], (2, 3)),)),
            FragmentSpec(MergeMode.AVG, (TensorSpec(names[1], (2,)),)),
            FragmentSpec(MergeMode.AVG, (TensorSpec(names[2], (1, 1)), TensorSpec(names[3], (3,)))),
        )
    )


def test_export_maps_fragments_to_named_views_without_copies() -> None:
    layout = named_layout()
    checkpoint = make_checkpoint(fingerprint=layout.fingerprint())
    exported = export_tensors(checkpoint, layout)
    assert list(exported.tensors) == ["w", "v", "b", "c"]
    assert exported.tensors["w"].shape == (2, 3) and exported.tensors["c"].shape == (3,)
    last = checkpoint.fragments[2].params
    assert exported.tensors["c"].view("<u4").tolist() == last[1:].view("<u4").tolist()
    assert np.shares_memory(exported.tensors["c"], last)
    assert exported.metadata["layout_fingerprint"] == layout.fingerprint().hex()
    assert exported.metadata["global_step"] == "5"


def test_v3_export_refuses_a_layout_with_equal_sizes_but_another_fingerprint() -> None:
    checkpoint = make_checkpoint(fingerprint=named_layout().fingerprint())
    with pytest.raises(CheckpointError) as caught:
        export_tensors(checkpoint, named_layout(("w", "v", "c", "b")))
    assert caught.value.code is ErrorCode.CKPT_LAYOUT_MISMATCH


@pytest.mark.parametrize(
    ("fmt", "identity", "code"),
    [
        (CheckpointFormat.V2, LegacyIdentity(), ErrorCode.CKPT_IDENTITY_REQUIRED),
        (CheckpointFormat.V2, LegacyIdentity(bytes(32)), ErrorCode.CKPT_LAYOUT_MISMATCH),
        (CheckpointFormat.V1, LegacyIdentity(), ErrorCode.CKPT_IDENTITY_REQUIRED),
        (
            CheckpointFormat.V2,
            LegacyIdentity(None, IsoBackend.TORCH_SVD),
            ErrorCode.CKPT_LAYOUT_MISMATCH,
        ),
    ],
)
def test_legacy_export_of_a_grouped_layout_needs_the_audited_identity(
    fmt: CheckpointFormat, identity: LegacyIdentity, code: ErrorCode
) -> None:
    with pytest.raises(CheckpointError) as caught:
        verify_identity(legacy(fmt), named_layout(), identity)
    assert caught.value.code is code


def test_legacy_export_with_identity_supplied() -> None:
    layout = named_layout()
    supplied = LegacyIdentity(layout.fingerprint(), IsoBackend.TORCH_SVD)
    assert verify_identity(legacy(CheckpointFormat.V1), layout, supplied) is IsoBackend.TORCH_SVD
    v2 = legacy(CheckpointFormat.V2)
    assert verify_identity(v2, layout, LegacyIdentity(layout.fingerprint())) is IsoBackend.SCALAR
    # V1 needs its backend even with the fingerprint supplied.
    with pytest.raises(CheckpointError) as caught:
        verify_identity(legacy(CheckpointFormat.V1), layout, LegacyIdentity(layout.fingerprint()))
    assert caught.value.code is ErrorCode.CKPT_IDENTITY_REQUIRED


def test_export_refuses_fragment_count_and_size_mismatches() -> None:
    layout = named_layout()
    for numels in ((6, 2), (6, 2, 5)):
        checkpoint = make_checkpoint(numels, fingerprint=layout.fingerprint())
        with pytest.raises(CheckpointError) as caught:
            export_tensors(checkpoint, layout)
        assert caught.value.code is ErrorCode.CKPT_LAYOUT_MISMATCH


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"format": "other"}',
        '{"format": "yeto-layout-v1", "fragments": [{"merge_mode": "avg"}]}',
        '{"format": "yeto-layout-v1", "fragments": [{"merge_mode": "median", "tensors": []}]}',
        '{"format": "yeto-layout-v1", "fingerprint": "00", "fragments": '
        '[{"merge_mode": "avg", "tensors": [{"name": "a", "shape": [2]}]}]}',
        '{"format": "yeto-layout-v1", "fragments": '
        '[{"merge_mode": "avg", "tensors": [{"name": "a", "shape": [0]}]}]}',
        # Values of the wrong type are refused, never converted.
        *(
            '{"format": "yeto-layout-v1", "fragments": [{"merge_mode": "avg", "tensors": '
            f'[{{"name": "a", "shape": {shape}}}]}}]}}'
            for shape in ("[Infinity]", "[4.9]", '["4"]', "[true, 4]", '{"4": 1}', "4")
        ),
        '{"format": "yeto-layout-v1", "fragments": '
        f'[{{"merge_mode": "avg", "tensors": [{{"name": "a", "shape": {[1] * 65}}}]}}]}}',
        '{"format": "yeto-layout-v1", "fragments": '
        '[{"merge_mode": "avg", "tensors": [{"name": "a", "shape": [4294967296, 4294967296]}]}]}',
        '{"format": "yeto-layout-v1", "fragments": '
        '[{"merge_mode": "AVG", "tensors": [{"name": "a", "shape": [2]}]}]}',
        '{"format": "yeto-layout-v1", "fragments": '
        '[{"merge_mode": "avg", "tensors": [{"name": 7, "shape": [2]}]}]}',
        '{"format": "yeto-layout-v1", "fragments": '
        '[{"merge_mode": "avg", "tensors": [{"name": "\\ud800", "shape": [2]}]}]}',
        '{"format": "yeto-layout-v1", "fragments": []}',
        '{"format": "yeto-layout-v1", "fragments": ["avg"]}',
        # Strict RFC 8259, as serde and most readers other than Python's take it: a repeated
        # key (which one wins differs between readers), NaN/Infinity tokens (not JSON) even
        # where a key is ignored, and an empty name (nothing to export it as) are defects.
        '{"format": "bogus", "format": "yeto-layout-v1", "fragments": '
        '[{"merge_mode": "avg", "tensors": [{"name": "a", "shape": [2]}]}]}',
        '{"format": "yeto-layout-v1", "fragments": '
        '[{"merge_mode": "avg", "tensors": [{"name": "a", "name": "b", "shape": [2]}]}]}',
        *(
            '{"format": "yeto-layout-v1", "note": ' + token + ', "fragments": '
            '[{"merge_mode": "avg", "tensors": [{"name": "a", "shape": [2]}]}]}'
            for token in ("NaN", "Infinity", "-Infinity")
        ),
        '{"format": "yeto-layout-v1", "fragments": '
        '[{"merge_mode": "avg", "tensors": [{"name": "", "shape": [2]}]}]}',
    ],
)
def test_a_bad_layout_file_is_one_coded_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "layout.json"
    path.write_text(text)
    with pytest.raises(CheckpointError) as caught:
        load_layout(path)
    assert caught.value.code is ErrorCode.CKPT_BAD_LAYOUT
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.timeout(20)
def test_a_layout_that_is_a_device_or_a_directory_is_refused_not_read(tmp_path: Path) -> None:
    """/dev/zero would never end; a named FIFO no writer holds open reads as empty."""
    named = [tmp_path, *([Path("/dev/zero")] if os.path.exists("/dev/zero") else [])]
    for path in named:
        with pytest.raises(CheckpointError) as caught:
            load_layout(path)
        assert caught.value.code is ErrorCode.CKPT_IO and caught.value.section == "layout"
        assert "not a regular file or a pipe" in str(caught.value)
        assert str(path) in str(caught.value)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(CheckpointError) as caught:
            load_layout(tmp_path / "fifo")
        assert caught.value.code is ErrorCode.CKPT_BAD_LAYOUT


@pytest.mark.skipif(not os.path.exists("/dev/fd"), reason="no /dev/fd here")
def test_a_layout_can_come_through_a_pipe() -> None:
    """As bash's ``--layout <(command)`` passes it."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, named_layout().to_json().encode())
        os.close(write_end)
        layout = load_layout(f"/dev/fd/{read_end}")
    finally:
        os.close(read_end)
    assert layout.fingerprint() == named_layout().fingerprint()


def test_a_layout_file_over_its_cap_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """The cap itself is accepted (a layout padded with spaces to it), one byte more is not."""
    path = tmp_path / "layout.json"
    text = named_layout().to_json()
    path.write_text(text + " " * (MAX_LAYOUT_FILE_BYTES - len(text)))
    assert load_layout(path).fingerprint() == named_layout().fingerprint()
    with path.open("a") as file:
        file.write(" ")
    with pytest.raises(CheckpointError) as caught:
        load_layout(path)
    assert caught.value.code is ErrorCode.CKPT_BAD_LAYOUT
    assert f"larger than {MAX_LAYOUT_FILE_BYTES} bytes" in str(caught.value)


def test_a_regular_layout_file_over_its_cap_is_refused_without_reading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its size says enough: a 1 TiB sparse file costs no read (it was read up to the cap)."""
    path = tmp_path / "layout.json"
    with path.open("wb") as file:
        file.truncate(1 << 40)
    reads: list[int] = []
    real_read = io.BufferedReader.read

    class CountingReader(io.BufferedReader):
        def read(self, size: int | None = -1, /) -> bytes:
            reads.append(-1 if size is None else size)
            return real_read(self, size)

    monkeypatch.setattr(os, "fdopen", lambda fd, mode="rb": CountingReader(io.FileIO(fd, "r")))
    with pytest.raises(CheckpointError) as caught:
        load_layout(path)
    assert caught.value.code is ErrorCode.CKPT_BAD_LAYOUT
    assert reads == []


def test_layout_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "layout.json"
    path.write_text(named_layout().to_json())
    assert load_layout(path).fingerprint() == named_layout().fingerprint()
    assert os.path.getsize(path) > 0


def test_orphaned_temporaries_are_those_of_writers_that_are_gone(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    live_pid = os.getppid()  # whatever started this process: alive
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead_pid = int(gone.stdout)
    orphan = tmp_path / f".ckpt.{dead_pid}.0123456789ab.tmp"
    # Its own id: a former process's (a container restarted with the same id).
    former = tmp_path / f".ckpt.{os.getpid()}.00000000000a.tmp"
    live = tmp_path / f".ckpt.{live_pid}.0123456789ab.tmp"  # another writer, still writing
    fresh = tmp_path / f".ckpt.{dead_pid}.00000000000b.tmp"  # a writer this process can't see
    unrelated = [
        tmp_path / f".other.{dead_pid}.0123456789ab.tmp",
        tmp_path / ".ckpt.x.tmp",
        tmp_path / f".ckpt.{10**30}.0123456789ab.tmp",  # no process id at all
    ]
    for path in (orphan, former, live, fresh, *unrelated):
        path.write_bytes(b"partial")
        if path is not fresh:
            os.utime(path, (time.time() - 120, time.time() - 120))
    assert orphaned_temporaries(target) == sorted([orphan, former])
    assert orphaned_temporaries(tmp_path / "missing-dir" / "ckpt") == []
