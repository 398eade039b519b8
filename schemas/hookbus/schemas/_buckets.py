"""Configuration of the JetStream KV buckets hookbus creates (data only, no I/O).

Both the workers (which write declarations) and the dispatcher (which watches them)
create the bucket if it is absent, with exactly this configuration, so either may start
first. On a cluster, pass ``replicas=3`` (JetStream R3) to `handlers_bucket_config`.
"""

from __future__ import annotations

from nats.js.api import KeyValueConfig

from ._subjects import HANDLERS_BUCKET

__all__ = ["handlers_bucket_config"]


def handlers_bucket_config(*, replicas: int = 1) -> KeyValueConfig:
    """The `HANDLERS_BUCKET` config: one value per key (history 1), file storage, direct get."""
    return KeyValueConfig(
        bucket=HANDLERS_BUCKET,
        description="hookbus handler declarations (one per event and handler)",
        history=1,
        replicas=replicas,
        direct=True,
    )
