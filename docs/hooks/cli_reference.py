"""MkDocs hook: the command-line reference in docs/cli.md (where the page says ``<!-- cli-reference -->``), generated
at build time from mpdiag's own argparse parser, whose `run`/`rerun`/`watch` flags come from the options table
(mpdiag.options.OPTIONS): every flag and its help (with its default), as `python -m mpdiag COMMAND --help` says
them, so the page cannot drift from the code."""

from __future__ import annotations

import argparse

MARKER = "<!-- cli-reference -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    from mpdiag.cli import build_parser  # only for the page that asks: it imports torch

    return markdown.replace(MARKER, cli_reference(build_parser()))


def cli_reference(parser: argparse.ArgumentParser) -> str:
    """One section per command (and per action of a command with actions), a table of its arguments."""
    return "\n\n".join(_sections(parser, "python -m mpdiag"))


def _sections(parser: argparse.ArgumentParser, prefix: str):
    commands = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if commands is None:
        return
    said = {a.dest: a.help for a in commands._choices_actions}
    for name, sub in commands.choices.items():
        rows = [_row(a) for a in sub._actions
                if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        text = f"### `{prefix} {name}`\n\n{_cell(said.get(name) or sub.description or '')}"
        if rows:
            text += "\n\n| argument | what it does |\n|---|---|\n" + "\n".join(rows)
        yield text
        yield from _sections(sub, f"{prefix} {name}")


def _row(action: argparse.Action) -> str:
    """The argument's names and its help as ``--help`` prints it (defaults included, where the help says them)."""
    joiner = " / " if isinstance(action, argparse.BooleanOptionalAction) else ", "
    name = joiner.join(f"`{s}`" for s in action.option_strings) or f"`{action.dest.upper()}`"
    return f"| {name} | {_cell((action.help or '').replace('%%', '%'))} |"


def _cell(text: str) -> str:
    """Text for one markdown table cell: pipes escaped, on one line."""
    return " ".join(str(text).split()).replace("|", "\\|")
