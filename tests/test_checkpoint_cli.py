"""``yeto checkpoint inspect|export`` through ``yeto_learn.cli.main`` (and once as a process)."""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import struct
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from signal_hooks import AFTER_CALL, ON_IMPORT, command

from yeto_learn import checkpoint_cli
from yeto_learn.cli import main
from yeto_learn.process_control import Stopped
from yeto_proto.checkpoint import (
    Checkpoint,
    CheckpointFormat,
    FragmentState,
    LedgerEntry,
    TrailerKind,
    write_checkpoint,
    write_final_marker,
)
from yeto_proto.constants import IsoBackend, MergeMode
from yeto_proto.layout import FragmentSpec, Layout, TensorSpec

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = bytes(range(7, 39))


def model_layout(
    names: tuple[str, str, str] = ("embed.weight", "head.weight", "head.bias"),
) -> Layout:
    return Layout(
        (
            FragmentSpec(MergeMode.ISO, (TensorSpec(names[0], (3, 4)),)),
            FragmentSpec(MergeMode.AVG, (TensorSpec(names[1], (2, 2)), TensorSpec(names[2], (2,)))),
        )
    )


def v3_checkpoint(layout: Layout, global_step: int = 4) -> Checkpoint:
    rng = np.random.default_rng(3)
    fragments = tuple(
        FragmentState(
            version=v,
            params=rng.standard_normal(n).astype(np.float32),
            momentum=rng.standard_normal(n).astype(np.float32),
        )
        for v, n in zip((3, 4), (12, 6), strict=True)
    )
    return Checkpoint(
        format=CheckpointFormat.V3,
        iso_backend=IsoBackend.TORCH_SVD,
        fingerprint=layout.fingerprint(),
        global_step=global_step,
        fragments=fragments,
        ledger=(LedgerEntry(0, 4, 96, 12288), LedgerEntry(1, 3, 70, 9000)),
        contract=CONTRACT,
        trailer=TrailerKind.FINGERPRINT_AND_CONTRACT,
    )


def as_legacy(v3: bytes, fmt: CheckpointFormat, trailer_bytes: int) -> bytes:
    """The same state in V1 or V2 form: another prefix, the same body, a shorter trailer."""
    backend, step = v3[4], v3[37:45]
    prefix = struct.pack("<I", fmt) + (bytes([backend]) if fmt is CheckpointFormat.V2 else b"")
    body = v3[45 : len(v3) - 68]
    return prefix + step + body + v3[len(v3) - 68 :][:trailer_bytes]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    layout = model_layout()
    paths = {name: tmp_path / f"{name}.bin" for name in ("v1", "v2", "v3")}
    write_checkpoint(paths["v3"], v3_checkpoint(layout))
    v3 = paths["v3"].read_bytes()
    paths["v2"].write_bytes(as_legacy(v3, CheckpointFormat.V2, 0))
    paths["v1"].write_bytes(as_legacy(v3, CheckpointFormat.V1, 0))
    paths["layout"] = tmp_path / "layout.json"
    paths["layout"].write_text(layout.to_json())
    return paths


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def export_argv(files: dict[str, Path], out: Path) -> tuple[str | Path, ...]:
    """``yeto checkpoint export`` of the V3 fixture to ``out``."""
    return ("checkpoint", "export", files["v3"], "--layout", files["layout"], "--out", out)


def inspect_json(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, Any]:
    code, out, err = run(capsys, "checkpoint", "inspect", path, "--json")
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


