"""The `hookbus auth` commands (`init`, `add`, `issue`, `revoke`, `table`; `provision` is added from
`hookbus.cli._provision`): the click face of `hookbus.cli._auth_files`, which writes and reads
the files."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from hookbus.cli._permissions import ROLES

from ._auth_files import (
    AUTH_CONF,
    CLUSTER_CONF,
    SERVER_CONF,
    NewIdentity,
    add_identity,
    init_setup,
    issue_identity,
    markdown_table,
    revoke_identity,
    worker_pairs,
)
from ._auth_links import GATEWAY_CONF, cluster_conf
from ._command_support import DURATION

__all__ = ["auth"]

_ADDABLE = ("agent", "worker", "approver", "auditor", "dispatcher", "admin")


def _check_sans(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> tuple[str, ...]:
    from ._tls import check_san

    try:
        return tuple(check_san(name) for name in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.group()
def auth() -> None:
    """NATS credentials for hookbus: nkey users with role permissions, one account per tenant."""


@auth.command("init")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder to write server.conf, auth.conf, seeds and contexts to.",
)
@click.option("--tenant", "tenants", multiple=True, help="A tenant (NATS account); repeat.")
@click.option(
    "--agent",
    "agents",
    multiple=True,
    help="An agent identity, a client of the dispatcher service; repeat.",
)
@click.option(
    "--embedded-agent",
    "embedded_agents",
    multiple=True,
    help="An agent identity that runs its own HookDispatcher (calls handlers itself; "
    "approvals still go through the dispatcher service); repeat.",
)
@click.option(
    "--worker",
    "workers",
    multiple=True,
    metavar="NAME:EVENT/HANDLER[,EVENT/HANDLER]",
    help="A worker identity and the (event, handler) pairs it serves, e.g. "
    "security:tool:pre/security_policy; repeat.",
)
@click.option("--approver", "approvers", multiple=True, help="An approver identity; repeat.")
@click.option("--auditor", "auditors", multiple=True, help="An auditor identity; repeat.")
@click.option(
    "--route",
    "routes",
    multiple=True,
    metavar="[CLUSTER=]HOST:PORT[,HOST:PORT]",
    help="A cluster node's route address; repeat. Writes cluster-auth.conf (route password "
    "and URLs); CLUSTER=... the route addresses of a named cluster of a supercluster: "
    "writes cluster-auth-CLUSTER.conf (a password of its own), once per cluster.",
)
@click.option(
    "--gateway",
    "gateways",
    multiple=True,
    metavar="CLUSTER=HOST:PORT[,HOST:PORT]",
    help="A cluster's gateway addresses (a supercluster); repeat for every cluster. Writes "
    "gateway-auth.conf (the gateway password and every cluster's gateway URLs).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", default=4222, show_default=True, help="Client port.")
@click.option(
    "--store-dir", default=None, help="JetStream store (default: OUT/jetstream, absolute)."
)
@click.option(
    "--js-domain",
    default=None,
    metavar="DOMAIN",
    help="This server's JetStream domain (the hub of a fleet over leaf nodes): every "
    "identity may also reach the buckets as $JS.<DOMAIN>.API (from a leaf), and every "
    "context names the domain.",
)
@click.option("--tls-cert", type=click.Path(dir_okay=False), help="Server certificate (PEM).")
@click.option("--tls-key", type=click.Path(dir_okay=False), help="Server key (PEM).")
@click.option("--tls-ca", type=click.Path(dir_okay=False), help="CA clients verify it with.")
@click.option(
    "--tls/--no-tls",
    "tls",
    default=True,
    show_default=True,
    help="Make a local CA and a server certificate (for --host, each --san, 127.0.0.1, ::1, "
    "localhost) unless --tls-cert is given; --no-tls: plain TCP (a laptop).",
)
@click.option(
    "--san",
    "sans",
    multiple=True,
    metavar="NAME",
    callback=_check_sans,
    help="Another DNS name or IP address clients reach the server by, for the certificate "
    "(e.g. a Kubernetes service: nats, nats.NS.svc, nats.NS.svc.cluster.local); repeat.",
)
@click.option(
    "--jwt",
    "jwt",
    is_flag=True,
    help="NATS JWT mode: an operator, one account per tenant, and a .creds file (user JWT "
    "and seed) per identity; later identities are issued with `hookbus auth issue`, with no "
    "server file change or reload. Default: static nkey users in auth.conf.",
)
@click.option(
    "--demo",
    is_flag=True,
    help="Also the identities `hookbus demo --secure` uses: its agents, one worker per "
    "example worker file (with the handlers the file declares) and its approver.",
)
def init_cmd(
    jwt: bool,
    demo: bool,
    out: Path,
    tenants: tuple[str, ...],
    agents: tuple[str, ...],
    embedded_agents: tuple[str, ...],
    workers: tuple[str, ...],
    approvers: tuple[str, ...],
    auditors: tuple[str, ...],
    routes: tuple[str, ...],
    gateways: tuple[str, ...],
    host: str,
    port: int,
    store_dir: str | None,
    js_domain: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
    tls: bool,
    sans: tuple[str, ...],
) -> None:
    """Write a nats-server config with one nkey user per identity: an admin and a
    dispatcher, plus the agents, workers, approvers and auditors asked for, in every
    tenant (default tenant HOOKBUS; files of another tenant T go to OUT/T/).

    Run it with `hookbus server --config OUT/server.conf`; connect a client with
    `--nkey OUT/<role>-<name>.nk` (with --jwt: `--creds OUT/<role>-<name>.creds`)."""
    if sans and (tls_cert or not tls):
        raise click.UsageError(
            "--san names go into the certificate `hookbus auth init` makes: not with"
            + (" --tls-cert (put them in your own certificate)" if tls_cert else " --no-tls")
        )
    if demo:
        from hookbus.demo import demo_identities, find_examples_dir  # only for --demo

        demo_agents, demo_embedded, demo_workers, demo_approvers = demo_identities(
            find_examples_dir()
        )
        agents, workers = (*agents, *demo_agents), (*workers, *demo_workers)
        embedded_agents = (*embedded_agents, *demo_embedded)
        approvers = (*approvers, *demo_approvers)
    try:
        setup = init_setup(
            out,
            tenants=tenants,
            agents=agents,
            embedded_agents=embedded_agents,
            workers=workers,
            approvers=approvers,
            auditors=auditors,
            routes=routes,
            gateways=gateways,
            host=host,
            port=port,
            store_dir=store_dir,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_ca=tls_ca,
            tls=tls,
            sans=sans,
            js_domain=js_domain,
            jwt=jwt,
        )
    except OSError as exc:  # a folder that cannot be made or written (/proc, read-only)
        where = exc.filename or out
        raise click.ClickException(f"cannot write {where}: {exc.strerror or exc}") from exc
    for ident in setup.identities:
        where = ident.secret_path(out, setup)
        click.echo(f"{ident.tenant:<10} {ident.role:<10} {ident.name:<20} {where}")
    what = "operator and accounts" if setup.jwt else "accounts and users"
    click.echo(f"server config: {out / SERVER_CONF} ({what}: {out / AUTH_CONF})")
    if setup.routes:
        click.echo(f"route credentials for every node's cluster block: {out / CLUSTER_CONF}")
    for cluster in setup.clusters:
        where = out / cluster_conf(cluster)
        click.echo(f"route credentials for cluster {cluster}'s cluster blocks: {where}")
    if setup.gateways:
        click.echo(f"gateway credentials for every node's gateway block: {out / GATEWAY_CONF}")


def _identity_options(folder: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The arguments and options `auth add` and `auth issue` share (`folder`: what --dir
    names), handed to the command as one `NewIdentity` (its first argument)."""
    options = [
        click.argument("role", type=click.Choice(_ADDABLE)),
        click.argument("name"),
        click.option(
            "--dir",
            "out",
            required=True,
            type=click.Path(file_okay=False, exists=True, path_type=Path),
            help=f"The folder {folder} wrote.",
        ),
        click.option(
            "--tenant", default=None, help="Its tenant (default: HOOKBUS, or the only one)."
        ),
        click.option(
            "--handler",
            "handlers",
            multiple=True,
            metavar="EVENT/HANDLER",
            help="An (event, handler) pair a worker serves, e.g. tool:pre/redact_pii; repeat.",
        ),
        click.option(
            "--from",
            "from_worker",
            metavar="FILE.py:ATTR",
            help="A worker: serve every (event, handler) the HookWorker FILE.py:ATTR declares.",
        ),
        click.option("--embedded", is_flag=True, help="An agent that runs its own HookDispatcher."),
    ]

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def command(
            role: str,
            name: str,
            out: Path,
            tenant: str | None,
            handlers: tuple[str, ...],
            from_worker: str | None,
            embedded: bool,
            **rest: Any,
        ) -> None:
            if role not in ROLES:  # narrows the click choice to a role
                raise click.BadParameter(f"unknown role {role!r}")
            if from_worker:  # the (event, handler) pairs it declares, too
                handlers = (*handlers, *worker_pairs(from_worker))
            fn(NewIdentity(out, role, name, tenant, handlers, embedded), **rest)

        for option in reversed(options):
            command = option(command)
        return command

    return decorate


