"""What the package's command-line tools (python -m arfuse.bench, torchrun -m arfuse.check)
share: the --help formatter."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with "(default: X)" after an option's help where it says something: not
    for an option without a default (None), not for a flag (store_true / store_false: the flag is
    the non-default), and not where the help text already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (text is argparse.SUPPRESS or "default" in text or not action.option_strings
                or action.nargs == 0 or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"
