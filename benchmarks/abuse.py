"""One agent abusing its own grants on a secured server, and what the others notice.

```
.venv/bin/python benchmarks/abuse.py --quick          # a short smoke: about 30 s
.venv/bin/python benchmarks/abuse.py --seconds 20     # each measuring window 20 s
```

It makes a server as an operator would: ``hookbus auth init`` (agents ``victim`` and
``attacker``, worker ``sec`` serving ``tool:pre/security``, approver ``alice``),
nats-server with that config, ``hookbus auth provision`` (the admin creates the buckets),
then a ``hookbus dispatcher`` service and a ``hookbus worker`` as their own identities.

1. Baseline: the victim's emit latency through the service, one at a time (p50, p99).
2. Attack: the attacker, in a process of its own, for the same time and more,
   - floods emits through the service, 500 in flight (from its second second on);
   - tries to create 1,000 consumers on ``KV_hookbus_handlers`` and
     ``KV_hookbus_suspensions`` (unnamed, durable, randomly named, and in its own slots),
     and to delete the dispatcher service's consumers by their slot names;
   - writes suspension records under its own prefix until refused;
   - asks for many approvals (emits whose handler answers ``ask_user``), each with its own
     idempotency key, so that they stay pending;
   while the victim's latency is measured again.
3. While the attack goes on, a fresh dispatcher service and a fresh worker are started:
   did they start, and how long did they take?

It prints the figures, the ratios to the baseline taken in the same run, what the
attacker achieved, and one JSON line (``ABUSE {...}``). Like the other benchmarks it is
a command, not a test: it asserts nothing, and exits 1 only if the run itself fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NATS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import Proc

from hookbus.schemas import TOOL_PRE, HookResult, emit_service_subject, encode_token
from hookbus.workers import HookWorker

HERE = Path(__file__).resolve()
PY = sys.executable
FLOOD_IN_FLIGHT = 500
CONSUMER_ATTEMPTS = 1000
VICTIM_RATE_PER_S = 100.0
STREAMS = ("KV_hookbus_handlers", "KV_hookbus_suspensions")

# -- the worker the benchmark serves (``hookbus worker benchmarks/abuse.py:worker``) -------

worker = HookWorker()


@worker.handler(TOOL_PRE, name="security", timeout_s=5.0)
def security(event: str, data: dict[str, Any]) -> HookResult | None:
    """Allow every call, except one marked ``ask``: that one asks a human (who never
    answers in this benchmark)."""
    if data.get("ask"):
        return HookResult(
            action="ask_user", approval_prompt="allow?", approval_timeout=300.0,
            approval_default="deny", reason="abuse benchmark",
        )  # fmt: skip
    return None


# -- plumbing ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _context(folder: Path, stem: str) -> dict[str, Any]:
    return dict(json.loads((folder / f"{stem}.json").read_text()))


async def _connect(url: str, folder: Path, stem: str, **options: Any) -> NATS:
    ctx = _context(folder, stem)
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        url, nkeys_seed=ctx["nkey"], inbox_prefix=ctx["inbox_prefix"], error_cb=on_error,
        connect_timeout=5, max_reconnect_attempts=3, **options,
    )  # fmt: skip
    nc._abuse_errors = errors  # type: ignore[attr-defined]
    return nc


class Child(Proc):
    """A ``hookbus`` process that prints `ready` on stderr once it serves, timed."""

    def __init__(self, label: str, argv: list[str], ready: str) -> None:
        super().__init__(label, argv, ready)
        self.ready_s: float | None = None
        self.failure = ""

    async def start(self, timeout_s: float = 60.0) -> bool:  # type: ignore[override]
        """Spawn it and wait for its ready line; False (and `error`) if it exited or
        was not ready in time."""
        t0 = time.perf_counter()
        try:
            await super().start(timeout_s)
        except RuntimeError as exc:
            self.failure = str(exc)
            return False
        self.ready_s = time.perf_counter() - t0
        return True

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def error(self) -> str:
        return (self.failure or "".join(self.lines[-5:])).strip()[-500:]


def _dispatcher(url: str, folder: Path) -> Child:
    nkey = str(folder / "dispatcher-dispatcher.nk")
    argv = [PY, "-m", "hookbus.cli", "dispatcher", "--url", url, "--nkey", nkey]
    return Child("dispatcher", argv, "dispatcher serving")


def _worker(url: str, folder: Path) -> Child:
    nkey = str(folder / "worker-sec.nk")
    argv = [PY, "-m", "hookbus.cli", "worker", f"{HERE}:worker", "--url", url, "--nkey", nkey]
    return Child("worker", argv, "hookbus worker: serving")


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) process `pid` has used so far; 0.0 if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return 0.0


def _cpu_shares(
    pids: dict[str, int | None], before: dict[str, float], seconds: float
) -> dict[str, float]:
    """Each process's share of one core since `before` (its CPU seconds then)."""
    return {k: round((_cpu_s(pid) - before[k]) / seconds, 2) for k, pid in pids.items()}


