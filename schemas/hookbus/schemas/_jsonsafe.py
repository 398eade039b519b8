"""Event data as JSON values, the way amplifier-core hands it to handlers (pure, no I/O).

amplifier-core 2.0.2 serialises an emit's data to JSON before any handler runs (Python's
``json.dumps(data, default=str)``, parsed back by its Rust kernel), so every handler gets
its own JSON copy: a `Decimal` arrives as ``"1.23"``, a `datetime` as ``str(dt)``, a tuple
as a list, an int key as a string key, and in-place edits by one handler are seen by no
other handler nor by the caller. hookbus does the same, locally and over NATS alike.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from ._errors import BadRequestError

__all__ = ["json_safe", "json_safe_encoded"]

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def json_safe(data: Any) -> dict[str, Any]:
    """A fresh JSON-native copy of an emit's `data` (dicts, lists, str, int, float, bool,
    None only), made as amplifier-core makes it: values JSON cannot hold become their
    ``str()``; tuples become lists; int, float, bool and None keys become strings.

    Raises:
        BadRequestError: `data` is not a dict, holds NaN or an infinity (not JSON; the
            message names it), has a key JSON cannot hold (a tuple, ...), refers to itself,
            or is nested deeper than the interpreter's recursion limit.
    """
    return json_safe_encoded(data)[0]


def json_safe_encoded(data: Any) -> tuple[dict[str, Any], bytes | None]:
    """`json_safe`'s copy, and its compact JSON encoding when `data` was JSON-native
    already (the bytes the copy was decoded from; None otherwise): what a dispatcher sends,
    so an event's data is encoded once. Raises as `json_safe`."""
    if not isinstance(data, dict):
        raise BadRequestError(f"event data must be a dict, not {type(data).__name__}")
    try:  # JSON-native already (the copy equals the original): the same copy, faster
        encoded = _encode(data)
        fast: dict[str, Any] = _decode(encoded)
        if fast == data:
            return fast, encoded
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError, msgspec.DecodeError):
        pass  # the general path below says what is wrong, or converts as amplifier-core does
    try:
        text = json.dumps(data, default=str, allow_nan=False)
    except ValueError as exc:  # NaN / inf, or a circular reference
        raise BadRequestError(f"event data is not JSON: {exc}") from exc
    except TypeError as exc:  # a key of a type JSON objects cannot have
        raise BadRequestError(f"event data is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadRequestError("event data is nested too deeply") from exc
    copy: dict[str, Any] = json.loads(text)
    return copy, None
