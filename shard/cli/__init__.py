"""The `shard` command: a module per sub-command (COMMANDS), each a thin layer over the Python API,
imported when its command is asked for (the help imports them all): `shard run` pays for no compiler."""

from __future__ import annotations

import importlib
import signal
import sys

import typer
from rich.markup import escape
from typer.core import TyperGroup

from shard.cli.common import err, terminate
from shard.errors import ShardError
from shard.runtime.scheduler import exit_now_if_stuck

# command -> the module of this package that holds it (its `app`)
COMMANDS = {"compile": "compile", "run": "run", "generate": "generate", "verify": "verify", "inspect": "inspect",
            "pack": "pack", "build-engines": "pack", "probe": "probe", "cache": "cache", "toolkit": "toolkit",
            "zoo": "zoo", "act": "act"}


class Commands(TyperGroup):
    """The sub-commands, each from its module once asked for."""

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: typer.Context, name: str):
        if name not in COMMANDS:
            return None
        made = typer.main.get_command(importlib.import_module(f"{__name__}.{COMMANDS[name]}").app)
        # a module of several commands (pack) is a group of them; a sub-app (cache) is the group itself
        command = made.commands[name] if isinstance(made, TyperGroup) and name in made.commands else made
        command.name = name
        return literal_help(command)


def literal_help(command):
    """`command` (and a group's commands) with its help and its options' help escaped for rich: typer
    reads help as rich markup, where "[default: MODEL.shard]" or "pixel_values [cameras, 3, S, S]"
    is a tag and vanished from the help printed."""
    for item in (command, *command.params):
        if getattr(item, "help", None):
            item.help = escape(item.help)
    for sub in getattr(command, "commands", {}).values():
        literal_help(sub)
    return command


app = typer.Typer(cls=Commands, help="Make models that edge NPUs choke on compile, run and stay accurate on them.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)


@app.callback()
def shard() -> None:
    """Make models that edge NPUs choke on compile, run and stay accurate on them."""


def main() -> None:
    signal.signal(signal.SIGTERM, terminate)
    try:
        app()
    except ShardError as exc:
        err.print(f"[red]error[/]: {escape(str(exc))}", highlight=False, soft_wrap=True)  # shapes look like markup
        exit_now_if_stuck(1)
        sys.exit(1)