# -- inspect -------------------------------------------------------------------------------------
def test_inspect_reports_every_field_of_v3(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    info = inspect_json(capsys, files["v3"])
    assert info["format"] == "V3" and info["magic"] == "0xD1705A80"
    assert info["iso_backend"] == "torch-svd"
    assert info["fingerprint"] == model_layout().fingerprint().hex()
    assert info["fingerprint_source"] == "prefix"
    assert info["global_step"] == 4
    assert [(f["id"], f["version"], f["numel"]) for f in info["fragments"]] == [
        (0, 3, 12),
        (1, 4, 6),
    ]
    assert info["versions_match_schedule"] is True
    assert info["ledger"][1] == {"learner_id": 1, "merges": 3, "steps": 70, "tokens": 9000}
    assert info["contract"] == CONTRACT.hex()
    assert (info["trailer"], info["trailer_bytes"]) == ("fingerprint+contract", 68)
    assert info["final_marker"]["status"] == "absent"


def damaged_copy(files: dict[str, Path], tmp_path: Path) -> Path:
    """The V3 fixture with head.bias[1] (fragment 1's params[5]) NaN: a damaged file."""
    checkpoint = v3_checkpoint(model_layout())
    params = checkpoint.fragments[1].params.copy()
    params[5] = np.nan
    fragments = (checkpoint.fragments[0], replace(checkpoint.fragments[1], params=params))
    path = tmp_path / "damaged.bin"
    write_checkpoint(path, replace(checkpoint, fragments=fragments))
    return path


def test_inspect_reports_non_finite_values(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    """A damaged file (resume refuses it) looked sound to inspect."""
    assert inspect_json(capsys, files["v3"])["all_finite"] is True
    info = inspect_json(capsys, damaged_copy(files, tmp_path))
    assert info["all_finite"] is False
    assert [f["finite"] for f in info["fragments"]] == [True, False]
    code, text, _ = run(capsys, "checkpoint", "inspect", damaged_copy(files, tmp_path))
    assert code == 0 and "NON-FINITE VALUES" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("  ")]
    assert rows[1] == ["0", "3", "12"] and rows[2] == ["1", "4", "6", "(non-finite", "values)"]


def test_an_export_of_non_finite_values_warns(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "model.pt"
    damaged = damaged_copy(files, tmp_path)
    argv = ("checkpoint", "export", damaged, "--layout", files["layout"], "--out", out)
    code, stdout, err = run(capsys, *argv)
    assert code == 0 and "exported 3 tensors" in stdout
    assert err.splitlines() == [
        "yeto checkpoint export: warning: non-finite values in head.bias: the checkpoint is "
        "damaged (a merge never lets one in); exported as they are"
    ]
    code, _, err = run(capsys, *export_argv(files, tmp_path / "sound.pt"))
    assert code == 0 and err == ""


def test_inspect_reads_legacy_formats(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    v2 = inspect_json(capsys, files["v2"])
    v1 = inspect_json(capsys, files["v1"])
    assert (v2["format"], v2["iso_backend"], v2["fingerprint"]) == ("V2", "torch-svd", None)
    assert (v1["format"], v1["iso_backend"], v1["contract"]) == ("V1", None, None)
    for info in (v1, v2):
        assert info["global_step"] == 4 and info["trailer_bytes"] == 0
        assert [f["numel"] for f in info["fragments"]] == [12, 6]


def test_inspect_reports_the_size_of_the_file_it_decoded(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A syncer replacing the checkpoint between the read and a second stat made inspect show
    one file's step beside the other's size."""
    path, decoded_size = files["v3"], files["v3"].stat().st_size
    real_read = checkpoint_cli.read_checkpoint

    def read_then_replace(name: Path, *, mapped: bool = False) -> Checkpoint:
        checkpoint = real_read(name, mapped=mapped)
        write_checkpoint(path, replace(v3_checkpoint(model_layout(), 9), ledger=()))
        return checkpoint

    monkeypatch.setattr(checkpoint_cli, "read_checkpoint", read_then_replace)
    info = inspect_json(capsys, path)
    assert (info["global_step"], info["size_bytes"]) == (4, decoded_size)
    assert path.stat().st_size != decoded_size


def test_inspect_shows_the_final_marker_state(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    write_final_marker(files["v3"], 4)
    assert inspect_json(capsys, files["v3"])["final_marker"]["status"] == "final"
    write_final_marker(files["v3"], 3)
    marker = inspect_json(capsys, files["v3"])["final_marker"]
    assert (marker["status"], marker["global_step"]) == ("step-mismatch", 3)


def test_inspect_text_output(capsys: pytest.CaptureFixture[str], files: dict[str, Path]) -> None:
    code, out, _ = run(capsys, "checkpoint", "inspect", files["v1"])
    assert code == 0
    assert "V1 (magic 0xD1705A7E)" in out and "not recorded" in out
    assert "global step   4" in out and "ledger        2 entries" in out


def test_the_ledger_columns_say_they_sum_merged_pushes(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path]
) -> None:
    """Σ c_steps counts a local step once per fragment, and again where windows overlap: a
    column headed "steps" read as the learner's step count (16334 for 4737 steps)."""
    code, out, _ = run(capsys, "checkpoint", "inspect", files["v3"])
    assert code == 0
    lines = out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("ledger")))
    assert "not" in lines[header] and "totals" in lines[header], lines[header]
    columns = lines[header + 1]
    for title in ("learner", "merged PUSHes", "Σ c_steps", "Σ c_tokens"):
        assert title in columns, columns
    assert lines[header + 2].split() == ["0", "4", "96", "12288"]
    code, out, _ = run(capsys, "checkpoint", "inspect", "--help")
    assert "merged PUSH" in " ".join(out.split()) and "c_steps" in out


@pytest.mark.parametrize("cut", [0, 3, 60, 200])
def test_a_corrupt_file_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], cut: int
) -> None:
    bad = files["v3"].with_name("bad.bin")
    bad.write_bytes(files["v3"].read_bytes()[:cut])
    code, out, err = run(capsys, "checkpoint", "inspect", bad)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and str(bad) in err and "CKPT_TRUNCATED" in err


