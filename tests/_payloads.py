"""Payload types the suspension tests resolve hooks with (msgspec Structs)."""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["Budget", "Grant"]


class Grant(msgspec.Struct):
    approved: bool
    by: str = ""


class Budget(msgspec.Struct):
    amount: Annotated[int, msgspec.Meta(ge=0)]
