"""``hookbus schema`` and ``hookbus asyncapi``: the wire contract, printed or written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from hookbus.cli._asyncapi import asyncapi_document
from hookbus.schemas import json_schemas

__all__ = ["asyncapi", "schema", "write_output"]


def write_output(out: str | None, text: str) -> None:
    """Print `text`, or write it to the file `out` (created or replaced).

    Raises:
        click.ClickException: the file cannot be written (one line: the path and the
            system's reason, e.g. a missing folder or no permission).
    """
    if not out:
        click.echo(text)
        return
    try:
        Path(out).write_text(text + "\n")
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc.strerror or exc}") from exc
    click.echo(f"wrote {out}", err=True)


_OUT = click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write to this file instead of stdout.",
)


@click.command()
@_OUT
def schema(out: str | None) -> None:
    """Write the JSON Schema (2020-12) of every wire type (to write a worker in any
    language): one definition per type under $defs, with descriptions, required fields,
    enums and oneOf for exclusive fields."""
    write_output(out, json.dumps(json_schemas(), indent=2))


def _yaml(doc: dict[str, Any]) -> str:
    import yaml  # type: ignore[import-untyped]  # only this command needs it

    return str(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100)).rstrip("\n")


@click.command()
@_OUT
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["yaml", "json"]),
    default=None,
    help="Output format (default: json for an --out ending in .json, else yaml).",
)
def asyncapi(out: str | None, fmt: str | None) -> None:
    """Write the AsyncAPI 3.0 document of hookbus's NATS subjects, KV buckets and
    messages (request/reply operations, queue groups, payload schemas)."""
    if fmt is None:
        fmt = "json" if out and out.lower().endswith(".json") else "yaml"
    doc = asyncapi_document()
    write_output(out, json.dumps(doc, indent=2) if fmt == "json" else _yaml(doc))
