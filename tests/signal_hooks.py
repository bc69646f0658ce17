"""Programs that get a stop signal at one chosen moment, for the tests of Ctrl+C and SIGTERM.

Test modules import this helper (it is not a conftest). :func:`command` is the argv of a
``python -c`` process that puts a hook in place and then runs a console entry point, ``yeto``
(``yeto_learn.cli:entry``) or ``yeto-sync`` (``yeto_sync.cli:main``), on the given arguments.
The hook sends the signal from inside the process at its moment, so the moment is the same on
every run however loaded the machine, where a test that sends it after a sleep would hit a
different point each time:

* :data:`ON_IMPORT` — as a module starts to load (``numpy``: the console entry points must
  handle the stop signals before anything heavy is imported);
* :data:`ON_FORK` — from an ``os.fork`` hook of the n-th fork: ``before`` or ``after_in_parent``
  in the program itself, ``after_in_child`` in the child that fork made, before it runs its
  own program (where a handler that raises has its exception swallowed);
* :data:`AFTER_CALL` — right after a function of a yeto module returns.
"""

from __future__ import annotations

import sys
from pathlib import Path

ON_IMPORT = """
import importlib.abc, os, signal, sys

module, signum = sys.argv[1], int(sys.argv[2])


class SignalOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signum)
        return None


sys.meta_path.insert(0, SignalOnImport())
"""

ON_FORK = """
import os, signal, sys

where, nth, signum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
forks = 0


def before():
    global forks
    forks += 1
    if where == "before" and forks == nth:
        os.kill(os.getpid(), signum)


def after():
    if forks == nth:
        os.kill(os.getpid(), signum)


os.register_at_fork(before=before)
if where != "before":
    os.register_at_fork(**{where: after})
"""

AFTER_CALL = """
import importlib, os, signal, sys

target, signum = sys.argv[1], int(sys.argv[2])
module_name, name = target.rsplit(".", 1)
module = importlib.import_module(module_name)
real = getattr(module, name)


def signalled(*args, **kwargs):
    result = real(*args, **kwargs)
    os.kill(os.getpid(), signum)
    return result


setattr(module, name, signalled)
"""

_RUN = """
program, *arguments = sys.argv[sys.argv.index("--") + 1 :]
sys.argv = [program, *arguments]
if program == "yeto-sync":
    from yeto_sync.cli import main

    sys.exit(main())
from yeto_learn.cli import entry

entry()
"""


def command(hook: str, hook_args: list[str], program: str, *arguments: str) -> list[str]:
    """``program`` (``yeto`` or ``yeto-sync``) with ``arguments``, ``hook`` in place first."""
    return [sys.executable, "-c", hook + _RUN, *hook_args, "--", program, *arguments]


def processes_naming(path: Path) -> list[int]:
    """Live processes whose command line mentions ``path`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(path).encode() in cmdline:
            found.append(int(entry.name))
    return found


def processes_with_environment(entry: str) -> list[int]:
    """Live processes whose environment holds ``entry`` (``NAME=value``; Linux /proc): the
    descendants of a process started with it, even once reparented."""
    found = []
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        try:
            environment = (process / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if entry.encode() in environment:
            found.append(int(process.name))
    return found
