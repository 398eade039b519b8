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
``KV_hookbus_leases``       16 MiB     waiter leases (file storage, as every bucket)
``hookbus_decisions``       1 GiB      the decision audit trail (as ``--audit-max-bytes``)
==========================  =========  ====================================================

Every value is at most 1 MiB (the server's ``max_payload``). A full bucket refuses new keys
(JetStream's ``discard: new`` for KV) instead of dropping records; the tenant's account
limits (``auth.conf``) bound all of them together. Running it again changes nothing and
reports a stream that exists with another configuration.

``--placement-cluster`` and ``--placement-tag`` choose where JetStream puts every bucket and
the audit stream (JetStream ``placement``: a supercluster's cluster, server tags); without
them JetStream puts them in the cluster of the server provisioning connects to. A stream that
exists placed otherwise is reported, never moved or recreated.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Final

import click
import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, Placement

from hookbus._core.buckets import (
    approvals_bucket_config,
    bucket_placement,
    handlers_bucket_config,
    handlers_republish,
    leases_bucket_config,
    placement_text,
    republishes_registry,
    stream_config_differences,
    suspensions_bucket_config,
)
from hookbus._core.decisions_stream import add_stream, ensure_decisions_stream
from hookbus._core.jetstream import jetstream_context, js_domain_of, open_bucket
from hookbus.cli._permissions import inbox_prefix
from hookbus.schemas import (
    DECISIONS_STREAM,
    HANDLERS_BUCKET,
    BucketConfigError,
    HookbusError,
    decisions_stream_config,
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

log = logging.getLogger("hookbus.provision")


def bucket_configs(
    *, replicas: int = 1, placement: Placement | None = None
) -> list[KeyValueConfig]:
    """hookbus's buckets as provisioned: the library's configs with their limits, placed
    by `placement` (None: as `bucket_placement` reads the environment)."""
    configs = [
        handlers_bucket_config(replicas=replicas, placement=placement),
        suspensions_bucket_config(replicas=replicas, placement=placement),
        approvals_bucket_config(replicas=replicas, placement=placement),
        leases_bucket_config(replicas=replicas, placement=placement),
    ]
    return [
        dataclasses.replace(c, max_bytes=BUCKET_MAX_BYTES[c.bucket], max_value_size=MAX_VALUE_BYTES)
        for c in configs
    ]


async def provision(
    nc: Any,
    *,
    replicas: int = 1,
    audit_max_bytes: int = 1024 * MIB,
    placement: Placement | None = None,
) -> list[str]:
    """Create (or check) every bucket and the audit stream on `nc`'s account.

    An existing one is used as it is; what differs from the config asked (replicas,
    placement, ...) is a WARNING on ``hookbus.provision``.

    Args:
        replicas: JetStream replicas of each (3 on a 3-node cluster).
        audit_max_bytes: the audit stream's storage limit, bytes.
        placement: where JetStream puts each (cluster, server tags); None: as
            `bucket_placement` reads the environment (none there: JetStream chooses).
    Returns:
        One line per stream, e.g. ``"KV_hookbus_handlers: ready (64 MiB)"``.
    Raises:
        HookbusError: JetStream refused (e.g. no servers match the placement) or stayed
            unavailable (its message says which).
    """
    placement = placement or bucket_placement()
    lines = []
    for config in bucket_configs(replicas=replicas, placement=placement):
        await open_bucket(nc, config, log=log, check_replicas=True)
        lines.append(f"KV_{config.bucket}: ready ({(config.max_bytes or 0) // MIB} MiB)")
    if await _republish_registry(nc):
        lines.append(f"KV_{HANDLERS_BUCKET}: changes now republished (made by an older hookbus)")
    if placement is not None:
        await _placed_decisions_stream(nc, replicas, audit_max_bytes, placement)
    await ensure_decisions_stream(
        nc, max_bytes=audit_max_bytes, replicas=replicas, check_replicas=True
    )
    lines.append(f"{DECISIONS_STREAM}: ready ({audit_max_bytes // MIB} MiB)")
    return lines


async def _republish_registry(nc: Any) -> bool:
    """Add the republish of its changes to a handlers bucket an older hookbus created
    (dispatchers then follow it without a consumer each).

    Returns:
        Whether the stream was changed.
    """
    js = jetstream_context(nc, js_domain_of(nc))
    info = await js.stream_info(f"KV_{HANDLERS_BUCKET}")
    if republishes_registry(info.config):
        return False
    info.config.republish = handlers_republish()
    await js.update_stream(info.config)
    return True


async def _placed_decisions_stream(
    nc: Any, replicas: int, max_bytes: int, placement: Placement
) -> None:
    """Create the audit stream placed by `placement` if absent, or warn that it exists
    placed otherwise (`ensure_decisions_stream` then checks the rest of its config).

    Raises:
        BucketConfigError: JetStream refused to create it (e.g. no servers match).
    """
    config = decisions_stream_config(max_bytes=max_bytes, replicas=replicas, placement=placement)
    js = jetstream_context(nc, timeout=10.0)
    try:
        info = await js.stream_info(DECISIONS_STREAM)
    except nats.js.errors.NotFoundError:
        try:
            await add_stream(js, config)
        except nats.js.errors.APIError as exc:
            raise BucketConfigError(
                f"cannot create the decision audit stream {DECISIONS_STREAM} as asked"
                f" (replicas {replicas}, placement {placement_text(placement)}):"
                f" {getattr(exc, 'description', None) or exc}"
            ) from None
        return
    except (TimeoutError, nats.errors.Error):
        return  # ensure_decisions_stream says what it could not read
    placed = [
        d for d in stream_config_differences(config, info.config) if d.startswith("placement")
    ]
    if placed:
        log.warning(
            "stream %s exists with another config, used as it is: %s",
            DECISIONS_STREAM,
            "; ".join(placed),
        )


def _admin_settings(
    out: Path, tenant: str, url: str | None, js_domain: str | None = None
) -> ConnectionSettings:
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
    secret = str(admin.secret_path(out, setup))
    return ConnectionSettings(
        url=url or setup.url(),
        creds=secret if setup.jwt else None,
        nkey=None if setup.jwt else secret,
        inbox_prefix=inbox_prefix(admin.public_key),
        tls_ca=ca,
        js_domain=js_domain or setup.js_domain,
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
@click.option(
    "--placement-cluster",
    help="Put every bucket and the audit stream in this cluster (of a supercluster). "
    "Default (neither placement option): env HOOKBUS_BUCKET_PLACEMENT_CLUSTER and "
    "HOOKBUS_BUCKET_PLACEMENT_TAGS, else the cluster of the server connected to.",
)
@click.option(
    "--placement-tag",
    "placement_tags",
    multiple=True,
    help="Put every replica on servers with this server tag (their server_tags); repeat: "
    "servers with all of them.",
)
@connection_options
def provision_cmd(
    out: Path | None,
    tenants: tuple[str, ...],
    replicas: int,
    placement_cluster: str | None,
    placement_tags: tuple[str, ...],
    conn: ConnectionSettings,
) -> None:
    """Create hookbus's buckets and audit stream, with their limits, as an admin: the only
    role that may create streams. Run it once after starting the server (again: it changes
    nothing). `--dir auth` provisions every tenant of an auth folder; otherwise connect as
    the admin with the usual options (e.g. NATS_URL and NATS_NKEY)."""
    from ._serve_cmds import run_async

    placement = bucket_placement(placement_cluster, placement_tags)

    async def one(settings: ConnectionSettings) -> list[str]:
        nc = await connect(settings, name="hookbus-provision", max_reconnects=0)
        try:
            return await provision(nc, replicas=replicas, placement=placement)
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
        for line in run_async(one(_admin_settings(out, tenant, conn.url, conn.js_domain))):
            click.echo(f"{tenant:<10} {line}")