@auth.command("add")
@_identity_options("`hookbus auth init`")
def add_cmd(new: NewIdentity) -> None:
    """Add one identity and write auth.conf again (existing seeds are never changed).
    Reload the running server afterwards (`nats-server --signal reload` or SIGHUP)."""
    ident = add_identity(new)
    click.echo(f"{ident.tenant} {ident.role} {ident.name}: {ident.seed_path(new.out)}")


@auth.command("issue")
@_identity_options("`hookbus auth init --jwt`")
@click.option(
    "--expires",
    "expires_s",
    type=DURATION,
    default=None,
    help="Valid for this long (90s, 12h, 30d; by this host's clock): then the server refuses"
    " it and closes its connections. Default: until revoked.",
)
def issue_cmd(new: NewIdentity, expires_s: float | None) -> None:
    """Issue a user credential (JWT mode): a .creds file with its role's permissions,
    signed by the tenant account's signing key. No server file changes and the running
    server needs no reload. Prints the .creds path."""
    try:
        ident = issue_identity(new, expires_s=expires_s)
    except OSError as exc:
        where = exc.filename or new.out
        raise click.ClickException(f"cannot write {where}: {exc.strerror or exc}") from exc
    click.echo(f"{ident.tenant} {ident.role} {ident.name}: {ident.creds_path(new.out)}")


