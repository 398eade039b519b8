"""Suspension benchmark: resolve -> waiter wakes, against a KV put.

    .venv/bin/python benchmarks/suspensions.py              # embedded nats-server, n=300
    .venv/bin/python benchmarks/suspensions.py --n 1000 --url nats://127.0.0.1:4222

Two dispatchers on two connections (a waiter and a resolver, as two processes would be)
in one process, so one clock times both ends; ``--processes`` puts the resolver (and the
baseline's puts) in a process of its own instead (`_resolver_proc.py`, driven line by
line; `time.perf_counter` is ``CLOCK_MONOTONIC`` on Linux, one clock for both):

- ``put``: one JetStream KV ``put`` of a record-sized value (the baseline);
- ``wake``: from just before ``resolve_hook`` is called on the resolver's connection to the
  waiter's ``hook()`` returning on its own connection: the resolver's compare-and-set on
  the revision its own watch saw (it listens to the events, so it keeps one), the KV watch
  delivery to the waiter; the waiter's "consumed" mark is written after it returned.

For reading the figure, a third sample per round, ``floor``: the least a KV-watch wake can
cost, a raw ``put`` on the resolver's connection -> a raw watcher on the waiter's
connection returns it (one write, one push, no hookbus code).

Samples are interleaved (one of each per round, alternating which goes first) so
machine noise hits both alike; the ratio ``wake_p50 / put_p50`` is the figure (target
<= 1.8). Each wake sample starts once the waiter is in its wait loop (its pending event,
published after the record is written and the shared watch is set up, has arrived), plus
a 2 ms settle outside the measured window. Not a test: nothing asserts.

``--scale N`` (e.g. 100000) measures suspensions at fleet scale instead, on one server:
N hooks waiting at once in one process (started in waves of 1,000, each wave until its
``pending`` events arrived), a listing of the N pending records (one pass, filtered by
status, one page of 100 and the whole set, through the API and ``hookbus suspensions list``),
then every hook resolved from a second connection (256 at a time) until every waiter has
returned. It prints the seconds of each phase and the JetStream consumers on the bucket.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.js.errors
from nats.js.api import KeyValueConfig

from hookbus._core.buckets import suspensions_bucket_config
from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    SUSPENSION_EVENTS_WILDCARD,
    SUSPENSIONS_BUCKET,
    HookEvent,
    SuspensionRecord,
    decode,
    encode,
)

__all__ = ["bench_one_process", "bench_scale", "bench_suspensions"]

BENCH_BUCKET = "hookbus_bench_kv"
"""The baseline's bucket: same settings as the suspensions bucket (file, history 1, direct)."""
TARGET_RATIO = 1.8
RESOLVER = Path(__file__).resolve().parent / "_resolver_proc.py"
WARMUP = 20
SETTLE_S = 0.002


class Answer(msgspec.Struct):
    approved: bool
    by: str = ""


def _record_sized_value() -> bytes:
    """A value the size of a resolved suspension record (what a resolve writes)."""
    return encode(
        SuspensionRecord(
            label="bench " + "x" * 40, status="resolved", hook_id=uuid.uuid4().hex,
            run_id=uuid.uuid4().hex, metadata={"tool_name": "bash", "prompt": "Allow bash?"},
            payload_type="Answer", payload_schema=msgspec.json.schema(Answer),
            resolution={"approved": True, "by": "bench"}, created_at=time.time(),
            settled_at=time.time(),
        )
    )  # fmt: skip


def _pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Resolver:
    """The resolver process (`_resolver_proc.py`): `ask` sends one command and returns the
    ``(t0, seconds)`` it answers."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, url: str) -> _Resolver:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(RESOLVER), url, BENCH_BUCKET,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if line.strip() != b"ready":
            raise RuntimeError(f"the resolver process did not start: {line!r}")
        return cls(proc)

    async def ask(self, command: str) -> tuple[float, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        t0, seconds = (await asyncio.wait_for(self.proc.stdout.readline(), 30)).split()
        return float(t0), float(seconds)

    async def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def _bench_bucket(nc: nats.NATS) -> Any:
    js = nc.jetstream()
    config = KeyValueConfig(bucket=BENCH_BUCKET, history=1, direct=True)
    try:
        return await js.create_key_value(config=config)
    except nats.js.errors.BadRequestError:
        return await js.key_value(BENCH_BUCKET)


async def _floor_watch(nc: Any) -> Any:
    """A watch of the bench bucket's ``floor`` key, read past its initial state (up to
    the "no more" marker): the raw put -> watch floor's delivery side."""
    watch = await (await nc.jetstream().key_value(BENCH_BUCKET)).watch("floor")
    while await watch.updates(timeout=5) is not None:
        pass
    return watch


