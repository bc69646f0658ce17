"""A real ``yeto-sync`` subprocess on 127.0.0.1 for end-to-end learner tests.

Test modules import this helper (it is not a conftest): ``with running_syncer(tmp_path, …) as
syncer`` yields its address and output paths and always stops the process afterwards.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LISTENING = "yeto-sync listening on "


def child_env() -> dict[str, str]:
    """The environment for child processes: this checkout first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class SyncerProcess:
    address: str
    checkpoint: Path
    tape: Path
    log: Path
    process: subprocess.Popen[str]

    def wait(self, timeout: float = 30.0) -> int:
        return self.process.wait(timeout)

    def log_tail(self, lines: int = 5) -> str:
        return "\n".join(self.log.read_text(encoding="utf-8").splitlines()[-lines:])


@contextlib.contextmanager
def running_syncer(
    directory: Path,
    *,
    learners: int,
    total_steps: int,
    extra: Sequence[str] = (),
    start_timeout: float = 30.0,
) -> Iterator[SyncerProcess]:
    """Start ``python -m yeto_sync`` with a checkpoint, final marker and event tape."""
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint = directory / "checkpoint.yeto"
    tape = directory / "events.jsonl"
    log = directory / "syncer.log"
    argv = [
        sys.executable, "-m", "yeto_sync",
        "--host", "127.0.0.1",
        "--port", "0",
        "--learners", str(learners),
        "--total-steps", str(total_steps),
        "--checkpoint-path", str(checkpoint),
        "--mark-final-checkpoint",
        "--event-tape", str(tape),
        "--quorum-timeout-s", "60",
        "--final-ack-timeout-s", "60",
        *extra,
    ]  # fmt: skip
    with open(log, "w", encoding="utf-8") as stderr:
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO, env=child_env()
        )
    try:
        first: queue.SimpleQueue[str] = queue.SimpleQueue()
        assert process.stdout is not None
        stdout = process.stdout
        threading.Thread(target=lambda: first.put(stdout.readline()), daemon=True).start()
        line = first.get(timeout=start_timeout)
        assert line.startswith(LISTENING), f"yeto-sync did not start: {line!r}"
        address = line.strip().removeprefix(LISTENING)
        yield SyncerProcess(address, checkpoint, tape, log, process)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
