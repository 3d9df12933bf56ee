"""Every option and subcommand of ``kvpath`` has a help string (issue 20).

The walker goes through the whole parser tree, so an option added without ``help=``
anywhere fails here with its full command path ("kvpath testbed run --qps").
"""

from __future__ import annotations

import argparse

from kvpath.cli import build_parser

# actions that argparse documents itself
_SELF_DOCUMENTING = (argparse._HelpAction, argparse._VersionAction)


def _has_help(text: str | None) -> bool:
    return bool(text and text.strip() and text != argparse.SUPPRESS)


def _action_name(action: argparse.Action) -> str:
    if action.option_strings:  # the long form when there is one: "--qps" over "-q"
        return max(action.option_strings, key=len)
    return action.metavar if isinstance(action.metavar, str) else action.dest


def missing_help(parser: argparse.ArgumentParser, path: str | None = None) -> list[str]:
    """Every option, positional and subcommand under ``parser`` without a help string."""
    path = path or parser.prog
    offenders: list[str] = []
    for action in parser._actions:
        if isinstance(action, _SELF_DOCUMENTING):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helped = {c.dest: c.help for c in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:  # an alias of a subcommand already walked
                    continue
                seen.add(id(sub))
                if not _has_help(helped.get(name)):
                    offenders.append(f"{path} {name} (subcommand)")
                offenders.extend(missing_help(sub, f"{path} {name}"))
            continue
        if not _has_help(action.help):
            offenders.append(f"{path} {_action_name(action)}")
    return offenders


def test_every_kvpath_option_and_subcommand_has_help() -> None:
    offenders = missing_help(build_parser())
    assert offenders == [], "options or subcommands without help=:\n  " + "\n  ".join(offenders)


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                out.extend(_parsers(sub))
    return out


def test_every_kvpath_help_page_renders() -> None:
    # a help string with a bare "%" or a bad %(name)s breaks only when --help formats it
    for parser in _parsers(build_parser()):
        assert parser.format_help(), parser.prog


def test_walker_reports_a_missing_help_at_any_depth() -> None:
    p = argparse.ArgumentParser(prog="tool")
    p.add_argument("--fine", help="documented")
    p.add_argument("--bare")
    sub = p.add_subparsers(dest="command")
    group = sub.add_parser("group", help="a group")
    inner = group.add_subparsers(dest="inner")
    leaf = inner.add_parser("leaf")  # no help for the subcommand
    leaf.add_argument("path")
    leaf.add_argument("--rate", help="   ")
    leaf.add_argument("--hidden", help=argparse.SUPPRESS)
    leaf.add_argument("--ok", type=float, default=1.0, help="a rate, per second (default %(default)s)")
    assert missing_help(p) == [
        "tool --bare",
        "tool group leaf (subcommand)",
        "tool group leaf path",
        "tool group leaf --rate",
        "tool group leaf --hidden",
    ]
