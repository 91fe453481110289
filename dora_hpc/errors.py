"""The one way a command reports bad input: one line on stderr, ``<what>: <message>``, and exit 2.

The message is printed as text, never as rich markup, so a config value or a path with brackets in it
reaches the user whole.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape


def fail(what: str, message: object, code: int = 2) -> int:
    """Print ``what: message`` as one line to stderr; return ``code`` for the command to exit with."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]{escape(what)}[/]: {escape(str(message))}", highlight=False)
    return code
