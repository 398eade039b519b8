"""The wire contract as JSON Schema 2020-12, generated from the msgspec types.

`json_schemas` is what ``hookbus schema`` prints: one ``$defs`` entry per wire type (and the
types they nest), valid in strict validators (ajv ``strict: true``: no keyword outside the
2020-12 vocabulary), with

- a description on every type and every property, taken from the types' own docstrings
  (the class docstring and the string literal after each field: `attribute_docs`), so the
  code and the contract cannot drift; a time or a duration names its unit;
- ``required`` for what a conforming writer always puts in the message (`EXTRA_REQUIRED`
  adds the fields hookbus writes although its decoders would default them);
- ``oneOf`` for exclusive fields (a reply has exactly one of ``result`` and ``error``);
- ``enum`` for codes (`WireError.code`, actions, failure kinds and policies, statuses);
- the bounds readers enforce (names of 1 to 200 characters, priorities within ±1,000,000,
  timeouts above 0 seconds, at most 64 tool globs).

Readers are lenient where writers are held to the contract: hookbus decodes a message
with unknown fields, absent defaults and unknown error codes (see the field descriptions).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from typing import Any, Final

import msgspec

from ._approvals import ApprovalMetadata
from ._audit import DecisionRecord
from ._bounds import MAX_PRIORITY, MAX_TOOL_PATTERNS
from ._codec import WIRE_TYPES
from ._subjects import MAX_NAME_LENGTH
from ._suspensions import HookEvent, HookPart, SuspensionRecord
from ._types import (
    WIRE_ERROR_CODES,
    ChainStep,
    ContextInjection,
    HandlerDeclaration,
    HandlerFailure,
    HookResult,
)

__all__ = [
    "EXTRA_REQUIRED",
    "JSON_SCHEMA_DIALECT",
    "attribute_docs",
    "json_schemas",
    "schema_definitions",
]

JSON_SCHEMA_DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"

EXTRA_REQUIRED: Final[dict[str, tuple[str, ...]]] = {
    # a result without an action would read as continue: a writer states it
    HookResult.__name__: ("action",),
    # workers write the derived routes; dispatchers re-derive them and refuse a mismatch
    HandlerDeclaration.__name__: ("subject", "collect_subject", "queue_group"),
    # hookbus is the only writer, and it encodes every field
    DecisionRecord.__name__: DecisionRecord.__struct_fields__,
    ApprovalMetadata.__name__: ApprovalMetadata.__struct_fields__,
    HookEvent.__name__: ("at",),
    SuspensionRecord.__name__: ("write_id", "created_at"),
}
"""Per type, the fields a conforming writer always puts in the message although hookbus's
decoders accept it without them (they have a default)."""

_NESTED: tuple[type[Any], ...] = (ChainStep, ContextInjection, HandlerFailure, HookPart)
"""Struct types that only travel inside the wire types."""

_EXCLUSIVE: Final[dict[str, tuple[str, str, str]]] = {
    "HookReply": ("result", "HookResult", "error"),
    "EmitReply": ("result", "HookResult", "error"),
}
"""Replies that carry exactly one of two fields: (first, its type, second: a `WireError`)."""


_DOCS: dict[type[Any], dict[str, str]] = {}
"""`attribute_docs` by class (the source does not change while the process runs)."""


_JSON_WORDS = {"None": "null", "True": "true", "False": "false"}


def _clean(doc: str) -> str:
    """A docstring as a description: dedented, lines of a paragraph joined, RST literals as
    Markdown code, Python's None / True / False as JSON's null / true / false."""
    text = inspect.cleandoc(doc)
    text = re.sub(r"(?<!\n)\n(?!\n)", " ", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return re.sub(r"\b(None|True|False)\b", lambda m: _JSON_WORDS[m.group(1)], text)


def attribute_docs(cls: type[Any]) -> dict[str, str]:
    """The attribute docstrings of a class and its bases: ``{field: text}``.

    An attribute docstring is the string literal right after an annotated field in the
    class body (the convention `help()` and documentation tools read). They are read from
    the module's source with `ast` (Python keeps none at run time); a class whose source is
    not available (a bytecode-only installation) contributes none.
    """
    cached = _DOCS.get(cls)
    if cached is not None:
        return cached
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass.__module__.startswith("msgspec"):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        node = ast.parse(textwrap.dedent(source)).body[0]
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = _clean(after.value.value)
    _DOCS[cls] = docs
    return docs


def _struct_types() -> dict[str, type[Any]]:
    return {t.__name__: t for t in (*WIRE_TYPES, *_NESTED)}


def _describe(defs: dict[str, Any]) -> None:
    """Put the class and attribute docstrings on each definition and property."""
    classes = _struct_types()
    for name, schema in defs.items():
        cls = classes.get(name)
        if cls is None:
            continue
        if cls.__doc__:
            schema["description"] = _clean(cls.__doc__)
        docs = attribute_docs(cls)
        for field, prop in schema.get("properties", {}).items():
            if field in docs:
                prop["description"] = docs[field]


def _require(defs: dict[str, Any]) -> None:
    for name, fields in EXTRA_REQUIRED.items():
        schema = defs[name]
        required = list(schema.get("required", []))
        required += [f for f in fields if f not in required]
        schema["required"] = required


def _exclusive(defs: dict[str, Any], ref: str) -> None:
    """``oneOf``: exactly one of the two fields is present and not null."""
    for name, (first, first_type, second) in _EXCLUSIVE.items():
        defs[name]["oneOf"] = [
            {
                "type": "object",
                "required": [first],
                "properties": {
                    first: {"$ref": ref.format(name=first_type)},
                    second: {"type": "null"},
                },
            },
            {
                "type": "object",
                "required": [second],
                "properties": {
                    second: {"$ref": ref.format(name="WireError")},
                    first: {"type": "null"},
                },
            },
        ]
    # a chain request's reply: its steps' replies instead of one result or error
    for alternative in defs["HookReply"]["oneOf"]:
        alternative["properties"]["chain"] = {"type": "null"}
    defs["HookReply"]["oneOf"].append(
        {
            "type": "object",
            "required": ["chain"],
            "properties": {
                "chain": {"type": "array"},
                "result": {"type": "null"},
                "error": {"type": "null"},
            },
        }
    )
    # a failed collect has no responses; a successful one has no error
    defs["CollectReply"]["oneOf"] = [
        {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {"$ref": ref.format(name="WireError")},
                "responses": {"type": "array", "maxItems": 0},
            },
        },
        {"type": "object", "properties": {"error": {"type": "null"}}},
    ]


def _approval_record(defs: dict[str, Any], ref: str) -> None:
    """``ApprovalRecord``: a `SuspensionRecord` whose label starts with ``approval:``."""
    defs["ApprovalRecord"] = {
        "title": "ApprovalRecord",
        "description": (
            "The SuspensionRecord of an approval: a dispatcher writes it when a handler "
            "answers ask_user, an approver resolves it with an ApprovalAnswer (after writing "
            "its answer proof)."
        ),
        "type": "object",
        "allOf": [{"$ref": ref.format(name="SuspensionRecord")}],
        "properties": {
            "label": {
                "type": "string",
                "pattern": "^approval:[0-9a-f]{32}$",
                "description": "`approval:` and 32 hex digits: a digest of the call (event, "
                "agent, session, handler, the call's id and its data).",
            },
            "metadata": {
                "$ref": ref.format(name="ApprovalMetadata"),
                "description": "The question, its options, timeout and default.",
            },
            "resolution": {
                "anyOf": [{"$ref": ref.format(name="ApprovalAnswer")}, {"type": "null"}],
                "description": "The approver's answer once resolved; null while pending.",
            },
        },
        "required": ["label", "metadata"],
    }


def _number_branch(prop: dict[str, Any]) -> dict[str, Any]:
    """The part of a property's schema that holds its number (or array) constraints."""
    for branch in prop.get("anyOf", []):
        if branch.get("type") != "null":
            return branch  # type: ignore[no-any-return]
    return prop


