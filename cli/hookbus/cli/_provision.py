"""`hookbus auth provision`: create hookbus's buckets and audit stream, with their limits,
as the admin of each tenant.

On a server from `hookbus auth init` no other role may create or change a stream (a create
request's body chooses the stream's subjects, so a right to create one bucket is a right to
create a stream over anyone's subjects). The admin therefore creates, once per tenant:

==========================  =========  ====================================================
stream                      max bytes  what
==========================  =========  ====================================================
``KV_hookbus_handlers``     64 MiB     handler declarations
``KV_hookbus_suspensions``  1 GiB      suspension records and their answer proofs
``KV_hookbus_approvals``    256 MiB    approval records, answer proofs, "Allow always" grants
``KV_hookbus_leases``       16 MiB     waiter leases (memory)
``hookbus_decisions``       1 GiB      the decision audit trail (as ``--audit-max-bytes``)
==========================  =========  ====================================================

Every value is at most 1 MiB (the server's ``max_payload``). A full bucket refuses new keys
(JetStream's ``discard: new`` for KV) instead of dropping records; the tenant's account
limits (``auth.conf``) bound all of them together. Running it again changes nothing and
reports a stream that exists with another configuration.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Final

import click
from nats.js.api import KeyValueConfig

from hookbus._core.buckets import (
    approvals_bucket_config,
    handlers_bucket_config,
    leases_bucket_config,
    suspensions_bucket_config,
)
from hookbus.cli._permissions import inbox_prefix
from hookbus.dispatcher._audit import ensure_decisions_stream
from hookbus.dispatcher._kv import open_bucket
from hookbus.schemas import (
    DECISIONS_STREAM,
    HookbusError,
)

from ._auth_files import load_setup
from ._command_support import connection_or_embedded
from ._connect import ConnectionSettings, connect, connection_options

__all__ = ["BUCKET_MAX_BYTES", "MAX_VALUE_BYTES", "provision", "provision_cmd"]

MIB: Final = 1024 * 1024

BUCKET_MAX_BYTES: Final = {
    "hookbus_handlers": 64 * MIB,
    "hookbus_suspensions": 1024 * MIB,
    "hookbus_approvals": 256 * MIB,
    "hookbus_leases": 16 * MIB,
}
"""Each bucket's storage limit, bytes."""

MAX_VALUE_BYTES: Final = MIB
"""The largest value a bucket takes (the server's ``max_payload``)."""


def bucket_configs(*, replicas: int = 1) -> list[KeyValueConfig]:
    """hookbus's buckets as provisioned: the library's configs with their limits."""
    configs = [
        handlers_bucket_config(replicas=replicas),
        suspensions_bucket_config(replicas=replicas),
        approvals_bucket_config(replicas=replicas),
        leases_bucket_config(replicas=replicas),
    ]
    return [
        dataclasses.replace(c, max_bytes=BUCKET_MAX_BYTES[c.bucket], max_value_size=MAX_VALUE_BYTES)
        for c in configs
    ]


async def provision(nc: Any, *, replicas: int = 1, audit_max_bytes: int = 1024 * MIB) -> list[str]:
    """Create (or check) every bucket and the audit stream on `nc`'s account.

    Returns:
        One line per stream, e.g. ``"KV_hookbus_handlers: ready (64 MiB)"``.
    Raises:
        HookbusError: JetStream refused or stayed unavailable (its message says which).
    """
    lines = []
    for config in bucket_configs(replicas=replicas):
        await open_bucket(nc, config)
        lines.append(f"KV_{config.bucket}: ready ({(config.max_bytes or 0) // MIB} MiB)")
    await ensure_decisions_stream(nc, max_bytes=audit_max_bytes, replicas=replicas)
    lines.append(f"{DECISIONS_STREAM}: ready ({audit_max_bytes // MIB} MiB)")
    return lines


def _admin_settings(out: Path, tenant: str, url: str | None) -> ConnectionSettings:
    """How to connect as `tenant`'s admin of the `hookbus auth init` folder `out` (the seed
    found in the folder itself, so the folder may have moved, e.g. into a container)."""
    setup = load_setup(out)
    admin = setup.find(tenant, "admin", "admin")
    if admin is None:
        raise click.ClickException(f"tenant {tenant} of {out} has no admin identity")
    ca = next(
        (str(p) for p in (Path(setup.tls_ca or ""), out / "ca.pem") if p.name and p.is_file()),
        None,
    )
    return ConnectionSettings(
        url=url or setup.url(),
        nkey=str(admin.seed_path(out)),
        inbox_prefix=inbox_prefix(admin.public_key),
        tls_ca=ca,
    )


@click.command("provision")
@click.option(
    "--dir",
    "out",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="A folder `hookbus auth init` wrote: provision every tenant (or --tenant), each as "
    "its admin. Without it: the one account of the connection options' identity.",
)
@click.option("--tenant", "tenants", multiple=True, help="With --dir: only this tenant; repeat.")
@click.option("--replicas", default=1, show_default=True, help="JetStream replicas (3: cluster).")
@connection_options
def provision_cmd(
    out: Path | None, tenants: tuple[str, ...], replicas: int, conn: ConnectionSettings
) -> None:
    """Create hookbus's buckets and audit stream, with their limits, as an admin: the only
    role that may create streams. Run it once after starting the server (again: it changes
    nothing). `--dir auth` provisions every tenant of an auth folder; otherwise connect as
    the admin with the usual options (e.g. NATS_URL and NATS_NKEY)."""
    from ._serve_cmds import run_async

    async def one(settings: ConnectionSettings) -> list[str]:
        nc = await connect(settings, name="hookbus-provision", max_reconnects=0)
        try:
            return await provision(nc, replicas=replicas)
        except HookbusError as exc:
            raise click.ClickException(str(exc)) from None
        finally:
            await nc.close()

    if out is None:
        if tenants:
            raise click.UsageError("--tenant needs --dir")
        with connection_or_embedded(conn) as server:  # --embedded: a private server (a try)
            for line in run_async(one(server)):
                click.echo(line)
        return
    known = load_setup(out).tenants
    unknown = [t for t in tenants if t not in known]
    if unknown:
        raise click.BadParameter(f"unknown tenant(s) {unknown}; known: {known}")
    for tenant in tenants or known:
        for line in run_async(one(_admin_settings(out, tenant, conn.url))):
            click.echo(f"{tenant:<10} {line}")
