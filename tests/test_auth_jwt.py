"""`hookbus auth init --jwt` and `hookbus auth issue`: identities issued as NATS JWTs
(operator, one account per tenant, users signed by the account's signing key), against a
real nats-server started from the generated config: every identity connects with its
``.creds``; one issued after the server started connects with no reload and no server file
changed; a worker and an embedded agent issued later decide an emit end to end; the
least-privilege probes hold. The full probe suite runs in both modes in
tests/test_permissions.py."""

from __future__ import annotations

import base64
import hashlib
import json
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import nats.errors
import pytest
from _closing import closing
from click.testing import CliRunner
from nats.aio.client import Client as NATS

from hookbus.cli import EmbeddedNatsServer, find_nats_server
from hookbus.cli._auth_files import load_setup
from hookbus.cli._command_tree import cli
from hookbus.cli._connect import ConnectionSettings, auth_ca
from hookbus.cli._jwt import (
    JwtError,
    KeyPair,
    creds_text,
    decode,
    new_key,
    parse_creds,
    user_jwt,
    user_permissions,
)
from hookbus.cli._permissions import RolePermissions, agent, permissions_for, worker
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult, handler_subject, suspension_key
from hookbus.workers import HookWorker

anyio_test = pytest.mark.anyio
EVENT = "tool:pre"


def hookbus(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def issue(out: Path, tenant: str, role: str, name: str, *options: str) -> str:
    """``hookbus auth issue ROLE NAME`` in tenant `tenant` of the setup in `out` (it must
    succeed): its output."""
    return hookbus("auth", "issue", role, name, "--dir", str(out), "--tenant", tenant, *options)


def init_jwt(out: Path, *options: str) -> Path:
    """``hookbus auth init --jwt --out OUT OPTIONS`` (it must succeed): `out`."""
    hookbus("auth", "init", "--jwt", "--out", str(out), *options)
    return out


def _claims_part(token: str) -> dict[str, Any]:
    part = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))))


# -- the claims (pure) ------------------------------------------------------------------


def test_a_user_jwt_carries_its_roles_permissions_signed_by_the_account_signing_key() -> None:
    account, signing, user = new_key("account"), new_key("account"), new_key("user")
    perms = worker("sec", [f"{EVENT}/security", f"{EVENT}/audit"], public_key=user.public_key)
    token = user_jwt(signing, user.public_key, "sec", perms, issuer_account=account.public_key)
    header = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
    assert header == {"typ": "JWT", "alg": "ed25519-nkey"}
    claims = decode(token)  # the signature is checked against iss
    assert claims["iss"] == signing.public_key and claims["sub"] == user.public_key
    assert claims["name"] == "sec" and isinstance(claims["iat"], int)
    nats_claims = claims["nats"]
    assert nats_claims["type"] == "user" and nats_claims["version"] == 2
    assert nats_claims["issuer_account"] == account.public_key
    # one mapping of the role's lists, nothing written twice
    assert nats_claims["pub"] == {"allow": perms.publish}
    assert nats_claims["sub"] == {"allow": perms.subscribe}
    assert any(" " in s for s in nats_claims["sub"]["allow"])  # queue-only entries kept
    r = perms.allow_responses
    assert r is not None
    assert nats_claims["resp"] == {"max": r.max_msgs, "ttl": int(r.expires_s * 1e9)}
    assert (nats_claims["subs"], nats_claims["data"], nats_claims["payload"]) == (-1, -1, -1)
    # jti: base32 SHA-512/256 of the standard claims without it (the NATS library's way)
    standard = {k: claims[k] for k in ("iat", "iss", "name", "sub")}
    digest = hashlib.new("sha512_256", json.dumps(standard, separators=(",", ":")).encode())
    assert claims["jti"] == base64.b32encode(digest.digest()).decode().rstrip("=")