def _bounds(defs: dict[str, Any]) -> None:
    """The bounds readers enforce, stated for writers (see `_declarations`, the service)."""
    positive = {"exclusiveMinimum": 0}
    name = {"minLength": 1, "maxLength": MAX_NAME_LENGTH}
    for type_name in ("HandlerDeclaration", "RequiredHandler"):
        props = defs[type_name]["properties"]
        props["event"].update(name)
        props["name"].update(name)
        props["priority"].update(minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY)
        props["timeout_s"].update(positive)
        globs = _number_branch(props["tool_filter"])
        globs.update(maxItems=MAX_TOOL_PATTERNS)
        globs["items"].update(name)
    for type_name in ("EmitRequest", "CollectRequest"):
        _number_branch(defs[type_name]["properties"]["timeout_s"]).update(positive)
    _number_branch(defs["EmitRequest"]["properties"]["approval_timeout_s"]).update(positive)


def _enums(defs: dict[str, Any]) -> None:
    code = defs["WireError"]["properties"]["code"]
    code["enum"] = list(WIRE_ERROR_CODES)


def schema_definitions(ref_template: str = "#/$defs/{name}") -> dict[str, Any]:
    """The definition of every wire type and nested type, by name (see the module
    docstring); `ref_template` places the references (``{name}`` is the type's name)."""
    _, defs = msgspec.json.schema_components((*WIRE_TYPES, *_NESTED), ref_template=ref_template)
    _describe(defs)
    _require(defs)
    _exclusive(defs, ref_template)
    _enums(defs)
    _bounds(defs)
    _approval_record(defs, ref_template)
    return defs


def json_schemas() -> dict[str, Any]:
    """The JSON Schema (2020-12) of every wire type, as one document.

    Shape: ``{"$schema", "title", "description", "$defs": {type name: schema},
    "anyOf": [{"$ref": "#/$defs/<wire type>"}, ...]}``: validate a message against
    ``#/$defs/<its type>`` (the root accepts any wire type). The ``anyOf`` lists exactly
    `WIRE_TYPES`, in order.
    """
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": "hookbus v1 wire types",
        "description": (
            "Every message and KV value hookbus puts on NATS (subjects hookbus.v1.*, "
            "JetStream KV buckets hookbus_*). Generated from the msgspec types of "
            "hookbus.schemas; `hookbus asyncapi` says which subject carries which type."
        ),
        "$defs": schema_definitions(),
        "anyOf": [{"$ref": f"#/$defs/{t.__name__}"} for t in WIRE_TYPES],
    }
