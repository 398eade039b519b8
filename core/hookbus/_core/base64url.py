"""Unpadded base64url (RFC 4648 section 5, as JWTs write it): the CLI's NATS JWTs and the
console's signed sign-in cookie."""

from __future__ import annotations

import base64

__all__ = ["b64url", "unb64url"]


def b64url(data: bytes) -> str:
    """`data` as unpadded base64url text."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    """The bytes of base64url `text`, padded or not.

    Raises:
        ValueError: `text` is not base64url (`binascii.Error`), or not ASCII.
    """
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
