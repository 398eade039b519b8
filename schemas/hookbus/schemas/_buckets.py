"""Configuration of the JetStream KV buckets hookbus creates (data only, no I/O).

Both the workers (which write declarations) and the dispatcher (which watches them)
create the bucket if it is absent, with exactly this configuration, so either may start
first. On a cluster, pass ``replicas=3`` (JetStream R3) to `handlers_bucket_config`.
"""

from __future__ import annotations

from nats.js.api import KeyValueConfig

from ._subjects import APPROVALS_BUCKET, HANDLERS_BUCKET, SUSPENSIONS_BUCKET

__all__ = ["approvals_bucket_config", "handlers_bucket_config", "suspensions_bucket_config"]


def handlers_bucket_config(*, replicas: int = 1) -> KeyValueConfig:
    """The `HANDLERS_BUCKET` config: one value per key (history 1), file storage, direct get."""
    return KeyValueConfig(
        bucket=HANDLERS_BUCKET,
        description="hookbus handler declarations (one per event and handler)",
        history=1,
        replicas=replicas,
        direct=True,
    )


def suspensions_bucket_config(*, ttl_s: float = 7 * 24 * 3600, replicas: int = 1) -> KeyValueConfig:
    """The `SUSPENSIONS_BUCKET` config. Every record expires `ttl_s` seconds after its last
    write (the bucket's max age), so abandoned suspensions do not pile up."""
    return KeyValueConfig(
        bucket=SUSPENSIONS_BUCKET,
        description="hookbus suspensions: one record per label",
        history=1,
        ttl=ttl_s,
        replicas=replicas,
        direct=True,
    )


def approvals_bucket_config(*, ttl_s: float = 24 * 3600, replicas: int = 1) -> KeyValueConfig:
    """The `APPROVALS_BUCKET` config: "Allow always" grants, kept `ttl_s` seconds."""
    return KeyValueConfig(
        bucket=APPROVALS_BUCKET,
        description='hookbus "Allow always" grants per session, handler and tool',
        history=1,
        ttl=ttl_s,
        replicas=replicas,
        direct=True,
    )
