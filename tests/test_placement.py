"""Where hookbus's buckets live on a cluster, and what opening them prints.

- `hookbus auth provision --placement-tag` puts every bucket and the audit stream on the
  servers with that tag (a real 3-node cluster, one node tagged ``site:a``); a placement no
  server matches fails with one line; provisioning again with another placement reports
  the difference and moves nothing.
- On a cluster whose buckets are R3 (as provisioned), `hookbus emit` (a process that only
  opens them, asking for nothing) prints no warning about their replica count.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from _cluster import Cluster

from hookbus.schemas import (
    APPROVALS_BUCKET,
    DECISIONS_STREAM,
    HANDLERS_BUCKET,
    LEASES_BUCKET,
    SUSPENSIONS_BUCKET,
)

pytestmark = [pytest.mark.anyio]

HOOKBUS = [sys.executable, "-m", "hookbus.cli"]
STREAMS = [
    *(f"KV_{b}" for b in (HANDLERS_BUCKET, SUSPENSIONS_BUCKET, APPROVALS_BUCKET, LEASES_BUCKET)),
    DECISIONS_STREAM,
]


def _tag_first_node(c: Cluster, tag: str) -> None:
    """Give node n1 the server tag `tag` (written into its config at start)."""
    node = c.nodes[0]
    write = node.write_config

    def tagged() -> None:
        write()
        with node.config_file.open("a") as f:
            f.write(f'server_tags: ["{tag}"]\n')

    node.write_config = tagged  # type: ignore[method-assign]


def _room_for_provisioning(c: Cluster) -> None:
    """Let each node reserve what provisioning asks (every bucket's and the audit stream's
    max_bytes: several GiB); the test clusters' 1 GB file store refuses that ("insufficient
    storage") as soon as the meta leader has the nodes' storage figures. Reserved, not used."""
    for node in c.nodes:
        write = node.write_config

        def roomy(write: Any = write, node: Any = node) -> None:
            write()
            text = node.config_file.read_text()
            node.config_file.write_text(text.replace("max_file_store: 1GB", "max_file_store: 64GB"))

        node.write_config = roomy  # type: ignore[method-assign]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path / "cluster")
    _room_for_provisioning(c)
    _tag_first_node(c, "site:a")
    c.start()
    try:
        await c.wait_ready()
        yield c
    finally:
        c.stop()


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKBUS_", "NATS_"))}
    return {**env, "PYTHONUNBUFFERED": "1"}


async def _hookbus(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import anyio

    return await anyio.run_process(
        [*HOOKBUS, *args], check=False, env=env or _env(), stdin=subprocess.DEVNULL
    )


async def test_provision_places_every_stream_on_the_tagged_server(cluster: Cluster) -> None:
    url = ["--url", cluster.url]

    nowhere = await _hookbus("auth", "provision", *url, "--placement-tag", "site:nowhere")
    err = nowhere.stderr.decode()
    assert nowhere.returncode == 1, err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "cannot create bucket hookbus_handlers" in err and "tags [site:nowhere]" in err, err

    done = await _hookbus("auth", "provision", *url, "--placement-tag", "site:a")
    assert done.returncode == 0, done.stderr.decode()
    nc = await cluster.connect()
    try:
        js = nc.jetstream(timeout=5)
        for stream in STREAMS:
            info = await js.stream_info(stream)
            assert info.config.placement is not None, stream
            assert info.config.placement.tags == ["site:a"], (stream, info.config.placement)
            assert info.cluster is not None and info.cluster.leader == "n1", (stream, info.cluster)
            assert not info.cluster.replicas, (stream, info.cluster.replicas)
    finally:
        await nc.close()

    moved = await _hookbus("auth", "provision", *url, "--placement-tag", "site:b")
    err = moved.stderr.decode()
    assert moved.returncode == 0, err
    assert "placement: asked tags [site:b], bucket has tags [site:a]" in err, err
    assert "placement: asked tags [site:b], stream has tags [site:a]" in err, err


async def test_emit_on_r3_buckets_warns_nothing_about_replicas(cluster: Cluster) -> None:
    done = await _hookbus("auth", "provision", "--url", cluster.url, "--replicas", "3")
    assert done.returncode == 0, done.stderr.decode()
    for env in (_env(), {**_env(), "HOOKBUS_BUCKET_REPLICAS": "3"}):
        emitted = await _hookbus(
            "emit", "tool:pre", '{"tool_name": "bash"}', "--url", cluster.url, env=env
        )
        err = emitted.stderr.decode()
        assert emitted.returncode == 0, err
        assert "bucket has" not in err and "another config" not in err, err
        assert '"continue"' in emitted.stdout.decode()
    audited = await _hookbus(
        "emit", "tool:pre", '{"tool_name": "bash"}', "--audit", "--url", cluster.url, env=_env()
    )  # the R3 audit stream too, opened by a client without a replicas option
    err = audited.stderr.decode()
    assert audited.returncode == 0 and "stream has" not in err and "another config" not in err, err
