"""The help every ``lmcache-p2p`` command prints: its description as written, each option's default shown."""

from __future__ import annotations

import argparse
import copy


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks; an option's help ends with ``(default: X)`` unless it says its
    default itself, or has none worth saying (None, False: a flag off; an empty list)."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):  # an option without help still shows its default
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or not _shows_default(action):
            return text
        return f"{text} (default: %(default)s)"


def _shows_default(action: argparse.Action) -> bool:
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS:  # `is`: 0 == False
        return False
    return bool(action.option_strings) and default != [] and default != ""
