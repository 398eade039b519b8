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
from collections.abc import Sequence

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

__all__ = [
    "TABLE_CHUNK_ROWS",
    "id_column",
    "is_short_id",
    "print_rows",
    "short_id",
    "table_console",
]

_SHORT_ID = re.compile(r"[0-9a-f]{8}")


def table_console() -> Console:
    """A console for tables: the terminal's width, or unbounded when piped."""
    console = Console()
    return console if console.is_terminal else Console(width=100_000)


def id_column(table: Table, header: str) -> None:
    """Add a column of identifiers (or of text a user decides on): folded onto more lines
    when narrow, never cut."""
    table.add_column(header, overflow="fold")


TABLE_CHUNK_ROWS = 500
"""Rows a listing renders at once: rich lays a table out whole (every cell measured and
rendered before the first line is printed), so a listing of 100,000 rows is printed as
tables of this many rows, one after the other, with the same column widths."""


def print_rows(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    ids: int = 0,
    caption: str | None = None,
) -> None:
    """Print `rows` as one table (its first `ids` columns fold as `id_column` does): in chunks of
    `TABLE_CHUNK_ROWS` rows when longer, so time and memory grow with the rows, not with
    the whole table laid out at once. The chunks share the columns' widths (the widest
    cell of each column over all rows); the title and header open the first, the caption
    closes the last."""
    console = table_console()
    widths = [cell_len(h) for h in headers]
    if len(rows) > TABLE_CHUNK_ROWS:
        for row in rows:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], cell_len(cell))
    chunks = [rows[i : i + TABLE_CHUNK_ROWS] for i in range(0, len(rows), TABLE_CHUNK_ROWS)]
    for n, chunk in enumerate(chunks or [rows]):
        first, last = n == 0, n == max(len(chunks), 1) - 1
        table = Table(
            title=title if first else None,
            caption=caption if last else None,
            show_header=first,
        )
        for i, header in enumerate(headers):
            fixed = widths[i] if len(rows) > TABLE_CHUNK_ROWS else None
            if i < ids:
                table.add_column(header, overflow="fold", width=fixed)
            else:
                table.add_column(header, width=fixed)
        for row in chunk:
            table.add_row(*row)
        console.print(table)


def short_id(identifier: str) -> str:
    """8 lower-case hex characters standing for `identifier` (the start of its SHA-256):
    the same on every run, so a table's id can be typed into the next command."""
    return hashlib.sha256(identifier.encode()).hexdigest()[:8]


def is_short_id(text: str) -> bool:
    """Whether `text` has the form of a `short_id` (no approval label, which starts with
    ``approval:``, and no grant key, which has dots, has it)."""
    return _SHORT_ID.fullmatch(text) is not None
