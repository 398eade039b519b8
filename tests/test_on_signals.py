"""`on_signals`: the CLI's one signal path (first signal: stop gracefully; again: at once)."""

from __future__ import annotations

import asyncio
import signal

from hookbus.cli._lifecycle import on_signals


def test_first_then_again_and_handlers_restored() -> None:
    calls: list[tuple[str, signal.Signals]] = []
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with on_signals(lambda s: calls.append(("first", s)), lambda s: calls.append(("again", s))):
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
    assert calls == [
        ("first", signal.SIGTERM),
        ("again", signal.SIGINT),
        ("again", signal.SIGTERM),
    ]
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_on_the_event_loop() -> None:
    calls: list[tuple[str, signal.Signals]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with on_signals(lambda s: calls.append(("first", s)), loop=loop):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            await asyncio.sleep(0.05)

    before = signal.getsignal(signal.SIGINT)
    asyncio.run(main())
    assert calls == [("first", signal.SIGINT), ("first", signal.SIGINT)]  # no `again`
    assert signal.getsignal(signal.SIGINT) is before
