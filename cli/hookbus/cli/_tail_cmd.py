"""`hookbus tail`: follow the decision audit trail live, one compact line per decision.

The reading is `hookbus decisions --follow`'s (`read_trail`); only the printing differs.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime

import click

from hookbus.schemas import DecisionRecord

from ._command_support import ConnectionSettings, connection_options
from ._decisions_cmd import _Filters, _Printer, filter_options, latency, read_trail

__all__ = ["tail"]

_HEADER = ("time", "event", "agent", "tool", "action", "latency", "decided_by")
_WIDTHS = (13, 18, 18, 12, 14, 9, 0)


def tail_line(r: DecisionRecord) -> str:
    """One decision as ``TIME EVENT AGENT TOOL ACTION LATENCY DECIDED_BY``: TIME is the UTC
    time of day the decision was taken (``HH:MM:SS.mmmZ``), LATENCY how long the emit took
    to decide (`latency`: ``12.3ms``, ``4.56s``), absent values are ``-``; columns are padded
    to a fixed width (a longer value is kept whole and pushes the rest right)."""
    when = datetime.fromtimestamp(r.time, UTC).strftime("%H:%M:%S.%f")[:-3] + "Z"
    cells = (
        when, r.event, r.agent_id or "-", r.tool_name or "-", r.action,
        latency(r.duration_ms), r.decided_by or "-",
    )  # fmt: skip
    return _row(cells)


def _row(cells: tuple[str, ...]) -> str:
    return " ".join(c.ljust(w) for c, w in zip(cells, _WIDTHS, strict=True)).rstrip()


class _TailPrinter(_Printer):
    """Compact lines (a header first on a terminal), or JSON lines (--json)."""

    def following(self) -> None:
        click.echo("following the decision audit trail (Ctrl-C stops)", err=True)
        if not self.as_json and sys.stdout.isatty():
            click.echo(_row(_HEADER))

    def one(self, r: DecisionRecord) -> None:
        if self.as_json:
            super().one(r)
        else:
            click.echo(tail_line(r))


@click.command("tail")
@connection_options
@filter_options
@click.option(
    "--last",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Start with the N most recent matching decisions (0: new decisions only).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object (the full record) per line.")
def tail(conn: ConnectionSettings, filters: _Filters, last: int, as_json: bool) -> None:
    """Follow decisions live until Ctrl-C (exit 0): one line per decision, with the columns
    time (UTC), event, agent, tool, action, latency (how long the emit took to decide:
    12.3ms, 4.56s; - for records without it), decided_by. Reads the hookbus_decisions stream,
    written by `hookbus dispatcher --audit` (env HOOKBUS_AUDIT=1); needs a NATS user that may
    read it (admin, auditor). `hookbus decisions --follow` prints the long form."""
    out = _TailPrinter(as_json=as_json, follow=True)
    read_trail(conn, "hookbus-tail", filters, limit=last, since=None, follow=True, out=out)
