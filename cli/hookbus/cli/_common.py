"""What the CLI commands share: the connection options (or the embedded server), connecting,
loading `module:attr`, parsing JSON arguments, logging setup, the bucket and drain options."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import math
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
import nats
import nats.errors
from nats.aio.client import Client as NATS

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookbusError

from ._connect import ConnectionSettings as ConnectionSettings
from ._connect import connect as connect
from ._connect import connection_options as connection_options
from ._server import EmbeddedNatsServer

log = logging.getLogger("hookbus.cli")

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class Duration(click.ParamType):  # type: ignore[type-arg]
    """Seconds, as a number or with a unit: ``90``, ``90s``, ``15m``, ``24h``, ``7d``."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, int | float):
            seconds = float(value)
        else:
            text = str(value).strip().lower()
            scale = _UNITS.get(text[-1:])
            try:
                seconds = float(text[:-1] if scale else text) * (scale or 1.0)
            except ValueError:
                self.fail(f"{value!r} is not a duration (e.g. 90, 90s, 15m, 24h, 7d)", param, ctx)
        if not math.isfinite(seconds) or seconds <= 0:
            self.fail(f"{value!r} must be a finite duration above 0", param, ctx)
        return seconds


DURATION = Duration()

bucket_replicas_option = click.option(
    "--bucket-replicas",
    envvar="HOOKBUS_BUCKET_REPLICAS",
    type=click.IntRange(1, 5),
    default=1,
    show_default=True,
    help="JetStream replicas of the KV buckets this process creates (env "
    "HOOKBUS_BUCKET_REPLICAS): 1 on a single server, 3 on a 3-node cluster, so that losing "
    "a node loses no route, suspension or grant.",
)

strict_buckets_option = click.option(
    "--strict-buckets",
    envvar="HOOKBUS_STRICT_BUCKETS",
    is_flag=True,
    help="Refuse to start when a bucket exists with another config (replicas, TTL, history) "
    "than asked (env HOOKBUS_STRICT_BUCKETS=1); without it, a warning names the differences.",
)

grace_period_option = click.option(
    "--grace-period",
    "grace_s",
    envvar="HOOKBUS_GRACE_PERIOD",
    type=DURATION,
    default=20.0,
    show_default=True,
    help="On SIGTERM/SIGINT: seconds (or 15s, 1m) that requests in flight get to finish "
    "before the rest are answered with a retryable 'unavailable' (env HOOKBUS_GRACE_PERIOD). "
    "Keep it below the orchestrator's kill deadline (Kubernetes: 30 s).",
)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@contextlib.contextmanager
def connection_or_embedded(conn: ConnectionSettings) -> Iterator[ConnectionSettings]:
    """Yield `conn`, or, when it has no URL, `conn` with the embedded nats-server's URL."""
    if conn.url:
        yield conn
        return
    if conn.has_credentials or conn.uses_tls:
        log.warning(
            "no --url: the embedded nats-server has no auth and no TLS; the credentials"
            " and TLS options are not used"
        )
    with EmbeddedNatsServer() as server:
        click.echo(f"embedded nats-server at {server.url} (data in {server.data_dir})", err=True)
        yield conn.with_url(server.url)


async def drain_or_close(nc: NATS) -> None:
    """Drain the connection; if the server is gone (drain cannot run), just close it."""
    try:
        await nc.drain()
    except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError,
            nats.errors.TimeoutError):  # fmt: skip
        log.warning("NATS server unreachable at shutdown: closing without draining")
        await nc.close()


def load_object(ref: str) -> Any:
    """Load ``module:attr`` or ``path/to/file.py:attr``.

    Raises:
        click.BadParameter: a clear message for a missing module, file or attribute.
    """
    module_ref, sep, attr = ref.partition(":")
    if not sep or not module_ref or not attr:
        raise click.BadParameter(f"{ref!r} is not MODULE:ATTR (e.g. examples.security:worker)")
    try:
        if module_ref.endswith(".py") or "/" in module_ref:
            path = Path(module_ref)
            if not path.is_file():
                raise click.BadParameter(f"no such file: {module_ref}")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")
            module = importlib.import_module(module_ref)
    except ImportError as exc:
        raise click.BadParameter(f"cannot import {module_ref!r}: {exc}") from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise click.BadParameter(f"module {module_ref!r} has no attribute {attr!r}") from exc
    return obj


def parse_json_object(text: str, *, what: str = "JSON") -> dict[str, Any]:
    """Parse a JSON object argument. Raises `click.BadParameter` with the position."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(
            f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    if not isinstance(value, dict):
        raise click.BadParameter(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


T = TypeVar("T")


def with_dispatcher(
    conn: ConnectionSettings | str | None,
    fn: Callable[[HookDispatcher], Awaitable[T]],
    *,
    name: str,
) -> T:
    """Run ``fn(dispatcher)`` on a started `HookDispatcher` (approvals off) connected as
    client `name` with `conn` (settings or a URL; no URL: the embedded server), and return
    what it returned.

    Raises:
        click.ClickException: a hookbus error, as one line.
    """
    if not isinstance(conn, ConnectionSettings):
        conn = ConnectionSettings(url=conn)

    async def run(server: ConnectionSettings) -> T:
        nc = await connect(server, name=name)
        try:
            async with HookDispatcher(nc, approvals=False) as d:
                return await fn(d)
        finally:
            await nc.close()

    with connection_or_embedded(conn) as server:
        try:
            return anyio.run(run, server, backend="asyncio")
        except HookbusError as exc:
            raise click.ClickException(str(exc)) from exc