def _waiting(waiter: HookDispatcher, i: int) -> tuple[str, asyncio.Task[None], list[float]]:
    """A fresh label, the task in which `waiter` waits on it, and the list its wake time
    (`time.perf_counter`) is appended to."""
    label = f"bench {uuid.uuid4().hex[:8]} {i}"
    woke: list[float] = []

    async def wait() -> None:
        await waiter.hook(label, Answer)
        woke.append(time.perf_counter())

    return label, asyncio.create_task(wait()), woke


async def _until_pending(waiter: HookDispatcher, label: str) -> None:
    """Return once `label`'s record is pending (read every millisecond, for 10 s at most)."""
    for _ in range(10_000):
        got = await waiter.suspensions.get(label)
        if got is not None and got[0].status == "pending":
            return
        await asyncio.sleep(0.001)
    raise TimeoutError(f"{label!r} did not become pending")


async def bench_suspensions(url: str, n: int, *, processes: bool = False) -> dict[str, Any]:
    """`bench_one_process`'s figures; with `processes`, the resolver and the baseline's
    puts in a process of their own."""
    if not processes:
        return await bench_one_process(url, n)
    nc_wait = await nats.connect(url, name="bench-waiter")
    resolver: _Resolver | None = None
    try:
        waiter = HookDispatcher(nc_wait, approvals=False)
        await waiter.start()
        await _bench_bucket(nc_wait)
        resolver = await _Resolver.start(url)
        floor_watch = await _floor_watch(nc_wait)
        puts: list[float] = []
        floors: list[float] = []
        wakes: list[float] = []
        calls: list[float] = []

        async def wake_once(i: int) -> tuple[float, float]:
            assert resolver is not None
            label, task, woke = _waiting(waiter, i)
            await _until_pending(waiter, label)
            await asyncio.sleep(SETTLE_S)  # not measured
            t0, call = await resolver.ask(f"resolve {label}")
            await asyncio.wait_for(task, 10)
            return woke[0] - t0, call

        async def floor_once(i: int) -> float:
            assert resolver is not None
            asked = asyncio.ensure_future(resolver.ask("floor"))
            while await floor_watch.updates(timeout=10) is None:
                pass
            seen = time.perf_counter()
            t0, _ = await asked
            return seen - t0

        async def put_once(i: int) -> float:
            assert resolver is not None
            return (await resolver.ask(f"put {i % 64}"))[1]

        async with waiter.run():  # its exit removes the bench records
            for i in range(WARMUP + n):
                order = (
                    (wake_once, floor_once, put_once)
                    if i % 2
                    else (put_once, floor_once, wake_once)
                )
                got: dict[Any, Any] = {}
                for step in order:
                    got[step] = await step(i)
                if i >= WARMUP:
                    w, c = got[wake_once]
                    puts.append(got[put_once])
                    floors.append(got[floor_once])
                    wakes.append(w)
                    calls.append(c)
        await floor_watch.stop()
        await waiter.close()
        return _summary(n, puts, floors, wakes, calls)
    finally:
        if resolver is not None:
            await resolver.stop()
        await nc_wait.close()


def _summary(
    n: int, puts: list[float], floors: list[float], wakes: list[float], calls: list[float]
) -> dict[str, Any]:
    with_ms = {
        "put_p50_ms": statistics.median(puts) * 1e3,
        "put_p90_ms": _pct(puts, 0.9) * 1e3,
        "wake_p50_ms": statistics.median(wakes) * 1e3,
        "wake_p90_ms": _pct(wakes, 0.9) * 1e3,
        "resolve_call_p50_ms": statistics.median(calls) * 1e3,
        "floor_p50_ms": statistics.median(floors) * 1e3,
    }
    ratio = with_ms["wake_p50_ms"] / with_ms["put_p50_ms"]
    return {
        "n": n,
        **{k: round(v, 3) for k, v in with_ms.items()},
        "floor_ratio": round(with_ms["floor_p50_ms"] / with_ms["put_p50_ms"], 2),
        "ratio": round(ratio, 2),
        "target": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO,
    }