def test_the_yeto_process_exits_2_on_a_foreign_file(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"PK\x03\x04" + bytes(64))
    done = subprocess.run(
        [sys.executable, "-m", "yeto_learn.cli", "checkpoint", "inspect", str(foreign)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("yeto checkpoint inspect: error: CKPT_BAD_MAGIC: prefix:")
    assert str(foreign) in done.stderr


def test_a_closed_stdout_ends_quietly_with_141(files: dict[str, Path]) -> None:
    """`yeto checkpoint inspect … | head -1`: the reader left; no traceback, exit 128 + SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read: the first write fails with EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "yeto_learn.cli", "checkpoint", "inspect", str(files["v3"])],
            cwd=ROOT,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


def with_stdout_closed(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    """``yeto ARGV >&-``: the process starts with no descriptor 1 at all."""
    yeto = [sys.executable, "-m", "yeto_learn.cli", *map(str, argv)]
    return subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", *yeto],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, timeout=60,
    )  # fmt: skip


def test_with_stderr_closed_an_error_line_never_lands_in_the_output(tmp_path: Path) -> None:
    """`yeto checkpoint inspect MISSING --json 2>&-`: Python's None stderr sent the error line
    to stdout, into what a script parses."""
    yeto = [sys.executable, "-m", "yeto_learn.cli", "checkpoint", "inspect"]
    done = subprocess.run(
        ["sh", "-c", 'exec "$@" 2>&- <&-', "sh", *yeto, str(tmp_path / "missing"), "--json"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (2, "")


@pytest.mark.parametrize("extra", [[], ["--json"], ["--help"]], ids=["text", "json", "help"])
def test_a_stdout_closed_from_the_start_is_a_reader_gone(
    files: dict[str, Path], extra: list[str]
) -> None:
    """`yeto checkpoint inspect … >&-` ends as `… | head -0` does: quietly, exit 141."""
    done = with_stdout_closed("checkpoint", "inspect", files["v3"], *extra)
    assert (done.returncode, done.stderr) == (141, "")


def test_an_export_with_stdout_closed_writes_its_file_and_exits_141(
    files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "model.safetensors"
    done = with_stdout_closed(*export_argv(files, out))
    assert (done.returncode, done.stderr) == (141, "")
    assert out.is_file()  # only the line saying so found no reader


def to_a_full_disk(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    """``yeto ARGV > /dev/full``: every write to stdout fails with ENOSPC, as on a full disk."""
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, "-m", "yeto_learn.cli", *map(str, argv)],
            cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip


NO_SPACE = "cannot write the output: No space left on device\n"
needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


@needs_dev_full
@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["text", "json"])
def test_an_inspect_that_cannot_be_written_is_one_line_and_exit_1(
    files: dict[str, Path], extra: list[str]
) -> None:
    """The text fits stdout's buffer (it fails in the last flush), the JSON does not."""
    done = to_a_full_disk("checkpoint", "inspect", files["v3"], *extra)
    assert (done.returncode, done.stderr) == (1, f"yeto checkpoint inspect: {NO_SPACE}")


@needs_dev_full
def test_an_export_whose_message_cannot_be_written_is_one_line_and_exit_1(
    files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "model.safetensors"
    done = to_a_full_disk(*export_argv(files, out))
    written = f" (the export itself was written: {out})\n"
    assert (done.returncode, done.stderr) == (
        1,
        f"yeto checkpoint export: {NO_SPACE.rstrip()}{written}",
    )
    assert out.is_file()  # the export itself was written; only its message was not


@needs_dev_full
def test_help_that_cannot_be_written_is_one_line_and_exit_1() -> None:
    done = to_a_full_disk("checkpoint", "inspect", "--help")
    assert (done.returncode, done.stderr) == (1, f"yeto: {NO_SPACE}")


def test_usage_errors_exit_2_and_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["checkpoint"]) == 2
    assert main(["--help"]) == 0
    assert "checkpoint" in capsys.readouterr().out


def test_ctrl_c_while_yeto_loads_is_one_line(files: dict[str, Path]) -> None:
    """Ctrl+C as ml_dtypes loads: no KeyboardInterrupt traceback, one line, exit 130."""
    argv = command(
        ON_IMPORT, ["ml_dtypes", str(int(signal.SIGINT))], "yeto",
        "checkpoint", "inspect", str(files["v3"]),
    )  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "yeto checkpoint inspect: stopped by SIGINT while starting; nothing was written"
    ]


def test_ctrl_c_while_inspecting_is_one_line(files: dict[str, Path]) -> None:
    hook = ["yeto_learn.checkpoint_cli.describe", str(int(signal.SIGINT))]
    argv = command(AFTER_CALL, hook, "yeto", "checkpoint", "inspect", str(files["v3"]))
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "yeto checkpoint inspect: stopped by SIGINT; nothing was written"
    ]


