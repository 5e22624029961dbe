"""The CLI contract, in one place: bad input exits 2 with one line on stderr (`moewatch: error: ...`),
never click's usage block or a traceback; --json prints machine output only, on stdout.

Every verb is a `OneLineCommand` (or calls `fail_input`): click's usage errors (an unknown flag, a
value of the wrong type) and any InputError the verb raises (moewatch/errors.py) take this path.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from .errors import InputError

PROG = "moewatch"


def fail_input(message: str, prog: str = PROG) -> NoReturn:
    """Bad input: one line on stderr, exit 2."""
    click.echo(f"{prog}: error: {' '.join(str(message).split())}", err=True)
    sys.exit(2)


class OneLineCommand(click.Command):
    """A verb whose usage errors and InputErrors are one line and exit 2. `prefix_with_name` puts the
    verb's name before the message (`moewatch: error: plan: --gpus: ...`)."""

    prefix_with_name = False

    def _fail(self, message: str) -> NoReturn:
        fail_input(f"{self.name}: {message}" if self.prefix_with_name else message)

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            self._fail(exc.format_message())

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            self._fail(exc.format_message())
        except InputError as exc:
            self._fail(str(exc))


class NamedOneLineCommand(OneLineCommand):
    """A OneLineCommand whose messages start with the verb's name."""

    prefix_with_name = True
