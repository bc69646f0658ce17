"""Run ``python -m yeto_sync`` as a subprocess on 127.0.0.1 with ``--port 0``, for daemon tests.

The daemon's stdout must carry exactly one ready line; stderr is collected by a thread (so the
pipe never fills) and kept for assertions.
"""

from __future__ import annotations

import os
import re
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
READY = re.compile(r"^yeto-sync listening on (127\.0\.0\.1):(\d+)\n$")
#: The code at the start of an ERROR text (after a pinned prefix, if any).
ERROR_CODE = re.compile(
    r"^(?:invalid first frame: |HELLO authentication failed: )?([A-Z][A-Z0-9_]+)(?::|$)"
)


def error_code(text: str) -> str:
    match = ERROR_CODE.match(text)
    assert match, f"ERROR text without a code: {text!r}"
    return match.group(1)


class Daemon:
    """One ``yeto-sync`` process; use as a context manager (it is killed on the way out)."""

    def __init__(
        self,
        *flags: str,
        env: dict[str, str] | None = None,
        nofile: int | None = None,
        fsize: int | None = None,
        nohup: bool = False,
    ) -> None:
        """``nofile``: the daemon's RLIMIT_NOFILE (soft and hard), if given. ``fsize``: its
        RLIMIT_FSIZE, with SIGXFSZ ignored, so a write past that many bytes fails with EFBIG
        the way a full disk fails with ENOSPC. ``nohup``: started ignoring SIGHUP, as by
        ``nohup``."""
        self.flags = ["--host", "127.0.0.1", "--port", "0", *flags]
        self.env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.nofile = nofile
        self.fsize = fsize
        self.nohup = nohup
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self._stderr: list[str] = []
        self._reader: threading.Thread | None = None

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self._reader is not None:
            self._reader.join(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def start(self, timeout: float = 30.0) -> None:
        if self.proc is not None:
            # A second start would lose the first process, which nothing would then stop.
            raise RuntimeError("this Daemon was started already (entering `with` starts it)")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "yeto_sync", *self.flags],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=self._limit,
        )
        assert self.proc.stderr is not None and self.proc.stdout is not None
        stderr = self.proc.stderr
        self._reader = threading.Thread(target=self._collect, args=(stderr,), daemon=True)
        self._reader.start()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no ready line within {timeout} s; stderr:\n{self.stderr}"
        line = self.proc.stdout.readline()
        match = READY.match(line)
        assert match, f"bad ready line {line!r}; stderr:\n{self.stderr}"
        self.port = int(match.group(2))

    def _limit(self) -> None:
        # Ignored or not as asked, whatever the tests run under (an ignored signal stays
        # ignored across exec, and yeto-sync leaves an ignored SIGHUP alone).
        signal.signal(signal.SIGHUP, signal.SIG_IGN if self.nohup else signal.SIG_DFL)
        if self.nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))
        if self.fsize is not None:
            limit_file_size(self.fsize)

    def _collect(self, stream: IO[str]) -> None:
        for line in stream:
            self._stderr.append(line)

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(10)
        return code

    def signal(self, signum: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def rest_of_stdout(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        return self.proc.stdout.read()

    def rss_kib(self) -> int:
        """VmRSS of the daemon from /proc/<pid>/status."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS line")


def limit_file_size(size: int) -> None:
    """In a child before exec: writes past ``size`` bytes of any file fail with EFBIG."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
