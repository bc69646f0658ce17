"""The receive low-water mark: set for in-place reads, back at one byte for everything else."""

from __future__ import annotations

import select
import socket
import sys
from collections.abc import Iterator

import pytest

from yeto_sync.receive_watermark import READ_WATERMARK_CAP, ReceiveWatermark

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="SO_RCVLOWAT semantics of Linux")


class FakeSocket:
    """Records option calls; ``fail`` makes every call raise."""

    def __init__(self, rcvbuf: int = 64 << 20, fail: bool = False) -> None:
        self.rcvbuf = rcvbuf
        self.fail = fail
        self.marks: list[int] = []

    def getsockopt(self, level: int, option: int) -> int:
        assert (level, option) == (socket.SOL_SOCKET, socket.SO_RCVBUF)
        if self.fail:
            raise OSError("not supported")
        return self.rcvbuf

    def setsockopt(self, level: int, option: int, value: int) -> None:
        assert (level, option) == (socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        if self.fail:
            raise OSError("not supported")
        self.marks.append(value)


def watermark(fake: FakeSocket, cap: int = READ_WATERMARK_CAP) -> ReceiveWatermark:
    return ReceiveWatermark(fake, cap)  # type: ignore[arg-type]


def test_an_in_place_read_waits_for_what_it_wants_up_to_the_cap() -> None:
    fake = FakeSocket()
    mark = watermark(fake)
    mark.before_wait(300_000, direct=True)
    mark.before_wait(50 << 20, direct=True)
    mark.before_wait(10, direct=True)  # a payload's last bytes: exactly those
    assert fake.marks == [300_000, READ_WATERMARK_CAP, 10]
    assert mark.mark == 10


def test_headers_and_small_frames_wait_for_one_byte() -> None:
    fake = FakeSocket()
    mark = watermark(fake)
    mark.before_wait(4 << 20, direct=False)  # the shared buffer: nothing is certain to come
    assert fake.marks == []  # already one byte
    mark.before_wait(4 << 20, direct=True)
    mark.before_wait(4 << 20, direct=False)
    assert fake.marks == [READ_WATERMARK_CAP, 1]


def test_the_mark_is_set_only_when_it_changes() -> None:
    fake = FakeSocket()
    mark = watermark(fake)
    for _ in range(5):
        mark.before_wait(8 << 20, direct=True)
    assert fake.marks == [READ_WATERMARK_CAP]


def test_the_mark_stays_within_a_quarter_of_the_receive_buffer() -> None:
    # A larger mark would make Linux grow the buffer and clamp the window to the mark.
    fake = FakeSocket(rcvbuf=400_000)
    mark = watermark(fake)
    mark.before_wait(8 << 20, direct=True)
    assert fake.marks == [100_000]


def test_a_cap_of_one_byte_leaves_the_socket_alone() -> None:
    fake = FakeSocket()
    mark = watermark(fake, cap=1)
    mark.before_wait(8 << 20, direct=True)
    assert fake.marks == [] and mark.mark == 1


def test_a_platform_that_refuses_the_option_reads_as_before() -> None:
    fake = FakeSocket(fail=True)
    mark = watermark(fake)
    mark.before_wait(8 << 20, direct=True)
    fake.fail = False
    mark.before_wait(4 << 20, direct=True)  # given up: no more calls
    assert fake.marks == [] and mark.mark == 1


def test_a_refusal_after_a_mark_was_set_puts_it_back_to_one_byte() -> None:
    fake = FakeSocket()
    mark = watermark(fake)
    mark.before_wait(8 << 20, direct=True)

    def refuse_once(level: int, option: int) -> int:
        raise OSError("gone")

    fake.getsockopt = refuse_once  # type: ignore[method-assign]
    mark.before_wait(500_000, direct=True)
    assert fake.marks == [READ_WATERMARK_CAP, 1] and mark.mark == 1


@pytest.fixture
def waiting_pair() -> Iterator[tuple[socket.socket, socket.socket, ReceiveWatermark]]:
    """A loopback connection whose receiver waits inside a payload: 50,000 bytes still due."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    with sender, receiver:
        receiver.setblocking(False)
        mark = ReceiveWatermark(receiver, cap=20_000)
        mark.before_wait(50_000, direct=True)
        yield sender, receiver, mark


def _readable(sock: socket.socket, timeout: float = 0.2) -> bool:
    return bool(select.select([sock], [], [], timeout)[0])


@linux_only
def test_a_real_socket_reports_readable_at_the_mark(
    waiting_pair: tuple[socket.socket, socket.socket, ReceiveWatermark],
) -> None:
    sender, receiver, mark = waiting_pair
    assert receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == mark.mark
    assert 1 < mark.mark <= 20_000
    sender.sendall(bytes(mark.mark - 1))
    assert not _readable(receiver)
    sender.sendall(b"x")
    assert _readable(receiver)
    mark.before_wait(100, direct=False)
    assert receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


@linux_only
def test_a_real_socket_reports_eof_below_the_mark(
    waiting_pair: tuple[socket.socket, socket.socket, ReceiveWatermark],
) -> None:
    # A peer that stops inside a payload and closes is noticed, not waited for.
    sender, receiver, _ = waiting_pair
    sender.sendall(b"partial")
    assert not _readable(receiver)
    sender.shutdown(socket.SHUT_WR)
    assert _readable(receiver, timeout=5)
    assert receiver.recv(100) == b"partial"
    assert receiver.recv(100) == b""