def test_an_agent_has_no_response_permission_and_an_empty_list_denies_all() -> None:
    assert "resp" not in user_permissions(agent("a1"))
    empty = RolePermissions(role="auditor", name="x", publish_permissions=(),
                            subscribe_permissions=())  # fmt: skip
    assert user_permissions(empty) == {"pub": {"deny": [">"]}, "sub": {"deny": [">"]}}


def test_an_expiring_user_jwt_carries_exp_hashed_into_its_jti() -> None:
    account, user = new_key("account"), new_key("user")
    at = int(time.time()) + 3600
    token = user_jwt(account, user.public_key, "a", agent("a"), issuer_account=account.public_key,
                     expires_at=at)  # fmt: skip
    claims = decode(token)
    assert claims["exp"] == at
    standard = {k: claims[k] for k in ("exp", "iat", "iss", "name", "sub")}  # the library's order
    digest = hashlib.new("sha512_256", json.dumps(standard, separators=(",", ":")).encode())
    assert claims["jti"] == base64.b32encode(digest.digest()).decode().rstrip("=")
    assert "exp" not in decode(user_jwt(account, user.public_key, "a", agent("a"),
                                        issuer_account=account.public_key))  # fmt: skip
    with pytest.raises(JwtError, match="expire"):
        user_jwt(account, user.public_key, "a", agent("a"), issuer_account=account.public_key,
                 expires_at=int(time.time()) - 1)  # fmt: skip


