"""``hookbus server``, ``hookbus worker`` and ``hookbus dispatcher``: the commands that run
until stopped.

Each stops cleanly on the first SIGINT (Ctrl-C) or SIGTERM: the worker and the dispatcher
drain within their grace period (`_lifecycle.Supervisor`), the server stops its
nats-server child; none leaves a child process, a port or a temporary folder behind. A
second signal stops at once. Each prints a banner on stderr once it serves. SIGHUP makes
the server's nats-server read its config again (a reload, never a stop).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import click
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig

from hookbus._core.buckets import handlers_bucket_config
from hookbus._core.deadlines import Deadline
from hookbus._core.embedded_server import EmbeddedNatsServer, NatsServerNotFoundError
from hookbus._core.kv import open_bucket
from hookbus.dispatcher import DispatcherService, HookDispatcher
from hookbus.schemas import (
    COLLECT_SERVICE_WILDCARD,
    DISPATCHER_QUEUE_GROUP,
    EMIT_SERVICE_WILDCARD,
    HookbusError,
)
from hookbus.workers import HookWorker

from ._command_support import (
    DURATION,
    ConnectionSettings,
    FiniteFloatRange,
    bucket_replicas_option,
    connect,
    connection_options,
    connection_or_embedded,
    grace_period_option,
    load_object,
    max_reconnects_option,
    strict_buckets_option,
    wait_for_server_option,
)
from ._connect import LOCAL_URL, _redacted
from ._decisions_cmd import audit_options
from ._extras import MissingExtraError
from ._lifecycle import (
    Supervisor,
    on_hangup,
    on_signals,
    run_async,
    running_loop,
    stop_on_signals,
)
from ._otel import otel_session, otlp_option

__all__ = ["dispatcher_cmd", "server", "worker"]


# -- server ---------------------------------------------------------------------------------
RELOAD_WAIT_S = 5.0
"""How long `server` reads nats-server's log for the outcome of a reload it asked."""


def _ask_reload(srv: EmbeddedNatsServer, config: str | None) -> tuple[int, Deadline] | None:
    """SIGHUP: have nats-server read `config` again; (log offset, deadline on
    `time.monotonic()`) to read how it went, None (and a line saying so) for the
    development server, which has no config."""
    if config is None:
        click.echo(
            "hookbus server: SIGHUP: the development server has no config file to reload"
            " (--config); nothing done",
            err=True,
        )
        return None
    return srv.reload(), Deadline.after(RELOAD_WAIT_S, time.monotonic())  # no loop runs


def _say_reloaded(
    srv: EmbeddedNatsServer, config: str, offset: int, deadline: Deadline
) -> tuple[int, Deadline] | None:
    """One line once nats-server's log tells how the reload went, or the wait is over
    (then None); until then, the same (offset, deadline)."""
    outcome = srv.reload_outcome(offset)
    if outcome is None and not deadline.passed(time.monotonic()):
        return offset, deadline
    if outcome is None:
        said = f"asked nats-server to reload {config}; its log ({srv.log_file}) says nothing yet"
    elif outcome[0]:
        said = f"nats-server reloaded {config}"
    else:
        said = f"nats-server did not reload {config} and runs on as it was: {outcome[1]}"
    click.echo(f"hookbus server: SIGHUP: {said}", err=True)
    return None