def _body(data: dict[str, Any], **extra: Any) -> bytes:
    return json.dumps({"data": data, **extra}).encode()


async def _emit(
    nc: NATS, agent: str, body: bytes, timeout_s: float = 10.0, *, action: bool = False
) -> str:
    """One emit through the service: ``ok`` (with `action`: ``ok <action>``, and the
    reason's ``quota:`` prefix if any), the error code, or ``timeout`` / ``nats``."""
    try:
        msg = await nc.request(emit_service_subject(TOOL_PRE, agent), body, timeout=timeout_s)
    except nats.errors.TimeoutError:
        return "timeout"
    except nats.errors.Error as exc:
        return f"nats:{type(exc).__name__}"
    reply = json.loads(msg.data)
    if "error" in reply:
        return str(reply["error"].get("code"))
    if not action:
        return "ok"
    result = reply.get("result") or {}
    quota = " quota" if str(result.get("reason") or "").startswith("quota:") else ""
    return f"ok {result.get('action', 'continue')}{quota}"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _victim(nc: NATS, seconds: float) -> dict[str, Any]:
    """The victim's emits, one at a time at most `VICTIM_RATE_PER_S` (an agent at work,
    within its default quota), for `seconds`: latencies of the answered ones (ms) and
    every outcome."""
    body = _body({"tool_name": "read_file", "tool_input": {"path": "notes.txt"}})
    lat: list[float] = []
    when: list[float] = []
    codes: dict[str, int] = {}
    start = time.perf_counter()
    deadline = start + seconds
    next_at = start
    while time.perf_counter() < deadline:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        t0 = time.perf_counter()
        next_at = t0 + 1.0 / VICTIM_RATE_PER_S
        code = await _emit(nc, "victim", body)
        if code == "ok":
            lat.append((time.perf_counter() - t0) * 1000)
            when.append(t0 - start)
        codes[code] = codes.get(code, 0) + 1
    slowest = sorted(zip(lat, when, strict=True), reverse=True)[:5]
    return {
        "emits": sum(codes.values()), "codes": codes,
        "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99),
        "mean_ms": statistics.fmean(lat) if lat else float("nan"),
        "slowest": [f"{ms:.1f} ms at {at:.1f} s" for ms, at in slowest],
    }  # fmt: skip


# -- the attacker (a process of its own: ``abuse.py _attack``) -------------------------------


async def _flood(nc: NATS, stop: asyncio.Event, out: dict[str, int]) -> None:
    body = _body({"tool_name": "read_file", "tool_input": {}})
    await asyncio.sleep(1.0)  # the approvals first: the flood would take all its room

    async def one() -> None:
        while not stop.is_set():
            code = await _emit(nc, "attacker", body, timeout_s=5.0)
            out[code] = out.get(code, 0) + 1

    await asyncio.gather(*(one() for _ in range(FLOOD_IN_FLIGHT)))


