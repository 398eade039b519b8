"""`hookbus auth init` secures the client port with TLS by default, against real
nats-servers run from its output (no mocks): its own CA and server certificate (key files
0600), a ``tls`` block in tls.conf (which server.conf includes), the CA and a ``tls://``
URL in every context; a client verifying with that CA (the CLI from a context, from a seed
of the folder, or with ``--tls-ca``; a program with `auth_ssl_context`) is served, a plain
one is refused; ``--no-tls`` keeps a plain setup."""

from __future__ import annotations

import json
import os
import socket
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from _ports import free_port, on_free_port
from click.testing import CliRunner

from hookbus.cli import EmbeddedNatsServer, find_nats_server
from hookbus.cli._command_tree import cli
from hookbus.cli._connect import auth_ssl_context

anyio_test = pytest.mark.anyio


def init(out: Path, *args: str, port: int | None = None) -> int:
    port = free_port() if port is None else port
    result = CliRunner().invoke(
        cli, ["auth", "init", "--out", str(out), "--agent", "a1", "--port", str(port), *args],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return port


def hookbus(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
    return subprocess.run(
        [sys.executable, "-m", "hookbus.cli", *args], capture_output=True, text=True,
        timeout=60, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    base = tmp_path_factory.mktemp("tls")

    def start(port: int) -> tuple[EmbeddedNatsServer, Path, int]:
        out = base / f"port-{port}" / "auth"
        init(out, port=port)
        server = EmbeddedNatsServer(out / "run", config=out / "server.conf")
        server.start()
        return server, out, port

    server, out, port = on_free_port(start)
    try:
        yield out, port
    finally:
        server.stop()


def test_init_makes_a_ca_and_a_server_certificate(tls_server: tuple[Path, int]) -> None:
    out, port = tls_server
    for name in ("ca.pem", "server-cert.pem", "server-key.pem"):
        assert (out / name).is_file(), name
    assert stat.S_IMODE((out / "server-key.pem").stat().st_mode) == 0o600
    assert "PRIVATE KEY" not in (out / "ca.pem").read_text()  # the CA's key is not kept
    assert 'include "tls.conf"' in (out / "server.conf").read_text()
    conf = (out / "tls.conf").read_text()
    assert "tls {" in conf and "verify: false" in conf
    assert "timeout: 5 " in conf  # a fleet's handshakes at start queue past the default 2 s
    assert f'cert_file: "{(out / "server-cert.pem").resolve()}"' in conf
    for context in out.glob("*.json"):
        if context.name == "hookbus-auth.json":
            continue
        ctx = json.loads(context.read_text())
        assert ctx["url"] == f"tls://127.0.0.1:{port}", context
        assert ctx["ca"] == str((out / "ca.pem").resolve()), context
    check = subprocess.run(
        [find_nats_server(), "-c", str(out / "server.conf"), "-t"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr + check.stdout
    # the certificate is for 127.0.0.1, ::1 and localhost (and --host)
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((out / "server-cert.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]


@anyio_test
async def test_a_verified_client_is_served_and_a_plain_one_refused(
    tls_server: tuple[Path, int],
) -> None:
    out, port = tls_server
    admin = json.loads((out / "admin-admin.json").read_text())
    for source in (out, out / "admin-admin.json", out / "admin-admin.nk"):
        tls = auth_ssl_context(source)
        assert tls is not None, source
        nc = await nats.connect(
            admin["url"], tls=tls, nkeys_seed=admin["nkey"], inbox_prefix=admin["inbox_prefix"],
            allow_reconnect=False, connect_timeout=5,
        )  # fmt: skip
        try:
            await nc.flush()
            assert nc.connected_url is not None
        finally:
            await nc.close()
    # plain TCP: the server asks for TLS and refuses a client that goes on without it
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        info = sock.recv(4096).decode()
        assert '"tls_required":true' in info, info
        sock.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert b"PONG" not in answer, answer
    # a TLS client that does not trust the CA is refused by its own check
    with pytest.raises((ssl.SSLError, nats.errors.Error, OSError)):
        await nats.connect(
            admin["url"], tls=ssl.create_default_context(), nkeys_seed=admin["nkey"],
            allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0,
        )  # fmt: skip


def test_the_cli_verifies_with_the_folders_ca(tls_server: tuple[Path, int]) -> None:
    out, port = tls_server
    url = f"tls://127.0.0.1:{port}"
    seed = str(out / "admin-admin.nk")
    for args in (
        ["--context", str(out / "admin-admin.json")],
        ["--url", url, "--nkey", seed],  # the seed's folder gives the CA
        ["--url", url, "--nkey", seed, "--tls-ca", str(out / "ca.pem")],
    ):
        done = hookbus("handlers", "--json", *args)
        assert done.returncode == 0, (args, done.stderr)
        assert json.loads(done.stdout) is not None
    # a seed outside the folder, without --tls-ca: the system's CAs do not know this one
    lone = out.parent / "lone.nk"
    lone.write_bytes((out / "admin-admin.nk").read_bytes())
    done = hookbus("handlers", "--json", "--url", url, "--nkey", str(lone))
    assert done.returncode != 0
    assert "TLS with NATS at" in done.stderr and "system's CAs" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@anyio_test
async def test_no_tls_keeps_the_plain_setup(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    port = init(out, "--no-tls")
    assert not (out / "ca.pem").exists() and not (out / "server-key.pem").exists()
    assert "tls {" not in (out / "server.conf").read_text() + (out / "tls.conf").read_text()
    ctx = json.loads((out / "agent-a1.json").read_text())
    assert ctx["url"] == f"nats://127.0.0.1:{port}" and "ca" not in ctx
    assert auth_ssl_context(out) is None
    with EmbeddedNatsServer(out / "run", config=out / "server.conf"):
        nc = await nats.connect(
            ctx["url"], nkeys_seed=ctx["nkey"], inbox_prefix=ctx["inbox_prefix"],
            allow_reconnect=False, connect_timeout=5,
        )  # fmt: skip
        try:
            await nc.flush()
        finally:
            await nc.close()


def test_own_files_are_used_as_given(tmp_path: Path) -> None:
    """--tls-cert/--tls-key/--tls-ca: the user's files, no CA made."""
    from hookbus.cli._tls import make_local_tls

    mine = make_local_tls(tmp_path / "mine", "127.0.0.1")
    out = tmp_path / "auth"
    init(out, "--tls-cert", str(mine.cert), "--tls-key", str(mine.key), "--tls-ca", str(mine.ca))
    assert not (out / "ca.pem").exists()
    conf = (out / "tls.conf").read_text()
    assert f'cert_file: "{mine.cert}"' in conf and f'ca_file: "{mine.ca}"' in conf
    assert json.loads((out / "agent-a1.json").read_text())["ca"] == str(mine.ca)