@click.command()
@click.option(
    "--port",
    type=int,
    default=None,
    help="Client port (default 4222; -1: any free port; with --config: the config's).",
)
@click.option(
    "--data-dir",
    default=".hookbus/nats",
    show_default=True,
    type=click.Path(file_okay=False),
    help="JetStream store (kept across runs); with --config: the log and ports file only.",
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="A nats-server config (e.g. `hookbus auth init`'s server.conf): auth, TLS, listen.",
)
def server(port: int | None, data_dir: str, config: str | None) -> None:
    """Run nats-server (JetStream on) in the foreground: with --config, as configured;
    without, the development server: open (no auth) and on loopback only. The first
    SIGINT (Ctrl-C) or SIGTERM stops it (a second kills it at once); exit 1 if nats-server
    exits by itself. SIGHUP has nats-server read --config again (e.g. after `hookbus auth
    add`): it keeps running, and one line says whether the reload took."""
    if config:
        srv = EmbeddedNatsServer(data_dir, port=port, config=config)
    else:
        click.echo(
            "development server: open (no auth: any local process may connect) and on"
            " loopback (127.0.0.1) only; for auth: `hookbus auth init`, then"
            " `hookbus server --config`",
            err=True,
        )
        srv = EmbeddedNatsServer(data_dir, port=4222 if port is None else port)
    received: list[signal.Signals] = []
    hangups: list[bool] = []

    def kill(sig: signal.Signals) -> None:  # again: at once
        pid = srv.pid
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    # handled even if inherited as ignored (a background job of a script): the child has
    # a process group of its own, so only this process hears a terminal's Ctrl-C
    with on_signals(received.append, kill), on_hangup(lambda: hangups.append(True)):
        try:
            try:
                url = srv.start()
            except NatsServerNotFoundError as exc:
                hint = " (or nats-server on PATH)"
                raise MissingExtraError("hookbus server", "server", hint) from exc
            except HookbusError as exc:
                raise click.ClickException(str(exc)) from exc
            if not received:
                where = f"log in {srv.log_file}" if config else f"data in {data_dir}"
                label = f"with {config}" if config else "with JetStream"
                hup = f"; kill -HUP {os.getpid()} reloads it" if config else ""
                click.echo(f"nats-server {label} at {url}; {where}{hup}; Ctrl-C stops it")
            asked: tuple[int, Deadline] | None = None  # a reload's log offset and deadline
            while not received:
                code = srv.poll()
                if code is not None:
                    raise click.ClickException(
                        f"nats-server exited by itself with status {code}; see {srv.log_file}"
                    )
                if hangups:
                    hangups.clear()
                    asked = _ask_reload(srv, config)
                if asked is not None and config is not None:
                    asked = _say_reloaded(srv, config, *asked)
                time.sleep(0.05)
            name = signal.Signals(received[0]).name
            click.echo(f"hookbus server: {name}: stopping nats-server", err=True)
        finally:
            srv.stop()


# -- worker ---------------------------------------------------------------------------------
def _worker_banner(obj: HookWorker, url: str, max_concurrency: int, grace_s: float) -> str:
    specs = obj.handlers
    lines = [
        f"hookbus worker: serving {len(specs)} handler(s) at {_redacted(url)} (concurrency"
        f" {max_concurrency}, grace {grace_s:g} s, loop {running_loop()}; Ctrl-C drains and"
        " stops)"
    ]
    for spec in specs:
        d = spec.declaration
        tools = ",".join(d.tool_filter) if d.tool_filter else "*"
        lines.append(
            f"  {d.event}  {d.name}  priority {d.priority}  queue group {d.queue_group}"
            f"  tools {tools}  timeout {d.timeout_s:g} s  failure policy {d.failure_policy}"
        )
    return "\n".join(lines)


