"""What the CLI commands share beside connecting (`hookbus.cli._connect`, whose
`connect`, `connection_options` and `ConnectionSettings` it passes on): the embedded server
when no URL is given, the duration and bounded-float option types, logging setup, loading
`module:attr`, parsing JSON arguments, closing or draining a connection, and running a
command with a `HookDispatcher`."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import logging
import math
import sys
import traceback
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio
import click
import nats
import nats.errors
from nats.aio.client import Client as NATS

from hookbus._core.embedded_server import EmbeddedNatsServer, NatsServerNotFoundError
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookbusError, agent_token

from ._connect import DEFAULT_MAX_RECONNECTS, FIRST_CONNECT_WAIT_S, RECONNECT_WAIT_S
from ._connect import ConnectionSettings as ConnectionSettings
from ._connect import connect as connect
from ._connect import connection_options as connection_options
from ._extras import MissingExtraError

log = logging.getLogger("hookbus.cli")

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class Duration(click.ParamType):  # type: ignore[type-arg]
    """Seconds, as a number or with a unit: ``90``, ``90s``, ``15m``, ``24h``, ``7d``."""

    name = "duration"

    def __init__(self, *, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

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
        if self.allow_zero:
            if not math.isfinite(seconds) or seconds < 0:
                self.fail(f"{value!r} must be a finite duration, 0 or above", param, ctx)
        elif not math.isfinite(seconds) or seconds <= 0:
            self.fail(f"{value!r} must be a finite duration above 0", param, ctx)
        return seconds


DURATION = Duration()


class FiniteFloatRange(click.FloatRange):
    """`click.FloatRange` that refuses ``nan``, ``inf`` and ``-inf`` (which compare
    false with every bound, so a plain range lets nan through): a usage error, exit 2."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


class AgentId(click.types.StringParamType):
    """An agent id: not empty, and one `hookbus.schemas.agent_token` can encode (at most
    `MAX_NAME_LENGTH` characters); else a usage error, exit 2."""

    name = "agent"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = str(value)
        if not text.strip():
            self.fail("an agent id cannot be empty (leave the option out for none)", param, ctx)
        try:
            agent_token(text)
        except HookbusError as exc:
            self.fail(str(exc), param, ctx)
        return text


AGENT_ID = AgentId()


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


max_reconnects_option = click.option(
    "--max-reconnects",
    envvar="HOOKBUS_MAX_RECONNECTS",
    type=click.IntRange(min=-1),
    default=DEFAULT_MAX_RECONNECTS,
    show_default=True,
    help=f"After losing NATS: reconnect attempts, {RECONNECT_WAIT_S:g} s apart, before giving "
    "up with exit code 1 (env HOOKBUS_MAX_RECONNECTS; -1: forever).",
)

wait_for_server_option = click.option(
    "--wait-for-server",
    "wait_for_server_s",
    envvar="HOOKBUS_WAIT_FOR_SERVER",
    type=Duration(allow_zero=True),
    default=FIRST_CONNECT_WAIT_S,
    show_default=True,
    help="At start: seconds (or 30s, 1m) to keep trying a NATS server that does not answer"
    " yet (one just started), saying so in one line, before failing (env"
    " HOOKBUS_WAIT_FOR_SERVER; 0: fail at once). A refusal (credentials, TLS) fails at once.",
)


@contextlib.contextmanager
def connection_or_embedded(conn: ConnectionSettings) -> Iterator[ConnectionSettings]:
    """Yield `conn`; with ``--embedded`` (`ConnectionSettings.embedded`), start a private
    nats-server first (its own process group, temporary data removed on exit) and yield
    settings for it. Commands without --embedded never start a server."""
    if not conn.embedded:
        yield conn
        return
    if conn.has_credentials or conn.uses_tls:
        log.warning(
            "--embedded: the embedded nats-server has no auth and no TLS; the credentials"
            " and TLS options are not used"
        )
    server = EmbeddedNatsServer()
    try:
        try:
            server.start()
        except BaseException:
            server.stop()  # its temporary folder too
            raise
    except NatsServerNotFoundError as exc:
        raise MissingExtraError(
            "the embedded nats-server", "server", " (or nats-server on PATH, or --url)"
        ) from exc
    except HookbusError as exc:  # it would not start
        raise click.ClickException(f"cannot start the embedded nats-server: {exc}") from exc
    try:
        click.echo(
            f"embedded nats-server at {server.url} (data in {server.data_dir}, removed on exit)",
            err=True,
        )
        yield ConnectionSettings(url=server.url, inbox_prefix=conn.inbox_prefix)
    finally:
        server.stop()


async def close_quietly(nc: NATS, timeout_s: float = 2.0) -> None:
    """Close the connection within `timeout_s` seconds; never raises (a server gone
    mid-close resets the socket: nothing is left to tell it)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            await nc.close()


async def drain_or_close(nc: NATS, timeout_s: float = 5.0) -> None:
    """Drain the connection within `timeout_s` seconds; if the server is gone (reconnecting,
    drain cannot run) or the drain fails or runs out of time, close it. Never raises."""
    if nc.is_closed:
        return
    if nc.is_connected:
        try:
            async with asyncio.timeout(timeout_s):
                await nc.drain()
            return
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            log.warning("NATS drain at shutdown failed (%r): closing without draining", exc)
    else:
        log.warning("NATS server unreachable at shutdown: closing without draining")
    await close_quietly(nc)


def load_object(ref: str) -> Any:
    """Load ``module:attr`` or ``path/to/file.py:attr``.

    Raises:
        click.BadParameter: a clear one-line message for a missing module, file or
            attribute, a syntax error in the module, or an exception its import raised
            (with the file and line where it was raised).
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
            if spec is None or spec.loader is None:
                raise click.BadParameter(f"{module_ref} cannot be loaded as a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")
            module = importlib.import_module(module_ref)
    except click.BadParameter:
        raise
    except SyntaxError as exc:
        where = f"{exc.filename or module_ref}, line {exc.lineno}" if exc.lineno else module_ref
        raise click.BadParameter(f"syntax error in {where}: {exc.msg}") from exc
    except ImportError as exc:
        raise click.BadParameter(f"cannot import {module_ref!r}: {exc}") from exc
    except Exception as exc:  # the module's own code raised while it was imported
        raise click.BadParameter(
            f"{module_ref} failed to load: {type(exc).__name__}: {exc}{_raised_at(exc)}"
        ) from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise click.BadParameter(f"module {module_ref!r} has no attribute {attr!r}") from exc
    return obj


def _raised_at(exc: BaseException) -> str:
    """`` (at FILE line N)``: the innermost frame of `exc` outside the import machinery."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "importlib" not in f.filename and f.filename != __file__]  # fmt: skip
    return f" (at {frames[-1].filename} line {frames[-1].lineno})" if frames else ""


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
    client `name` with `conn` (settings or a URL; no URL: `LOCAL_URL` if a server answers
    there; ``--embedded``: a private server for this call), and return what it returned.

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
            await close_quietly(nc)

    with connection_or_embedded(conn) as server:
        try:
            return anyio.run(run, server, backend="asyncio")
        except HookbusError as exc:
            raise click.ClickException(str(exc)) from exc
