"""A fresh JSON copy of event data for each handler (pure, no I/O).

amplifier-core hands every handler its own JSON copy of an emit's data, so in-place edits
by one handler are seen by no other handler nor by the caller (see
`hookbus.schemas.json_safe`, which makes the emit's data JSON in the first place). The
hook worker and the dispatcher copy the data per handler with `json_copy`.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from hookbus.schemas import BadRequestError
from hookbus.schemas.event_data import json_safe_encoded, walked_copy

__all__ = ["json_copy", "json_safe_encoded", "walked_copy"]

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def json_copy(data: dict[str, Any], json_size: int | None = None) -> dict[str, Any]:
    """A fresh deep copy of JSON data, for one handler (the next handler and the caller
    never see its in-place edits). Values that are not JSON-native (in data a local
    handler returned) are converted as amplifier-core converts a handler's result:
    `Decimal` to a string, `datetime` to ISO 8601, sets and tuples to lists, NaN to
    None, and anything else to its ``str()``.

    `json_size`: about how many bytes the compact JSON of `data` takes, given only for
    data known to be JSON as it is (msgspec decoded it from JSON, or encoded it already);
    a large one is then copied by walking it (`walked_copy`) without encoding it again,
    the same copy. None: not known.

    Raises:
        BadRequestError: the data refers to itself, has a key JSON objects cannot have,
            or is nested deeper than the interpreter's recursion limit.
    """
    if json_size is not None:
        walked = walked_copy(data, json_size)
        if walked is not None:
            return walked
    try:
        encoded = _encode(data)
        walked = walked_copy(data, encoded)  # a large event: its strings shared, not decoded
        copy: dict[str, Any] = _decode(encoded) if walked is None else walked
        return copy
    except (TypeError, msgspec.EncodeError, msgspec.DecodeError):
        pass  # a type msgspec does not encode: amplifier-core's str() fallback below
    except RecursionError as exc:
        raise BadRequestError("data is nested too deeply") from exc
    try:
        copy = _decode(_encode(json.loads(json.dumps(data, default=str))))
    except (ValueError, TypeError, msgspec.DecodeError) as exc:
        raise BadRequestError(f"data is not JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadRequestError("data is nested too deeply") from exc
    return copy