def test_a_tampered_jwt_or_a_bad_creds_file_is_refused() -> None:
    account, user = new_key("account"), new_key("user")
    token = user_jwt(account, user.public_key, "a", agent("a"), issuer_account=account.public_key)
    assert "issuer_account" not in _claims_part(token)["nats"]  # signed by the account itself
    head, _, sig = token.split(".")
    forged = _claims_part(token)
    forged["nats"]["pub"] = {"allow": [">"]}
    raw = json.dumps(forged).encode()
    with pytest.raises(JwtError, match="signature"):
        decode(f"{head}.{base64.urlsafe_b64encode(raw).rstrip(b'=').decode()}.{sig}")
    with pytest.raises(JwtError):
        decode("a.b")
    assert parse_creds(creds_text(token, user.seed)) == (token, user.seed)
    with pytest.raises(JwtError, match="SEED"):
        parse_creds(f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n")
    with pytest.raises(JwtError):
        KeyPair.from_seed("not a seed")


# -- the files ---------------------------------------------------------------------------


def test_init_jwt_writes_a_valid_config_that_does_not_grow_with_users(tmp_path: Path) -> None:
    small, large = tmp_path / "small", tmp_path / "large"
    hookbus("auth", "init", "--jwt", "--no-tls", "--out", str(small), "--agent", "a1")
    hookbus("auth", "init", "--jwt", "--no-tls", "--out", str(large),
            *(f"--agent=a{i}" for i in range(30)), "--worker", f"sec:{EVENT}/security")  # fmt: skip
    for out in (small, large):
        check = subprocess.run([find_nats_server(), "-c", str(out / "server.conf"), "-t"],
                               capture_output=True, text=True, timeout=30)  # fmt: skip
        assert check.returncode == 0, check.stderr + check.stdout
        seeds = {p.name for p in out.rglob("*.nk")}
        assert seeds == {"operator.nk", "system-account.nk", "account.nk",
                         "account-signing.nk"}, "JWT mode: .creds, no user seed"  # fmt: skip
        for secret in [*out.rglob("*.creds"), *out.rglob("*.nk")]:
            assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
        conf = (out / "auth.conf").read_text()
        assert "resolver: MEMORY" in conf and "users:" not in conf
    # the server's config holds the operator and the accounts, never a user
    sizes = [len((out / "auth.conf").read_text()) for out in (small, large)]
    assert abs(sizes[0] - sizes[1]) < 200, sizes
    setup = load_setup(small)
    assert setup.jwt is not None
    account = setup.jwt["accounts"]["HOOKBUS"]
    claims = decode(account["jwt"])
    assert claims["iss"] == setup.jwt["operator"]["public_key"]
    assert claims["nats"]["signing_keys"] == [account["signing_key"]]
    limits = claims["nats"]["limits"]
    # the static mode's sizes as nats-server's config reads them (8G: 8 * 1000**3 bytes)
    assert limits["disk_storage"] == 8 * 1000**3 and limits["mem_storage"] == 256 * 1000**2
    assert limits["streams"] > 0 and limits["consumer"] > 0
    operator = decode(setup.jwt["operator"]["jwt"])["nats"]
    assert operator["system_account"] == setup.jwt["system_account"]["public_key"]
    ctx = json.loads((small / "agent-a1.json").read_text())
    assert ctx["creds"] == str((small / "agent-a1.creds").resolve()) and "nkey" not in ctx


def test_issue_and_add_refuse_what_their_mode_does_not_do(tmp_path: Path) -> None:
    static, jwt = tmp_path / "static", tmp_path / "jwt"
    hookbus("auth", "init", "--no-tls", "--out", str(static))
    hookbus("auth", "init", "--jwt", "--no-tls", "--out", str(jwt), "--tenant", "T1",
            "--tenant", "T2")  # fmt: skip
    assert "without --jwt" in hookbus("auth", "issue", "agent", "a", "--dir", str(static), code=1)
    assert "auth issue" in hookbus("auth", "add", "agent", "a", "--dir", str(jwt), "--tenant",
                                   "T1", code=1)  # fmt: skip
    # usage errors: exit 2
    assert "--tenant" in hookbus("auth", "issue", "agent", "a", "--dir", str(jwt), code=2)
    assert "unknown tenant" in hookbus("auth", "issue", "agent", "a", "--dir", str(jwt),
                                       "--tenant", "T3", code=2)  # fmt: skip
    assert "no handler" in hookbus("auth", "issue", "worker", "w", "--dir", str(jwt),
                                   "--tenant", "T1", code=2)  # fmt: skip
    assert "only a worker" in hookbus("auth", "issue", "agent", "a", "--dir", str(jwt), "--tenant",
                                      "T1", "--handler", f"{EVENT}/x", code=2)  # fmt: skip
    hookbus("auth", "issue", "agent", "a", "--dir", str(jwt), "--tenant", "T1")
    before = (jwt / "T1" / "agent-a.creds").read_bytes()
    assert "not overwriting" in hookbus("auth", "issue", "agent", "a", "--dir", str(jwt),
                                        "--tenant", "T1", code=1)  # fmt: skip
    assert (jwt / "T1" / "agent-a.creds").read_bytes() == before
    assert "already exists" in hookbus("auth", "issue", "admin", "admin", "--dir", str(jwt),
                                       "--tenant", "T2", code=1)  # fmt: skip


def test_a_leaf_link_credential_is_good_for_a_leaf_link_only_and_limits_nothing_else(
    tmp_path: Path,
) -> None:
    static, jwt = tmp_path / "static", tmp_path / "jwt"
    hookbus("auth", "init", "--no-tls", "--out", str(static))
    hookbus("auth", "init", "--jwt", "--no-tls", "--out", str(jwt), "--tenant", "T1",
            "--tenant", "T2")  # fmt: skip
    assert "leafnodes block" in hookbus("auth", "leaf-link", "s1", "--dir", str(static), code=1)
    assert "--tenant" in hookbus("auth", "leaf-link", "s1", "--dir", str(jwt), code=2)
    path, account = hookbus("auth", "leaf-link", "s1", "--dir", str(jwt), "--tenant", "T2").split()
    assert Path(path) == jwt / "T2" / "leaf-s1.creds"
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    token, _ = parse_creds(Path(path).read_text())
    claims = _claims_part(token)
    setup = load_setup(jwt)
    assert account == setup.jwt["accounts"]["T2"]["public_key"] == claims["nats"]["issuer_account"]
    assert claims["iss"] == setup.jwt["accounts"]["T2"]["signing_key"]
    assert claims["nats"]["allowed_connection_types"] == ["LEAFNODE"]
    assert "pub" not in claims["nats"] and "sub" not in claims["nats"]
    assert "not overwriting" in hookbus("auth", "leaf-link", "s1", "--dir", str(jwt), "--tenant",
                                        "T2", code=1)  # fmt: skip
    with pytest.raises(JwtError, match="connection types"):  # never a user without limits
        user_jwt(new_key("account"), new_key("user").public_key, "u", None,
                 issuer_account=new_key("account").public_key)  # fmt: skip


# -- against a server ---------------------------------------------------------------------


@pytest.fixture
def jwt_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    out = init_jwt(tmp_path / "auth", "--tenant", "T1", "--tenant", "T2", "--agent", "a1",
                   "--embedded-agent", "e1", "--worker", f"sec:{EVENT}/security",
                   "--approver", "alice", "--auditor", "aud")  # fmt: skip
    with EmbeddedNatsServer(out / "run", config=out / "server.conf", port=-1) as server:
        yield server.url, out


async def connect(url: str, creds: Path) -> tuple[NATS, list[str]]:
    """Connect with a ``.creds`` file as the CLI would (its inbox prefix and the folder's
    CA found from the file)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    ca = auth_ca(str(creds))
    assert ca is not None, "the creds file's folder names its CA"
    options = ConnectionSettings(url=url, creds=str(creds), tls_ca=ca).nats_options()
    assert options["inbox_prefix"].startswith("_INBOX_U")
    nc = NATS()
    try:  # a TLS handshake on a busy machine can take seconds: a wide timeout
        await nc.connect(url, error_cb=on_error, allow_reconnect=False, connect_timeout=15,
                         **options)  # fmt: skip
    except BaseException:  # nats-py leaves a refused connection's transport open
        await nc.close()
        raise
    return nc, errors


async def cut_then_refused(nc: NATS, url: str, creds: Path, *refusals: str) -> None:
    """Wait (20 s at most) until the server closes `nc`, a connection with `creds`; then a
    new connection with them is refused (``authorization``, or one of `refusals`)."""
    with anyio.fail_after(20):
        while nc.is_connected:  # noqa: ASYNC110  (no event for it)
            await anyio.sleep(0.05)
    with pytest.raises(Exception, match="(?i)" + "|".join(("authorization", *refusals))):
        await connect(url, creds)


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


async def _violation(errors: list[str], needle: str) -> None:
    """Until the server reported a permissions violation mentioning `needle` (5 s)."""
    for _ in range(250):
        if any("permissions violation" in e.lower() and needle.lower() in e.lower()
               for e in errors):  # fmt: skip
            return
        await anyio.sleep(0.02)
    raise AssertionError(f"no permissions violation for {needle!r}: {errors}")


@anyio_test
async def test_identities_connect_and_one_issued_later_needs_no_reload(
    jwt_server: tuple[str, Path],
) -> None:
    url, out = jwt_server
    for creds in sorted(out.rglob("*.creds")):
        nc, errors = await connect(url, creds)
        try:
            assert await nc.jetstream().account_info() is not None  # a reply to its inbox
            assert errors == [], (creds, errors)
        finally:
            await nc.close()
    server_files = _files(out)
    issue(out, "T1", "agent", "late")
    issue(out, "T1", "worker", "late-w", "--handler", f"{EVENT}/audit")
    assert _files(out) == server_files, "issuing changes no server file"
    for stem in ("agent-late", "worker-late-w"):
        nc, errors = await connect(url, out / "T1" / f"{stem}.creds")
        try:
            assert await nc.jetstream().account_info() is not None
            assert errors == []
        finally:
            await nc.close()
    # a credential of another operator is refused
    stranger = out.parent / "stranger"
    hookbus("auth", "init", "--jwt", "--no-tls", "--out", str(stranger))
    tls = ConnectionSettings(tls_ca=load_setup(out).tls_ca).ssl_context()
    refused = NATS()
    try:
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await refused.connect(url, user_credentials=str(stranger / "admin-admin.creds"),
                                  allow_reconnect=False, connect_timeout=15, tls=tls)  # fmt: skip
    finally:  # nats-py leaves a refused connection's transport open: closed in this loop
        await refused.close()


@anyio_test
async def test_issued_worker_and_embedded_agent_decide_end_to_end_within_their_rights(
    jwt_server: tuple[str, Path],
) -> None:
    url, out = jwt_server
    provisioned = await anyio.run_process(
        [sys.executable, "-m", "hookbus.cli", "auth", "provision", "--dir", str(out),
         "--tenant", "T1", "--url", url], check=False,
    )  # fmt: skip  # the admin's .creds, found in the folder
    assert provisioned.returncode == 0, provisioned.stderr.decode()
    issue(out, "T1", "worker", "guard", "--handler", f"{EVENT}/guard")
    issue(out, "T1", "agent", "pay", "--embedded")
    issue(out, "T1", "agent", "other")
    async with closing(connect) as login:
        worker_nc, _ = await login(url, out / "T1" / "worker-guard.creds")
        agent_nc, _ = await login(url, out / "T1" / "agent-pay.creds")
        plain_nc, plain_errors = await login(url, out / "T1" / "agent-other.creds")
        w = HookWorker(worker_nc)

        @w.handler(EVENT, name="guard", failure_policy="deny")
        async def guard(event: str, data: dict[str, Any]) -> HookResult:
            command = str(data.get("tool_input", {}).get("command", ""))
            return HookResult(action="deny" if "rm -rf" in command else "continue",
                              reason="destructive" if "rm -rf" in command else None)  # fmt: skip

        async with w, HookDispatcher(agent_nc, agent_id="pay") as d:
            d.set_default_fields(session_id="s1")
            await d.refresh()
            assert "guard" in d.list_handlers(EVENT)[EVENT]
            denied = await d.emit(EVENT, {"tool_name": "bash",
                                          "tool_input": {"command": "rm -rf /"}})  # fmt: skip
            assert denied.action == "deny", denied
            allowed = await d.emit(EVENT, {"tool_name": "bash",
                                           "tool_input": {"command": "ls"}})  # fmt: skip
            assert allowed.action == "continue", allowed
            # least privilege: a plain agent may not call the worker's handler subject ...
            await plain_nc.publish(handler_subject(EVENT, "guard"), b"{}")
            await plain_nc.flush()
            await _violation(plain_errors, "hookbus.v1.handler")
            # ... nor read another agent's records
            kv = await plain_nc.jetstream(timeout=2).key_value("hookbus_suspensions")
            with pytest.raises(Exception):  # noqa: B017  (the refusal, then a timeout)
                await kv.get(suspension_key("label", "pay"))
            await _violation(plain_errors, "hookbus_suspensions")
            # ... nor serve the worker's handler
            await plain_nc.subscribe(handler_subject(EVENT, "guard"), queue="guard")
            await _violation(plain_errors, "subscription")


@anyio_test
async def test_issued_users_of_one_tenant_do_not_reach_another(
    jwt_server: tuple[str, Path],
) -> None:
    url, out = jwt_server
    issue(out, "T1", "agent", "twin")
    issue(out, "T2", "agent", "twin")
    async with closing(connect) as login:
        t1, _ = await login(url, out / "T1" / "agent-twin.creds")
        t2, _ = await login(url, out / "T2" / "agent-twin.creds")
        sub = await t2.subscribe("hookbus.v1.suspension.twin.>")
        await t2.flush()
        await t1.publish("hookbus.v1.suspension.twin.l.pending", b"tenant one")
        await t1.flush()
        with pytest.raises(nats.errors.TimeoutError):
            await sub.next_msg(timeout=0.5)


def test_every_role_can_be_issued(tmp_path: Path) -> None:
    out = init_jwt(tmp_path / "auth", "--no-tls")
    for role, extra in (("agent", ()), ("worker", ("--handler", f"{EVENT}/x")),
                        ("approver", ()), ("auditor", ()), ("dispatcher", ()),
                        ("admin", ())):  # fmt: skip
        hookbus("auth", "issue", role, f"n-{role}", "--dir", str(out), *extra)
        token, seed = parse_creds((out / f"{role}-n-{role}.creds").read_text())
        claims = decode(token)
        handlers = [f"{EVENT}/x"] if role == "worker" else None
        pub = KeyPair.from_seed(seed).public_key
        expected = permissions_for(role, f"n-{role}", handlers=handlers, public_key=pub)  # type: ignore[arg-type]
        assert claims["sub"] == pub
        assert claims["nats"]["pub"] == {"allow": expected.publish}
        assert claims["nats"]["sub"] == {"allow": expected.subscribe}


@anyio_test
async def test_an_expiring_credential_works_until_it_expires_then_is_refused_and_cut(
    tmp_path: Path,
) -> None:
    out = init_jwt(tmp_path / "auth")
    assert "duration" in hookbus("auth", "issue", "agent", "x", "--dir", str(out),
                                 "--expires", "soon", code=2)  # fmt: skip
    with EmbeddedNatsServer(out / "run", config=out / "server.conf", port=-1) as server:
        hookbus("auth", "issue", "agent", "brief", "--dir", str(out), "--expires", "8s")
        hookbus("auth", "issue", "agent", "lasting", "--dir", str(out))
        expires_at = decode(parse_creds((out / "agent-brief.creds").read_text())[0])["exp"]
        async with closing(connect) as login:
            brief, _ = await login(server.url, out / "agent-brief.creds")
            lasting, _ = await login(server.url, out / "agent-lasting.creds")
            assert await brief.jetstream().account_info() is not None
            await anyio.sleep(max(0.0, expires_at + 1 - time.time()))
            await cut_then_refused(brief, server.url, out / "agent-brief.creds", "expired")
            assert lasting.is_connected and await lasting.jetstream().account_info() is not None


@anyio_test
async def test_a_revoked_credential_is_refused_after_a_reload_and_others_stay(
    tmp_path: Path,
) -> None:
    out = init_jwt(tmp_path / "auth")
    with EmbeddedNatsServer(out / "run", config=out / "server.conf", port=-1) as server:
        hookbus("auth", "issue", "agent", "leaked", "--dir", str(out))
        hookbus("auth", "issue", "agent", "kept", "--dir", str(out))
        async with closing(connect) as login:
            leaked, _ = await login(server.url, out / "agent-leaked.creds")
            kept, kept_errors = await login(server.url, out / "agent-kept.creds")
            said = hookbus("auth", "revoke", str(out / "agent-leaked.creds"), "--dir", str(out))
            assert "reload" in said
            public = KeyPair.from_seed(parse_creds(
                (out / "agent-leaked.creds").read_text())[1]).public_key  # fmt: skip
            claims = decode(load_setup(out).jwt["accounts"]["HOOKBUS"]["jwt"])  # type: ignore[index]
            assert public in claims["nats"]["revocations"]
            offset = server.reload()
            with anyio.fail_after(20):
                while (outcome := server.reload_outcome(offset)) is None:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            assert outcome == (True, ""), outcome
            await cut_then_refused(leaked, server.url, out / "agent-leaked.creds")
            # the other credential kept its connection and still connects
            assert kept.is_connected and await kept.jetstream().account_info() is not None
            again, errors = await connect(server.url, out / "agent-kept.creds")
            assert await again.jetstream().account_info() is not None and errors == []
            await again.close()
            refusals = [e for e in kept_errors if "violation" in e.lower()]
            assert kept.is_connected and refusals == [], kept_errors
    assert "neither" in hookbus("auth", "revoke", "UXXX", "--dir", str(out), code=2)
    static = tmp_path / "static"
    hookbus("auth", "init", "--no-tls", "--out", str(static))
    assert "JWT mode" in hookbus("auth", "revoke", public, "--dir", str(static), code=1)