def test_importing_the_command_does_not_import_torch() -> None:
    code = "import sys, yeto_learn, yeto_learn.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


# -- export --------------------------------------------------------------------------------------
def expected_tensors(path: Path) -> dict[str, np.ndarray[Any, Any]]:
    checkpoint = v3_checkpoint(model_layout())
    first, second = (f.params for f in checkpoint.fragments)
    assert path.exists()
    return {
        "embed.weight": first.reshape(3, 4),
        "head.weight": second[:4].reshape(2, 2),
        "head.bias": second[4:],
    }


def test_export_safetensors_is_bit_exact(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    out = tmp_path / "model.safetensors"
    code, stdout, err = run(capsys, *export_argv(files, out))
    assert code == 0, err
    assert "3 tensors" in stdout
    loaded = load_file(str(out))
    for name, want in expected_tensors(files["v3"]).items():
        assert loaded[name].dtype == np.float32 and loaded[name].shape == want.shape
        assert loaded[name].tobytes() == want.tobytes()
    with safe_open(str(out), "np") as handle:
        metadata = handle.metadata()
    assert metadata["layout_fingerprint"] == model_layout().fingerprint().hex()
    assert (metadata["global_step"], metadata["iso_backend"]) == ("4", "torch-svd")


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_an_export_gets_the_mode_of_any_new_file(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path, name: str
) -> None:
    # safetensors writes a private temporary file: its 0600 made the export unreadable to others
    umask = os.umask(0o022)
    try:
        out = tmp_path / name
        code, _, err = run(capsys, *export_argv(files, out))
        assert code == 0, err
        assert stat.S_IMODE(out.stat().st_mode) == 0o644
    finally:
        os.umask(umask)


def test_export_torch_state_dict_is_bit_exact(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    import torch

    out = tmp_path / "model.pt"
    code, _, err = run(capsys, *export_argv(files, out))
    assert code == 0, err
    state_dict = torch.load(out, weights_only=True)
    expected = expected_tensors(files["v3"])
    assert list(state_dict) == list(expected)
    for name, want in expected.items():
        assert state_dict[name].dtype == torch.float32
        assert state_dict[name].numpy().tobytes() == want.tobytes()
        # Saved with its own bytes only, not the whole fragment buffer it was a view of.
        assert state_dict[name].untyped_storage().nbytes() == want.nbytes


def write_layout(tmp_path: Path, layout: Layout) -> Path:
    path = tmp_path / "other-layout.json"
    path.write_text(layout.to_json())
    return path


def test_export_refuses_before_touching_the_output(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"previous export")
    # Same sizes, tensors named differently: the V3 fingerprint proves it is another layout.
    renamed = write_layout(tmp_path, model_layout(("a", "b", "c")))
    truncated = files["v3"].with_name("cut.bin")
    truncated.write_bytes(files["v3"].read_bytes()[:-10])
    bad_layout = tmp_path / "broken.json"
    bad_layout.write_text("{")
    for checkpoint, layout, code_name in (
        (files["v3"], renamed, "CKPT_LAYOUT_MISMATCH"),
        (truncated, files["layout"], "CKPT_BAD_TRAILER"),
        (files["v3"], bad_layout, "CKPT_BAD_LAYOUT"),
    ):
        code, _, err = run(
            capsys, "checkpoint", "export", checkpoint, "--layout", layout, "--out", out
        )
        assert code == 2 and code_name in err and err.count("\n") == 1
        assert "(file " in err, err  # every error line names its file
    assert out.read_bytes() == b"previous export"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_tensor_named_like_the_safetensors_metadata_key_is_refused_there(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Exit 0 and a file no reader loads (its header held the key twice), over a good one."""
    layout = model_layout(("embed.weight", "__metadata__", "head.bias"))
    checkpoint_path = tmp_path / "ck.bin"
    write_checkpoint(checkpoint_path, v3_checkpoint(layout))
    layout_path = write_layout(tmp_path, layout)
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"previous export")
    code, _, err = run(
        capsys, "checkpoint", "export", checkpoint_path, "--layout", layout_path, "--out", out
    )
    assert code == 2 and "__metadata__" in err and err.count("\n") == 1, err
    assert out.read_bytes() == b"previous export"
    as_torch = tmp_path / "model.pt"
    code, _, err = run(
        capsys, "checkpoint", "export", checkpoint_path, "--layout", layout_path, "--out", as_torch
    )
    assert code == 0, err


def test_an_export_removes_what_an_unfinished_export_to_the_same_file_left(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    """An export killed mid-write (kill -9, out of memory, a SIGBUS from a checkpoint cut short
    in place) left its temporary file, as large as the export, for good."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    out = tmp_path / "model.pt"
    left = tmp_path / f".model.pt.{int(gone.stdout)}.0123456789ab.tmp"
    fresh = tmp_path / f".model.pt.{int(gone.stdout)}.00000000000b.tmp"  # maybe still written
    for path in (left, fresh):
        path.write_bytes(b"partial export")
    os.utime(left, (time.time() - 120, time.time() - 120))
    code, _, err = run(capsys, *export_argv(files, out))
    assert code == 0, err
    assert not left.exists() and fresh.exists() and out.exists()
    assert err == f"yeto checkpoint export: removed {left} (14 bytes), left by an export that " \
        "did not finish\n"  # fmt: skip


def test_legacy_export_needs_the_identity_for_grouped_layouts(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "legacy.safetensors"
    fingerprint = model_layout().fingerprint().hex()
    base = ("checkpoint", "export")
    common = ("--layout", files["layout"], "--out", out)

    code, _, err = run(capsys, *base, files["v2"], *common)
    assert code == 2 and "CKPT_IDENTITY_REQUIRED" in err and not out.exists()
    assert f"(file {files['v2']}, layout {files['layout']})" in err, err
    code, _, err = run(capsys, *base, files["v2"], *common, "--legacy-fingerprint", "00" * 32)
    assert code == 2 and "CKPT_LAYOUT_MISMATCH" in err and not out.exists()
    code, _, err = run(capsys, *base, files["v2"], *common, "--legacy-fingerprint", fingerprint)
    assert code == 0, err

    code, _, err = run(capsys, *base, files["v1"], *common, "--legacy-fingerprint", fingerprint)
    assert code == 2 and "--iso-backend" in err
    code, _, err = run(
        capsys,
        *base,
        files["v1"],
        *common,
        "--legacy-fingerprint",
        fingerprint,
        "--iso-backend",
        "torch-svd",
    )
    assert code == 0, err
    from safetensors.numpy import load_file

    loaded = load_file(str(out))
    for name, want in expected_tensors(files["v1"]).items():
        assert loaded[name].tobytes() == want.tobytes()


def test_legacy_export_of_an_ungrouped_layout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    layout = Layout(
        (
            FragmentSpec(MergeMode.AVG, (TensorSpec("a", (12,)),)),
            FragmentSpec(MergeMode.AVG, (TensorSpec("b", (2, 3)),)),
        )
    )
    v3 = tmp_path / "v3.bin"
    write_checkpoint(v3, v3_checkpoint(model_layout()))
    v2 = tmp_path / "v2.bin"
    v2.write_bytes(as_legacy(v3.read_bytes(), CheckpointFormat.V2, 0))
    out = tmp_path / "out.pt"
    layout_path = write_layout(tmp_path, layout)
    code, _, err = run(capsys, "checkpoint", "export", v2, "--layout", layout_path, "--out", out)
    assert code == 0, err
    # A fingerprint trailer in a legacy file is compared too: here it names another layout.
    v2.write_bytes(as_legacy(v3.read_bytes(), CheckpointFormat.V2, 32))
    code, _, err = run(capsys, "checkpoint", "export", v2, "--layout", layout_path, "--out", out)
    assert code == 2 and "CKPT_LAYOUT_MISMATCH" in err


@pytest.mark.parametrize(
    "extra",
    [("--out", "model.bin"), ("--out", "m.pt", "--legacy-fingerprint", "xyz")],
    ids=["suffix", "fingerprint-hex"],
)
def test_export_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], extra: tuple[str, ...]
) -> None:
    code, _, err = run(
        capsys, "checkpoint", "export", files["v3"], "--layout", files["layout"], *extra
    )
    assert code == 2 and "error:" in err


def test_export_into_a_missing_directory_is_ckpt_io(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "no-such-dir" / "model.safetensors"
    code, _, err = run(capsys, *export_argv(files, out))
    assert code == 2 and "CKPT_IO" in err and str(out) in err and err.count("\n") == 1


@pytest.mark.parametrize("length", [300, 245])
def test_an_export_to_a_name_too_long_is_one_line_before_anything_is_written(
    capsys: pytest.CaptureFixture[str],
    files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    length: int,
) -> None:
    """300 bytes: the checks of --out raised ENAMETOOLONG as a traceback. 245: the name fits,
    its temporary sibling does not, so every write failed after the export was built."""
    out = tmp_path / ("o" * (length - len(".pt")) + ".pt")
    monkeypatch.setattr(checkpoint_cli, "atomic_replace", None)  # never reached
    code, _, err = run(capsys, *export_argv(files, out))
    assert code == 2 and err.count("\n") == 1, err
    assert "CKPT_IO: write: " in err and "too long" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files.values())


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_an_export_onto_a_directory_is_refused_before_anything_is_written(
    capsys: pytest.CaptureFixture[str],
    files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    """It was found only when the rename failed, after the whole export was written and
    synced, and exited 1 as a full disk does: it is bad input, known up front."""
    out = tmp_path / name
    out.mkdir()
    monkeypatch.setattr(checkpoint_cli, "atomic_replace", None)  # never reached
    code, _, err = run(capsys, *export_argv(files, out))
    assert code == 2 and err.count("\n") == 1, err
    assert f"CKPT_IO: write: is a directory (file {out})" in err, err
    assert out.is_dir() and not any(out.iterdir())


def test_a_torch_export_may_end_in_pth(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "model.pth"
    code, _, err = run(capsys, *export_argv(files, out))
    assert code == 0 and out.is_file(), err
    bad = tmp_path / "model.bin"
    code, _, err = run(capsys, *export_argv(files, bad))
    assert code == 2 and "must end in .safetensors, .pt or .pth, not 'model.bin'" in err, err


def test_a_stop_that_torchs_writer_turns_into_its_own_error_is_reported_as_the_stop(
    capsys: pytest.CaptureFixture[str],
    files: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl+C during a .pt export: torch caught the Stopped raised inside its write callback
    and failed with its own error, which came out as a false CKPT_IO line and exit 1."""

    def torch_swallowing_the_stop(exported: object, staging: Path) -> None:
        staging.write_bytes(b"the first bytes")
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises Stopped here
        except Stopped:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos") from None

    monkeypatch.setattr(checkpoint_cli, "_save_torch", torch_swallowing_the_stop)
    out = tmp_path / "model.pt"
    code, _, err = run(capsys, *export_argv(files, out))
    assert (code, err) == (
        128 + signal.SIGTERM,
        f"yeto checkpoint export: stopped by SIGTERM; {out} was not written\n",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "layout.json",
        "v1.bin",
        "v2.bin",
        "v3.bin",
    ]


@pytest.fixture
def state_pt(files: dict[str, Path], tmp_path: Path) -> Path:
    """A V3 checkpoint whose name ends in .pt, as an export's may."""
    checkpoint = tmp_path / "state.pt"
    checkpoint.write_bytes(files["v3"].read_bytes())
    return checkpoint


@pytest.mark.parametrize("named", ["the-same-name", "through-a-symlink"])
def test_an_export_onto_the_checkpoint_it_reads_is_refused(
    capsys: pytest.CaptureFixture[str],
    files: dict[str, Path],
    tmp_path: Path,
    state_pt: Path,
    named: str,
) -> None:
    # A checkpoint named state.pt exported onto itself was replaced by the export, exit 0.
    checkpoint = given = state_pt
    if named == "through-a-symlink":
        given = tmp_path / "link.pt"
        given.symlink_to(checkpoint)
    code, _, err = run(
        capsys, "checkpoint", "export", given, "--layout", files["layout"], "--out", checkpoint
    )
    assert (code, err) == (
        2,
        f"yeto checkpoint export: error: --out {checkpoint} is the checkpoint being exported; "
        "nothing was written\n",
    )
    assert checkpoint.read_bytes() == files["v3"].read_bytes()


@pytest.mark.parametrize("named", ["a-hard-link", "a-symlink"])
def test_an_export_onto_another_name_of_the_checkpoint_leaves_the_checkpoint(
    capsys: pytest.CaptureFixture[str],
    files: dict[str, Path],
    tmp_path: Path,
    state_pt: Path,
    named: str,
) -> None:
    """The rename replaces only that name: the checkpoint's data stays under its own."""
    checkpoint = state_pt
    out = tmp_path / "export.pt"
    if named == "a-hard-link":
        os.link(checkpoint, out)
    else:
        out.symlink_to(checkpoint)
    code, _, _ = run(
        capsys, "checkpoint", "export", checkpoint, "--layout", files["layout"], "--out", out
    )
    assert code == 0 and not out.is_symlink()
    assert checkpoint.read_bytes() == files["v3"].read_bytes()


def _limit_file_size() -> None:
    """In the child: a write past 200 bytes fails with EFBIG, as a full disk fails."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))


@pytest.mark.parametrize("earlier", [False, True], ids=["new", "replacing"])
@pytest.mark.parametrize(
    ("suffix", "save"), [(".pt", "_save_torch"), (".safetensors", "_save_safetensors")]
)
def test_a_signal_once_the_export_is_saved_leaves_no_file_behind(
    files: dict[str, Path], tmp_path: Path, suffix: str, save: str, earlier: bool
) -> None:
    """SIGTERM once the temporary file is whole, before it replaces the output: it killed the
    process and left the temporary file; now the export stops, removes it and says so."""
    out = tmp_path / f"model{suffix}"
    if earlier:
        out.write_bytes(b"an earlier export")
    hook = [f"yeto_learn.checkpoint_cli.{save}", str(int(signal.SIGTERM))]
    argv = command(
        AFTER_CALL, hook, "yeto", "checkpoint", "export", str(files["v3"]),
        "--layout", str(files["layout"]), "--out", str(out),
    )  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    kept = f"{out} was not replaced" if earlier else f"{out} was not written"
    assert done.stderr.splitlines() == [f"yeto checkpoint export: stopped by SIGTERM; {kept}"]
    names = ["v1.bin", "v2.bin", "v3.bin", "layout.json", *([out.name] if earlier else [])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    if earlier:
        assert out.read_bytes() == b"an earlier export"


def test_a_signal_right_after_the_rename_says_the_export_was_written(
    files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "model.safetensors"
    argv = command(
        AFTER_CALL, ["os.replace", str(int(signal.SIGTERM))], "yeto", "checkpoint", "export",
        str(files["v3"]), "--layout", str(files["layout"]), "--out", str(out),
    )  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.splitlines() == [
        f"yeto checkpoint export: stopped by SIGTERM; {out} was written"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["v1.bin", "v2.bin", "v3.bin", "layout.json", out.name]
    )


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_an_export_that_does_not_fit_is_one_line_exit_1_and_no_file(
    files: dict[str, Path], tmp_path: Path, suffix: str
) -> None:
    out = tmp_path / f"model{suffix}"
    done = subprocess.run(
        [sys.executable, "-m", "yeto_learn.cli", "checkpoint", "export", str(files["v3"]),
         "--layout", str(files["layout"]), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, preexec_fn=_limit_file_size,
    )  # fmt: skip
    assert done.returncode == 1  # the input was fine: not 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("yeto checkpoint export: error: CKPT_IO: write: ")
    assert "File too large" in line and line.endswith(f"(file {out})")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["v1.bin", "v2.bin", "v3.bin", "layout.json"]
    )
