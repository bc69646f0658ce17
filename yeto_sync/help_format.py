"""The ``--help`` layout shared by ``yeto-sync`` and the ``yeto`` commands."""

from __future__ import annotations

import argparse
import textwrap


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: …)`` after an option's help, unless it has none (``None``), is required, or
    its help already says what the default is; lines are wrapped at spaces only."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.required or "default" in text:
            return action.help
        return super()._get_help_string(action)

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Never inside ./yeto-launch-TIME or --sync-interval, as argparse's wrapping would.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)
