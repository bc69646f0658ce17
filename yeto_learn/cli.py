"""The ``yeto`` command: one argparse parser whose subcommands live in their own modules.

A subcommand module offers ``register(commands)``: it adds its parser to ``commands`` and sets
``handler=<function(args) -> int>`` and ``command_prog`` (its name for error lines) as defaults.
Adding ``yeto launch`` or ``yeto bench`` is one more entry in :data:`SUBCOMMANDS`. Modules import
heavy dependencies (torch) inside their handlers, so ``yeto --help`` stays fast.

Exit codes: 0 success; 2 bad input (usage, or a file that failed validation: one line on stderr
naming the file, the section and the reason); 1 when an output cannot be written (a full disk);
141 when the reader of stdout went away.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeAlias

from yeto_proto.errors import ProtocolError

from . import bench_closure, checkpoint_cli, launch
from .process_control import divert_closed_stdout, exit_process

EXIT_OK = 0
EXIT_BAD_INPUT = 2
#: 128 + SIGPIPE, as a shell reports a command killed by a closed pipe.
EXIT_BROKEN_PIPE = 141

#: What a subcommand module's ``register`` receives.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
#: Each registers one top-level subcommand.
SUBCOMMANDS: tuple[Callable[[Commands], None], ...] = (
    checkpoint_cli.register,
    launch.register,
    bench_closure.register,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yeto", description="YETO v4 learners, benchmarks and checkpoint tools."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in SUBCOMMANDS:
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
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # argparse would report them with the top-level usage, not the command's
            chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # argparse exits on --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except ProtocolError as exc:
        # Subcommands set ``command_prog`` (e.g. "yeto checkpoint inspect") for this line.
        prog = getattr(args, "command_prog", parser.prog)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # Whoever read stdout went away (`yeto checkpoint inspect … | head -1`): stop quietly.
        divert_closed_stdout()
        return EXIT_BROKEN_PIPE


def entry() -> NoReturn:
    """The ``yeto`` program (its console script, ``python -m yeto_learn.cli``): run
    :func:`main` and end the process with its status. Tests call :func:`main` in-process."""
    exit_process(main())


if __name__ == "__main__":
    entry()
