"""How the long-running commands (``worker``, ``dispatcher``, ``emit``) start and stop,
and which event loop they run on.

- `run_loop` runs a command's coroutine on uvloop when it is installed (the ``uvloop``
  extra), else on asyncio's own loop; ``HOOKBUS_LOOP=asyncio`` (or ``hookbus --loop
  asyncio``) opts out, ``HOOKBUS_LOOP=uvloop`` insists (`MissingExtraError` without it).
  `running_loop` names the loop that runs, for the banners.

- Before the event loop runs (and after it), SIGINT and SIGTERM raise `Interrupted`, so
  the ``with`` blocks around it (the embedded nats-server, the OpenTelemetry flush) unwind
  and clean up; `stop_on_signals` turns it into exit code 128 + the signal's number.
  SIGINT is handled even when the process was started with it ignored (a non-interactive
  shell's background job), as nats-server does.
- While it runs (`Supervisor`): the first SIGINT or SIGTERM starts the command's drain,
  bounded by its grace period (plus `DRAIN_MARGIN_S`); a second one, or the bound, stops
  at once (exit 128 + signal). A signal before the command serves stops it at once.
- `on_signals` is the one place that takes SIGINT and SIGTERM, for every long-running
  command (the three above, ``server``, ``gateway``, ``console``): the first one asks the
  command to stop gracefully, each later one to stop at once; the handlers in place before
  are back once the block ends.
- `on_hangup` takes SIGHUP for ``server``, whose nats-server reads its config again on it
  (a reload, as nats-server itself does on SIGHUP): it never stops a command.
- A NATS connection that nats-py gave up on (every reconnect attempt failed) ends the
  command with one error line (exit 1), never a retry loop without end.
- A serving command (``worker``, ``dispatcher``, ``gateway``: `run_loop`'s ``serving``)
  moves what its start made (modules, the handlers, the telemetry SDK) out of the
  garbage collector's reach before it serves (`gc.freeze`), so the collector's full
  passes walk only what serving makes, and collects its youngest generation after
  `SERVING_GC_THRESHOLDS` allocations, not CPython's 700 (2,000 on 3.13), so that the
  objects of requests in flight are rarely promoted (see docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Final, TypeVar

import anyio
import click
from nats.aio.client import Client as NATS

from hookbus._core.deadlines import NEVER, Deadline

from ._command_support import close_quietly, drain_or_close
from ._connect import _redacted
from ._extras import MissingExtraError

__all__ = [
    "DRAIN_MARGIN_S",
    "LOOP_CHOICES",
    "LOOP_ENV",
    "Interrupted",
    "Supervisor",
    "listen",
    "loop_choice",
    "on_hangup",
    "on_signals",
    "run_async",
    "run_loop",
    "running_loop",
    "serve_announced",
    "serve_until_signalled",
    "stop_on_signals",
]

log = logging.getLogger("hookbus.cli")

T = TypeVar("T")

LOOP_ENV = "HOOKBUS_LOOP"
"""The environment variable that picks the event loop: ``auto``, ``uvloop`` or ``asyncio``."""
LOOP_CHOICES = ("auto", "uvloop", "asyncio")

DRAIN_MARGIN_S = 5.0
"""Seconds past the grace period a drain may take before the command stops at once."""

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def loop_choice(preference: str | None = None) -> str:
    """The event loop a command runs on: ``"uvloop"`` or ``"asyncio"``.

    Args:
        preference: ``auto`` (uvloop if installed, else asyncio), ``uvloop`` or ``asyncio``
            (any case); None reads ``HOOKBUS_LOOP`` (unset or empty: ``auto``).
    Raises:
        click.BadParameter: `preference` (or ``HOOKBUS_LOOP``) is none of those.
        MissingExtraError: ``uvloop`` asked for and not installed.
    """
    raw = os.environ.get(LOOP_ENV, "") if preference is None else preference
    wanted = raw.strip().lower() or "auto"
    if wanted not in LOOP_CHOICES:
        raise click.BadParameter(
            f"{raw!r} is not one of {', '.join(LOOP_CHOICES)}", param_hint=f"{LOOP_ENV} / --loop"
        )
    if wanted == "asyncio":
        return "asyncio"
    installed = importlib.util.find_spec("uvloop") is not None
    if wanted == "uvloop" and not installed:
        raise MissingExtraError(f"{LOOP_ENV}=uvloop (--loop uvloop)", "uvloop")
    return "uvloop" if installed else "asyncio"


SERVING_GC_THRESHOLDS: Final = (20_000, 20, 20)
"""`gc.set_threshold` of a serving command: a young collection every 20,000 net
allocations of tracked objects, the middle one every 20 of those, the full one every 20
middle ones (and CPython's own rule: when a quarter of the old objects are new). Kept
where an operator set a higher first threshold."""


def run_loop(func: Callable[..., Awaitable[T]], *args: Any, serving: bool = False) -> T:
    """Run ``func(*args)`` to its end on a new event loop, through anyio's asyncio backend
    (nats-py runs on asyncio only): uvloop's loop or asyncio's, as `loop_choice` says.

    `serving`: a long-running command that serves requests. What exists before its loop
    starts is collected once and then frozen (`gc.freeze`: the objects leave the
    collector's generations; reference counting still frees them), so each full
    collection while it serves walks only the objects made since, not every module and
    the telemetry SDK again; and the collector's thresholds become
    `SERVING_GC_THRESHOLDS`.

    Raises:
        click.BadParameter, MissingExtraError: see `loop_choice` (before any loop runs).
        Exception: whatever `func` raised.
    """
    name = loop_choice()
    options: dict[str, Any] = {}
    if name == "uvloop":
        import uvloop

        options["loop_factory"] = uvloop.new_event_loop
    log.debug("event loop: %s", name)
    if serving:
        gc.collect()  # the start's cyclic garbage, before it is frozen for good
        gc.freeze()
        if gc.get_threshold()[0] < SERVING_GC_THRESHOLDS[0]:
            gc.set_threshold(*SERVING_GC_THRESHOLDS)
    return anyio.run(func, *args, backend="asyncio", backend_options=options)


def run_async(coro: Coroutine[Any, Any, T], *, serving: bool = False) -> T:
    """Run a coroutine on the CLI's event loop (`run_loop`: uvloop when installed, else
    asyncio's; nats-py's backend is asyncio; `serving`: see `run_loop`).

    Raises:
        click.BadParameter, MissingExtraError: a ``HOOKBUS_LOOP`` that cannot be had.
    """

    async def runner() -> T:
        return await coro

    try:
        return run_loop(runner, serving=serving)
    finally:
        coro.close()  # never started (no loop could be had): no "never awaited" warning


def running_loop() -> str:
    """``"uvloop"`` or ``"asyncio"``: the event loop running this coroutine."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.split(".")[0] == "uvloop" else "asyncio"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM outside the event loop; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(sig: signal.Signals) -> None:
    raise Interrupted(sig)


@contextlib.contextmanager
def on_signals(
    first: Callable[[signal.Signals], None],
    again: Callable[[signal.Signals], None] | None = None,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
) -> Iterator[None]:
    """Inside the block, the first SIGINT or SIGTERM calls ``first(sig)`` (stop
    gracefully) and each later one ``again(sig)`` (stop at once; None: `first` again).

    Args:
        first: called with the first signal.
        again: called with each signal after the first.
        loop: the running event loop, to handle them on it (``loop.add_signal_handler``:
            the callbacks run as loop callbacks); None handles them with `signal.signal`
            (the callbacks run in the main thread between two bytecodes, and may raise).
    The handlers in place before are put back when the block ends.
    """
    received: list[signal.Signals] = []

    def dispatch(sig: signal.Signals) -> None:
        received.append(sig)
        (first if len(received) == 1 or again is None else again)(sig)

    saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    for sig in _SIGNALS:
        if loop is not None:
            loop.add_signal_handler(sig, dispatch, sig)
        else:
            signal.signal(sig, lambda signum, frame: dispatch(signal.Signals(signum)))
    try:
        yield
    finally:
        for sig in _SIGNALS:
            if loop is not None:
                loop.remove_signal_handler(sig)
            signal.signal(sig, saved[sig])  # asyncio leaves the default behind


@contextlib.contextmanager
def on_hangup(callback: Callable[[], None]) -> Iterator[None]:
    """Inside the block, SIGHUP calls ``callback()`` (with `signal.signal`: in the main
    thread, between two bytecodes) instead of ending the process (its default, exit 129);
    the handler in place before is back when the block ends. A no-op where there is no
    SIGHUP (Windows)."""
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is None:
        yield
        return
    saved = signal.getsignal(hangup)
    signal.signal(hangup, lambda signum, frame: callback())
    try:
        yield
    finally:
        signal.signal(hangup, saved)


async def serve_until_signalled(server: Any, sockets: list[socket.socket]) -> None:
    """Run a ``uvicorn.Server`` on `sockets` until it stops; the signals go through
    `on_signals` instead of uvicorn's own handlers: the first SIGINT or SIGTERM stops it
    gracefully (``should_exit``: open requests finish within its graceful-shutdown
    timeout, then its lifespan ends), a second one at once (``force_exit``)."""

    def stop(sig: signal.Signals) -> None:
        server.should_exit = True

    def force(sig: signal.Signals) -> None:
        server.force_exit = True

    server.capture_signals = contextlib.nullcontext  # uvicorn's own: none
    with on_signals(stop, force):
        await server.serve(sockets=sockets)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free port).

    Raises:
        click.ClickException: the address cannot be bound.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise click.ClickException(f"cannot resolve --host {host!r}: {exc.strerror}") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # answers are written in parts (head, body): without it Nagle's algorithm holds the
    # body back until the client's delayed ACK (40 ms on Linux); accepted sockets inherit it
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve_announced(
    server: Any, sock: socket.socket, *, what: str, scheme: str, banner: str, path: str = ""
) -> None:
    """`serve_until_signalled` on `sock` (a `listen` socket, closed at the end); once it
    serves, print ``hookbus <what> serving <scheme>://<host>:<port><path> <banner>`` on
    stderr (an IPv6 host in brackets; nothing if it was stopped while starting)."""
    host, port = sock.getsockname()[:2]
    url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}{path}"
    startup = server.startup

    async def announce(sockets: list[socket.socket] | None = None) -> None:
        await startup(sockets)
        if not server.should_exit:
            click.echo(f"hookbus {what} serving {url} {banner}", err=True)

    server.startup = announce
    try:
        await serve_until_signalled(server, [sock])
    finally:
        sock.close()