@click.command()
@click.argument("target", metavar="MODULE:ATTR")
@connection_options
@otlp_option
@click.option(
    "--max-concurrency",
    default=None,
    type=click.IntRange(min=1),
    help="Requests handled at once by this process; more are refused 'busy' at once."
    "  [default: the HookWorker's own max_concurrency, 256 unless it sets another]",
)
@grace_period_option
@bucket_replicas_option
@strict_buckets_option
@max_reconnects_option
@wait_for_server_option
@click.option(
    "--replace",
    is_flag=True,
    help="Take over handler names already declared with other settings (else refused).",
)
def worker(
    target: str,
    conn: ConnectionSettings,
    otlp_endpoint: str | None,
    max_concurrency: int | None,
    grace_s: float,
    bucket_replicas: int,
    strict_buckets: bool,
    max_reconnects: int,
    wait_for_server_s: float,
    replace: bool,
) -> None:
    """Serve the HookWorker at MODULE:ATTR (or path/to/file.py:ATTR) until SIGTERM/SIGINT,
    then drain within the grace period: every request received is answered (a result, or
    a retryable 'unavailable' for what could not finish). A second signal stops at once."""
    obj = load_object(target)
    if not isinstance(obj, HookWorker):
        raise click.BadParameter(f"{target} is a {type(obj).__name__}, not a HookWorker")
    if not obj.handlers:
        raise click.BadParameter(f"the HookWorker at {target} has no handlers")
    if max_concurrency is not None:  # given: it overrides the worker's own setting
        obj.max_concurrency = max_concurrency
    obj.replace = obj.replace or replace

    async def body(sup: Supervisor, server: ConnectionSettings) -> None:
        nc = await connect(
            server,
            name=f"hookbus-worker {target}",
            service=True,
            max_reconnects=max_reconnects,
            wait_for_server_s=wait_for_server_s,
        )
        url = server.url or LOCAL_URL
        sup.watch(nc, url)
        await _ensure_bucket(
            nc, handlers_bucket_config(replicas=bucket_replicas), strict=strict_buckets
        )
        try:
            await obj.start(nc)
        except (HookbusError, ValueError) as exc:  # a conflicting declaration, no registry
            raise click.ClickException(str(exc)) from exc
        sup.serving(lambda: obj.shutdown(grace_s=grace_s))
        click.echo(_worker_banner(obj, url, obj.max_concurrency, grace_s), err=True)
        await obj.run(nc)

    what = "hookbus worker"
    with (
        stop_on_signals(what),
        connection_or_embedded(conn) as server,
        otel_session(
            "hookbus-worker", otlp_endpoint, resource_attributes={"hookbus.worker.target": target}
        ),
    ):
        sup = Supervisor(what, grace_s=grace_s, max_reconnects=max_reconnects)
        code = run_async(sup.run(lambda s: body(s, server)), serving=True)
    if code:
        raise click.exceptions.Exit(code)


