"""What reading a record from the stream's leader costs, against a direct get.

    .venv/bin/python benchmarks/kv_reads.py                      # embedded nats-server
    .venv/bin/python benchmarks/kv_reads.py --n 2000 --rounds 5 --url nats://127.0.0.1:4222

A record hookbus decides on is read with ``$JS.API.STREAM.MSG.GET`` (the leader answers;
`hookbus._core.leader_reads.LeaderKeyValue`), not with a direct get (any replica answers,
one that lags with an older revision): see docs/decisions-under-faults.md. Both reads of
the same 2 KB record on one connection, `n` sequential gets each, the two interleaved
round by round (which goes first alternates); prints the median latency of each, µs of
this process's CPU per get, and the ratios leader / direct. Not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import nats

from hookbus._core.buckets import suspensions_bucket_config
from hookbus._core.kv import open_bucket
from hookbus._core.leader_reads import read_from_replicas
from hookbus.cli import EmbeddedNatsServer


async def timed_gets(kv: object, key: str, n: int) -> tuple[float, float]:
    """Median µs per get (wall clock) and µs of CPU per get over `n` sequential gets."""
    laps: list[float] = []
    cpu = time.process_time()
    for _ in range(n):
        start = time.perf_counter()
        await kv.get(key)  # type: ignore[attr-defined]
        laps.append(time.perf_counter() - start)
    return statistics.median(laps) * 1e6, (time.process_time() - cpu) / n * 1e6


async def main(url: str, n: int, rounds: int) -> None:
    leader_nc, direct_nc = await nats.connect(url), await nats.connect(url)
    try:
        config = suspensions_bucket_config()
        leader = await open_bucket(leader_nc, config)
        direct = read_from_replicas(await open_bucket(direct_nc, config))
        key = "bench.kv-reads"
        await leader.put(key, b"x" * 2048)
        got: dict[str, list[tuple[float, float]]] = {"leader": [], "direct": []}
        for r in range(rounds):
            order = [("leader", leader), ("direct", direct)]
            for name, kv in order if r % 2 == 0 else order[::-1]:
                got[name].append(await timed_gets(kv, key, n))
        med = {k: tuple(statistics.median(x[i] for x in v) for i in (0, 1)) for k, v in got.items()}
        for name, (lat, cpu) in med.items():
            print(f"{name:>6}: {lat:8.1f} µs per get (median), {cpu:6.1f} µs CPU per get")
        print(
            f"leader / direct: latency {med['leader'][0] / med['direct'][0]:.2f}x, "
            f"client CPU {med['leader'][1] / med['direct'][1]:.2f}x "
            f"({rounds} rounds of {n} gets each, medians)"
        )
    finally:
        await leader_nc.close()
        await direct_nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a nats-server with JetStream (default: embedded)")
    parser.add_argument("--n", type=int, default=1000, help="gets per round and kind")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.url:
        asyncio.run(main(args.url, args.n, args.rounds))
    else:
        with EmbeddedNatsServer() as server:
            asyncio.run(main(server.url, args.n, args.rounds))
