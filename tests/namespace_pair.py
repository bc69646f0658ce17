"""A server in the hub namespace of a shaped setup and a peer in learner 0's, each a process.

Shared by the tests that move bytes over ``benchmarks/shaped_link.py``'s veth links.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import pytest
from shaped_link import ShapedLinks, shaped_links_available

SPAWN = multiprocessing.get_context("spawn")


@functools.cache
def _why_no_shaped_links() -> str | None:
    return shaped_links_available()  # makes and removes a namespace pair: asked once, lazily


def skip_without_shaped_links() -> None:
    """Skip the calling test where namespaces cannot be made (not root, no iproute2).

    Asked when a test runs, not when the module is collected: collecting must not touch the
    host's network namespaces.
    """
    why_not = _why_no_shaped_links()
    if why_not is not None:
        pytest.skip(why_not)


def start_pair(
    links: ShapedLinks,
    hub_target: Callable[..., None],
    hub_args: tuple[Any, ...],
    peer_target: Callable[..., None],
) -> tuple[BaseProcess, Connection, BaseProcess, Connection]:
    """``hub_target(hub, *hub_args, pipe)`` first; once it sent its listening port,
    ``peer_target(learner namespace, hub address, port, pipe)``. Returns each process with the
    test's end of its pipe."""
    hub_pipe, hub_end = SPAWN.Pipe()
    hub = SPAWN.Process(target=hub_target, args=(links.hub, *hub_args, hub_end))
    hub.start()
    port = hub_pipe.recv()
    peer_pipe, peer_end = SPAWN.Pipe()
    peer = SPAWN.Process(
        target=peer_target,
        args=(links.learner_namespace(0), links.hub_address(0), port, peer_end),
    )
    peer.start()
    return hub, hub_pipe, peer, peer_pipe