# -- dispatcher -----------------------------------------------------------------------------
@click.command("dispatcher")
@connection_options
@otlp_option
@click.option(
    "--max-concurrency",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="Emit requests served at once by this replica; more are refused 'busy' at once.",
)
@click.option(
    "--agent-max-in-flight",
    default=DispatcherService.AGENT_MAX_IN_FLIGHT,
    show_default=True,
    type=click.IntRange(min=0),
    help="Requests of one agent served at once by this replica; more are refused 'busy' at"
    " once, so one agent cannot take the whole --max-concurrency (0: no per-agent bound).",
)
@click.option(
    "--agent-rate",
    "agent_rate_per_s",
    default=DispatcherService.AGENT_RATE_PER_S,
    show_default=True,
    type=FiniteFloatRange(min=0),
    help="Requests per second one agent may send to this replica (a token bucket); more"
    " are refused 'quota' at once (0: no rate limit).",
)
@click.option(
    "--agent-burst",
    default=DispatcherService.AGENT_BURST,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests one agent may send at once after a pause (the token bucket's size).",
)
@grace_period_option
@bucket_replicas_option
@click.option(
    "--suspension-ttl",
    "suspension_ttl_s",
    envvar="HOOKBUS_SUSPENSION_TTL",
    type=DURATION,
    default="7d",
    show_default=True,
    help="How long a suspension record lives after its last write (env HOOKBUS_SUSPENSION_TTL).",
)
@click.option(
    "--approval-ttl",
    "approval_ttl_s",
    envvar="HOOKBUS_APPROVAL_TTL",
    type=DURATION,
    default="24h",
    show_default=True,
    help='How long an "Allow always" grant allows after its answer (env HOOKBUS_APPROVAL_TTL).',
)
@click.option(
    "--max-pending-approvals",
    "max_pending_approvals",
    envvar="HOOKBUS_MAX_PENDING_APPROVALS",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Pending approvals one agent may have at once; a question beyond them is denied "
    "with a reason starting 'quota:' (env HOOKBUS_MAX_PENDING_APPROVALS).",
)
@click.option(
    "--expiry-sweep",
    "expiry_sweep_s",
    envvar="HOOKBUS_EXPIRY_SWEEP",
    type=DURATION,
    default="15s",
    show_default=True,
    help="Mean time between two sweeps (jittered by 20 %) that end approvals nobody waits"
    " for, past their timeout plus a margin, with their default (env HOOKBUS_EXPIRY_SWEEP).",
)
@strict_buckets_option
@max_reconnects_option
@wait_for_server_option
@audit_options
def dispatcher_cmd(
    conn: ConnectionSettings,
    otlp_endpoint: str | None,
    max_concurrency: int,
    agent_max_in_flight: int,
    agent_rate_per_s: float,
    agent_burst: int,
    grace_s: float,
    bucket_replicas: int,
    suspension_ttl_s: float,
    approval_ttl_s: float,
    max_pending_approvals: int,
    expiry_sweep_s: float,
    strict_buckets: bool,
    max_reconnects: int,
    wait_for_server_s: float,
    audit: bool,
    audit_max_age_s: float,
    audit_max_bytes: int,
) -> None:
    """Serve emit / emit_and_collect on hookbus.v1.emit.<agent>.<event> and
    hookbus.v1.emit_and_collect.<agent>.<event> (queue group hookbus-dispatcher). SIGTERM/SIGINT
    drain within the grace period: intake stops at once, requests in flight finish, then
    approval waits are aborted (left pending: the agent's retry with the same idempotency
    key resumes them) and whatever is left is answered with a retryable 'unavailable'.
    A second signal stops at once."""

    async def body(sup: Supervisor, server: ConnectionSettings) -> None:
        nc = await connect(
            server,
            name="hookbus-dispatcher",
            service=True,
            max_reconnects=max_reconnects,
            wait_for_server_s=wait_for_server_s,
        )
        url = server.url or LOCAL_URL
        sup.watch(nc, url)
        dispatcher = HookDispatcher(
            nc,
            strict_events=True,
            bucket_replicas=bucket_replicas,
            suspension_ttl_s=suspension_ttl_s,
            approval_ttl_s=approval_ttl_s,
            max_pending_approvals=max_pending_approvals,
            strict_buckets=strict_buckets,
            audit=audit,
            audit_max_age_s=audit_max_age_s,
            audit_max_bytes=audit_max_bytes,
        )
        service = DispatcherService(
            dispatcher, nc, max_concurrency=max_concurrency, grace_s=grace_s,
            agent_max_in_flight=agent_max_in_flight or None,
            agent_rate_per_s=agent_rate_per_s or None, agent_burst=agent_burst,
            expiry_sweep_s=expiry_sweep_s,
        )  # fmt: skip
        try:
            await service.start()
        except HookbusError as exc:  # a bucket that differs (strict), JetStream down
            raise click.ClickException(str(exc)) from exc
        sup.serving(service.stop)
        routes = dispatcher.list_handlers()
        handlers = sum(len(names) for names in routes.values())
        click.echo(
            f"dispatcher serving {EMIT_SERVICE_WILDCARD} and {COLLECT_SERVICE_WILDCARD}"
            f" at {_redacted(url)} (queue group {DISPATCHER_QUEUE_GROUP}, concurrency"
            f" {max_concurrency}, per agent {agent_max_in_flight or 'unbounded'} in flight and"
            f" {f'{agent_rate_per_s:g}/s burst {agent_burst}' if agent_rate_per_s else 'no rate'},"
            f" {handlers} handler(s) declared for {len(routes)} event(s),"
            f" audit {'on' if audit else 'off'}, grace {grace_s:g} s, loop {running_loop()};"
            " Ctrl-C drains and stops)",
            err=True,
        )
        await service.run()

    what = "hookbus dispatcher"
    with (
        stop_on_signals(what),
        connection_or_embedded(conn) as server,
        otel_session("hookbus-dispatcher", otlp_endpoint),
    ):
        sup = Supervisor(what, grace_s=grace_s, max_reconnects=max_reconnects)
        code = run_async(sup.run(lambda s: body(s, server)), serving=True)
    if code:
        raise click.exceptions.Exit(code)


async def _ensure_bucket(nc: NATS, config: KeyValueConfig, *, strict: bool) -> None:
    """Create `config`'s bucket as asked, or report it if it exists with another config.

    Raises:
        click.ClickException: `strict` and the bucket differs, or JetStream is unavailable.
    """
    try:
        await open_bucket(nc, config, strict=strict)
    except HookbusError as exc:
        raise click.ClickException(str(exc)) from exc
