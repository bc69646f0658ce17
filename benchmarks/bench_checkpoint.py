"""Checkpoint write/read speed and peak memory against a plain sequential write/read.

    python benchmarks/bench_checkpoint.py [--numel 268435456] [--fragments 8] [--repeats 3]

The default is 256M parameters: 1 GiB of params plus 1 GiB of momentum. Every measurement runs
in a fresh subprocess so each peak RSS (``resource.getrusage(...).ru_maxrss``) is its own:

- write: ``write_checkpoint`` (temp file, write, fsync, rename, fsync the directory) against
  writing the same arrays to a file and fsyncing it;
- read, page cache warm (the file read once beforehand through a small buffer):
  ``read_checkpoint`` (full validation, arrays into numpy) against ``readinto`` of the plain file
  into fresh arrays of the same sizes;
- read, cold: the same after ``posix_fadvise(DONTNEED)`` has dropped the file from the cache.

Times are medians over the repeats (the order of plain and checkpoint alternates), peaks the
maximum. Targets: checkpoint speed ≥ 0.7× plain,
peak RSS ≤ 1.2× the checkpoint file. Files go to a temporary directory that is removed after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from yeto_proto.checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointFormat,
    FragmentState,
    LedgerEntry,
    TrailerKind,
    read_checkpoint,
    write_checkpoint,
)
from yeto_proto.constants import IsoBackend  # noqa: E402

SPEED_TARGET = 0.7
RSS_TARGET = 1.2


# -- children: one measurement each -----------------------------------------------------------
def _fragment_sizes(numel: int, fragments: int) -> list[int]:
    return [numel // fragments + (1 if i < numel % fragments else 0) for i in range(fragments)]


def _state(numel: int, fragments: int) -> Checkpoint:
    rng = np.random.default_rng(0)
    states = []
    for index, size in enumerate(_fragment_sizes(numel, fragments)):
        params = np.empty(size, dtype=np.float32)
        momentum = np.empty(size, dtype=np.float32)
        rng.random(dtype=np.float32, out=params)
        rng.random(dtype=np.float32, out=momentum)
        states.append(FragmentState(index + 1, params, momentum))
    return Checkpoint(
        format=CheckpointFormat.V3,
        iso_backend=IsoBackend.SCALAR,
        fingerprint=bytes(32),
        global_step=fragments,
        fragments=tuple(states),
        ledger=(LedgerEntry(0, fragments, 24 * fragments, 1 << 20),),
        contract=bytes(range(32)),
        trailer=TrailerKind.FINGERPRINT_AND_CONTRACT,
    )


def _write_plain(path: Path, checkpoint: Checkpoint) -> None:
    with open(path, "wb") as file:
        for fragment in checkpoint.fragments:
            file.write(fragment.params.view(np.uint8).data)
            file.write(fragment.momentum.view(np.uint8).data)
        file.flush()
        os.fsync(file.fileno())


def _read_plain(path: Path, sizes: list[int]) -> list[np.ndarray[Any, Any]]:
    """Read the plain file into fresh arrays of the checkpoint's sizes (same allocations)."""
    arrays = []
    with open(path, "rb") as file:
        for size in sizes:
            for _ in ("params", "momentum"):
                array = np.empty(size, dtype=np.float32)
                arrays.append(array)
                view = array.view(np.uint8).data
                filled = 0
                while filled < array.nbytes:
                    got = file.readinto(view[filled:])
                    if not got:
                        raise RuntimeError("short read")
                    filled += got
    return arrays


def _prime_cache(path: Path) -> None:
    """Read the file once through a small reused buffer (the cache fills, RSS does not)."""
    chunk = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as file:
        while file.readinto(chunk):
            pass


def _drop_from_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def child(task: str, path: Path, numel: int, fragments: int) -> dict[str, Any]:
    if task.startswith("write"):
        checkpoint = _state(numel, fragments)
        start = time.perf_counter()
        if task == "write-plain":
            _write_plain(path, checkpoint)
        else:
            write_checkpoint(path, checkpoint)
        seconds = time.perf_counter() - start
    else:
        if task.endswith("cold"):
            _drop_from_cache(path)
        else:
            _prime_cache(path)
        start = time.perf_counter()
        if task.startswith("read-plain"):
            arrays = _read_plain(path, _fragment_sizes(numel, fragments))
            assert len(arrays) == 2 * fragments
        else:
            loaded = read_checkpoint(path)
            assert loaded.num_fragments == fragments
        seconds = time.perf_counter() - start
    # ru_maxrss is KiB on Linux.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_rss": peak}


# -- parent: schedule, collect, print ---------------------------------------------------------
def _run_child(task: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--child",
        task,
        "--path",
        str(path),
        "--numel",
        str(args.numel),
        "--fragments",
        str(args.fragments),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--fragments", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=None, help="where the temp dir goes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path, args.numel, args.fragments)))
        return

    workdir = Path(tempfile.mkdtemp(prefix="yeto-bench-ckpt-", dir=args.dir))
    plain, ckpt = workdir / "plain.bin", workdir / "checkpoint.bin"
    rows = [
        ("write (fsync)", "write-plain", "write-ckpt"),
        ("read, page cache warm", "read-plain", "read-ckpt"),
        ("read, cold", "read-plain-cold", "read-ckpt-cold"),
    ]
    samples: dict[str, list[dict[str, Any]]] = {task: [] for _, a, b in rows for task in (a, b)}
    try:
        for repeat in range(args.repeats):
            for _, plain_task, ckpt_task in rows:
                # Alternate which goes first, so neither always meets a cold start of the VM's
                # page allocation or the other's writeback.
                order = [(plain_task, plain), (ckpt_task, ckpt)]
                for task, path in order if repeat % 2 == 0 else order[::-1]:
                    samples[task].append(_run_child(task, path, args))
        size = ckpt.stat().st_size
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def median(task: str) -> float:
        return float(statistics.median(s["seconds"] for s in samples[task]))

    def peak(task: str) -> int:
        return int(max(s["peak_rss"] for s in samples[task]))

    gib = 1 << 30
    print(
        f"checkpoint: {args.numel} parameters in {args.fragments} fragments, "
        f"{size / gib:.3f} GiB file; median of {args.repeats}, each in its own process\n"
    )
    print(
        "| operation | plain s | checkpoint s | plain GiB/s | checkpoint GiB/s | speed ratio "
        "(≥ 0.7) | checkpoint peak RSS / file (≤ 1.2) | plain peak RSS / file |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    failures = []
    for label, plain_task, ckpt_task in rows:
        plain_s, ckpt_s = median(plain_task), median(ckpt_task)
        ratio = plain_s / ckpt_s
        rss_ratio = peak(ckpt_task) / size
        ok = ratio >= SPEED_TARGET and rss_ratio <= RSS_TARGET
        if not ok:
            failures.append(label)
        print(
            f"| {label} | {plain_s:.3f} | {ckpt_s:.3f} | {size / gib / plain_s:.2f} | "
            f"{size / gib / ckpt_s:.2f} | {ratio:.2f}× {'✓' if ratio >= SPEED_TARGET else '✗'} | "
            f"{rss_ratio:.3f} {'✓' if rss_ratio <= RSS_TARGET else '✗'} | "
            f"{peak(plain_task) / size:.3f} |"
        )
    print("\nall targets met" if not failures else f"\ntargets missed: {', '.join(failures)}")


if __name__ == "__main__":
    main()
