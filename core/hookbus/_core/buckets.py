"""Configuration of the JetStream KV buckets hookbus creates (data only, no I/O).

Both the workers (which write declarations) and the dispatcher (which watches them)
create the bucket if it is absent, with exactly this configuration, so either may start
first. On a cluster, pass ``replicas=3`` (JetStream R3) to every ``*_bucket_config``.
A bucket that already exists keeps its configuration (JetStream refuses to create it again
with another one); `config_differences` names what differs so that it is reported, never
used silently. `stream_config_differences` does the same for the decision audit trail's
stream (`hookbus.schemas.decisions_stream_config`).

**Placement** (which cluster, or which tagged servers, hold a bucket: JetStream's
``placement``) is chosen by the operator: `bucket_placement` reads it, once, from
``HOOKBUS_BUCKET_PLACEMENT_CLUSTER`` and ``HOOKBUS_BUCKET_PLACEMENT_TAGS``, and every
``*_bucket_config`` uses it unless given one (``decisions_stream_config`` places the audit
stream only as given). None set: no placement (JetStream puts the stream in the cluster of
the server that created it).
"""

from __future__ import annotations

import os
from typing import Any

from nats.js.api import KeyValueConfig, Placement, RePublish, StorageType, StreamConfig

from hookbus.schemas import (
    APPROVALS_BUCKET,
    HANDLERS_BUCKET,
    LEASES_BUCKET,
    REGISTRY_CHANGES_WILDCARD,
    SUSPENSIONS_BUCKET,
)

__all__ = [
    "PLACEMENT_CLUSTER_ENV",
    "PLACEMENT_TAGS_ENV",
    "approvals_bucket_config",
    "bucket_placement",
    "config_differences",
    "handlers_bucket_config",
    "handlers_republish",
    "leases_bucket_config",
    "placement_text",
    "republishes_registry",
    "stream_config_differences",
    "suspensions_bucket_config",
]


PLACEMENT_CLUSTER_ENV = "HOOKBUS_BUCKET_PLACEMENT_CLUSTER"
"""The env var naming the cluster that holds the buckets and audit stream hookbus creates."""

PLACEMENT_TAGS_ENV = "HOOKBUS_BUCKET_PLACEMENT_TAGS"
"""The env var listing (comma-separated) the server tags every replica's server must have."""


def bucket_placement(
    cluster: str | None = None, tags: list[str] | tuple[str, ...] | None = None
) -> Placement | None:
    """JetStream placement of the buckets and stream hookbus creates.

    Args:
        cluster: the cluster's name (a supercluster's cluster, as in its ``cluster { name }``).
        tags: server tags (``server_tags``) every server holding a replica must have.
    Returns:
        A `Placement` of the arguments if either is given; else one from the environment
        (`PLACEMENT_CLUSTER_ENV`, `PLACEMENT_TAGS_ENV`: comma-separated, blanks ignored);
        None when neither gives any (no placement: JetStream chooses).
    """
    if cluster is None and not tags:
        cluster = os.environ.get(PLACEMENT_CLUSTER_ENV, "").strip() or None
        tags = [t.strip() for t in os.environ.get(PLACEMENT_TAGS_ENV, "").split(",")]
    tags = [t for t in (tags or []) if t]
    if not cluster and not tags:
        return None
    return Placement(cluster=cluster or None, tags=tags or None)


def placement_text(placement: Any) -> str:
    """`placement` in one phrase, e.g. ``"cluster east, tags [site:a]"``; ``"none"``."""
    cluster = getattr(placement, "cluster", None)
    tags = sorted(getattr(placement, "tags", None) or [])
    parts = ([f"cluster {cluster}"] if cluster else []) + ([f"tags {tags}"] if tags else [])
    return ", ".join(parts).replace("'", "") or "none"


def _placed(placement: Placement | None) -> Placement | None:
    return placement if placement is not None else bucket_placement()


def handlers_republish() -> RePublish:
    """The handlers bucket stream's republish: every stored message of the bucket
    (``$KV.<HANDLERS_BUCKET>.>``) to ``REGISTRY_CHANGES_WILDCARD``, whole (not headers
    only), so that a dispatcher follows the registry with a core subscription."""
    return RePublish(
        src=f"$KV.{HANDLERS_BUCKET}.>", dest=REGISTRY_CHANGES_WILDCARD, headers_only=False
    )


