"""Validation of the handler registry's records (declarations and required handlers).

Every value read from `HANDLERS_BUCKET` is untrusted input: anyone who may write the bucket
may write anything. A record is accepted only if it fits these bounds, and it is bound to
its key: the event and name inside must be the ones the key encodes, and the subject,
collect subject and queue group are derived from (event, name), never read from the value
(a non-empty value that differs refuses the record). Dispatchers skip and report a record
that fails; it never takes a dispatcher or a CLI command down.

Bounds (the numbers are `hookbus.schemas`'s, enforced here; a handler's options through
`HandlerOptions`, the one definition a worker's and an in-process handler's options are
checked by too):

=============================  ================================================
value size                     at most `MAX_RECORD_BYTES` bytes
event, handler names           `validate_name`; the encoded key within `MAX_KEY_LENGTH`
``timeout_s``                  finite and > 0; clamped to `MAX_HANDLER_TIMEOUT_S` seconds
``priority``                   an int within ±`MAX_PRIORITY`
``tool_filter``                at most `MAX_TOOL_PATTERNS` non-empty globs of at most
                               `MAX_NAME_LENGTH` characters (kept as written; matched
                               ignoring case, see `ToolFilter`)
``handler_set``                at most `MAX_HANDLER_SET` valid handler names, the
                               declared handler's own among them
=============================  ================================================
"""

from __future__ import annotations

from typing import Final, TypeVar

import msgspec

from hookbus.schemas import (
    MAX_HANDLER_SET,
    MAX_RECORD_BYTES,
    BadRequestError,
    HandlerDeclaration,
    HookbusError,
    RequiredHandler,
    collect_subject,
    decode,
    handler_queue_group,
    handler_subject,
    parse_registry_key,
    validate_name,
)

from .handler_options import OPTIONS, HandlerOptions

__all__ = [
    "check_declaration",
    "check_required",
    "declaration_differences",
    "derive_declaration",
]

COMPARED_FIELDS: Final = OPTIONS
"""The declaration settings two workers must agree on to serve the same handler: its
options."""

R = TypeVar("R", HandlerDeclaration, RequiredHandler)


def _check_common(record: R, event: str, name: str) -> R:
    validate_name("event", record.event)
    validate_name("handler", record.name)
    if (record.event, record.name) != (event, name):
        raise BadRequestError(
            f"the value declares ({record.event!r}, {record.name!r}) but its key is for"
            f" ({event!r}, {name!r})"
        )
    options = HandlerOptions.remote(  # the bounds every path applies; raises if out
        priority=record.priority,
        timeout_s=record.timeout_s,
        failure_policy=record.failure_policy,
        tool_filter=record.tool_filter,
    )
    if options.timeout_s != record.timeout_s:
        record = msgspec.structs.replace(record, timeout_s=options.timeout_s)
    if isinstance(record, HandlerDeclaration) and record.handler_set is not None:
        names = record.handler_set
        if len(names) > MAX_HANDLER_SET or record.name not in names:
            raise BadRequestError(
                f"handler_set must list the handler itself and at most {MAX_HANDLER_SET} names"
            )
        for n in names:
            validate_name("handler", n)
    return record


def _decode_bounded(key: str, value: bytes | None, type_: type[R]) -> tuple[str, str, str, R]:
    kind, event, name = parse_registry_key(key)
    if not value:
        raise BadRequestError(f"empty value at {key!r}")
    if len(value) > MAX_RECORD_BYTES:
        raise BadRequestError(f"value is {len(value)} bytes, at most {MAX_RECORD_BYTES}")
    try:
        record = decode(value, type_)
    except HookbusError as exc:
        raise BadRequestError(str(exc)) from exc
    return kind, event, name, record


def derive_declaration(decl: HandlerDeclaration) -> HandlerDeclaration:
    """`decl` with its subject, collect subject and queue group derived from its
    (event, name).

    Raises:
        BadRequestError: the names are too long for a subject.
    """
    return msgspec.structs.replace(
        decl,
        subject=handler_subject(decl.event, decl.name),
        collect_subject=collect_subject(decl.event),
        queue_group=handler_queue_group(decl.name),
    )


def check_declaration(key: str, value: bytes | None) -> HandlerDeclaration:
    """The `HandlerDeclaration` stored at `key`, validated against the key and the bounds
    of the module docstring; its timeout clamped and its subjects derived.

    Raises:
        BadRequestError: the record is refused; the message says why (also for a key that
            is not a declaration key).
    """
    kind, event, name, decl = _decode_bounded(key, value, HandlerDeclaration)
    if kind != "handler":
        raise BadRequestError(f"{key!r} is not a declaration key")
    decl = _check_common(decl, event, name)
    derived = derive_declaration(decl)
    for field in ("subject", "collect_subject", "queue_group"):
        given = getattr(decl, field)
        if given and given != getattr(derived, field):
            raise BadRequestError(
                f"{field} {given[:80]!r} differs from the derived {getattr(derived, field)!r}"
            )
    return derived


def check_required(key: str, value: bytes | None) -> RequiredHandler:
    """The `RequiredHandler` stored at `key`, validated like `check_declaration`.

    Raises:
        BadRequestError: the record is refused; the message says why.
    """
    kind, event, name, req = _decode_bounded(key, value, RequiredHandler)
    if kind != "required":
        raise BadRequestError(f"{key!r} is not a required-handler key")
    return _check_common(req, event, name)


def declaration_differences(live: HandlerDeclaration, asked: HandlerDeclaration) -> list[str]:
    """The settings (`COMPARED_FIELDS`) on which two declarations of one handler differ,
    one line each, e.g. ``"failure_policy: live 'deny', declared 'ignore'"``; empty for
    replicas of the same handler."""
    out = []
    for field in COMPARED_FIELDS:
        a, b = getattr(live, field), getattr(asked, field)
        if a != b:
            out.append(f"{field}: live {a!r}, declared {b!r}")
    return out
