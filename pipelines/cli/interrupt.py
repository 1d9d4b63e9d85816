"""Ctrl-C (and SIGTERM, where a command commits work first) ends every command with exit code 130,
the shell's code for a command stopped by SIGINT."""

from __future__ import annotations

import signal
import sys

import click

INTERRUPTED = 130


def _terminate_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """SIGTERM (a scheduler stopping us) takes Ctrl-C's path: finished work is kept, exit 130."""
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)


class Group(click.Group):
    """A click group whose commands exit 130 when interrupted (click's own default: "Aborted!", 1)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (KeyboardInterrupt, click.Abort):
            click.echo("interrupted", err=True)
            sys.exit(INTERRUPTED)