async def bench_one_process(url: str, n: int) -> dict[str, Any]:
    """Measure `n` interleaved rounds (after `WARMUP` unmeasured ones) against `url`.

    Returns (times in milliseconds): ``{"n", "put_p50_ms", "put_p90_ms", "wake_p50_ms",
    "wake_p90_ms", "resolve_call_p50_ms", "floor_p50_ms", "floor_ratio", "ratio", "target",
    "met"}`` where ``ratio`` is ``wake_p50_ms / put_p50_ms``; ``resolve_call_p50_ms`` is how
    long ``resolve_hook`` itself took (read, schema check, compare-and-set, event) and
    ``floor_p50_ms`` a raw put -> raw watcher wake (``floor_ratio`` to the put): both only
    for reading the wake figure.
    """
    nc_wait = await nats.connect(url, name="bench-waiter")
    nc_res = await nats.connect(url, name="bench-resolver")
    try:
        waiter = HookDispatcher(nc_wait, approvals=False)
        resolver = HookDispatcher(nc_res, approvals=False)
        await waiter.start()
        await resolver.start()
        js = nc_res.jetstream()
        config = KeyValueConfig(bucket=BENCH_BUCKET, history=1, direct=True)
        try:
            kv = await js.create_key_value(config=config)
        except nats.js.errors.BadRequestError:
            kv = await js.key_value(BENCH_BUCKET)
        value = _record_sized_value()
        events = await resolver.hook_events()

        floor_watch = await _floor_watch(nc_wait)
        puts: list[float] = []
        floors: list[float] = []
        wakes: list[float] = []
        calls: list[float] = []

        async def put_once(i: int) -> float:
            t0 = time.perf_counter()
            await kv.put(f"k{i % 64}", value)
            return time.perf_counter() - t0

        async def floor_once(i: int) -> float:
            t0 = time.perf_counter()
            await kv.put("floor", value)
            while await floor_watch.updates(timeout=10) is None:
                pass
            return time.perf_counter() - t0

        async def wake_once(i: int) -> tuple[float, float]:
            label, task, woke = _waiting(waiter, i)
            async for e in events:
                if e.hook.label == label and e.hook.status == "pending":
                    break
            await asyncio.sleep(SETTLE_S)  # not measured
            t0 = time.perf_counter()
            await resolver.resolve_hook(label, Answer(approved=True, by="bench"))
            t_call = time.perf_counter() - t0
            await asyncio.wait_for(task, 10)
            return woke[0] - t0, t_call

        async with waiter.run():  # its exit removes the bench records
            for i in range(WARMUP + n):
                if i % 2:
                    w, c = await wake_once(i)
                    f = await floor_once(i)
                    p = await put_once(i)
                else:
                    p = await put_once(i)
                    f = await floor_once(i)
                    w, c = await wake_once(i)
                if i >= WARMUP:
                    puts.append(p)
                    floors.append(f)
                    wakes.append(w)
                    calls.append(c)
        await floor_watch.stop()
        await events.aclose()
        await waiter.close()
        await resolver.close()
        return _summary(n, puts, floors, wakes, calls)
    finally:
        await nc_wait.close()
        await nc_res.close()


