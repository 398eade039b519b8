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
import json
import ssl
from pathlib import Path
from typing import Any, Final

import click
import nats
from nats.js.api import KeyValueConfig

from hookbus.dispatcher._audit import ensure_decisions_stream
from hookbus.dispatcher._kv import open_bucket
from hookbus.schemas import (
    DECISIONS_STREAM,
    HookbusError,
    approvals_bucket_config,
    handlers_bucket_config,
    leases_bucket_config,
    suspensions_bucket_config,
)

from ._auth import DEFAULT_TENANT, load_setup

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


def _admin_context(out: Path, tenant: str) -> dict[str, Any]:
    folder = out if tenant == DEFAULT_TENANT else out / tenant
    path = folder / "admin-admin.json"
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise click.ClickException(f"{path} not found: the tenant has no admin identity") from None


def _tls(ctx: dict[str, Any]) -> ssl.SSLContext | None:
    ca = ctx.get("ca")
    if not ca:
        return None
    return ssl.create_default_context(cafile=ca)


@click.command("provision")
@click.option(
    "--dir",
    "out",
    required=True,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="The folder `hookbus auth init` wrote (its admin identities are used).",
)
@click.option("--tenant", "tenants", multiple=True, help="Only this tenant; repeat (default: all).")
@click.option("--url", default=None, help="Server URL (default: the folder's).")
@click.option("--replicas", default=1, show_default=True, help="JetStream replicas (3: cluster).")
def provision_cmd(out: Path, tenants: tuple[str, ...], url: str | None, replicas: int) -> None:
    """Create hookbus's buckets and audit stream, with their limits, in every tenant, as
    its admin: the only role that may create streams. Run once after starting the server
    (again: it changes nothing)."""
    from ._serve_cmds import run_async

    setup = load_setup(out)
    chosen = list(tenants) or setup.tenants
    unknown = [t for t in chosen if t not in setup.tenants]
    if unknown:
        raise click.BadParameter(f"unknown tenant(s) {unknown}; known: {setup.tenants}")

    async def one(tenant: str) -> list[str]:
        ctx = _admin_context(out, tenant)
        try:
            nc = await nats.connect(
                url or ctx["url"],
                nkeys_seed=ctx["nkey"],
                inbox_prefix=ctx["inbox_prefix"],
                tls=_tls(ctx),
                allow_reconnect=False,
                connect_timeout=5,
            )
        except Exception as exc:  # unreachable, refused, TLS: one line, no traceback
            why = str(exc) or type(exc).__name__
            raise click.ClickException(
                f"cannot connect as {tenant}'s admin to {url or ctx['url']}: {why}"
            ) from None
        try:
            return await provision(nc, replicas=replicas)
        except HookbusError as exc:
            raise click.ClickException(f"tenant {tenant}: {exc}") from None
        finally:
            await nc.close()

    for tenant in chosen:
        for line in run_async(one(tenant)):
            click.echo(f"{tenant:<10} {line}")
