"""JSON encoding of the wire types: one encoder and one decoder per type, built once.

msgspec JSON: readable with the `nats` CLI, writable from any language. Decode errors
become `WireFormatError` with msgspec's message, which names the JSON path
(e.g. ``Expected `str`, got `int` - at `$.event```).
"""

from __future__ import annotations

import re
from itertools import accumulate
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

__all__ = ["MAX_NESTING", "WIRE_TYPES", "check_nesting", "decode", "encode", "to_builtins"]

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

MAX_NESTING = 500
"""The deepest nesting of JSON arrays and objects a message may have, on every Python.

The interpreter's own limit is no rule: msgspec stops at the recursion limit, which is about
1,000 levels on Python 3.11 and about 10,000 on 3.13 (where it no longer follows
`sys.setrecursionlimit`), so the same bytes would be a valid event on one host and a format
error on the next. Deeper is a `WireFormatError` where bytes are read (`decode`): a message
is refused by its receiver, whatever Python either side runs. (`encode` does not scan what
it writes: its cost would be paid on every large message sent; data nested too deeply for
the interpreter fails there, and deeper than this, at whoever reads it.)"""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_SHALLOW_LEN = MAX_NESTING
"""Text no longer than this has at most MAX_NESTING opening brackets (one byte each)."""
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_FIND_FROM = 8 * 1024
"""Text this long or longer is first searched for its opening brackets with ``find``."""
_BYTES_PER_FIND = 512
"""The ``find`` calls allowed: one per this many bytes (then the one pass that keeps only
the brackets is the cheaper count, and takes over)."""


def _openers(raw: bytes, most: int) -> int | None:
    """How many opening brackets (``[`` and ``{``, in strings or not) `raw` has, each found
    with ``bytes.find`` (a ``memchr``: text with few of them is passed over at memory
    speed, nothing allocated); None once more than `most` were found."""
    found = 0
    for opener in (b"[", b"{"):
        at = raw.find(opener)
        while at >= 0:
            found += 1
            if found > most:
                return None
            at = raw.find(opener, at + 1)
    return found


def check_nesting(data: bytes | str) -> None:
    """Refuse JSON nested deeper than `MAX_NESTING` levels of arrays and objects.

    Costs nothing for text of at most `MAX_NESTING` bytes. Text of `_FIND_FROM` bytes or
    more with few opening brackets (a large event: a file's content, a command's output)
    is passed with one ``memchr`` pass per kind of opening bracket (about 0.01 ms for
    512 KB, against 0.2 ms to decode it). Otherwise one pass keeping only the brackets
    when it has no more than `MAX_NESTING` of them (about 1 µs for a reply of 1.6 KB;
    0.19 ms for 512 KB); else a scan with strings taken out (about 4 ms for 500 KB
    holding 5,000 objects, against 1.8 ms to decode them). Text that is not JSON at all
    is left to the decoder.

    Raises:
        WireFormatError: nested deeper than `MAX_NESTING`.
    """
    if len(data) <= _SHALLOW_LEN:  # too short to hold MAX_NESTING + 1 levels
        return
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if (
        len(raw) >= _FIND_FROM
        and _openers(raw, min(MAX_NESTING, len(raw) // _BYTES_PER_FIND)) is not None
    ):
        return  # too few opening brackets to nest deeper
    if len(raw.translate(None, _NOT_BRACKETS)) <= MAX_NESTING:  # (a C loop, no copy kept)
        return
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) > MAX_NESTING:
        raise WireFormatError(f"nested too deeply (more than {MAX_NESTING} levels)")


def encode(obj: Any) -> bytes:
    """Encode a wire type (or any msgspec-encodable value) as compact JSON bytes.

    Raises:
        WireFormatError: the value is nested deeper than the interpreter's recursion limit
            (a receiver refuses more than `MAX_NESTING` levels when it decodes).
        TypeError: a value of a type JSON cannot hold (msgspec's error).
    """
    try:
        return _encoder.encode(obj)
    except RecursionError as exc:
        raise WireFormatError("the data is nested too deeply to encode") from exc


def decode(data: bytes | str, type_: type[T]) -> T:
    """Decode JSON into `type_`.

    Any bytes at all end here or as a value: invalid UTF-8 inside a string (msgspec raises
    `UnicodeDecodeError` for it, not `DecodeError`) and nesting deeper than `MAX_NESTING`
    are format errors like any other.

    Raises:
        WireFormatError: the bytes are not JSON or do not fit `type_` (message has the path).
    """
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        check_nesting(data)
        return dec.decode(data)  # type: ignore[no-any-return]
    except WireFormatError as exc:
        raise WireFormatError(f"invalid {type_.__name__}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireFormatError(f"invalid {type_.__name__}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise WireFormatError(f"invalid {type_.__name__}: invalid UTF-8 ({exc.reason})") from exc
    except RecursionError as exc:
        raise WireFormatError(f"invalid {type_.__name__}: nested too deeply") from exc


def to_builtins(obj: Any) -> Any:
    """A wire type as plain dicts and lists (for printing and for JSON Schema checks)."""
    return msgspec.to_builtins(obj)