async def bench_scale(url: str, n: int, *, wave: int = 1000) -> dict[str, Any]:
    """Create `n` waiting hooks in one process, list them, resolve them all and wait until
    every waiter returned. Returns seconds per phase and the bucket's consumer count."""
    nc_wait = await nats.connect(url, name="bench-scale-waiter", pending_size=256 * 1024 * 1024)
    nc_res = await nats.connect(url, name="bench-scale-resolver")
    tag = f"scale-{uuid.uuid4().hex[:6]}"
    labels = [f"{tag} {i}" for i in range(n)]
    try:
        waiter = HookDispatcher(nc_wait, approvals=False)
        resolver = HookDispatcher(nc_res, approvals=False)
        await waiter.start()
        await resolver.start()
        events = await nc_res.subscribe(SUSPENSION_EVENTS_WILDCARD, pending_msgs_limit=-1)
        await nc_res.flush()
        woke = 0
        all_woke = asyncio.Event()

        async def wait(label: str) -> None:
            nonlocal woke
            await waiter.hook(label, Answer)
            woke += 1
            if woke == n:
                all_woke.set()

        tasks = []
        t0 = time.perf_counter()
        for start in range(0, n, wave):
            chunk = labels[start : start + wave]
            tasks += [asyncio.create_task(wait(label)) for label in chunk]
            seen = 0
            while seen < len(chunk):
                hook = decode((await events.next_msg(timeout=60)).data, HookEvent).hook
                if hook.status == "pending" and hook.label.startswith(tag):
                    seen += 1
        create_s = time.perf_counter() - t0
        info = await nc_res.jetstream().stream_info(f"KV_{SUSPENSIONS_BUCKET}")
        consumers = info.state.consumer_count

        t0 = time.perf_counter()
        first = await resolver.suspensions.page(status="pending", prefix=tag, limit=100)
        page_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        everything = await resolver.suspensions.page(status="pending", prefix=tag)
        list_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hookbus.cli", "suspensions", "list", "--status", "pending",
            "--limit", "100", "--json", "--url", url,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "NO_COLOR": "1"},
        )  # fmt: skip
        cli_code = await cli.wait()
        cli_s = time.perf_counter() - t0

        limit = asyncio.Semaphore(256)

        async def resolve(label: str) -> None:
            async with limit:
                await resolver.resolve_hook(label, Answer(approved=True, by="bench"))

        t0 = time.perf_counter()
        await asyncio.gather(*(resolve(label) for label in labels))
        resolve_s = time.perf_counter() - t0
        await asyncio.wait_for(all_woke.wait(), 600)
        wake_s = time.perf_counter() - t0
        await asyncio.gather(*tasks)
        await events.unsubscribe()
        await waiter.close()
        await resolver.close()
        return {
            "n": n,
            "create_s": round(create_s, 2),
            "list_first_page_s": round(page_s, 2),
            "list_all_s": round(list_s, 2),
            "listed": everything.total,
            "first_page": len(first.records),
            "cli_list_page_s": round(cli_s, 2),
            "cli_ok": cli_code == 0,
            "resolve_all_s": round(resolve_s, 2),
            "resolve_and_wake_all_s": round(wake_s, 2),
            "woken": woke,
            "bucket_consumers_while_waiting": consumers,
        }
    finally:
        await nc_wait.close()
        await nc_res.close()