def republishes_registry(stream_config: Any) -> bool:
    """Whether a handlers bucket's stream config (as the server reports it) republishes
    the whole bucket as `handlers_republish` says (a bucket an older hookbus created
    does not)."""
    return _republishes(handlers_republish(), stream_config)


def _republishes(want: RePublish, stream_config: Any) -> bool:
    have = getattr(stream_config, "republish", None)
    return (
        have is not None
        and have.src == want.src
        and have.dest == want.dest
        and bool(have.headers_only) == bool(want.headers_only)
    )


def handlers_bucket_config(
    *, replicas: int = 1, placement: Placement | None = None
) -> KeyValueConfig:
    """The `HANDLERS_BUCKET` config: one value per key (history 1), file storage, direct
    get, and every stored message republished (`handlers_republish`).

    Every ``*_bucket_config`` takes `placement`: where JetStream puts the bucket's replicas
    (None: `bucket_placement`, from the environment; none there: JetStream chooses)."""
    return _kv_config(
        HANDLERS_BUCKET,
        "hookbus handler declarations (one per event and handler)",
        replicas=replicas,
        placement=placement,
        republish=handlers_republish(),
    )


def suspensions_bucket_config(
    *, ttl_s: float = 7 * 24 * 3600, replicas: int = 1, placement: Placement | None = None
) -> KeyValueConfig:
    """The `SUSPENSIONS_BUCKET` config. Every record expires `ttl_s` seconds after its last
    write (the bucket's max age), so abandoned suspensions do not pile up."""
    return _kv_config(
        SUSPENSIONS_BUCKET,
        "hookbus suspensions: one record per label",
        replicas=replicas,
        placement=placement,
        ttl_s=ttl_s,
    )


def leases_bucket_config(
    *, lease_s: float = 15.0, replicas: int = 1, placement: Placement | None = None
) -> KeyValueConfig:
    """The `LEASES_BUCKET` config: a waiter lease lives `lease_s` seconds after its last
    heartbeat (the bucket's max age, counted by the server's clock). File storage, as every
    bucket hookbus needs: a memory bucket is gone after a server restart (a bucket an older
    hookbus made in memory is reported as differing, and made again in file storage by the
    first lease written after it is lost: `Leases`)."""
    return _kv_config(
        LEASES_BUCKET,
        "hookbus waiter leases: one key per process with waiters",
        replicas=replicas,
        placement=placement,
        ttl_s=lease_s,
    )


def approvals_bucket_config(
    *, ttl_s: float = 7 * 24 * 3600, replicas: int = 1, placement: Placement | None = None
) -> KeyValueConfig:
    """The `APPROVALS_BUCKET` config: approval records (``<agent>.<label>``), the approvers'
    answer proofs (``<agent>.<label>.<approver>``) and "Allow always" grants (five tokens,
    see `grant_key`), each kept `ttl_s` seconds after its last write (7 days: the longest
    approval). A grant's own lifetime is its ``expires_at``, checked when it is read."""
    return _kv_config(
        APPROVALS_BUCKET,
        'hookbus approvals, answer proofs and "Allow always" grants',
        replicas=replicas,
        placement=placement,
        ttl_s=ttl_s,
    )


def _kv_config(
    bucket: str,
    description: str,
    *,
    replicas: int,
    placement: Placement | None,
    ttl_s: float | None = None,
    republish: RePublish | None = None,
) -> KeyValueConfig:
    """A bucket as hookbus makes each of its own: one value per key (history 1), direct
    get, file storage (the default), placed by `placement` (None: `bucket_placement`);
    `ttl_s`: the bucket's max age in seconds (None: none)."""
    return KeyValueConfig(
        bucket=bucket,
        description=description,
        history=1,
        ttl=ttl_s,
        replicas=replicas,
        direct=True,
        placement=_placed(placement),
        republish=republish,
    )


def _seconds(value: float | None) -> float:
    """A max age in seconds, with None and 0 both meaning "no limit" (0)."""
    return float(value or 0.0)


def _storage(value: Any) -> str:
    if value is None:
        return StorageType.FILE.value  # JetStream's default
    return str(getattr(value, "value", value))


def _placement_differs(asked: Any, actual: Any) -> bool:
    """Whether a stream placed `actual` is not placed as `asked` (None asked: never)."""
    if asked is None:
        return False
    return (asked.cluster or None) != (getattr(actual, "cluster", None) or None) or sorted(
        asked.tags or []
    ) != sorted(getattr(actual, "tags", None) or [])


