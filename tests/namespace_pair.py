"""A server in the hub namespace of a shaped setup and a peer in learner 0's, each a process.

Shared by the tests that move bytes over ``benchmarks/shaped_link.py``'s veth links.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from shaped_link import ShapedLinks

SPAWN = multiprocessing.get_context("spawn")


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