def _jwt_folder_option(more: str = "") -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The required ``--dir`` of a JWT-mode command (as `out`), its help ending in `more`."""
    return click.option(
        "--dir",
        "out",
        required=True,
        type=click.Path(file_okay=False, exists=True, path_type=Path),
        help=f"The folder `hookbus auth init --jwt` wrote{more}.",
    )


@auth.command("revoke")
@click.argument("who", metavar="CREDS_OR_PUBKEY")
@_jwt_folder_option(" (its operator's key re-signs the account)")
@click.option(
    "--tenant", default=None, help="The tenant of a public key (default: HOOKBUS, or the only one)."
)
def revoke_cmd(who: str, out: Path, tenant: str | None) -> None:
    """Revoke a user credential (JWT mode): its public key goes into its account's
    revocations, the account's JWT is signed again and auth.conf written again. Reload the
    running server afterwards (SIGHUP, or `nats-server --signal reload`): it then refuses
    the credential and closes its connections."""
    tenant, user = revoke_identity(out, who, tenant=tenant)
    click.echo(f"{tenant} {user}: revoked; reload the server to apply it ({out / AUTH_CONF})")


@auth.command("leaf-link")
@click.argument("site")
@_jwt_folder_option()
@click.option("--tenant", default=None, help="Its tenant (default: HOOKBUS, or the only one).")
def leaf_link_cmd(site: str, out: Path, tenant: str | None) -> None:
    """Issue the credential leaf site SITE's nats-server links to the hub with (JWT mode):
    a user of the tenant's account accepted only as a leaf node, with no limit of its own
    (each client at the site keeps its own permissions). Give the site's remote the
    .creds path as `credentials` and the account's public key as `account`
    (deploy/leaf/secured/leaf-jwt.conf). No server file changes. Prints both, one per
    line."""
    from ._auth_leaf import issue_leaf_link

    try:
        path, account = issue_leaf_link(out, site, tenant=tenant)
    except OSError as exc:
        where = exc.filename or out
        raise click.ClickException(f"cannot write {where}: {exc.strerror or exc}") from exc
    click.echo(f"{path}\n{account}")


@auth.command("table")
def table_cmd() -> None:
    """Print the role -> permissions table (markdown), as in docs/security.md."""
    click.echo(markdown_table(), nl=False)