def config_differences(asked: KeyValueConfig, actual: Any, *, replicas: bool = True) -> list[str]:
    """What an existing bucket's configuration does not share with the one asked for.

    Compares replicas, TTL (max age, seconds, within 1 ms), history, storage, direct get
    and, when one is asked, republish and placement: the settings that decide durability,
    record lifetime, how dispatchers follow a bucket and where it lives.

    Args:
        asked: the config hookbus would create the bucket with (``*_bucket_config``).
        actual: the bucket stream's config as the server reports it (a nats-py
            ``StreamConfig``, e.g. ``(await kv.status()).stream_info.config``).
        replicas: compare the replica count (False: a client opening a bucket someone
            else created, which takes the bucket's replicas as they are).
    Returns:
        One human-readable line per difference, e.g. ``"replicas: asked 3, bucket has 1"``
        or ``"placement: asked tags [site:a], bucket has none"``; empty when the bucket is
        as asked.
    """
    pairs: list[tuple[str, Any, Any]] = [
        *(
            [("replicas", asked.replicas or 1, getattr(actual, "num_replicas", None) or 1)]
            if replicas
            else []
        ),
        ("history", asked.history or 1, getattr(actual, "max_msgs_per_subject", None) or 1),
        ("storage", _storage(asked.storage), _storage(getattr(actual, "storage", None))),
        ("direct get", bool(asked.direct), bool(getattr(actual, "allow_direct", False))),
    ]
    out = [f"{name}: asked {a}, bucket has {b}" for name, a, b in pairs if a != b]
    if asked.republish is not None and not _republishes(asked.republish, actual):
        have = getattr(actual, "republish", None)
        shown = f"{have.src} to {have.dest}" if have is not None else "none"
        out.append(
            f"republish: asked {asked.republish.src} to {asked.republish.dest}, bucket has {shown}"
        )
    ttl_asked, ttl_actual = _seconds(asked.ttl), _seconds(getattr(actual, "max_age", None))
    if abs(ttl_asked - ttl_actual) > 1e-3:
        shown = [f"{t:g} s" if t else "none" for t in (ttl_asked, ttl_actual)]
        out.append(f"ttl: asked {shown[0]}, bucket has {shown[1]}")
    out += _placement_difference(asked.placement, actual, "bucket")
    return out


def _placement_difference(asked: Placement | None, actual: Any, what: str) -> list[str]:
    """The placement line of `config_differences` / `stream_config_differences` (`what`:
    "bucket" or "stream"), or none: compared only when a placement is asked."""
    placed = getattr(actual, "placement", None)
    if not _placement_differs(asked, placed):
        return []
    return [f"placement: asked {placement_text(asked)}, {what} has {placement_text(placed)}"]


def _value(v: Any) -> Any:
    return getattr(v, "value", v)


def stream_config_differences(asked: StreamConfig, actual: Any) -> list[str]:
    """What an existing stream's config does not share with the one asked for: subjects,
    retention, discard, max age (within 1 ms), max bytes, replicas, storage, and placement
    when one is asked.

    Args:
        asked: the config hookbus would create it with
            (`hookbus.schemas.decisions_stream_config`).
        actual: the stream's config as the server reports it (``StreamInfo.config``).
    Returns:
        One line per difference, e.g. ``"max_bytes: asked 1073741824, stream has -1"``.
    """
    pairs: list[tuple[str, Any, Any]] = [
        ("subjects", sorted(asked.subjects or []), sorted(getattr(actual, "subjects", []) or [])),
        ("retention", _value(asked.retention), _value(getattr(actual, "retention", None))),
        ("discard", _value(asked.discard), _value(getattr(actual, "discard", None))),
        ("max_bytes", asked.max_bytes, getattr(actual, "max_bytes", None)),
        ("replicas", asked.num_replicas or 1, getattr(actual, "num_replicas", None) or 1),
        ("storage", _value(asked.storage), _value(getattr(actual, "storage", None))),
    ]
    out = [f"{name}: asked {a}, stream has {b}" for name, a, b in pairs if a != b]
    age_asked = float(asked.max_age or 0)
    age_actual = float(getattr(actual, "max_age", None) or 0)
    if abs(age_asked - age_actual) > 1e-3:
        out.append(f"max_age: asked {age_asked:g} s, stream has {age_actual:g} s")
    out += _placement_difference(asked.placement, actual, "stream")
    return out
