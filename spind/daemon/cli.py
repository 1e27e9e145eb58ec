"""`spind start | status | stop`."""

from __future__ import annotations


def add_parsers(sub, add_config_args) -> None:
    """Register the daemon subcommands."""
