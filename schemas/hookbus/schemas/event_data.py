"""Event data as JSON values, the way amplifier-core hands it to handlers (pure, no I/O).

amplifier-core 2.0.2 serialises an emit's data to JSON before any handler runs (Python's
``json.dumps(data, default=str)``, parsed back by its Rust kernel), so every handler gets
its own JSON copy: a `Decimal` arrives as ``"1.23"``, a `datetime` as ``str(dt)``, a tuple
as a list, an int key as a string key, and in-place edits by one handler are seen by no
other handler nor by the caller. hookbus does the same, locally and over NATS alike.

Public: `json_safe` (also ``hookbus.schemas.json_safe``) makes an emit's data JSON;
`json_safe_encoded` gives its encoding too, and `walked_copy` copies large JSON data by
sharing its strings: the dispatcher and the workers copy each handler's data with them.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec

from ._errors import BadRequestError

__all__ = ["json_safe", "json_safe_encoded", "walked_copy"]

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


SHARE_FROM_BYTES = 16 * 1024
"""Encoded size from which `json_safe_encoded` first tries to copy by walking the data
(`_shared_copy`) instead of decoding the bytes back: a decode costs per byte, a walk per
value, so a large event made of a few large strings (a file's content, a command's output)
is copied for a fraction of a decode."""

BYTES_PER_NODE = 1024
"""The walk gives up (and the bytes are decoded) once it has met more values than one per
this many encoded bytes: for data made of many small values a decode is the faster copy,
and the walk's wasted work stays under about a tenth of that decode."""

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
"""The ints the walk shares: those of 64 bits (a larger one takes the decode, which says
whether the interpreter can convert it at all)."""


class _NotShared(Exception):
    """The walk met a value that is not JSON-native as it is, or ran out of budget."""


def _shared_copy(data: dict[str, Any], budget: int) -> dict[str, Any] | None:
    """The copy ``msgspec.json.decode(msgspec.json.encode(data))`` gives, built by walking
    `data` (new dicts and lists; its strs, ints, floats, bools and None are immutable and
    shared: equal to the decoded ones and of the same exact types); None if `data` holds
    anything else (a subclass, a tuple, a non-str key, a NaN, an int over 64 bits) or has
    more than `budget` values. A caller then decodes instead."""
    left = [budget]

    def copy(value: Any) -> Any:
        left[0] -= 1
        if left[0] < 0:
            raise _NotShared
        kind = type(value)
        if kind is str or kind is bool or value is None:
            return value
        if kind is dict:
            out = {}
            for key, item in value.items():
                if type(key) is not str:
                    raise _NotShared
                out[key] = copy(item)
            return out
        if kind is list:
            return [copy(item) for item in value]
        if kind is int and _INT_MIN <= value <= _INT_MAX:
            return value
        if kind is float and math.isfinite(value):
            return value
        raise _NotShared

    try:
        shared: dict[str, Any] = copy(data)
    except (_NotShared, RecursionError):
        return None
    return shared


def walked_copy(data: dict[str, Any], encoded: bytes | int) -> dict[str, Any] | None:
    """The copy decoding `encoded` (the compact JSON of `data`, or its length in bytes)
    would give, made by walking `data` when that is cheaper: `encoded` is
    `SHARE_FROM_BYTES` or longer and the walk vouches for every value (`_shared_copy`);
    else None (decode the JSON instead)."""
    size = encoded if isinstance(encoded, int) else len(encoded)
    if size < SHARE_FROM_BYTES:
        return None
    return _shared_copy(data, size // BYTES_PER_NODE)


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
        shared = walked_copy(data, encoded)
        if shared is not None:
            return shared, encoded
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