async def _consumers(
    nc: NATS, folder: Path, attempts: int, out: dict[str, Any], held: list[Any]
) -> None:
    """Try `attempts` consumer creations of every kind on both streams, take its own slots,
    and try to delete the dispatcher service's consumers."""
    from hookbus._core.consumer_slots import identity_key, slot_names
    from hookbus._core.consumers import open_consumer

    me = encode_token("attacker")
    filters = {"KV_hookbus_handlers": "$KV.hookbus_handlers.>",
               "KV_hookbus_suspensions": f"$KV.hookbus_suspensions.{me}.>"}  # fmt: skip
    limit = asyncio.Semaphore(100)
    created: dict[str, int] = {}
    refused: dict[str, int] = {}

    async def create(i: int) -> None:
        stream = STREAMS[i % 2]
        kind = ("unnamed", "durable", "random name")[(i // 2) % 3]
        name = uuid.uuid4().hex
        config: dict[str, Any] = {
            "deliver_subject": nc.new_inbox(), "filter_subject": filters[stream],
            "ack_policy": "none", "inactive_threshold": 3600 * 10**9,
        }  # fmt: skip
        api = "$JS.API.CONSUMER"
        if kind == "unnamed":
            subject = f"{api}.CREATE.{stream}"
        elif kind == "durable":
            subject, config["durable_name"] = f"{api}.DURABLE.CREATE.{stream}.{name}", name
        else:
            subject, config["name"] = f"{api}.CREATE.{stream}.{name}.{filters[stream]}", name
        payload = json.dumps({"stream_name": stream, "config": config}).encode()
        async with limit:
            try:
                msg = await nc.request(subject, payload, timeout=1.0)
                ok = "error" not in json.loads(msg.data)
            except Exception:
                ok = False
        key = f"{stream} {kind}"
        (created if ok else refused)[key] = (created if ok else refused).get(key, 0) + 1

    await asyncio.gather(*(create(i) for i in range(attempts)))
    out["created"], out["refused"] = created, refused

    async def cb(msg: Any) -> None:
        pass

    slots: dict[str, int] = {}
    stopped: dict[str, str] = {}
    for stream in STREAMS:
        slots[stream] = 0
        for _ in range(10):  # more than its slots: the rest must be refused
            try:
                held.append(
                    await open_consumer(nc.jetstream(timeout=1.0), stream, filters[stream], cb=cb)
                )
                slots[stream] += 1
            except Exception as exc:
                stopped[stream] = f"{type(exc).__name__}: {exc}"[:240]
                break
    out["slots_held"], out["slot_refusals"] = slots, stopped
    service = identity_key(_Prefix(_context(folder, "dispatcher-dispatcher")["inbox_prefix"]))
    deleted = 0
    for stream in STREAMS:
        for name in slot_names(service or "UNKNOWN"):
            try:
                msg = await nc.request(f"$JS.API.CONSUMER.DELETE.{stream}.{name}", b"", timeout=0.5)
                deleted += "error" not in json.loads(msg.data)
            except Exception:
                pass
    out["deleted_service_consumers"] = deleted


class _Prefix:
    def __init__(self, prefix: str) -> None:
        self._inbox_prefix = prefix


async def _records(nc: NATS, stop: asyncio.Event, out: dict[str, Any]) -> None:
    """Suspension records under its own prefix, as fast as acknowledged, until refused."""
    js = nc.jetstream(timeout=2.0)
    me = encode_token("attacker")
    value = json.dumps({"status": "pending", "pad": "x" * 900}).encode()
    written = 0
    limit = asyncio.Semaphore(32)
    refused = asyncio.Event()

    async def put(i: int) -> None:
        nonlocal written
        async with limit:
            if refused.is_set() or stop.is_set():
                return
            try:
                await js.publish(f"$KV.hookbus_suspensions.{me}.flood{i}", value)
                written += 1
            except (TimeoutError, nats.errors.TimeoutError):
                # a refused publish is never acknowledged: its refusal is an async error
                errors = getattr(nc, "_abuse_errors", [])
                violation = next((e for e in errors if "permissions violation for publish to"
                                  ' "$kv.hookbus_suspensions' in e.lower()), None)  # fmt: skip
                if violation is not None:
                    out.setdefault("refused_with", violation[:200])
                    refused.set()
                    return
                out["ack_timeouts"] = out.get("ack_timeouts", 0) + 1  # busy, not refused
            except Exception as exc:
                out.setdefault("refused_with", f"{type(exc).__name__}: {exc}"[:200])
                refused.set()

    i = 0
    while not (refused.is_set() or stop.is_set()):
        await asyncio.gather(*(put(i + k) for k in range(256)))
        i += 256
    out["written"] = written
    out["refused"] = refused.is_set()


async def _approvals(nc: NATS, stop: asyncio.Event, count: int, out: dict[str, int]) -> None:
    """Approvals it asks for and leaves pending (each its own idempotency key)."""
    limit = asyncio.Semaphore(64)

    async def ask(i: int) -> None:
        async with limit:
            if stop.is_set():
                return
            body = _body({"tool_name": "pay", "tool_input": {}, "ask": True},
                         idempotency_key=f"abuse-{uuid.uuid4().hex}", timeout_s=3.0)  # fmt: skip
            code = await _emit(nc, "attacker", body, timeout_s=6.0, action=True)
            out[code] = out.get(code, 0) + 1

    await asyncio.gather(*(ask(i) for i in range(count)))


async def attack(url: str, folder: Path, seconds: float, attempts: int, asks: int) -> None:
    nc = await _connect(url, folder, "agent-attacker", pending_size=64 * 1024 * 1024)
    flood_nc = await _connect(url, folder, "agent-attacker", pending_size=64 * 1024 * 1024)
    stop = asyncio.Event()
    flood: dict[str, int] = {}
    consumers: dict[str, Any] = {}
    records: dict[str, Any] = {}
    approvals: dict[str, int] = {}
    held: list[Any] = []
    print("attack started", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.call_later(seconds, stop.set)
    t0 = time.perf_counter()
    tasks = [
        asyncio.create_task(_flood(flood_nc, stop, flood)),
        asyncio.create_task(_consumers(nc, folder, attempts, consumers, held)),
        asyncio.create_task(_records(nc, stop, records)),
        asyncio.create_task(_approvals(nc, stop, asks, approvals)),
    ]
    await stop.wait()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(15):
            await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        t.cancel()
    elapsed = time.perf_counter() - t0
    for sub in held:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    violations = sum("permissions violation" in e.lower() for e in nc._abuse_errors)  # type: ignore[attr-defined]
    print(json.dumps({
        "seconds": round(elapsed, 2), "flood": flood, "flood_rate": sum(flood.values()) / elapsed,
        "consumers": consumers, "records": records, "approvals": approvals,
        "permission_violations": violations,
    }), flush=True)  # fmt: skip
    for conn in (nc, flood_nc):
        with contextlib.suppress(Exception):
            await conn.close()


# -- the run -------------------------------------------------------------------------------


def _setup(folder: Path, port: int) -> tuple[subprocess.Popen[bytes], str]:
    from hookbus.cli import find_nats_server

    subprocess.run(
        [PY, "-m", "hookbus.cli", "auth", "init", "--out", str(folder), "--agent", "victim",
         "--agent", "attacker", "--worker", f"sec:{TOOL_PRE}/security", "--approver", "alice",
         "--no-tls", "--port", str(port)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    log = folder / "nats.log"
    server = subprocess.Popen(
        [find_nats_server(), "-c", str(folder / "server.conf"), "-l", str(log)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            break
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"nats-server did not start: {log.read_text()[-1000:]}")
        time.sleep(0.05)
    url = f"nats://127.0.0.1:{port}"
    provisioned = subprocess.run(
        [PY, "-m", "hookbus.cli", "auth", "provision", "--dir", str(folder), "--url", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if provisioned.returncode != 0:
        raise RuntimeError(f"hookbus auth provision failed: {provisioned.stderr[-1000:]}")
    return server, url


async def run(seconds: float, quick: bool) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="hookbus-abuse-"))
    server, url = _setup(folder, _free_port())
    children: list[Child] = []
    attacker: asyncio.subprocess.Process | None = None
    try:
        service, serving = _dispatcher(url, folder), _worker(url, folder)
        children += [service, serving]
        for child in (service, serving):
            if not await child.start():
                raise RuntimeError(f"{child.label} did not start:\n{child.error()}")
        victim = await _connect(url, folder, "agent-victim")
        await _victim(victim, 1.0)  # warm up
        baseline = await _victim(victim, seconds)
        print(f"baseline: {baseline}", file=sys.stderr, flush=True)
        attempts = 200 if quick else CONSUMER_ATTEMPTS
        asks = 100 if quick else 400
        attack_s = seconds + 70.0  # the measurement, then the fresh processes' start
        attacker = await asyncio.create_subprocess_exec(
            PY, str(HERE), "_attack", "--dir", str(folder), "--url", url,
            "--seconds", str(attack_s), "--attempts", str(attempts), "--asks", str(asks),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert attacker.stderr is not None and attacker.stdout is not None
        line = await asyncio.wait_for(attacker.stderr.readline(), 30)
        if b"attack started" not in line:
            raise RuntimeError(f"the attacker did not start: {line!r}")
        await asyncio.sleep(min(2.0, seconds / 4))  # let the flood and the consumers begin
        pids = {"nats-server": server.pid, "dispatcher": service.pid, "worker": serving.pid,
                "attacker": attacker.pid, "victim (this process)": os.getpid()}  # fmt: skip
        before = {k: _cpu_s(pid) for k, pid in pids.items()}
        t0 = time.perf_counter()
        under = await _victim(victim, seconds)
        cpu = _cpu_shares(pids, before, time.perf_counter() - t0)
        print(f"under attack: {under}", file=sys.stderr, flush=True)
        fresh_service, fresh_worker = _dispatcher(url, folder), _worker(url, folder)
        children += [fresh_service, fresh_worker]
        started = await asyncio.gather(fresh_service.start(60), fresh_worker.start(60))
        after = await _victim(victim, min(seconds, 3.0))  # and with both replicas serving
        fresh = {
            child.label: {"started": ok, "ready_s": child.ready_s,
                          "error": None if ok else child.error()}
            for child, ok in zip((fresh_service, fresh_worker), started, strict=True)
        }  # fmt: skip
        attacker.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(attacker.communicate(), 60)
        lines = out.decode().strip().splitlines()
        attack_report = json.loads(lines[-1]) if lines else {}
        first_alive = service.alive and serving.alive
        await victim.close()
    finally:
        if attacker is not None and attacker.returncode is None:
            attacker.kill()
            await attacker.wait()
        for child in children:
            await child.stop()
        server.terminate()
        server.wait(10)
        shutil.rmtree(folder, ignore_errors=True)

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {
        "seconds": seconds,
        "baseline": baseline,
        "under_attack": under,
        "after_fresh_start": after,
        "p50_ratio": ratio(under["p50_ms"], baseline["p50_ms"]),
        "p99_ratio": ratio(under["p99_ms"], baseline["p99_ms"]),
        "victim_errors_under_attack": {k: v for k, v in under["codes"].items() if k != "ok"},
        "first_service_and_worker_alive": first_alive,
        "cpu_cores_under_attack": cpu,
        "fresh_start": fresh,
        "attacker": attack_report,
    }


def _print(r: dict[str, Any]) -> None:
    b, u = r["baseline"], r["under_attack"]
    a = r["attacker"]
    print(f"victim emit p50: {b['p50_ms']:.2f} ms alone, {u['p50_ms']:.2f} ms under attack"
          f" ({r['p50_ratio']:.2f}x)")  # fmt: skip
    print(f"victim emit p99: {b['p99_ms']:.2f} ms alone, {u['p99_ms']:.2f} ms under attack"
          f" ({r['p99_ratio']:.2f}x)")  # fmt: skip
    print(f"victim emits: {b['emits']} alone, {u['emits']} under attack;"
          f" errors under attack: {r['victim_errors_under_attack'] or 'none'}")  # fmt: skip
    print(f"attacker flood ({FLOOD_IN_FLIGHT} in flight): {a.get('flood')}"
          f" ({a.get('flood_rate', 0):.0f} answers/s)")  # fmt: skip
    c = a.get("consumers", {})
    print(f"attacker consumers: created {c.get('created')}, refused {c.get('refused')},"
          f" own slots held {c.get('slots_held')} (then {c.get('slot_refusals')});"
          f" service consumers deleted: {c.get('deleted_service_consumers')}")  # fmt: skip
    print(f"attacker suspension records: {a.get('records')}")
    print(f"attacker approvals asked: {a.get('approvals')}")
    print(f"cores used while the victim was measured under attack ({os.cpu_count()} on this"
          f" machine): {r['cpu_cores_under_attack']}")  # fmt: skip
    print(f"first dispatcher and worker still running: {r['first_service_and_worker_alive']}")
    for label, f in r["fresh_start"].items():
        state = (f"started in {f['ready_s']:.2f} s" if f["started"]
                 else f"did NOT start: {f['error']}")  # fmt: skip
        print(f"fresh {label} during the attack: {state}")
    print("ABUSE " + json.dumps(r, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    parser.add_argument("--quick", action="store_true", help="short windows (3 s): a smoke")
    parser.add_argument(
        "--seconds", type=float, default=None,
        help="seconds of each measuring window (default 10; --quick 3)",
    )  # fmt: skip
    a = sub.add_parser("_attack", help=argparse.SUPPRESS)
    a.add_argument("--dir", required=True)
    a.add_argument("--url", required=True)
    a.add_argument("--seconds", type=float, required=True)
    a.add_argument("--attempts", type=int, default=CONSUMER_ATTEMPTS)
    a.add_argument("--asks", type=int, default=400)
    args = parser.parse_args()
    if args.cmd == "_attack":
        asyncio.run(attack(args.url, Path(args.dir), args.seconds, args.attempts, args.asks))
        return
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    try:
        result = asyncio.run(run(seconds, args.quick))
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"abuse run failed: {exc}", file=sys.stderr)
        sys.exit(1)
    _print(result)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
