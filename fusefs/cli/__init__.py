"""The `ckptfs` command: main.py parses and dispatches; each concern registers its own
subcommands (mount, service, ops, tier, demo); sizes and progress live beside them."""

from fusefs.cli.main import UserError, main

__all__ = ["UserError", "main"]
