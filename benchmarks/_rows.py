"""The benchmark's table: one `Row` per figure, its baseline from the same run, the ratio,
the target and the verdict; `render` prints them with rich, `as_json` for ``--json``;
`render_summary` prints the median and range of each row over several runs (``--runs N``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["Row", "as_json", "fmt_value", "ms", "render", "render_summary", "rps", "us"]


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
    value: float | None = None
    """The figure compared with the target (a ratio, a fraction, seconds), for ``--runs``."""
    limit: float | None = None
    """The target's bound on `value` (None: a reference row)."""
    at_least: bool = False
    """The target is ``value >= limit`` (throughput), not ``value <= limit``."""
    unit: str = "x"
    """How `value` prints: ``x`` (a ratio), ``%`` (a fraction), ``us`` (seconds as us),
    ``rps`` (calls per second)."""

    def judge(self, value: float) -> bool | None:
        if self.limit is None:
            return None
        return value >= self.limit if self.at_least else value <= self.limit

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


def fmt_value(x: float, unit: str) -> str:
    if unit == "%":
        return f"{x:.0%}"
    if unit == "us":
        return f"{x * 1e6:.1f} us"
    if unit == "rps":
        return f"{x:,.0f}/s"
    return f"{x:.2f}x"


def render(
    rows: list[Row], notes: list[str], header: str, console: Console,
    headings: dict[int, str] | None = None,
) -> None:  # fmt: skip
    """The table; `headings` puts a title line before the row at each index."""
    headings = headings or {}
    table = Table(title="hookbus, each figure against a baseline of the same run", caption=header)
    table.add_column("measure", max_width=46)
    table.add_column("hookbus", justify="right", no_wrap=True)
    table.add_column("baseline (same run)", justify="right", max_width=34)
    table.add_column("ratio", justify="right", no_wrap=True)
    table.add_column("target", justify="right", no_wrap=True)
    table.add_column("result", max_width=40)
    table.add_column("raw, same shape (floor)", justify="right", max_width=30)
    style = {"MET": "green", "MISSED": "red", "-": "dim"}
    for i, row in enumerate(rows):
        if i in headings:
            table.add_row(f"[bold]{headings[i]}[/]", "", "", "", "", "", "")
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


def render_summary(
    runs: list[dict[str, Row]], order: list[str], sections: dict[str, str], console: Console
) -> list[dict[str, Any]]:
    """One line per row: the median of its `value` over `runs`, the range, the target and
    the verdict of the median; each run's figure and status beside. Returns the lines as
    dicts (for ``--json``)."""
    n = len(runs)
    table = Table(title=f"hookbus, median and range of {n} runs (each ratio against its"
                  " baseline of the same run)")  # fmt: skip
    table.add_column("row", max_width=52)
    table.add_column("median", justify="right", no_wrap=True)
    table.add_column("range (min - max)", justify="right", no_wrap=True)
    table.add_column("target", justify="right", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("each run", max_width=44)
    out: list[dict[str, Any]] = []
    style = {"MET": "green", "MISSED": "red", "-": "dim"}
    for key in order:
        rows = [r[key] for r in runs if key in r]
        if not rows:
            continue
        if key in sections:
            table.add_row(f"[bold]{sections[key]}[/]", "", "", "", "", "")
        first = rows[0]
        values = [r.value for r in rows if r.value is not None and not r.unavailable]
        each = ", ".join(
            (fmt_value(r.value, r.unit) if r.value is not None and not r.unavailable else "-")
            + ("" if r.status in ("MET", "MISSED", "-") else f" {r.status}")
            for r in rows
        )
        line: dict[str, Any] = {"key": key, "measure": first.measure, "target": first.target,
                                "values": [r.value for r in rows],
                                "statuses": [r.status for r in rows]}  # fmt: skip
        if not values:
            verdict = "unavailable" if all(r.unavailable for r in rows) else "-"
            table.add_row(first.measure, "-", "-", first.target, verdict, each)
            out.append(line | {"verdict": verdict})
            continue
        mid = _median(values)
        met = first.judge(mid)
        invalid = any(r.errors for r in rows)
        verdict = "-" if met is None else "MET" if met else "MISSED"
        if invalid:
            verdict += " (a run had failed calls)"
        table.add_row(
            first.measure, fmt_value(mid, first.unit),
            f"{fmt_value(min(values), first.unit)} - {fmt_value(max(values), first.unit)}",
            first.target, f"[{style.get(verdict.split(' ')[0], 'yellow')}]{verdict}[/]", each,
        )  # fmt: skip
        out.append(line | {"median": mid, "min": min(values), "max": max(values),
                           "verdict": verdict})  # fmt: skip
    console.print(table)
    judged = [x for x in out if x["verdict"].split(" ")[0] in ("MET", "MISSED")]
    met_n = sum(1 for x in judged if x["verdict"] == "MET")
    console.print(f"{met_n} of {len(judged)} targets met by the median of {n} runs.")
    return out


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    k = len(s)
    return s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2


def as_json(rows: dict[str, Row], notes: list[str], header: str, settings: Any) -> dict[str, Any]:
    """``{"header", "settings", "rows": [{"key", ...every Row field, "status"}], "notes"}``."""
    return {
        "header": header,
        "settings": settings,
        "rows": [{"key": k, **asdict(r), "status": r.status} for k, r in rows.items()],
        "notes": notes,
    }
