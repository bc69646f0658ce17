"""A bandwidth-limited link shaped by the kernel: network namespaces, veth pairs and ``tbf``.

The syncer side runs in a *hub* namespace; each learner runs in a namespace of its own joined to
the hub by a veth pair whose two ends each carry a token-bucket qdisc of ``rate``: one link per
learner and direction, as a learner on its own machine behind a 1 Gbit/s NIC sees it. Unlike a
throttle in the benchmark's socket layer, the kernel drains a sender's socket buffer onto the
link while the sender waits for a core, so the link does not go idle because a process was
descheduled for a millisecond: only the program's real work and the wire are measured.

Needs root (``CAP_NET_ADMIN``) and iproute2 (``ip``, ``tc``); :func:`shaped_links_available`
tells. Everything is created under names carrying this process's id and removed on exit (the
namespaces go, and the veth pairs with them).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000
PREFIX = "yetobench"
NETNS_DIR = "/var/run/netns"
#: The bucket lets this many bytes pass at once after an idle moment (about 1 ms at 1 Gbit/s);
#: it must hold one GSO packet (64 KiB) or tbf would split every large packet.
BURST_BYTES = 128 << 10
#: How long a packet may wait in the qdisc before tbf drops it (TCP keeps far less queued).
QUEUE_LATENCY = "50ms"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tc(namespace: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], check=True, capture_output=True)


def shaped_links_available() -> str | None:
    """None when shaped links can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}`"
    try:
        with shaped_links(1, 1e9 / 8):
            pass
    except (OSError, subprocess.CalledProcessError) as exc:
        stderr = getattr(exc, "stderr", "") or ""
        return f"could not create a shaped link: {exc} {stderr}".strip()
    return None


def enter_namespace(name: str | None) -> None:
    """Move the calling thread (of a fresh, single-threaded process) into namespace ``name``.

    Sockets it opens afterwards, and threads it starts, live in that namespace.
    """
    if name is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ShapedLinks:
    """The namespaces of one shaped setup: ``hub`` for the syncer, one per learner."""

    hub: str
    learners: tuple[str, ...]
    rate: float

    def hub_address(self, learner: int) -> str:
        """The hub's address on learner ``learner``'s link (where that learner connects)."""
        return f"10.{200 + learner // 250}.{learner % 250}.1"

    def learner_namespace(self, learner: int) -> str:
        return self.learners[learner]

    def command_in_hub(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside the hub namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.hub, *command]


def _remove_orphans() -> None:
    """Namespaces left by a benchmark that was killed (its process id is gone)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(rf"{PREFIX}(\d+)(hub|l\d+)", name)
        if match and not Path(f"/proc/{match[1]}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextmanager
def shaped_links(count: int, rate: float) -> Iterator[ShapedLinks]:
    """``count`` learner links of ``rate`` bytes per second each way, removed on exit."""
    _remove_orphans()
    tag = f"{PREFIX}{os.getpid()}"
    links = ShapedLinks(f"{tag}hub", tuple(f"{tag}l{i}" for i in range(count)), rate)
    created: list[str] = []
    rate_arg = f"{int(rate * 8)}bit"
    shape = ["root", "tbf", "rate", rate_arg, "burst", str(BURST_BYTES), "latency", QUEUE_LATENCY]
    try:
        for namespace in (links.hub, *links.learners):
            _ip("netns", "add", namespace)
            created.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
        for i, namespace in enumerate(links.learners):
            hub_end, learner_end = f"hub{i}", "uplink"
            _ip("-n", links.hub, "link", "add", hub_end, "type", "veth", "peer", "name",
                learner_end, "netns", namespace)  # fmt: skip
            hub_ip = links.hub_address(i)
            learner_ip = hub_ip.rsplit(".", 1)[0] + ".2"
            _ip("-n", links.hub, "addr", "add", f"{hub_ip}/30", "dev", hub_end)
            _ip("-n", namespace, "addr", "add", f"{learner_ip}/30", "dev", learner_end)
            _ip("-n", links.hub, "link", "set", hub_end, "up")
            _ip("-n", namespace, "link", "set", learner_end, "up")
            _tc(links.hub, "qdisc", "add", "dev", hub_end, *shape)
            _tc(namespace, "qdisc", "add", "dev", learner_end, *shape)
        yield links
    finally:
        for namespace in reversed(created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
