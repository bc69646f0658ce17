"""The ``yeto`` command: one argparse parser whose subcommands live in their own modules.

A subcommand module offers ``register(commands)``: it adds its parser to ``commands`` and sets
``handler=<function(args) -> int>`` and ``command_prog`` (its name for error lines) as defaults.
Adding ``yeto launch`` or ``yeto bench`` is one more entry in :func:`subcommands`. Modules import
heavy dependencies (torch) inside their handlers, so ``yeto --help`` stays fast.

This module imports next to nothing as it loads (the rest is imported where it is used):
:func:`entry` handles the stop signals before the subcommand modules (numpy, ml_dtypes) load,
so Ctrl+C or SIGTERM at any moment ends the command with its last line, never a traceback or a
silent death.

Exit codes: 0 success; 2 bad input (usage, or a file that failed validation: one line on stderr
naming the file, the section and the reason); 1 when an output cannot be written (a full disk),
stdout included (``yeto checkpoint inspect: cannot write the output: No space left on device``);
141 when the reader of stdout went away (or stdout was closed from the start); 128 + n after
signal n (SIGINT, SIGTERM, SIGHUP).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn, TypeAlias, cast

from yeto_sync.standard_streams import hold_closed_standard_descriptors
from yeto_sync.stop_signals import Stopped, StopSignals, ignore_stop_signals, installed

from .output import OutputFailed, flush_stdout, stand_in_for_closed_stdout, stdout_writes

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

EXIT_OK = 0
#: stdout (or another output) could not be written.
EXIT_OUTPUT_FAILED = 1
EXIT_BAD_INPUT = 2
#: 128 + SIGPIPE, as a shell reports a command killed by a closed pipe.
EXIT_BROKEN_PIPE = 141

#: What a subcommand module's ``register`` receives.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def subcommands() -> tuple[Callable[[Commands], None], ...]:
    """Each registers one top-level subcommand (imported here, not as this module loads)."""
    from . import bench_closure, checkpoint_cli, launch

    return (checkpoint_cli.register, launch.register, bench_closure.register)


class _Parser(argparse.ArgumentParser):
    """argparse, except that a help text or usage line that cannot be written raises (argparse
    drops the OSError: ``yeto --help > /dev/full`` would print nothing and exit 0)."""

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        if message:
            (file or sys.stderr).write(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="yeto", description="YETO v4 learners, benchmarks and checkpoint tools.")
    # Every subcommand's parser (and theirs) is a _Parser too: argparse makes them of its type.
    commands = cast(
        "Commands", parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    )
    for register in subcommands():
        register(commands)
    return parser


def chosen_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The (sub)command's own parser that ``args`` came from: ``yeto checkpoint inspect``'s."""
    while True:
        commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, commands[0].dest, None) if commands else None
        if name is None or name not in commands[0].choices:
            return parser
        parser = commands[0].choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``yeto`` command; its exit status.

    Under :func:`entry`, a stop signal that arrived while ``yeto`` started (imports, the command
    line) ends it here, before the command does anything.
    """
    parser = build_parser()
    prog = parser.prog
    try:
        try:
            with stdout_writes():  # --help
                args, unknown = parser.parse_known_args(argv)
                if unknown:  # argparse would report them with the top-level usage
                    chosen_parser(parser, args).error(
                        f"unrecognized arguments: {' '.join(unknown)}"
                    )
        except SystemExit as exc:  # argparse exits on --help (0) and usage errors (2)
            code = exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
        else:
            # Subcommands set ``command_prog`` (e.g. "yeto checkpoint inspect") for their lines.
            prog = getattr(args, "command_prog", prog)
            code = _handle(args, prog)
        flush_stdout()
        return code
    except BrokenPipeError:
        # Whoever read stdout went away (`yeto checkpoint inspect … | head -1`): stop quietly.
        _give_up_stdout()
        return EXIT_BROKEN_PIPE
    except OutputFailed as exc:
        print(f"{prog}: cannot write the output: {exc.reason}", file=sys.stderr)
        _give_up_stdout()
        return EXIT_OUTPUT_FAILED


def _handle(args: argparse.Namespace, prog: str) -> int:
    stops = installed()
    if stops is not None:
        stops.command = prog  # for the "still stopping" note of a second signal
        try:
            stops.check()
        except Stopped as stop:
            print(f"{prog}: stopped by {stop} while starting; nothing was written", file=sys.stderr)
            return 128 + stop.signum
    from yeto_proto.errors import ProtocolError  # loaded already, by the subcommand modules

    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except Stopped as stop:  # each command says what it kept; this is for one that does not
        print(f"{prog}: stopped by {stop}", file=sys.stderr)
        return 128 + stop.signum
    except ProtocolError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _give_up_stdout() -> None:
    """stdout failed: point it at the null device, so that what it still buffers does not fail
    again (with a traceback) in the interpreter's last flush. In-process (tests), stdout may
    have no file descriptor: nothing to do then."""
    from .process_control import divert_closed_stdout

    with contextlib.suppress(OSError, ValueError):
        divert_closed_stdout()


def entry() -> NoReturn:
    """The ``yeto`` program (its console script, ``python -m yeto_learn.cli``): run
    :func:`main` and end the process with its status. Tests call :func:`main` in-process.

    The stop signals are handled from the first moment, before anything heavy is imported: a
    signal while ``yeto`` starts is recorded and ends it once :func:`main` can say so. Once the
    command returned, later signals are ignored: its last line is out, the process only exits.
    """
    stops = StopSignals("yeto").install()
    stand_in_for_closed_stdout()
    hold_closed_standard_descriptors()  # stdin and stderr; stdout has its stand-in
    from .process_control import exit_process

    try:
        code = main()
    except Stopped as stop:  # raised where no command could say what it kept
        stops.stopping = True  # a plain store: no handler runs before it
        print(f"yeto: stopped by {stop}", file=sys.stderr)
        code = 128 + stop.signum
    stops.raising = False
    ignore_stop_signals(stops.signals)
    exit_process(code)


if __name__ == "__main__":
    entry()
