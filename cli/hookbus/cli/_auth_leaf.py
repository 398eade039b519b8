"""The credential a leaf site's nats-server links to the hub with, in JWT mode
(``hookbus auth leaf-link``).

A leaf link carries one account's traffic between the hub and a site. With static nkey
users the hub names the link's user in its ``leafnodes { authorization }`` block
(``deploy/leaf/secured/``); in JWT mode (operator, accounts, users signed by the accounts'
keys) no user is configured on the server, so the link, like any client, presents a user
JWT of the tenant's account: ``leaf-<site>.creds`` in the tenant's folder.

That user may connect only as a leaf node (claim ``allowed_connection_types:
["LEAFNODE"]``: the hub refuses it on its client port), and has no publish or subscribe
limit of its own: what crosses the link is the tenant's traffic, and each client at the
site holds its own role's permissions there (the site's server includes the same
``auth.conf``: the same operator and accounts). Issuing one changes no server file and
needs no reload, as for any user (`hookbus.cli._auth_files.issue_identity`).
"""

from __future__ import annotations

from pathlib import Path

import click

from hookbus.schemas import encode_token

from ._auth_files import (
    DEFAULT_TENANT,
    _pick_tenant,
    _write_new_secret,
    account_signer,
    load_setup,
    new_user_seed,
)

__all__ = ["LEAF_CONNECTION_TYPES", "issue_leaf_link", "leaf_link_path"]

LEAF_CONNECTION_TYPES = ("LEAFNODE",)
"""The only connection a leaf link's credential is accepted for (a NATS JWT
``allowed_connection_types`` value)."""


def leaf_link_path(out: Path, site: str, tenant: str = DEFAULT_TENANT) -> Path:
    """Where `issue_leaf_link` writes site `site`'s credential for `tenant`:
    ``<out>[/<tenant>]/leaf-<site>.creds``."""
    folder = out if tenant == DEFAULT_TENANT else out / tenant
    return folder / f"leaf-{encode_token(site)}.creds"


def issue_leaf_link(out: Path, site: str, *, tenant: str | None = None) -> tuple[Path, str]:
    """What ``hookbus auth leaf-link`` does: sign the leaf link credential of site `site`
    for `tenant`'s account (see the module docstring) and write it (mode 0600).

    Returns:
        The ``.creds`` path, and the public key of the tenant's account (``A...``): a leaf
        server in operator mode names it in the remote (``account``).
    Raises:
        click.ClickException: `out` is not a JWT-mode folder, the credential exists, or the
            tenant's signing key cannot be read.
        click.BadParameter: unknown tenant, or several tenants and none given.
    """
    from ._jwt import creds_text, user_jwt

    setup = load_setup(out)
    if not setup.jwt:
        raise click.ClickException(
            f"{out} holds static nkey users (made without --jwt): the hub names the leaf"
            " link's user in its leafnodes block (deploy/leaf/secured/hub.conf)"
        )
    tenant = _pick_tenant(setup, tenant)
    path = leaf_link_path(out, site, tenant)
    if path.exists():
        raise click.ClickException(f"{path} exists: not overwriting a credential")
    signer, account = account_signer(setup, path.parent, tenant)
    seed, public = new_user_seed()
    token = user_jwt(
        signer, public, f"leaf link {site}", None, issuer_account=account["public_key"],
        connection_types=LEAF_CONNECTION_TYPES,
    )  # fmt: skip
    _write_new_secret(path, creds_text(token, seed))
    return path, account["public_key"]
