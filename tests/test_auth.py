"""`hookbus auth` and the permission model, against real nats-servers started from the
generated config (no mocks): the config is valid, seeds survive `auth add`, anonymous
clients are refused, every identity connects with its seed, tenants are isolated, and a
few permissions hold (the full per-role probe suite lives elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import nats
import pytest
from _closing import closing
from click.testing import CliRunner
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig

from hookbus._core.consumer_slots import slot_names
from hookbus._core.nats_guard import harden_connection
from hookbus.cli import EmbeddedNatsServer, find_nats_server
from hookbus.cli._auth_files import (
    DEFAULT_TENANT,
    Identity,
    load_setup,
    markdown_table,
    public_key_of,
)
from hookbus.cli._command_tree import cli
from hookbus.cli._permissions import (
    agent,
    inbox_prefix,
    permission_table,
    permissions_for,
    worker,
)
from hookbus.cli._provision import provision
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import BadRequestError, HookResult
from hookbus.workers import HookWorker

ROOT = Path(__file__).resolve().parents[1]
anyio_test = pytest.mark.anyio


def auth_cli(*args: str) -> str:
    result = CliRunner().invoke(cli, ["auth", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def config_check(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [find_nats_server(), "-c", str(config), "-t"], capture_output=True, text=True, timeout=30
    )


def seeds(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.nk"))}


# -- the model (pure) -----------------------------------------------------------------


def test_a_worker_serves_only_its_event_handler_pairs() -> None:
    perms = worker("sec", ["tool:pre/security_policy", "prompt:complete/a:b"])
    assert "hookbus.v1.collect.tool=3Apre security_policy" in perms.subscribe
    assert "hookbus.v1.handler.tool=3Apre.security_policy security_policy" in perms.subscribe
    assert "hookbus.v1.handler.prompt=3Acomplete.a=3Ab a=3Ab" in perms.subscribe
    assert "$KV.hookbus_handlers.tool=3Apre.security_policy" in perms.publish
    # bound to its events: no wildcard in an event position
    assert not any(".handler.*." in s or ".collect.* " in s or ".chain.*." in s
                   for s in perms.subscribe)  # fmt: skip
    assert not any("hookbus_handlers.*." in s for s in perms.publish)
    # and no stream or consumer creation, no registry listing
    assert not any("STREAM.CREATE" in s or "CONSUMER" in s for s in perms.publish)
    # one handler per event: one answer per request
    assert perms.allow_responses is not None and perms.allow_responses.max_msgs == 1
    two = worker("sec", ["tool:pre/a", "tool:pre/b", "tool:post/a"])
    assert two.allow_responses is not None and two.allow_responses.max_msgs == 3
    for bad in ([], ["security"], ["/security"], ["tool:pre/"]):
        with pytest.raises(BadRequestError):
            worker("sec", bad)


def test_an_agent_is_scoped_to_its_token() -> None:
    for embedded in (False, True):
        perms = agent("pay.ments", embedded=embedded, public_key="U" + "X" * 55)
        assert "hookbus.v1.emit.pay=2Ements.*" in perms.publish
        # only an embedded agent writes (its own records): a plain one writes nothing the
        # service does not bound
        writes = [s for s in perms.publish if s.startswith("$KV.")]
        own_records = "$KV.hookbus_suspensions.pay=2Ements.*"
        assert (writes == []) if not embedded else (own_records in writes), writes
        assert perms.subscribe == [
            "_INBOX_U" + "X" * 55 + ".>", "hookbus.v1.suspension.pay=2Ements.>",
            *(["hookbus.v1.registry.>"] if embedded else []),
        ]  # fmt: skip
        assert perms.allow_responses is None
        # reads of suspensions and grants only through subjects that carry its prefix
        scoped = [s for s in perms.publish
                  if "hookbus_suspensions" in s or "hookbus_approvals" in s]  # fmt: skip
        assert scoped and all(
            ".pay=2Ements." in s or s.startswith(("$JS.API.STREAM.INFO", "$JS.API.CONSUMER.INFO",
                                                  "$JS.API.CONSUMER.DELETE"))
            for s in scoped
        ), scoped  # fmt: skip
        # writes nothing in the approvals bucket: only the decider creates approvals
        assert not any(s.startswith("$KV.hookbus_approvals") for s in perms.publish)
        # consumers only in its own slots
        consumers = [s for s in perms.publish if ".CONSUMER." in s]
        assert consumers and all(".U" + "X" * 55 + "_" in s for s in consumers), consumers
        assert not any(s.startswith("$JS.API.STREAM.CREATE") for s in perms.publish)
    plain, embedded_perms = agent("a"), agent("a", embedded=True)
    assert not any(s.startswith("hookbus.v1.handler") for s in plain.publish)
    assert not any("hookbus_handlers" in s for s in plain.publish)
    assert "hookbus.v1.handler.*.*" in embedded_perms.publish


def _every_role(public_key: str | None = None) -> list[tuple[str, list[str], list[str]]]:
    """(role, publish, subscribe) of every non-admin role, the embedded agent included."""
    out = []
    for role in ("agent", "worker", "dispatcher", "approver", "auditor"):
        handlers = ["tool:pre/x"] if role == "worker" else None
        perms = permissions_for(role, "x", handlers=handlers, public_key=public_key)  # type: ignore[arg-type]
        out.append((role, perms.publish, perms.subscribe))
    embedded = agent("x", embedded=True, public_key=public_key)
    out.append(("agent (embedded)", embedded.publish, embedded.subscribe))
    return out


def test_only_the_admin_may_create_delete_update_or_purge_streams() -> None:
    for role, publish, _ in _every_role():
        verbs = ("STREAM.CREATE", "STREAM.DELETE", "STREAM.PURGE", "STREAM.UPDATE",
                 "STREAM.MSG.DELETE", "CONSUMER.DURABLE")  # fmt: skip
        assert not any(v in s for s in publish for v in verbs), role
        assert not any(s.endswith((".>", "*")) and "STREAM" in s for s in publish), role
        assert "$JS.API.>" not in publish
    assert "$JS.API.>" in permissions_for("admin", "admin").publish


def _covers(pattern: str, subject: str) -> bool:
    """Whether NATS subject `pattern` (``*``, ``>`` wildcards) matches `subject`."""
    want, have = pattern.split(" ")[0].split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or token not in ("*", have[i]):
            return False
    return len(want) == len(have)


def test_no_role_but_the_admin_may_forge_a_registry_change() -> None:
    """Only the server publishes the handler registry's republished changes: a dispatcher
    applies what arrives there, so no identity may publish there; those that follow the
    registry may subscribe."""
    forged = "hookbus.v1.registry._required.tool=3Apre.security"
    for role, publish, subscribe in _every_role("UKEY"):
        assert not any(_covers(p, forged) for p in publish), role
        follows = any(_covers(s, forged) for s in subscribe)
        assert follows == (role in ("dispatcher", "agent (embedded)", "approver")), role
    assert any(_covers(p, forged) for p in permissions_for("admin", "admin").publish)


def test_every_user_subscribes_only_to_its_own_inbox() -> None:
    for row in permission_table():
        if row.direction == "subscribe" and row.subject.startswith("_INBOX"):
            assert row.subject == "_INBOX_<PUBKEY>.>"
    admin = permissions_for("admin", "x", public_key="UKEY")
    for role, _, subscribe in [*_every_role("UKEY"), ("admin", [], admin.subscribe)]:
        inboxes = [s for s in subscribe if "INBOX" in s]
        assert inboxes == ["_INBOX_UKEY.>"], role
        assert ">" not in subscribe and "_INBOX.>" not in subscribe


def test_only_the_dispatcher_creates_consumers_beyond_its_slots() -> None:
    """Every other identity may create, inspect and delete consumers named by its own
    slots only: one identity cannot exhaust a stream's consumers or drop another's."""
    slots = slot_names("UKEY")
    for role, publish, _ in _every_role("UKEY"):
        consumers = [s for s in publish if ".CONSUMER." in s]
        if role == "dispatcher":
            assert "$JS.API.CONSUMER.CREATE.KV_hookbus_handlers" in consumers
            continue
        for s in consumers:
            name = s.split(".")[6 if ".MSG.NEXT." in s else 5]
            assert name in slots, (role, s)


def test_the_security_docs_worker_identity_lists_every_handler_of_its_example() -> None:
    """docs/security.md's "How to run it" makes the identity `hookbus worker
    examples/security_policy.py:worker` runs as: it must list every handler the example
    serves (a worker may declare and serve only the handlers its identity names)."""
    text = (ROOT / "docs" / "security.md").read_text()
    run_it = text.split("## How to run it", 1)[1]
    listed = re.search(r"--worker security:(\S+)", run_it)
    assert listed is not None
    spec = importlib.util.spec_from_file_location(
        "security_policy", ROOT / "examples" / "security_policy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    served = {f"{h.declaration.event}/{h.declaration.name}" for h in module.worker.handlers}
    assert set(listed.group(1).split(",")) == served


def test_the_security_doc_has_every_row_of_the_table() -> None:
    doc = (ROOT / "docs" / "security.md").read_text()
    missing = [line for line in markdown_table().splitlines() if line not in doc]
    assert missing == [], "docs/security.md is stale: paste `hookbus auth table`"


# -- the files ----------------------------------------------------------------------------


def test_init_writes_a_valid_config_seeds_and_contexts(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    auth_cli("init", "--out", str(out), "--agent", "payments",
             "--worker", "security:tool:pre/security_policy,prompt:complete/response_dlp",
             "--approver", "alice", "--auditor", "audit")  # fmt: skip
    check = config_check(out / "server.conf")
    assert check.returncode == 0 and "is valid" in check.stderr, check.stderr
    setup = load_setup(out)
    roles = {(i.role, i.name) for i in setup.identities}
    assert roles == {
        ("admin", "admin"), ("dispatcher", "dispatcher"), ("agent", "payments"),
        ("worker", "security"), ("approver", "alice"), ("auditor", "audit"),
    }  # fmt: skip
    sec = setup.find(DEFAULT_TENANT, "worker", "security")
    assert sec is not None
    assert sec.handlers == ["tool:pre/security_policy", "prompt:complete/response_dlp"]
    conf = (out / "auth.conf").read_text()
    for ident in setup.identities:
        seed = ident.seed_path(out)
        assert seed.parent == out and seed.name == f"{ident.role}-{ident.name}.nk"
        assert stat.S_IMODE(seed.stat().st_mode) == 0o600
        assert seed.read_text().startswith("SU")
        assert public_key_of(seed) == ident.public_key
        assert f'nkey: "{ident.public_key}"' in conf
        context = json.loads(ident.context_path(out).read_text())
        assert context["url"] == "tls://127.0.0.1:4222"  # TLS on by default ...
        assert context["ca"] == str(out / "ca.pem")  # ... verified with the folder's CA
        assert Path(context["nkey"]) == seed.resolve()
        assert context["inbox_prefix"] == f"_INBOX_{ident.public_key}"
    assert "no_auth_user" not in conf and "authorization" not in conf
    # a second init over the same folder is refused: seeds are never replaced
    again = CliRunner().invoke(cli, ["auth", "init", "--out", str(out)])
    assert again.exit_code != 0 and "auth add" in again.output


def test_add_adds_a_user_and_changes_no_seed(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    auth_cli("init", "--out", str(out), "--agent", "payments")
    before = seeds(out)
    auth_cli("add", "agent", "billing", "--dir", str(out))
    auth_cli("add", "worker", "sec", "--handler", "tool:pre/security_policy",
             "--handler", "tool:post/dlp", "--dir", str(out))  # fmt: skip
    after = seeds(out)
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) == {"agent-billing.nk", "worker-sec.nk"}
    setup = load_setup(out)
    billing = setup.find(DEFAULT_TENANT, "agent", "billing")
    assert billing is not None and f'"{billing.public_key}"' in (out / "auth.conf").read_text()
    assert setup.find(DEFAULT_TENANT, "worker", "sec").handlers == [  # type: ignore[union-attr]
        "tool:pre/security_policy", "tool:post/dlp"
    ]  # fmt: skip
    assert config_check(out / "server.conf").returncode == 0
    dup = CliRunner().invoke(cli, ["auth", "add", "agent", "billing", "--dir", str(out)])
    assert dup.exit_code != 0 and "already exists" in dup.output
    assert seeds(out) == after


def test_routes_get_a_password_of_their_own(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    auth_cli("init", "--out", str(out), "--route", "10.0.0.1:6222", "--route", "n2:6222")
    assert (out / ".gitignore").read_text().splitlines()[-1] == "*"  # seeds stay out of git
    cluster = out / "cluster-auth.conf"
    assert stat.S_IMODE(cluster.stat().st_mode) == 0o600
    text = cluster.read_text()
    password = text.split('password: "')[1].split('"')[0]
    assert len(password) >= 32 and password not in (out / "auth.conf").read_text()
    assert f'"nats-route://hookbus-route:{password}@10.0.0.1:6222"' in text
    assert f'"nats-route://hookbus-route:{password}@n2:6222"' in text
    auth_cli("add", "agent", "late", "--dir", str(out))
    assert cluster.read_text() == text
    bad = CliRunner().invoke(cli, ["auth", "init", "--out", str(tmp_path / "x"), "--route", "n1"])
    assert bad.exit_code != 0 and "HOST:PORT" in bad.output


def _password(conf: Path) -> str:
    return conf.read_text().split('password: "')[1].split('"')[0]


@pytest.mark.parametrize("mode", [(), ("--jwt",)], ids=["nkey", "jwt"])
def test_a_superclusters_clusters_and_gateways_get_passwords_of_their_own(
    tmp_path: Path, mode: tuple[str, ...]
) -> None:
    out = tmp_path / "auth"
    printed = auth_cli(
        "init", "--out", str(out), "--no-tls", *mode,
        "--route", "east=e1:6222,e2:6222", "--route", "east=e3:6222,e1:6222",
        "--route", "west=10.0.1.1:6222", "--gateway", "east=e1:7222,e2:7222",
        "--gateway", "west=10.0.1.1:7222",
    )  # fmt: skip
    east, west = (out / f"cluster-auth-{c}.conf" for c in ("east", "west"))
    gateway = out / "gateway-auth.conf"
    assert not (out / "cluster-auth.conf").exists()
    for conf in (east, west, gateway):
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600, conf.name
        assert str(conf) in printed
    passwords = {c.name: _password(c) for c in (east, west, gateway)}
    assert len(set(passwords.values())) == 3  # a password of its own each
    assert all(re.fullmatch(r"[0-9a-f]{64}", p) for p in passwords.values())
    e = passwords[east.name]
    assert re.findall(r'"nats-route://[^"]+"', east.read_text()) == [
        f'"nats-route://hookbus-route:{e}@{host}:6222"' for host in ("e1", "e2", "e3")
    ]  # each address once, in order
    g = passwords[gateway.name]
    text = gateway.read_text()
    assert "reject_unknown_cluster: true" in text
    assert f'{{ name: "west", urls: [ "nats://hookbus-gateway:{g}@10.0.1.1:7222" ] }}' in text
    assert f'"nats://hookbus-gateway:{g}@e2:7222"' in text
    written = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
    for name, content in written.items():
        if name not in passwords:
            assert not any(p in content for p in passwords.values()), name
    manifest = load_setup(out)
    assert manifest.clusters == {"east": ["e1:6222", "e2:6222", "e3:6222"],
                                 "west": ["10.0.1.1:6222"]}  # fmt: skip
    assert manifest.gateways == {"east": ["e1:7222", "e2:7222"], "west": ["10.0.1.1:7222"]}
    # what a node config includes, inside its blocks, is what nats-server takes
    (out / "node.conf").write_text(
        'server_name: n1\nlisten: 127.0.0.1:4222\njetstream { store_dir: "js" }\n'
        'cluster { name: east, listen: 127.0.0.1:6222, include "cluster-auth-east.conf" }\n'
        'gateway { name: east, listen: 127.0.0.1:7222, include "gateway-auth.conf" }\n'
        'include "tls.conf"\ninclude "auth.conf"\n'
    )
    check = config_check(out / "node.conf")
    assert check.returncode == 0, check.stderr + check.stdout
    for bad, hint in (("--route=east=", "no HOST:PORT"), ("--route==e1:6222", "cluster name"),
                      ("--route=east=e1", "HOST:PORT"), ("--route=east=a@b:1", "not a host"),
                      ("--gateway=e1:7222", "cluster name"),
                      ("--gateway=e s=e1:7222", "cluster name"),
                      ("--gateway=east=e1:99999", "HOST:PORT")):  # fmt: skip
        refused = CliRunner().invoke(cli, ["auth", "init", "--out", str(tmp_path / "x"), bad])
        assert refused.exit_code != 0 and hint in refused.output, (bad, refused.output)
        assert not (tmp_path / "x").exists()


def test_tls_conf_is_written_in_either_mode_and_jwt_settings_live_in_auth_conf(
    tmp_path: Path,
) -> None:
    """A node config that includes only tls.conf and auth.conf gets what server.conf gets."""
    plain, jwt = tmp_path / "plain", tmp_path / "jwt"
    auth_cli("init", "--out", str(plain), "--no-tls")
    auth_cli("init", "--out", str(jwt), "--jwt")
    assert "tls {" not in (plain / "tls.conf").read_text()
    assert "tls {" in (jwt / "tls.conf").read_text()
    for out in (plain, jwt):
        server = (out / "server.conf").read_text()
        assert 'include "tls.conf"' in server and 'include "auth.conf"' in server
        assert "tls {" not in server and "max_control_line" not in server
    assert "max_control_line: 64KB" in (jwt / "auth.conf").read_text()
    assert "max_control_line" not in (plain / "auth.conf").read_text()


def test_tenants_get_folders_and_accounts(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    auth_cli("init", "--out", str(out), "--tenant", "ACME", "--tenant", "GLOBEX",
             "--agent", "payments")  # fmt: skip
    assert (out / "ACME" / "agent-payments.nk").is_file()
    assert (out / "GLOBEX" / "agent-payments.nk").is_file()
    conf = (out / "auth.conf").read_text()
    assert "  ACME {" in conf and "  GLOBEX {" in conf
    refused = CliRunner().invoke(cli, ["auth", "add", "agent", "x", "--dir", str(out)])
    assert refused.exit_code != 0 and "--tenant" in refused.output
    auth_cli("add", "agent", "x", "--tenant", "GLOBEX", "--dir", str(out))
    assert (out / "GLOBEX" / "agent-x.nk").is_file() and not (out / "ACME" / "agent-x.nk").exists()
    assert config_check(out / "server.conf").returncode == 0


# -- a real server ----------------------------------------------------------------------


def _secured_server(out: Path) -> Iterator[tuple[str, Path]]:
    """A nats-server run from `hookbus auth init` output in `out`: two tenants, every role."""
    auth_cli("init", "--out", str(out), "--tenant", "ACME", "--tenant", "GLOBEX",
             "--embedded-agent", "payments",
             "--worker", "sec:tool:pre/security_policy,tool:pre/audit,"
             "chain:secured/security_policy,chain:secured/audit",
             "--approver", "alice", "--auditor", "audit")  # fmt: skip
    with EmbeddedNatsServer(out / "run", config=out / "server.conf", port=-1) as server:
        yield server.url, out


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A secured server shared by the module's probes (they create no bucket as hookbus
    would: some create them by hand, with other settings)."""
    yield from _secured_server(tmp_path_factory.mktemp("auth"))


@pytest.fixture
def secured_alone(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A secured server of the test's own, for a test that lets hookbus create its buckets."""
    yield from _secured_server(tmp_path / "auth")


def ident(out: Path, tenant: str, role: str, name: str) -> Identity:
    found = load_setup(out).find(tenant, role, name)
    assert found is not None
    return found


def _tls(out: Path) -> ssl.SSLContext | None:
    """A client TLS context trusting the CA `hookbus auth init` made in `out` (None: no TLS)."""
    ca = load_setup(out).tls_ca
    return ssl.create_default_context(cafile=ca) if ca else None


async def connect_as(url: str, out: Path, who: Identity) -> tuple[NATS, list[str]]:
    """Connect with `who`'s seed and inbox prefix; `errors` collects async errors."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        url,
        nkeys_seed=str(who.seed_path(out)),
        inbox_prefix=inbox_prefix(who.public_key),
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=15,  # a TLS handshake on a busy machine: a timed-out try leaks its socket
        tls=_tls(out),  # TLS is on by default: the server is verified with its CA
    )
    return nc, errors


Login = Callable[[str, str, str], Awaitable[tuple[NATS, list[str]]]]


def logins(server: tuple[str, Path]) -> contextlib.AbstractAsyncContextManager[Login]:
    """``await login(tenant, role, name)``: a connection to `server` (url, auth folder) as
    that identity, and the async errors it receives (`connect_as`); all closed on exit."""
    url, out = server
    return closing(lambda tenant, role, name: connect_as(url, out, ident(out, tenant, role, name)))


@pytest.fixture
async def login(secured: tuple[str, Path]) -> AsyncIterator[Login]:
    """`logins` to the module's `secured` server, closed at the test's end."""
    async with logins(secured) as login:
        yield login


@anyio_test
async def test_anonymous_and_unknown_keys_are_refused(
    secured: tuple[str, Path], tmp_path: Path
) -> None:
    url, _ = secured
    tls = _tls(secured[1])
    assert "authorization" in (await refusal(url, tls=tls)).lower()
    stranger = tmp_path / "stranger"
    auth_cli("init", "--out", str(stranger))  # a valid seed the server does not know
    denied = await refusal(url, nkeys_seed=str(stranger / "admin-admin.nk"), tls=tls)
    assert "authorization" in denied.lower()


@anyio_test
async def test_every_identity_connects_with_its_seed(secured: tuple[str, Path]) -> None:
    url, out = secured
    for who in load_setup(out).identities:
        nc, errors = await connect_as(url, out, who)
        try:
            # a request: its reply comes to the identity's own inbox prefix
            info = await nc.jetstream().account_info()
            assert info is not None
            assert errors == [], (who.role, errors)
        finally:
            await nc.close()


@anyio_test
async def test_tenants_do_not_see_each_other(login: Login) -> None:
    acme, _ = await login("ACME", "agent", "payments")
    acme_listener, _ = await login("ACME", "admin", "admin")
    globex, _ = await login("GLOBEX", "admin", "admin")
    subject = "hookbus.v1.suspension.payments.label.pending"
    seen_acme = await acme_listener.subscribe("hookbus.v1.suspension.>", max_msgs=1)
    seen_globex = await globex.subscribe("hookbus.v1.suspension.>")
    await acme_listener.flush()
    await globex.flush()
    await acme.publish(subject, b"from acme")
    await acme.flush()
    msg = await seen_acme.next_msg(timeout=3)  # the same tenant hears it ...
    assert msg.data == b"from acme"
    with pytest.raises(nats.errors.TimeoutError):  # ... the other does not
        await seen_globex.next_msg(timeout=0.5)


async def refusal(url: str, **options: object) -> str:
    """Connect with `options`, expecting a refusal; its text (the socket is closed after)."""
    nc = NATS()

    async def quiet(exc: Exception) -> None:
        pass

    try:
        await nc.connect(
            url,
            allow_reconnect=False,
            connect_timeout=3,
            error_cb=quiet,
            **options,  # type: ignore[arg-type]
        )
    except Exception as exc:
        return str(exc) or type(exc).__name__
    finally:
        await nc.close()
    raise AssertionError(f"connected to {url} with {options}")


async def _violation(errors: list[str], needle: str, kind: str = "") -> None:
    for _ in range(100):
        # nats-py lower-cases the server's error text
        if any(f"permissions violation for {kind}" in e.lower() and needle.lower() in e.lower()
               for e in errors):  # fmt: skip
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no permissions violation for {needle!r}: {errors}")


@anyio_test
async def test_an_agent_cannot_listen_to_handler_requests(login: Login) -> None:
    spy, spy_errors = await login("ACME", "agent", "payments")
    dispatcher, _ = await login("ACME", "dispatcher", "dispatcher")
    sub = await spy.subscribe("hookbus.v1.handler.>")
    await _violation(spy_errors, "hookbus.v1.handler.>")
    await dispatcher.publish("hookbus.v1.handler.tool=3Apre.sec", b"secret")
    await dispatcher.flush()
    with pytest.raises(nats.errors.TimeoutError):
        await sub.next_msg(timeout=0.5)


@anyio_test
async def test_a_worker_declares_only_its_own_handlers(login: Login) -> None:
    admin, _ = await login("ACME", "admin", "admin")
    wrk, wrk_errors = await login("ACME", "worker", "sec")
    await admin.jetstream().create_key_value(
        KeyValueConfig(bucket="hookbus_handlers", history=1, direct=True)
    )
    kv = await wrk.jetstream().key_value("hookbus_handlers")
    await kv.put("tool=3Apre.security_policy", b"{}")  # its own handler: acked
    assert (await kv.get("tool=3Apre.security_policy")).value == b"{}"
    with pytest.raises(nats.errors.TimeoutError):  # refused publish: no ack ever comes
        await wrk.jetstream().publish("$KV.hookbus_handlers.tool=3Apre.other", b"{}", timeout=1)
    await _violation(wrk_errors, "$KV.hookbus_handlers.tool=3Apre.other")
    # nor may it serve another handler's requests, or its own outside its queue group
    await wrk.subscribe("hookbus.v1.handler.*.other", queue="other")
    await _violation(wrk_errors, "hookbus.v1.handler.*.other")
    await wrk.subscribe("hookbus.v1.handler.*.audit")
    await _violation(wrk_errors, "hookbus.v1.handler.*.audit")


@anyio_test
async def test_one_worker_connection_answers_a_collect_once_per_handler(login: Login) -> None:
    """A worker serving two handlers hears one emit_and_collect twice (two queue groups)
    with one reply subject, and may answer it twice (nats-server needs allow_responses
    max >= 3 for that: the model gives 2 per handler)."""
    wrk, wrk_errors = await login("ACME", "worker", "sec")
    disp, _ = await login("ACME", "dispatcher", "dispatcher")
    harden_connection(wrk)  # its flush then follows its SUBs, as a hookbus worker's does
    for handler in ("security_policy", "audit"):

        async def answer(msg: nats.aio.msg.Msg, handler: str = handler) -> None:
            await msg.respond(handler.encode())

        await wrk.subscribe("hookbus.v1.collect.tool=3Apre", queue=handler, cb=answer)
    await wrk.flush()
    inbox = disp.new_inbox()
    replies = await disp.subscribe(inbox)
    await disp.publish("hookbus.v1.collect.tool=3Apre", b"{}", reply=inbox)
    got: set[bytes] = set()
    try:
        while len(got) < 2:
            msg = await replies.next_msg(timeout=10)
            assert not msg.headers, f"a status instead of an answer: {msg.headers}"
            got.add(msg.data)
    except nats.errors.TimeoutError:
        pytest.fail(f"answers {got}; the worker's async errors: {wrk_errors}")
    assert got == {b"security_policy", b"audit"}
    assert wrk_errors == []


@anyio_test
async def test_a_chain_with_progress_replies_is_answered_within_the_workers_permissions(
    secured_alone: tuple[str, Path],
) -> None:
    """Worker ``sec`` serves its two handlers as one chain; both wait, so its answer is a
    progress reply and a final one on the dispatcher's reply subject: its permissions must let
    both through, and the decision is the one-by-one one."""
    event = "chain:secured"
    async with logins(secured_alone) as login:
        admin, _ = await login("ACME", "admin", "admin")
        wrk, wrk_errors = await login("ACME", "worker", "sec")
        disp, disp_errors = await login("ACME", "dispatcher", "dispatcher")
        await provision(admin)  # the buckets: only the admin may create them
        worker = HookWorker(wrk)

        @worker.handler(event, priority=1)
        async def security_policy(ev: str, data: dict[str, object]) -> HookResult:
            await asyncio.sleep(0.05)
            return HookResult(action="modify", data={**data, "checked": True})

        @worker.handler(event, priority=2)
        async def audit(ev: str, data: dict[str, object]) -> HookResult:
            await asyncio.sleep(0.05)
            return HookResult(action="deny", reason=f"audited {data.get('checked')}")

        async with worker, HookDispatcher(disp) as d:
            results = [await d.emit(event, {"tool_name": "bash"}) for _ in range(3)]
        assert [(r.action, r.decided_by, r.reason, r.failures) for r in results] == [
            ("deny", "audit", "audited True", [])
        ] * 3
        assert wrk_errors == [] and disp_errors == []


@anyio_test
async def test_an_agent_reads_only_its_own_suspensions(login: Login) -> None:
    disp, _ = await login("GLOBEX", "admin", "admin")
    agt, agt_errors = await login("GLOBEX", "agent", "payments")
    kv = await disp.jetstream().create_key_value(
        KeyValueConfig(bucket="hookbus_suspensions", history=1, direct=True)
    )
    await kv.put("payments.l1", b"mine")
    await kv.put("other.l1", b"theirs")
    mine = await agt.jetstream().key_value("hookbus_suspensions")
    assert (await mine.get("payments.l1")).value == b"mine"
    await mine.put("payments.l2", b"own write")  # its own 2-token key: allowed
    with pytest.raises(nats.errors.TimeoutError):
        await mine.get("other.l1")
    await _violation(agt_errors, "$KV.hookbus_suspensions.other.l1")


@anyio_test
async def test_tls_options_give_a_tls_server_and_contexts(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    for name, pem in (("cert.pem", cert.cert_chain_pems[0]), ("key.pem", cert.private_key_pem),
                      ("ca.pem", ca.cert_pem)):  # fmt: skip
        pem.write_to_path(str(tmp_path / name))
    out = tmp_path / "auth"
    auth_cli("init", "--out", str(out), "--agent", "payments",
             "--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem"),
             "--tls-ca", str(tmp_path / "ca.pem"))  # fmt: skip
    assert config_check(out / "server.conf").returncode == 0
    who = ident(out, DEFAULT_TENANT, "agent", "payments")
    context = json.loads(who.context_path(out).read_text())
    assert context["url"].startswith("tls://") and context["ca"] == str(tmp_path / "ca.pem")
    with EmbeddedNatsServer(tmp_path / "run", config=out / "server.conf", port=-1) as server:
        url = "tls://" + server.url.partition("://")[2]
        tls = ssl.create_default_context()
        ca.configure_trust(tls)
        nc = await nats.connect(
            url,
            tls=tls,
            nkeys_seed=str(who.seed_path(out)),
            inbox_prefix=inbox_prefix(who.public_key),
            allow_reconnect=False,
        )
        try:
            assert (await nc.jetstream().account_info()) is not None
        finally:
            await nc.close()


@anyio_test
async def test_the_scoped_jetstream_forms_cannot_be_widened_by_the_request_body(
    secured: tuple[str, Path], login: Login
) -> None:
    """An agent allowed only the subject forms carrying its own key prefix cannot read
    another agent's keys by putting another filter in the request body: nats-server
    checks the body against the subject."""
    _, out = secured
    disp, _ = await login("ACME", "admin", "admin")
    agt, _ = await login("ACME", "agent", "payments")
    slots = slot_names(ident(out, "ACME", "agent", "payments").public_key)
    kv = await disp.jetstream().create_key_value(
        KeyValueConfig(bucket="hookbus_suspensions", history=1, direct=True)
    )
    await kv.put("other.secret", b"theirs")
    own, other = "$KV.hookbus_suspensions.payments.>", "$KV.hookbus_suspensions.other.>"
    inbox = agt.new_inbox()
    delivered = await agt.subscribe(inbox)
    for i, widen in enumerate([{"filter_subject": other}, {"filter_subjects": [own, other]}, {}]):
        name = slots[i]  # its own slot: the name is allowed, only the body widens
        config = {"name": name, "deliver_subject": inbox, "ack_policy": "none", **widen}
        reply = await agt.request(
            f"$JS.API.CONSUMER.CREATE.KV_hookbus_suspensions.{name}.{own}",
            json.dumps({"stream_name": "KV_hookbus_suspensions", "config": config}).encode(),
            timeout=3,
        )
        assert json.loads(reply.data).get("error"), (widen, reply.data)
    got = await agt.request(
        "$JS.API.DIRECT.GET.KV_hookbus_suspensions.$KV.hookbus_suspensions.payments.none",
        json.dumps({"last_by_subj": "$KV.hookbus_suspensions.other.secret"}).encode(),
        timeout=3,
    )
    assert got.data != b"theirs"
    with pytest.raises(nats.errors.TimeoutError):
        await delivered.next_msg(timeout=0.3)


# -- hookbus server --config -----------------------------------------------------------


def _hookbus(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hookbus.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=15)
    return out, err


@anyio_test
async def test_server_command_runs_a_generated_config(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    auth_cli("init", "--out", str(out), "--agent", "payments")
    proc = _hookbus("server", "--config", str(out / "server.conf"), "--port", "-1",
                    "--data-dir", str(tmp_path / "run"))  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 15)
        url = line.split(" at ")[1].split(";")[0]
        assert "authorization" in (await refusal(url, tls=_tls(out))).lower()
        nc, _ = await connect_as(url, out, ident(out, DEFAULT_TENANT, "agent", "payments"))
        await nc.jetstream().account_info()
        await nc.close()
        assert (out / "jetstream").is_dir()  # the config's store, not --data-dir
        # a plain agent running `hookbus emit` without --service is told to add it
        payments = ident(out, DEFAULT_TENANT, "agent", "payments")
        emitted = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "hookbus.cli", "emit", "tool:pre", "{}", "--agent-id",
             "payments", "--context", str(payments.context_path(out)), "--url", url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert emitted.returncode == 1, emitted.stderr
        assert "add --service" in emitted.stderr and "Traceback" not in emitted.stderr
    finally:
        _stop(proc)
    # nats-server removes its ports file when it exits: it was stopped, not orphaned
    assert list((tmp_path / "run" / "ports").glob("*.ports")) == []


def test_the_development_server_says_it_is_open_and_on_loopback(tmp_path: Path) -> None:
    proc = _hookbus("server", "--port", "-1", "--data-dir", str(tmp_path / "dev"))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "nats://127.0.0.1:" in line
    finally:
        _, err = _stop(proc)
    assert "open (no auth" in err and "loopback" in err


@pytest.mark.parametrize(
    "section", ["## How to run it", "## JWT mode: identities issued, not configured"]
)
def test_the_security_docs_steps_run_as_written(tmp_path: Path, section: str) -> None:
    """docs/security.md's "How to run it" commands (and those of its JWT mode, where the
    worker and the agent are issued while the server runs), run one by one as written (only
    the server's port is another, free one): the emit through the service is denied by the
    worker's security_policy."""
    text = (ROOT / "docs" / "security.md").read_text()
    block = text.split(section, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # "from the repository's root"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    background: list[subprocess.Popen[str]] = []
    try:
        result = None
        for line in block.strip().splitlines():
            args = shlex.split(line.removesuffix("&").strip())
            assert args[0] == "hookbus", line
            args = [sys.executable, "-m", "hookbus.cli", *args[1:]]
            if args[3:5] == ["auth", "init"]:
                args += ["--port", str(port)]
            if line.rstrip().endswith("&"):
                proc = subprocess.Popen(
                    args, cwd=tmp_path, env=env, text=True,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                )  # fmt: skip
                background.append(proc)
                _wait_ready(proc, port if args[3] == "server" else None)
                continue
            result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                                    timeout=120)  # fmt: skip
            assert result.returncode == 0, (line, result.stdout, result.stderr)
        assert result is not None
        decided = json.loads(result.stdout)
        assert (decided["action"], decided["decided_by"]) == ("deny", "security_policy"), decided
    finally:
        for proc in reversed(background):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=30)  # reads the rest and closes the pipe
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def _wait_ready(proc: subprocess.Popen[str], port: int | None) -> None:
    """Until `proc` listens on `port` (a server), or says it is serving (a dispatcher or
    worker prints its banner once its subscriptions are in place)."""
    deadline = time.monotonic() + 60
    if port is not None:
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
    assert proc.stdout is not None
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if "serving" in line:
            return
    raise AssertionError(f"not serving: {''.join(seen)[-2000:]}")


def test_identities_of_a_domain_may_reach_jetstream_through_it() -> None:
    """With a JetStream domain every JetStream API entry and KV write is also allowed as
    ``$JS.<domain>.API...`` (a client at a leaf reaching the hub); nothing else widens."""
    for role, publish, subscribe in _every_role("UKEY"):
        perms = permissions_for(
            role.split(" ")[0],  # type: ignore[arg-type]
            "x",
            handlers=["tool:pre/x"] if role == "worker" else None,
            embedded=role == "agent (embedded)",
            public_key="UKEY",
            js_domains=["hub"],
        )
        added = [s for s in perms.publish if s not in publish]
        for s in publish:
            if s.startswith("$JS.API."):
                assert "$JS.hub.API." + s[len("$JS.API.") :] in added, (role, s)
            if s.startswith("$KV."):
                assert "$JS.hub.API." + s in added, (role, s)
        assert all(s.startswith("$JS.hub.API.") for s in added), (role, added)
        assert perms.subscribe == subscribe
    assert "$JS.hub.API.>" in permissions_for("admin", "a", js_domains=["hub"]).publish
    with pytest.raises(BadRequestError):
        permissions_for("admin", "a", js_domains=["a.b"])


@anyio_test
async def test_a_secured_hub_domain_is_provisioned_and_decides_through_its_domain(
    tmp_path: Path,
) -> None:
    """`hookbus auth init --js-domain hub`: the server's JetStream is domain ``hub`` and
    every context names it; `auth provision --js-domain hub` makes the buckets there (it
    ignored the option before, and failed), and an embedded agent and a worker, both told
    the domain, decide at the hub: the guard denies. (At the hub itself the server lets
    ``$JS.hub.API`` through without the domain permissions: tests/test_sites_secured.py
    shows them needed, at a leaf.)"""
    out = tmp_path / "auth"
    event = "tool:pre"
    auth_cli("init", "--out", str(out), "--js-domain", "hub", "--embedded-agent", "a1",
             "--worker", f"w:{event}/guard", "--no-tls")  # fmt: skip
    assert "domain" in (out / "server.conf").read_text()
    assert json.loads((out / "agent-a1.json").read_text())["jetstream_domain"] == "hub"
    with EmbeddedNatsServer(out / "run", config=out / "server.conf", port=-1) as server:
        with anyio.fail_after(120):
            run = await anyio.run_process(
                [sys.executable, "-m", "hookbus.cli", "auth", "provision", "--dir", str(out),
                 "--url", server.url, "--js-domain", "hub"], check=False,
            )  # fmt: skip
        assert run.returncode == 0, run.stderr.decode()
        worker_nc, _ = await connect_as(server.url, out, ident(out, "HOOKBUS", "worker", "w"))
        agent_nc, errors = await connect_as(server.url, out, ident(out, "HOOKBUS", "agent", "a1"))
        try:
            worker = HookWorker(worker_nc, js_domain="hub")

            @worker.handler(event, name="guard", failure_policy="deny")
            async def guard(ev: str, data: dict[str, object]) -> HookResult:
                return HookResult(action="deny", reason="no")

            async with worker:
                async with HookDispatcher(agent_nc, agent_id="a1", js_domain="hub") as d:
                    for _ in range(100):
                        if d.routes(event):
                            break
                        await asyncio.sleep(0.05)
                    result = await d.emit(event, {"tool_name": "bash"})
                    assert result.action == "deny" and result.decided_by == "guard", result
            assert errors == []
        finally:
            await worker_nc.close()
            await agent_nc.close()
