"""Every option of the product's commands says what it does in ``--help``."""

from __future__ import annotations

from collections.abc import Iterator

import click
from click.testing import CliRunner

from streams import cli


def commands(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Each leaf command under ``command`` with its words after ``streams``."""
    if isinstance(command, click.Group):
        context = click.Context(command)
        for name in command.list_commands(context):
            sub = command.get_command(context, name)
            assert sub is not None
            yield from commands(sub, (*path, name))
    else:
        yield path, command


def test_every_option_of_every_command_has_a_help_text() -> None:
    """The product's commands and the harness's (offered through the entry-point group) alike."""
    product = [(path, command) for path, command in commands(cli.main) if command.callback is not None]
    paths = {path for path, _ in product}
    assert {("migrate",), ("worker",), ("follow",), ("operations", "adopt"), ("bench",), ("run",)} <= paths
    silent = [
        f"streams {' '.join(path)} {'/'.join(param.opts + param.secondary_opts)}"
        for path, command in product
        for param in command.params
        if isinstance(param, click.Option) and param.name != "help" and not param.help
    ]
    assert silent == []


def test_streams_help_gives_each_commands_first_sentence_whole() -> None:
    result = CliRunner().invoke(cli.main, ["--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    listing = " ".join(result.output.split("Commands:", 1)[1].split())
    accounting = (
        "accounting What the provider was asked, what it created, what it charged and refunded (from the ledger)."
    )
    assert accounting in listing
    assert "migrate Apply pending SQL migrations (yoyo) and create the Kafka topics." in listing
    assert "submit Publish submissions from a JSONL file:" in listing
