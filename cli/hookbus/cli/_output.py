"""How the listing commands print tables: never cutting an identifier a user copies into
another command (an approval label, a grant key, a handler name).

rich shrinks a table that is wider than the terminal by wrapping its cells and, by
default, cuts a word longer than its column with an ellipsis. Identifier columns here
fold instead (the rest of the identifier continues on the next line: nothing is lost),
and piped output (not a terminal) is as wide as the table needs, whatever ``COLUMNS``
says (rich's ``TTY_COMPATIBLE=1`` makes it a terminal of ``COLUMNS`` width). Where
identifiers are long (approval labels, grant keys), the table also shows a `short_id`,
8 characters that always fit, which the commands taking the identifier accept as well.
"""

from __future__ import annotations

import hashlib
import re

from rich.console import Console
from rich.table import Table

__all__ = ["id_column", "is_short_id", "short_id", "table_console"]

_SHORT_ID = re.compile(r"[0-9a-f]{8}")


def table_console() -> Console:
    """A console for tables: the terminal's width, or unbounded when piped."""
    console = Console()
    return console if console.is_terminal else Console(width=100_000)


def id_column(table: Table, header: str) -> None:
    """Add a column of identifiers (or of text a user decides on): folded onto more lines
    when narrow, never cut."""
    table.add_column(header, overflow="fold")


def short_id(identifier: str) -> str:
    """8 lower-case hex characters standing for `identifier` (the start of its SHA-256):
    the same on every run, so a table's id can be typed into the next command."""
    return hashlib.sha256(identifier.encode()).hexdigest()[:8]


def is_short_id(text: str) -> bool:
    """Whether `text` has the form of a `short_id` (no approval label, which starts with
    ``approval:``, and no grant key, which has dots, has it)."""
    return _SHORT_ID.fullmatch(text) is not None
