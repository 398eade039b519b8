"""deploy/ configs are validated offline by the real nats-server (`-t`), no Docker needed.

The shipped configs include what `hookbus auth init` writes (``auth/auth.conf``: the
accounts and nkey users; ``auth/cluster-auth.conf``: the route password), never shipped
themselves: each test writes them beside a copy of the configs first. No config allows an
anonymous client, and the single-server config, run, refuses one.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import nats
import pytest
from click.testing import CliRunner
from nats.aio.client import Client as NATS

from hookbus.cli import EmbeddedNatsServer, find_nats_server
from hookbus.cli._auth_files import public_key_of
from hookbus.cli._command_tree import cli
from hookbus.cli._permissions import inbox_prefix

DEPLOY_NATS = Path(__file__).parents[1] / "deploy" / "nats"
CONFIGS = sorted(DEPLOY_NATS.glob("*.conf"))
ROUTES = ("127.0.0.1:6222", "127.0.0.1:6223", "127.0.0.1:6224")


@pytest.fixture
def deploy_copy(tmp_path: Path) -> Path:
    """deploy/nats/*.conf copied to a folder with auth/ written by `hookbus auth init`."""
    folder = tmp_path / "nats"
    folder.mkdir()
    for config in CONFIGS:
        shutil.copy(config, folder / config.name)
    args = ["auth", "init", "--out", str(folder / "auth"), "--host", "0.0.0.0",
            "--agent", "payments", "--worker", "security:tool:pre/security_policy"]  # fmt: skip
    for route in ROUTES:
        args += ["--route", route]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return folder


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"hookbus.conf", "cluster-node1.conf"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_nats_config_is_valid(config: Path, deploy_copy: Path) -> None:
    out = subprocess.run(
        [find_nats_server(), "-c", str(deploy_copy / config.name), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    assert "is valid" in out.stderr + out.stdout


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_no_config_allows_anonymous_clients_or_routes(config: Path) -> None:
    text = config.read_text()
    assert 'include "auth/auth.conf"' in text
    for anonymous in ("no_auth_user", "authorization", "users", "accounts"):
        # every user comes from auth.conf; none is defined (or made the default) here
        assert not any(line.strip().startswith(anonymous) for line in text.splitlines())
    if "cluster {" in text:
        assert 'include "auth/cluster-auth.conf"' in text
        assert "nats-route://" not in text  # the routes carry the password: generated


@pytest.mark.anyio
async def test_the_single_server_config_refuses_anonymous_clients(
    deploy_copy: Path, tmp_path: Path
) -> None:
    config = deploy_copy / "hookbus.conf"
    text = config.read_text()  # its own ports and store here, the rest as shipped
    for shipped, local in (("0.0.0.0:4222", "127.0.0.1:-1"), ("0.0.0.0:8222", "127.0.0.1:-1"),
                           ("/data/jetstream", str(tmp_path / "js"))):  # fmt: skip
        assert shipped in text
        text = text.replace(shipped, local)
    config.write_text(text)
    with EmbeddedNatsServer(tmp_path / "run", config=config) as server:
        anonymous = NATS()

        async def quiet(exc: Exception) -> None:
            pass

        with pytest.raises(Exception, match=r"(?i)authorization"):
            await anonymous.connect(
                server.url, allow_reconnect=False, connect_timeout=3, error_cb=quiet
            )
        await anonymous.close()
        seed = deploy_copy / "auth" / "dispatcher-dispatcher.nk"
        nc = await nats.connect(
            server.url,
            nkeys_seed=str(seed),
            inbox_prefix=inbox_prefix(public_key_of(seed)),
            allow_reconnect=False,
        )
        try:
            assert (await nc.jetstream().account_info()) is not None
        finally:
            await nc.close()


def test_a_broken_config_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.conf"
    bad.write_text("jetstream { store_dir: \n")
    out = subprocess.run(
        [find_nats_server(), "-c", str(bad), "-t"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode != 0


DEPLOY_SUPERCLUSTER = Path(__file__).parents[1] / "deploy" / "supercluster"
SUPERCLUSTER_NODES = sorted(DEPLOY_SUPERCLUSTER.glob("*-n*.conf"))


def test_the_supercluster_has_two_clusters_of_three() -> None:
    assert [p.name for p in SUPERCLUSTER_NODES] == [
        f"{c}-n{i}.conf" for c in ("east", "west") for i in (1, 2, 3)
    ]
    assert not (DEPLOY_SUPERCLUSTER / "gateways.conf").exists()  # in auth/gateway-auth.conf
    common = (DEPLOY_SUPERCLUSTER / "common.conf").read_text()
    assert 'ping_interval: "1s"' in common and "ping_max: 2" in common


def _block(text: str, name: str) -> str:
    start = text.index(f"\n{name} {{")
    return text[start : text.index("\n}", start)]


@pytest.mark.parametrize("config", SUPERCLUSTER_NODES, ids=lambda p: p.name)
def test_every_supercluster_node_is_authenticated(config: Path) -> None:
    """Clients, routes and gateways: every credential comes from what `hookbus auth init`
    wrote into auth/, included relatively; no URL, user or password is in the file."""
    text = config.read_text()
    cluster = config.name.split("-")[0]
    lines = [line.split("#")[0].strip() for line in text.splitlines()]
    for top in ('include "common.conf"', 'include "auth/tls.conf"', 'include "auth/auth.conf"'):
        assert top in lines, top
    cluster_block, gateway_block = _block(text, "cluster"), _block(text, "gateway")
    assert f"name: {cluster}" in cluster_block and f"name: {cluster}" in gateway_block
    assert f'include "auth/cluster-auth-{cluster}.conf"' in cluster_block
    assert "no_advertise: true" in cluster_block
    assert 'include "auth/gateway-auth.conf"' in gateway_block
    for inline in ("nats-route://", "nats://", "routes:", "gateways:", "password", "users",
                   "accounts", "authorization", "no_auth_user"):  # fmt: skip
        assert not any(line.startswith(inline) or inline in line for line in lines), inline


@pytest.fixture(params=["nkey", "jwt"])
def supercluster_copy(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """deploy/supercluster copied, with auth/ written by `hookbus auth init` in each mode
    (JWT mode with TLS on the client port, the nkey mode without)."""
    folder = tmp_path / "supercluster"
    shutil.copytree(DEPLOY_SUPERCLUSTER, folder)
    args = ["auth", "init", "--out", str(folder / "auth"), "--host", "0.0.0.0",
            "--embedded-agent", "a1", "--worker", "security:tool:pre/security_policy",
            *(["--jwt"] if request.param == "jwt" else ["--no-tls"])]  # fmt: skip
    for c in ("east", "west"):
        nodes = [f"{c}-n{i}.example.internal" for i in (1, 2, 3)]
        args += ["--route", f"{c}=" + ",".join(f"{n}:6222" for n in nodes)]
        args += ["--gateway", f"{c}=" + ",".join(f"{n}:7222" for n in nodes)]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return folder


def test_supercluster_configs_are_valid_in_either_mode(supercluster_copy: Path) -> None:
    for config in SUPERCLUSTER_NODES:
        out = subprocess.run(
            [find_nats_server(), "-c", str(supercluster_copy / config.name), "-t"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.returncode == 0, config.name + out.stderr + out.stdout
        assert "is valid" in out.stderr + out.stdout
