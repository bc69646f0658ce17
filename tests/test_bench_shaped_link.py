"""The round benchmark's kernel-shaped link: a learner namespace, a hub, a rate both ways.

``benchmarks/shaped_link.py`` builds what ``bench_round.py --link kernel`` measures on; the
shaper sets a floor under a transfer's time (it never lets bytes through faster), so these checks
hold however busy the host is. Skipped where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from namespace_pair import skip_without_shaped_links, start_pair  # noqa: E402
from shaped_link import enter_namespace, shaped_links  # noqa: E402


@pytest.fixture(autouse=True)
def _needs_shaped_links() -> None:
    skip_without_shaped_links()


RATE = 100e6 / 8  # 100 Mbit/s: 2 MB take at least 0.16 s
PAYLOAD = 2_000_000


def _sender(namespace: str, host: str, port: int, pipe: Connection) -> None:
    enter_namespace(namespace)
    with socket.create_connection((host, port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(bytes(PAYLOAD))
        sock.recv(1)  # the hub has it all
        pipe.send(time.monotonic() - started)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def test_a_learner_reaches_the_hub_at_the_shaped_rate_and_everything_goes_on_exit() -> None:
    with shaped_links(1, RATE) as links:
        assert {links.hub, *links.learners} <= _namespaces()
        # The hub's side runs in a spawned process too: only a thread that enters the
        # namespace sees its addresses.
        receiver, results, sender, parent = start_pair(links, _hub_receiver, (), _sender)
        assert parent.poll(30), "no transfer over the shaped link"
        seconds = parent.recv()
        received = results.recv()
        sender.join(10)
        receiver.join(10)
    assert received == PAYLOAD
    # Shaped, not loopback: loopback moves 2 MB in about a millisecond.
    assert seconds >= 0.8 * PAYLOAD / RATE
    assert not {links.hub, *links.learners} & _namespaces()


def _hub_receiver(hub: str, pipe: Connection) -> None:
    enter_namespace(hub)
    with socket.create_server(("0.0.0.0", 0)) as server:
        pipe.send(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            got = 0
            while got < PAYLOAD and (chunk := conn.recv(1 << 16)):
                got += len(chunk)
            conn.sendall(b"k")
    pipe.send(got)


def test_entering_a_missing_namespace_is_an_error() -> None:
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    process = spawn.Process(target=_try_enter, args=("yeto-no-such-namespace", child))
    process.start()
    assert parent.poll(30)
    assert parent.recv() == "FileNotFoundError"
    process.join(10)


def _try_enter(name: str, pipe: Connection) -> None:
    try:
        enter_namespace(name)
        pipe.send("entered")
    except OSError as exc:
        pipe.send(type(exc).__name__)