async def bench_writes(url: str, n: int) -> dict[str, float]:
    """p50 (ms) of each kind of KV write a suspension makes, in a bucket configured as the
    suspensions bucket (`suspensions_bucket_config`), interleaved, no watcher: a put on an
    existing key and on a fresh one, a create (what a pending record is), a compare-and-set
    on the key created just before (what a resolution is) and on an older key."""
    nc = await nats.connect(url, name="bench-writes")
    try:
        js = nc.jetstream()
        config = suspensions_bucket_config()
        config.bucket = "hookbus_bench_writes"
        kv = await js.create_key_value(config=config)
        value = b"x" * 300
        await kv.put("existing", value)
        times: dict[str, list[float]] = {
            k: [] for k in ("put existing", "put fresh", "create", "cas fresh", "cas existing")
        }
        for i in range(WARMUP + n):
            took: dict[str, float] = {}
            t = time.perf_counter()
            await kv.put("existing", value)
            took["put existing"] = time.perf_counter() - t
            t = time.perf_counter()
            await kv.put(f"put.{i}", value)
            took["put fresh"] = time.perf_counter() - t
            t = time.perf_counter()
            revision = await kv.create(f"made.{i}", value)
            took["create"] = time.perf_counter() - t
            t = time.perf_counter()
            await kv.update(f"made.{i}", value, last=revision)
            took["cas fresh"] = time.perf_counter() - t
            last = (await kv.get("existing")).revision
            t = time.perf_counter()
            await kv.update("existing", value, last=last)
            took["cas existing"] = time.perf_counter() - t
            if i >= WARMUP:
                for k, v in took.items():
                    times[k].append(v)
        await js.delete_key_value(config.bucket)
        return {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
    finally:
        await nc.close()


async def bench_deliveries(url: str, n: int, consumers: int = 0) -> dict[str, float]:
    """p50 (ms) from a write's send to its delivery to a consumer of the waiter's kind
    (`subscribe_keys` on one agent's keys, on a connection of its own), in a bucket
    configured as the suspensions bucket: after a put on a fresh key, and after a
    compare-and-set on a key created 2 ms before (what a resolution is); with `consumers`
    more consumers of every key delivering to the watcher's process (as a resolver's or a
    console's watch would), each a message its Python handles too."""
    from nats.js.api import DeliverPolicy

    from hookbus._core.kv import subscribe_keys

    writer = await nats.connect(url, name="bench-writer")
    watcher = await nats.connect(url, name="bench-watcher")
    try:
        config = suspensions_bucket_config()
        config.bucket = "hookbus_bench_deliveries"
        kv = await writer.jetstream().create_key_value(config=config)
        watched = await watcher.jetstream().key_value(config.bucket)
        arrivals: dict[str, asyncio.Future[float]] = {}

        async def note(msg: Any) -> None:
            arrival = arrivals.pop(msg.subject, None)
            if arrival is not None:
                arrival.set_result(time.perf_counter())

        async def ignore(msg: Any) -> None:
            return None

        subs = [
            await subscribe_keys(
                watched, "agent.>", cb=note, deliver_policy=DeliverPolicy.NEW,
                inactive_threshold_s=60.0,
            )
        ]  # fmt: skip
        for _ in range(consumers):
            subs.append(
                await subscribe_keys(
                    watched, ">", cb=ignore, deliver_policy=DeliverPolicy.NEW,
                    inactive_threshold_s=60.0,
                )
            )  # fmt: skip
        await asyncio.sleep(0.2)
        prefix = f"$KV.{config.bucket}."

        def expect(key: str) -> asyncio.Future[float]:
            arrival = arrivals[prefix + key] = asyncio.get_running_loop().create_future()
            return arrival

        puts: list[float] = []
        swaps: list[float] = []
        value = b"x" * 300
        for i in range(WARMUP + n):
            arrival = expect(f"agent.put{i}")
            t = time.perf_counter()
            await kv.put(f"agent.put{i}", value)
            put = await asyncio.wait_for(arrival, 10) - t
            arrival = expect(f"agent.made{i}")
            revision = await kv.create(f"agent.made{i}", value)
            await asyncio.wait_for(arrival, 10)
            await asyncio.sleep(SETTLE_S)
            arrival = expect(f"agent.made{i}")
            t = time.perf_counter()
            await kv.update(f"agent.made{i}", value, last=revision)
            swap = await asyncio.wait_for(arrival, 10) - t
            if i >= WARMUP:
                puts.append(put)
                swaps.append(swap)
        for sub in subs:
            await sub.unsubscribe()
        await writer.jetstream().delete_key_value(config.bucket)
        return {
            "consumers": consumers,
            "put -> delivery": round(statistics.median(puts) * 1e3, 3),
            "cas -> delivery": round(statistics.median(swaps) * 1e3, 3),
        }
    finally:
        await watcher.close()
        await writer.close()


def _on_server(url: str | None, bench: Any, *args: Any, **kwargs: Any) -> Any:
    """``bench(url, *args, **kwargs)`` run to its end on the server at `url`, or on an
    embedded one when `url` is None."""
    if url:
        return asyncio.run(bench(url, *args, **kwargs))
    with EmbeddedNatsServer() as server:
        return asyncio.run(bench(server.url, *args, **kwargs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="measured rounds (default 300)")
    parser.add_argument("--url", default=None, help="NATS URL (default: an embedded server)")
    parser.add_argument(
        "--scale", type=int, default=None, metavar="N", help="fleet-scale run with N hooks"
    )
    parser.add_argument(
        "--processes", action="store_true",
        help="the resolver and the baseline's puts in a process of their own",
    )  # fmt: skip
    parser.add_argument(
        "--writes", action="store_true",
        help="p50 of each kind of KV write a suspension makes (put, create, compare-and-set)",
    )  # fmt: skip
    parser.add_argument(
        "--deliveries", type=int, default=None, metavar="CONSUMERS",
        help="p50 from a write to its delivery to a watch of the waiter's kind, with"
        " CONSUMERS more consumers of the bucket in the watcher's process",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.deliveries is not None:
        print(json.dumps(_on_server(args.url, bench_deliveries, args.n, args.deliveries), indent=2))
        return 0
    if args.writes:
        print(json.dumps(_on_server(args.url, bench_writes, args.n), indent=2))
        return 0
    if args.scale:
        print(json.dumps(_on_server(args.url, bench_scale, args.scale), indent=2))
        return 0
    result = _on_server(args.url, bench_suspensions, args.n, processes=args.processes)
    print(json.dumps(result, indent=2))
    print(
        f"resolve -> waiter wakes p50 {result['wake_p50_ms']:.3f} ms = {result['ratio']:.2f}x "
        f"a KV put ({result['put_p50_ms']:.3f} ms); target <= {TARGET_RATIO}x: "
        f"{'MET' if result['met'] else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
