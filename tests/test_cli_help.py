"""--help of the package's command-line tools: every option explained, each default said once,
and no "(default: None)" or "(default: True)" on an option that has no default or is a flag."""

import argparse
import re

import pytest

from arfuse.bench import cli as bench
from arfuse.bench import ladder
from arfuse.check import cli as dist_check


@pytest.mark.parametrize("build, options", [(bench.build_parser, 10),
                                            (dist_check.build_parser, 10),
                                            (ladder.build_parser, 7)],
                         ids=["bench", "check", "ladder"])
def test_help_texts(build, options):
    parser = build()
    text = parser.format_help()
    for bad in ("(default: None)", "(default: True)", "(default: False)", "(default: ==SUPPRESS==)"):
        assert bad not in text
    formatter = parser._get_formatter()  # argparse's own expansion of one option's help
    checked = 0
    for action in parser._actions:
        if action.help is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings)
        assert action.help, f"{name}: no help text"
        expanded = formatter._expand_help(action)
        assert len(re.findall(r"\bdefault\b", expanded)) <= 1, f"{name}: {expanded!r}"
        if action.nargs != 0 and action.default is not None:
            assert "default" in expanded, f"{name}: its default {action.default!r} is not said"
        checked += 1
    assert checked >= options
