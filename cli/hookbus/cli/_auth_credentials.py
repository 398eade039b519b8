"""How to connect as each identity of a folder `hookbus auth init` wrote: `auth_credentials`.

The auth files load only when it is called (``hookbus demo --secure``), never when this
module is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from ._connect import ConnectionSettings

__all__ = ["auth_credentials"]


def auth_credentials(
    auth_dir: Path, url: str | None, *, tenant: str | None = None
) -> Callable[[str, str], ConnectionSettings]:
    """Credentials of each identity of the auth folder `auth_dir` (``hookbus auth init``):
    its nkey seed, its inbox prefix and the server's CA, at `url` (default: the folder's).

    Returns:
        ``credentials(role, name)``: the `ConnectionSettings` of that identity of `tenant`
        (default: the folder's first tenant).

    Raises:
        click.ClickException: the folder has no ``hookbus-auth.json``; later, an identity
            asked for is missing (add it with ``hookbus auth add``).
    """
    from ._auth_files import load_setup  # the auth files, only when asked
    from ._permissions import inbox_prefix

    setup = load_setup(auth_dir)
    chosen = tenant or setup.tenants[0]

    def settings(role: str, name: str) -> ConnectionSettings:
        ident = setup.find(chosen, role, name)
        if ident is None:
            raise click.ClickException(
                f"{auth_dir} has no {role} {name!r} in tenant {chosen}: run"
                f" `hookbus auth add {role} {name} --dir {auth_dir}` (or init with --demo)"
            )
        return ConnectionSettings(
            url=url or setup.url(),
            nkey=str(ident.seed_path(auth_dir).resolve()),
            inbox_prefix=inbox_prefix(ident.public_key),
            tls_ca=setup.tls_ca,
        )

    return settings
