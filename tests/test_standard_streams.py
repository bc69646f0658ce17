"""hold_closed_standard_descriptors, in this process: only a descriptor that is really closed
(EBADF) gets the null device; one that merely fails fstat otherwise is left alone."""

from __future__ import annotations

import errno
import os
import sys

import pytest

from yeto_sync import standard_streams


def test_only_a_closed_descriptor_gets_the_null_device(monkeypatch: pytest.MonkeyPatch) -> None:
    real_fstat = os.fstat
    failures = {0: errno.EIO, 1: errno.EBADF}  # 0: open, fstat failed; 1: closed; 2: fine

    def fstat(fd: int) -> os.stat_result:
        if fd in failures:
            raise OSError(failures[fd], os.strerror(failures[fd]))
        return real_fstat(fd)

    dup2_calls: list[tuple[int, int]] = []
    opened: list[str] = []
    monkeypatch.setattr(os, "fstat", fstat)
    monkeypatch.setattr(os, "dup2", lambda source, target: dup2_calls.append((source, target)))
    real_open = os.open

    def open_(path: str, flags: int, *args: int) -> int:
        opened.append(path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_)
    standard_streams.hold_closed_standard_descriptors()
    assert opened == [os.devnull]
    assert [target for _, target in dup2_calls] == [1]


def test_a_missing_sys_stderr_is_put_on_descriptor_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", None)
    standard_streams.hold_closed_standard_descriptors()
    stream = sys.stderr
    assert stream is not None and stream.fileno() == 2
    assert stream.errors == "backslashreplace" and stream.line_buffering
