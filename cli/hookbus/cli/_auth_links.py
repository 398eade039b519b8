"""Credentials of the links between nats-servers, written by ``hookbus auth init``: routes
(the servers of one cluster) and gateways (the clusters of a supercluster). A route or a
gateway carries every account's traffic, so each needs a password of its own.

- ``--route HOST:PORT`` (repeat) writes ``cluster-auth.conf``; ``--route
  CLUSTER=HOST:PORT[,HOST:PORT...]`` (repeat, one per cluster) writes
  ``cluster-auth-<CLUSTER>.conf``. Either is included inside a node's ``cluster { }``:
  ``authorization { user, password }`` (what a route connecting to this node must give)
  and ``routes``, the cluster's route URLs with the credentials in them. Each cluster has a
  password of its own.
- ``--gateway CLUSTER=HOST:PORT[,HOST:PORT...]`` (repeat, one per cluster) writes
  ``gateway-auth.conf``, included inside every node's ``gateway { }``: ``authorization {
  user, password }`` (nats-server takes one user for gateways), ``reject_unknown_cluster:
  true`` (a gateway of a cluster not listed is refused) and ``gateways``, every cluster's
  gateway URLs with the credentials in them.

Passwords: 64 hex digits (256 bits) from `secrets`; files mode 0600, written once (never
overwritten: `write_link_files`). Routes and gateways are plain TCP here (no TLS of their
own): keep their ports on a private network.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

import click

__all__ = [
    "CLUSTER_CONF",
    "GATEWAY_CONF",
    "GATEWAY_USER",
    "ROUTE_USER",
    "cluster_conf",
    "link_password",
    "parse_gateways",
    "parse_routes",
    "render_cluster",
    "render_gateways",
    "write_link_files",
]

CLUSTER_CONF: Final = "cluster-auth.conf"
GATEWAY_CONF: Final = "gateway-auth.conf"
ROUTE_USER: Final = "hookbus-route"
GATEWAY_USER: Final = "hookbus-gateway"
_CLUSTER: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def link_password() -> str:
    """A fresh route or gateway password: 64 hex digits (256 random bits)."""
    return secrets.token_hex(32)


def cluster_conf(cluster: str | None) -> str:
    """The file name of a cluster's route credentials: ``cluster-auth-<cluster>.conf``,
    or ``cluster-auth.conf`` for the unnamed one (``--route HOST:PORT``)."""
    return CLUSTER_CONF if cluster is None else f"cluster-auth-{cluster}.conf"


def _address(address: str, option: str) -> str:
    """Check a ``HOST:PORT`` address.

    Raises:
        click.BadParameter: not ``HOST:PORT`` (port 1-65535), or a host with ``@``, ``/``,
            a quote or a blank (it goes into a URL with credentials).
    """
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"an address is HOST:PORT, got {address!r}", param_hint=option)
    if any(c in host for c in "@/ \"'=,"):
        raise click.BadParameter(f"not a host: {host!r}", param_hint=option)
    return address.strip()


def _cluster_spec(spec: str, option: str) -> tuple[str, list[str]]:
    """``CLUSTER=HOST:PORT[,HOST:PORT...]`` -> ``(CLUSTER, [HOST:PORT, ...])``.

    Raises:
        click.BadParameter: no cluster name or address, or a name that is not a letter or
            digit then up to 63 letters, digits, ``_`` or ``-``.
    """
    cluster, _, rest = spec.partition("=")
    if not _CLUSTER.fullmatch(cluster):
        raise click.BadParameter(
            f"a cluster name is a letter or digit, then up to 63 letters, digits, '_' or '-';"
            f" got {cluster!r} in {spec!r}",
            param_hint=option,
        )
    addresses = [_address(a, option) for a in rest.split(",") if a.strip()]
    if not addresses:
        raise click.BadParameter(f"{spec!r}: no HOST:PORT after '='", param_hint=option)
    return cluster, addresses


def _grouped(pairs: Iterable[tuple[str | None, list[str]]]) -> dict[str | None, list[str]]:
    out: dict[str | None, list[str]] = {}
    for cluster, addresses in pairs:
        out[cluster] = list(dict.fromkeys([*out.get(cluster, []), *addresses]))
    return out


def parse_routes(specs: Iterable[str]) -> dict[str | None, list[str]]:
    """``--route`` values by cluster: ``HOST:PORT`` (the unnamed cluster, key None) or
    ``CLUSTER=HOST:PORT[,HOST:PORT...]``; repeats of a cluster add up, in order, each
    address once.

    Raises:
        click.BadParameter: a value of neither form.
    """
    return _grouped(
        _cluster_spec(s, "--route") if "=" in s else (None, [_address(s, "--route")]) for s in specs
    )


def parse_gateways(specs: Iterable[str]) -> dict[str, list[str]]:
    """``--gateway CLUSTER=HOST:PORT[,HOST:PORT...]`` values by cluster (repeats add up).

    Raises:
        click.BadParameter: a value not of that form.
    """
    grouped = _grouped(_cluster_spec(s, "--gateway") for s in specs)
    return {str(cluster): addresses for cluster, addresses in grouped.items()}


def _q(text: str) -> str:
    return json.dumps(text)


def render_cluster(routes: Sequence[str], password: str) -> str:
    """A ``cluster-auth*.conf``: route credentials and URLs (``nats-route://`` with the
    credentials), for the ``cluster { }`` block of every node of one cluster."""
    lines = [
        "# Route credentials of one cluster, written by `hookbus auth init --route`.",
        "# Every node of the cluster includes this in its cluster block: a server without the",
        "# password cannot join as a route (a route sees every account's traffic). Secret.",
        "authorization {",
        f"  user: {_q(ROUTE_USER)}",
        f"  password: {_q(password)}",
        "}",
        "routes: [",
    ]
    lines += [f"  {_q(f'nats-route://{ROUTE_USER}:{password}@{route}')}" for route in routes]
    lines.append("]")
    return "\n".join(lines) + "\n"


def render_gateways(gateways: Mapping[str, Sequence[str]], password: str) -> str:
    """``gateway-auth.conf``: the gateway credentials, ``reject_unknown_cluster`` and every
    cluster's gateway URLs (``nats://`` with the credentials), for the ``gateway { }``
    block of every node of every cluster."""
    lines = [
        "# Gateway credentials of the supercluster, written by `hookbus auth init --gateway`.",
        "# Every node of every cluster includes this in its gateway block: a gateway without",
        "# the password cannot connect (it carries every account's traffic), nor can one of",
        "# a cluster not listed below. Secret.",
        "authorization {",
        f"  user: {_q(GATEWAY_USER)}",
        f"  password: {_q(password)}",
        "}",
        "reject_unknown_cluster: true",
        "gateways: [",
    ]
    for cluster, addresses in gateways.items():
        urls = ", ".join(_q(f"nats://{GATEWAY_USER}:{password}@{a}") for a in addresses)
        lines.append(f"  {{ name: {_q(cluster)}, urls: [ {urls} ] }}")
    lines.append("]")
    return "\n".join(lines) + "\n"


def write_link_files(
    out: Path,
    routes: Mapping[str | None, Sequence[str]],
    gateways: Mapping[str, Sequence[str]],
    write_new_secret: Callable[[Path, str], None],
) -> list[Path]:
    """Write a ``cluster-auth*.conf`` per cluster of `routes` and, with `gateways`,
    ``gateway-auth.conf`` into `out`, each with a fresh password, through
    `write_new_secret` (which makes a file mode 0600 and refuses an existing one).
    Returns the paths written."""
    written: list[Path] = []
    for cluster, addresses in routes.items():
        path = out / cluster_conf(cluster)
        write_new_secret(path, render_cluster(addresses, link_password()))
        written.append(path)
    if gateways:
        path = out / GATEWAY_CONF
        write_new_secret(path, render_gateways(gateways, link_password()))
        written.append(path)
    return written
