"""`spind bench ...` subcommands."""

from __future__ import annotations


def add_parsers(sub, add_config_args) -> None:
    """Register the bench subcommands (filled in by the bench module)."""
