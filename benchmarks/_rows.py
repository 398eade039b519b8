"""The benchmark's table: one `Row` per figure, its baseline from the same run, the ratio,
the target and the verdict; `render` prints them with rich, `as_json` for ``--json``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["Row", "as_json", "ms", "render", "rps", "us"]


@dataclass
class Row:
    measure: str
    hookbus: str
    baseline: str
    ratio: str
    target: str
    met: bool | None
    """None: a reference row, nothing to meet."""
    figures: dict[str, Any] = field(default_factory=dict)
    """Every figure of the row, seconds unless the key says otherwise (``_ms``, ``_us``)."""
    errors: int = 0
    """Failed calls: the row is INVALID."""
    refused: int = 0
    """Calls every replica refused (the concurrency bound at work): shown, not failures."""
    floor: str = ""
    """The same message pattern with raw nc.request (what no bus can beat), if any."""
    unavailable: str = ""
    """Why the row could not be measured (the row then has no figures)."""

    @property
    def status(self) -> str:
        if self.unavailable:
            return f"unavailable ({self.unavailable})"
        if self.errors:
            return f"INVALID ({self.errors} failed calls)"
        verdict = "-" if self.met is None else "MET" if self.met else "MISSED"
        return f"{verdict} ({self.refused} refused)" if self.refused else verdict


def ms(x: float) -> str:
    return f"{x * 1000:.3f} ms"


def us(x: float) -> str:
    return f"{x * 1e6:.1f} us"


def rps(x: float) -> str:
    return f"{x:,.0f} req/s"


def render(rows: list[Row], notes: list[str], header: str, console: Console) -> None:
    table = Table(title="hookbus, each figure against a baseline of the same run", caption=header)
    table.add_column("measure", max_width=46)
    table.add_column("hookbus", justify="right", no_wrap=True)
    table.add_column("baseline (same run)", justify="right", max_width=34)
    table.add_column("ratio", justify="right", no_wrap=True)
    table.add_column("target", justify="right", no_wrap=True)
    table.add_column("result", max_width=40)
    table.add_column("raw, same shape (floor)", justify="right", max_width=30)
    style = {"MET": "green", "MISSED": "red", "-": "dim"}
    for row in rows:
        st = row.status
        table.add_row(
            row.measure, row.hookbus, row.baseline, row.ratio, row.target,
            f"[{style.get(st.split(' ')[0], 'yellow')}]{st}[/]", row.floor,
        )  # fmt: skip
    console.print(table)
    judged = [r for r in rows if r.met is not None or r.unavailable]
    met = sum(1 for r in judged if r.met and not r.errors and not r.unavailable)
    console.print(f"{met} of {len(judged)} targets met.")
    for note in notes:
        console.print(f"  - {note}", highlight=False, soft_wrap=True)


def as_json(rows: dict[str, Row], notes: list[str], header: str, settings: Any) -> dict[str, Any]:
    """``{"header", "settings", "rows": [{"key", ...every Row field, "status"}], "notes"}``."""
    return {
        "header": header,
        "settings": settings,
        "rows": [{"key": k, **asdict(r), "status": r.status} for k, r in rows.items()],
        "notes": notes,
    }
