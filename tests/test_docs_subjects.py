"""Every subject form the code's docstrings, the CLI's help and the docs write has the shape of
one hookbus uses (the table in `hookbus.schemas._subjects`): a worker or an agent written in
another language from the docs subscribes or publishes where hookbus does.

A form is ``hookbus.v1.<kind>.<token>...`` where a token is a literal, a ``<placeholder>``
or a wildcard (``*``, ``>``); its kind and its number of tokens must be those of a subject
`hookbus.schemas` builds. docs/names.md is left out: it lists the old and the rejected names
on purpose.
"""

from __future__ import annotations

import re
from pathlib import Path

from hookbus.schemas import (
    chain_subject,
    collect_service_subject,
    collect_subject,
    decisions_subject,
    emit_service_subject,
    handler_instance_subject,
    handler_subject,
    suspension_event_subject,
)

ROOT = Path(__file__).resolve().parent.parent
# the nine package folders (tests/test_layout.py's PORTIONS), then the rest
SOURCES = [
    "schemas", "core", "workers", "dispatcher", "integrations", "amplifier", "testing", "cli",
    "demo", "deploy", "examples", "docs",
]  # fmt: skip
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".conf", ".html", ".js", ".ts"}
LEFT_OUT = {ROOT / "docs" / "names.md"}

_TOKEN = r"(?:[A-Za-z0-9_=\-]+|<[^<>`\n]+>|\*|>)"
_FORM = re.compile(r"hookbus\.v1\.(" + _TOKEN + r"(?:\." + _TOKEN + r")*)(\.?)")


def _shapes() -> dict[str, set[int]]:
    """By kind, the numbers of tokens after it in the subjects hookbus builds."""
    built = [
        handler_subject("tool:pre", "guard"),
        handler_instance_subject("tool:pre", "guard", "i1"),
        chain_subject("tool:pre", "set1"),
        chain_subject("tool:pre", "set1") + ".i1",  # a chain on one instance (docs/wire.md)
        collect_subject("tool:pre"),
        emit_service_subject("tool:pre", "payments"),
        collect_service_subject("tool:pre", "payments"),
        suspension_event_subject("approve_1", "pending", "payments"),
        decisions_subject("payments"),
        "hookbus.v1.registry.key",  # republished by the server: REGISTRY_CHANGES_WILDCARD
    ]
    shapes: dict[str, set[int]] = {}
    for subject in built:
        kind, *rest = subject.removeprefix("hookbus.v1.").split(".")
        shapes.setdefault(kind, set()).add(len(rest))
    return shapes


def _files() -> list[Path]:
    files = [ROOT / "README.md"]
    for name in SOURCES:
        files += [p for p in sorted((ROOT / name).rglob("*")) if p.suffix in SUFFIXES]
    return [f for f in files if f not in LEFT_OUT and "node_modules" not in f.parts]


def _wrong(text: str, shapes: dict[str, set[int]]) -> list[str]:
    wrong = []
    for m in _FORM.finditer(text):
        kind, *rest = m.group(1).split(".")
        after = text[m.end() : m.end() + 1]
        if m.group(2) and (after in "{\"'`" or after.isspace() or not after):
            continue  # a prefix being built (f"hookbus.v1.emit.{...}"), or wrapped mid-form
        if kind in ("*", ">") or not rest:
            continue  # the whole namespace, or a kind alone
        counts = shapes.get(kind)
        fits = counts is not None and (
            len(rest) in counts or (rest[-1] == ">" and len(rest) <= max(counts))
        )
        if not fits:
            wrong.append(m.group(0))
    return wrong


def test_every_subject_form_written_is_one_hookbus_uses() -> None:
    shapes = _shapes()
    wrong = {
        f"{path.relative_to(ROOT)}: {form}"
        for path in _files()
        for form in _wrong(path.read_text(errors="replace"), shapes)
    }
    assert not wrong, "\n".join(sorted(wrong))


def test_the_check_finds_a_form_without_its_agent_token() -> None:
    """The forms the docs once wrote wrongly are found (the check can fail)."""
    shapes = _shapes()
    text = "on ``hookbus.v1.emit.<event>``, ``hookbus.v1.chain.<set>`` and hookbus.v1.hooks.<a>.x"
    assert _wrong(text, shapes) == [
        "hookbus.v1.emit.<event>",
        "hookbus.v1.chain.<set>",
        "hookbus.v1.hooks.<a>.x",
    ]
    assert _wrong("``hookbus.v1.emit.<agent>.<event>``, hookbus.v1.handler.*.*.*", shapes) == []