@contextlib.contextmanager
def stop_on_signals(what: str) -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` inside the block; leaving the block on one
    prints one line and exits with 128 + its number (the blocks inside have unwound)."""
    try:
        with on_signals(_raise_interrupted):
            yield
    except Interrupted as exc:
        click.echo(f"{what}: {signal.Signals(exc.signum).name}: stopped", err=True)
        raise click.exceptions.Exit(128 + exc.signum) from None


class Supervisor:
    """Runs one command's coroutine on the event loop and owns SIGINT/SIGTERM meanwhile.

    The coroutine calls `watch` with its connection once connected (the supervisor drains
    and closes it at the end, within a bound) and `serving` with its drain function once it
    serves; `run` returns the exit code.

    Args:
        what: the command's name, for messages.
        grace_s: the drain's grace period, seconds.
        max_reconnects: the connection's reconnect attempts (for the message when they ran
            out; -1: forever).
    """

    def __init__(self, what: str, *, grace_s: float, max_reconnects: int = -1) -> None:
        self.what = what
        self.grace_s = grace_s
        self.max_reconnects = max_reconnects
        self.signum = 0
        self._forced = False
        self._deadline: Deadline = NEVER  # the drain's bound, on the loop's clock
        self._nc: NATS | None = None
        self._url = ""
        self._stop: Callable[[], Awaitable[None]] | None = None
        self._tasks: list[asyncio.Future[Any]] = []
        self._main: asyncio.Future[Any] | None = None

    def watch(self, nc: NATS, url: str) -> None:
        """Own `nc`: if nats-py closes it for good while serving, `run` fails; at the end it
        is drained (closed at once after a forced stop)."""
        self._nc, self._url = nc, url

    def serving(self, stop: Callable[[], Awaitable[None]]) -> None:
        """The command serves now; `stop()` drains it (called once, on the first signal)."""
        self._stop = stop

    def _on_again(self, sig: signal.Signals) -> None:
        self._forced = True
        click.echo(f"{self.what}: {sig.name} again: stopping at once", err=True)

    def _on_signal(self, sig: signal.Signals) -> None:
        loop = asyncio.get_running_loop()
        self.signum = sig
        if self._stop is None:  # not serving yet: nothing to drain
            self._forced = True
            click.echo(f"{self.what}: {sig.name}: stopping", err=True)
            return
        self._deadline = Deadline.after(self.grace_s, loop.time()).plus(DRAIN_MARGIN_S)
        click.echo(
            f"{self.what}: {sig.name}: draining (up to {self.grace_s:g} s; {sig.name} again"
            " stops at once)",
            err=True,
        )
        if self._nc is not None and not self._nc.is_connected:  # nothing to drain through
            self._tasks.append(asyncio.ensure_future(close_quietly(self._nc)))
        self._tasks.append(asyncio.ensure_future(self._stop()))

    async def run(self, body: Callable[[Supervisor], Awaitable[None]]) -> int:
        """Run ``body(self)`` to its end or until stopped; return the exit code: 0 when it
        ended by itself or drained after a signal, 128 + the signal when stopped at once.

        Raises:
            click.ClickException: the connection was given up on (one line).
            Exception: whatever `body` raised.
        """
        loop = asyncio.get_running_loop()
        with on_signals(self._on_signal, self._on_again, loop=loop):
            main = self._main = asyncio.ensure_future(body(self))
            try:
                return await self._supervise(main)
            finally:
                try:
                    if self._nc is not None:
                        if self._forced:
                            await close_quietly(self._nc)
                        else:
                            await drain_or_close(self._nc)
                finally:
                    for task in self._tasks:
                        task.cancel()

    async def _supervise(self, main: asyncio.Future[Any]) -> int:
        loop = asyncio.get_running_loop()
        lost = False
        while not main.done():
            await asyncio.wait({main}, timeout=0.1)
            if main.done():
                break
            late = loop.time() > self._deadline.when  # strictly (`passed` counts the bound)
            if late:
                click.echo(f"{self.what}: the drain ran past its bound: stopping", err=True)
            nc = self._nc
            lost = not self.signum and nc is not None and nc.is_closed
            if self._forced or late or lost:
                main.cancel()
                await asyncio.wait({main}, timeout=3.0)
                break
        if lost:
            raise click.ClickException(self._lost_message())
        if main.done() and not main.cancelled():
            main.result()  # raises what the body raised
        if self._forced or not main.done() or main.cancelled():
            return 128 + int(self.signum or signal.SIGTERM)
        return 0

    def _lost_message(self) -> str:
        nc = self._nc
        error = nc.last_error if nc is not None else None
        reason = f" (last error: {error})" if error else ""
        url = _redacted(self._url)
        if self.max_reconnects >= 0:
            return (
                f"gave up on NATS at {url}: {self.max_reconnects} reconnect attempts failed"
                f"{reason}; start this again once the server is back (--max-reconnects -1"
                " retries forever)"
            )
        return f"the connection to NATS at {url} was closed{reason}"
