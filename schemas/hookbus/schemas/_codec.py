"""JSON encoding of the wire types: one encoder and one decoder per type, built once.

msgspec JSON: readable with the `nats` CLI, writable from any language. Decode errors
become `WireFormatError` with msgspec's message, which names the JSON path
(e.g. ``Expected `str`, got `int` - at `$.event```).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from ._approvals import ApprovalGrant, ApprovalMetadata
from ._audit import DecisionRecord
from ._errors import WireFormatError
from ._suspensions import ApprovalAnswer, HookEvent, SuspensionRecord
from ._types import (
    CollectReply,
    CollectRequest,
    EmitReply,
    EmitRequest,
    EventEnvelope,
    HandlerDeclaration,
    HookReply,
    HookResult,
    RequiredHandler,
    WireError,
)

__all__ = ["WIRE_TYPES", "decode", "encode", "to_builtins"]

T = TypeVar("T")

WIRE_TYPES: tuple[type[Any], ...] = (
    EventEnvelope,
    HookResult,
    HookReply,
    HandlerDeclaration,
    EmitRequest,
    EmitReply,
    CollectRequest,
    CollectReply,
    WireError,
    SuspensionRecord,
    HookEvent,
    ApprovalAnswer,
    ApprovalGrant,
    DecisionRecord,
    RequiredHandler,
    ApprovalMetadata,
)
"""Every type that crosses the wire (messages and KV values); `json_schemas` covers exactly
these and the types they nest."""

_encoder = msgspec.json.Encoder()
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def encode(obj: Any) -> bytes:
    """Encode a wire type (or any msgspec-encodable value) as compact JSON bytes.

    Raises:
        WireFormatError: the value is nested deeper than the interpreter's recursion limit
            (data that decoded just under that limit can still fail here once wrapped in a
            reply: it is the sender's error, answered as ``bad_request``).
        TypeError: a value of a type JSON cannot hold (msgspec's error).
    """
    try:
        return _encoder.encode(obj)
    except RecursionError as exc:
        raise WireFormatError("the data is nested too deeply to encode") from exc


def decode(data: bytes | str, type_: type[T]) -> T:
    """Decode JSON into `type_`.

    Any bytes at all end here or as a value: invalid UTF-8 inside a string (msgspec raises
    `UnicodeDecodeError` for it, not `DecodeError`) and nesting deeper than the interpreter's
    recursion limit (`RecursionError`) are format errors like any other.

    Raises:
        WireFormatError: the bytes are not JSON or do not fit `type_` (message has the path).
    """
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        return dec.decode(data)  # type: ignore[no-any-return]
    except msgspec.DecodeError as exc:
        raise WireFormatError(f"invalid {type_.__name__}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise WireFormatError(f"invalid {type_.__name__}: invalid UTF-8 ({exc.reason})") from exc
    except RecursionError as exc:
        raise WireFormatError(f"invalid {type_.__name__}: nested too deeply") from exc


def to_builtins(obj: Any) -> Any:
    """A wire type as plain dicts and lists (for printing and for JSON Schema checks)."""
    return msgspec.to_builtins(obj)
