"""A connection whose peer falls silent (no FIN, no RST: a cut link) fails in bounded time.

``yeto_sync.socket_liveness.bound_silence`` is set on every socket of the syncer and the
learner. The silence tests cut a real link: two network namespaces joined by a veth pair (as
the round benchmark builds them), whose far end is set down; they are skipped where namespaces
cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from yeto_sync.socket_liveness import bound_silence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from namespace_pair import skip_without_shaped_links, start_pair  # noqa: E402
from shaped_link import enter_namespace, shaped_links  # noqa: E402


@pytest.fixture
def namespaces() -> None:
    skip_without_shaped_links()


SILENCE_S = 2.0


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux TCP options")
def test_the_options_bound_unacknowledged_data_and_idle_silence() -> None:
    with socket.socket() as sock:
        bound_silence(sock, 60.0)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 60_000
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 15
    with socket.socket() as sock:
        bound_silence(sock, float("inf"))  # no bound asked for: nothing set, nothing raised
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0


def _hub(namespace: str, bounded: bool, send_first: bool, pipe: Connection) -> None:
    """Accept one peer, wait for the cut, then report how the socket ended and when."""
    enter_namespace(namespace)
    with socket.create_server(("0.0.0.0", 0)) as server:
        pipe.send(server.getsockname()[1])
        conn, _ = server.accept()
    with conn:
        if bounded:
            bound_silence(conn, SILENCE_S)
        pipe.recv()  # the link is cut
        started = time.monotonic()
        conn.settimeout(3 * SILENCE_S + 2)
        try:
            if send_first:
                conn.sendall(b"x" * 1000)  # lands in the send buffer, never acknowledged
            conn.recv(1)
            outcome = "data"
        except OSError as exc:  # a socket timeout is a TimeoutError without an errno
            outcome = errno.errorcode[exc.errno] if exc.errno else "nothing noticed"
        pipe.send((outcome, time.monotonic() - started))


def _peer(namespace: str, host: str, port: int, pipe: Connection) -> None:
    enter_namespace(namespace)
    with socket.create_connection((host, port), timeout=10):
        pipe.send("connected")
        pipe.recv()  # hold the connection open until the test ends


def _cut_and_watch(bounded: bool, send_first: bool) -> tuple[str, float]:
    with shaped_links(1, 1e9) as links:
        hub, hub_pipe, peer, peer_pipe = start_pair(links, _hub, (bounded, send_first), _peer)
        try:
            assert peer_pipe.poll(15) and peer_pipe.recv() == "connected"
            # The far end goes down: the hub's packets vanish, nothing comes back.
            subprocess.run(
                ["ip", "-n", links.learner_namespace(0), "link", "set", "uplink", "down"],
                check=True,
            )
            hub_pipe.send("cut")
            assert hub_pipe.poll(30), "the hub never reported"
            outcome: tuple[str, float] = hub_pipe.recv()
        finally:
            peer_pipe.send("done")
            for process in (hub, peer):
                process.join(10)
                if process.is_alive():
                    process.kill()
    return outcome


@pytest.mark.usefixtures("namespaces")
@pytest.mark.parametrize("send_first", [True, False], ids=["unacknowledged data", "idle"])
def test_a_silent_peer_fails_the_connection_within_the_bound(send_first: bool) -> None:
    outcome, seconds = _cut_and_watch(bounded=True, send_first=send_first)
    assert outcome == "ETIMEDOUT", outcome
    assert seconds <= 3 * SILENCE_S + 1


@pytest.mark.usefixtures("namespaces")
def test_without_the_bound_a_silent_peer_goes_unnoticed() -> None:
    outcome, _ = _cut_and_watch(bounded=False, send_first=True)
    assert outcome == "nothing noticed"
