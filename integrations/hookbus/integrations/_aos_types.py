"""The OWASP Agent Observability Standard (AOS) objects the guardian door reads and writes.

msgspec Structs named as the AOS specification names them (version 0.1.0, sections 3.x for the
data objects, 4.x for each method's ``params``, 5.x for the responses, 6 for the error codes).
Requests are only *validated* with these types (`msgspec.convert`); the door forwards the
params as the agent sent them, unknown fields included. Where the specification's prose and
its published JSON Schema (``aos_schema.json``, 0.1.0) disagree, the schema and the
specification's own examples are followed:

- ``steps/toolCallResult``: ``params.toolCallResult = {executionId, result}`` (the prose lists
  ``executionId`` and ``result`` directly under ``params``);
- ``steps/message``: ``citations`` (plural) and optional (the prose: ``citation``, required);
- `User`: only ``id`` is required (the prose also requires ``organization``);
- ``ping``: ``timestamp`` at the top level of the request (the schema) or in ``params``
  (the prose), either is accepted.

`Agent` reads ``url`` (required by the schema since July 2025) but does not require it, so
agents written against the earlier schema are still decided; tests/fixtures/aos/README.md
says which schema the door is checked against.

Source: OWASP AOS specification 0.1.0 (``docs/spec/instrument/specification.md``) and
``specification/AOS/aos_schema.json``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

__all__ = [
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "SERVER_ERROR_MAX",
    "SERVER_ERROR_MIN",
    "A2AMessageParams",
    "A2ARequestParams",
    "AOSSuccessResponse",
    "AOSSuccessResult",
    "AgentTriggerParams",
    "JSONRPCError",
    "JSONRPCErrorResponse",
    "KnowledgeRetrievalParams",
    "MCPParams",
    "MCPRawMessage",
    "MemoryParams",
    "MessageParams",
    "PingParams",
    "PingRequestResult",
    "PingRequestSuccessResponse",
    "StepContext",
    "ToolCallRequestParams",
    "ToolCallResultParams",
]

# -- section 6: error codes (JSON-RPC 2.0's, with the schema's standard messages) ---------------
PARSE_ERROR = -32700
"""Not well-formed JSON (schema message ``"Invalid JSON payload"``)."""
INVALID_REQUEST = -32600
"""Valid JSON, not a valid JSON-RPC request object (``"Request payload validation error"``)."""
METHOD_NOT_FOUND = -32601
"""No such AOS method (``"Method not found"``)."""
INVALID_PARAMS = -32602
"""The method's params are missing a required field or have a wrong type
(``"Invalid parameters"``)."""
INTERNAL_ERROR = -32603
"""An unexpected error in the door itself (``"Internal error"``)."""
SERVER_ERROR_MIN, SERVER_ERROR_MAX = -32099, -32000
"""Implementation-defined server errors (unused by the door: see docs/aos.md, fail closed)."""

STANDARD_MESSAGES: dict[int, str] = {
    PARSE_ERROR: "Invalid JSON payload",
    INVALID_REQUEST: "Request payload validation error",
    METHOD_NOT_FOUND: "Method not found",
    INVALID_PARAMS: "Invalid parameters",
    INTERNAL_ERROR: "Internal error",
}
"""Each code's ``message`` as the schema's JSONParseError ... InternalError objects fix it."""

Metadata = dict[str, Any] | None
NonEmpty = Meta(min_length=1)


class _In(msgspec.Struct):
    """An AOS object as received: unknown fields are allowed (and kept by the door)."""


# -- 3.1 Agent and its parts ---------------------------------------------------------------------
class AgentProvider(_In):
    name: str
    url: str
    metadata: Metadata = None


class Organization(_In):
    id: str
    name: str | None = None
    metadata: Metadata = None


class Agent(_In):
    """3.1: ``id``, ``name``, ``instructions``, ``version``, ``provider`` are required;
    ``url`` is read but not required (the current schema requires it, earlier agents do not
    send it)."""

    id: str
    name: str
    instructions: str
    version: str
    provider: AgentProvider
    url: str | None = None
    description: str | None = None
    model: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    mcpServers: list[dict[str, Any]] | None = None
    resources: list[dict[str, Any]] | None = None
    organization: Organization | None = None
    metadata: Metadata = None


class Session(_In):
    id: str
    metadata: Metadata = None


class User(_In):
    id: str
    name: str | None = None
    email: str | None = None
    organization: Organization | None = None
    metadata: Metadata = None


class StepContext(_In):
    """3.8: the context of one agent step (``params.context`` of every ``steps/*`` method).

    ``timestamp`` is ISO 8601 text (UTC recommended), kept as sent.
    """

    agent: Agent
    session: Session
    turnId: str
    stepId: str
    timestamp: str
    user: User | None = None


# -- 3.4 Part, 3.7 Source ------------------------------------------------------------------------
class TextPart(_In, tag_field="kind", tag="text"):
    text: str
    metadata: Metadata = None


class FilePart(_In, tag_field="kind", tag="file"):
    """3.4.2: ``file`` is a FileWithBytes (``bytes``) or a FileWithUri (``uri``)."""

    file: dict[str, Any]
    metadata: Metadata = None

    def __post_init__(self) -> None:
        if not isinstance(self.file.get("bytes"), str) and not isinstance(
            self.file.get("uri"), str
        ):
            raise ValueError("a file part's `file` needs `bytes` or `uri` (text)")


class DataPart(_In, tag_field="kind", tag="data"):
    data: dict[str, Any]
    metadata: Metadata = None


Part = TextPart | FilePart | DataPart


class FileSource(_In, tag_field="kind", tag="file"):
    id: str
    name: str
    url: str | None = None


class SiteSource(_In, tag_field="kind", tag="site"):
    url: str


# -- 3.3 Message, 3.6 AgentTrigger, 3.14 knowledge, 3.15 tool call --------------------------------
class Message(_In):
    id: str
    role: Literal["user", "agent", "system"]
    content: Annotated[list[Part], NonEmpty]
    metadata: Metadata = None


class AgentTriggerEvent(_In):
    type: str
    id: str


class AgentTrigger(_In):
    type: Literal["autonomous"]
    event: AgentTriggerEvent
    content: Annotated[list[Part], NonEmpty]
    metadata: Metadata = None


class KnowledgeRetrievalResult(_In):
    id: str
    content: str
    mimeType: str | None = None
    metadata: Metadata = None


class KnowledgeRetrievalStepParams(_In):
    results: list[KnowledgeRetrievalResult]
    query: str | None = None
    keywords: list[str] | None = None


class ToolArgumentValue(_In):
    name: str
    value: Any
    id: str | None = None


class ToolCallRequest(_In):
    executionId: str
    toolId: str
    inputs: list[ToolArgumentValue]


class ToolCallResult(_In):
    outputs: list[TextPart]
    isError: bool


class ToolCallResultStep(_In):
    """``params.toolCallResult``. ``toolId`` is a hookbus extension (AOS names only the
    ``executionId``): when present it becomes the event's ``tool_name``."""

    executionId: str
    result: ToolCallResult
    toolId: str | None = None


# -- section 4: each method's params ---------------------------------------------------------------
class AgentTriggerParams(_In):
    """4.1 ``steps/agentTrigger``."""

    context: StepContext
    trigger: AgentTrigger


class KnowledgeRetrievalParams(_In):
    """4.2 ``steps/knowledgeRetrieval``."""

    context: StepContext
    knowledgeStep: KnowledgeRetrievalStepParams
    reasoning: str | None = None


class MemoryParams(_In):
    """4.3 ``steps/memoryStore`` and 4.4 ``steps/memoryContextRetrieval``."""

    context: StepContext
    memory: list[str]
    reasoning: str | None = None


class MessageParams(_In):
    """4.5 ``steps/message``."""

    context: StepContext
    message: Message
    citations: list[FileSource | SiteSource] | None = None
    reasoning: str | None = None


class ToolCallRequestParams(_In):
    """4.6 ``steps/toolCallRequest``."""

    context: StepContext
    toolCallRequest: ToolCallRequest
    reasoning: str | None = None


class ToolCallResultParams(_In):
    """4.6 ``steps/toolCallResult`` (as the schema and the examples nest it)."""

    context: StepContext
    toolCallResult: ToolCallResultStep
    reasoning: str | None = None


class PingParams(_In):
    """4.7 ``ping``: ``timeout`` in milliseconds. ``timestamp`` is here per the
    specification's prose; the schema puts it at the top level of the request (the door
    requires one of the two)."""

    timestamp: str | None = None
    timeout: int | None = None
    metadata: Metadata = None


class A2ARequestParams(_In):
    """4.8 / 4.9: an A2A method (``message/send``, ...): the raw A2A message as ``payload``;
    ``context`` is the schema's A2AContext (``from`` / ``to`` agents), kept as sent."""

    payload: dict[str, Any]
    reasoning: str | None = None
    context: dict[str, Any] | None = None


class A2AMessageParams(_In):
    """``protocols/A2A`` (the A2AMessage of the schema before July 2025, which the current
    one replaced by the A2A methods): the raw A2A message as ``message``."""

    message: dict[str, Any]
    reasoning: str | None = None


class MCPParams(_In):
    """4.10 ``protocols/MCP``: the raw MCP message as ``message``."""

    message: dict[str, Any]
    reasoning: str | None = None


class MCPRawMessage(_In):
    """``protocols/MCP`` as the specification's MCP examples send it: the MCP JSON-RPC
    message itself as ``params`` (a request, a response or an error)."""

    jsonrpc: Literal["2.0"]
    id: str | int | None = None
    method: str | None = None
    params: dict[str, Any] | list[Any] | None = None
    result: Any = msgspec.UNSET
    error: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.method is None and self.result is msgspec.UNSET and self.error is None:
            raise ValueError("an MCP message needs `method`, `result` or `error`")


# -- section 5: responses --------------------------------------------------------------------------
class _Out(msgspec.Struct):
    """A response object: optional fields left `UNSET` are not written; ``jsonrpc`` and a
    null ``id`` are."""


Decision = Literal["allow", "deny", "modify"]


class AOSSuccessResult(_Out):
    """5.1.1: ``decision`` and ``message`` always; ``modifiedRequest`` (a whole AOS request:
    ``jsonrpc``, ``id``, ``method``, ``params``) with ``modify``."""

    decision: Decision
    message: str
    reasoning: str | UnsetType = UNSET
    reasonCode: list[str] | UnsetType = UNSET
    data: dict[str, Any] | UnsetType = UNSET
    modifiedRequest: dict[str, Any] | UnsetType = UNSET


class AOSSuccessResponse(_Out, kw_only=True):
    """5.1: the guardian's decision on a ``steps/*``, ``protocols/*`` or A2A request."""

    jsonrpc: Literal["2.0"] = "2.0"
    id: str | int
    result: AOSSuccessResult


class PingRequestResult(_Out):
    """5.3.1: ``timestamp`` is ISO 8601 (UTC)."""

    status: Literal["connected", "error"]
    version: str
    timestamp: str
    metadata: dict[str, Any] | UnsetType = UNSET


class PingRequestSuccessResponse(_Out, kw_only=True):
    """5.3: the answer to ``ping``."""

    jsonrpc: Literal["2.0"] = "2.0"
    id: str | int
    result: PingRequestResult


class JSONRPCError(_Out):
    """3.13: JSON-RPC 2.0's error object; ``data`` carries the detail."""

    code: int
    message: str
    data: Any = UNSET


class JSONRPCErrorResponse(_Out, kw_only=True):
    """5.2: ``id`` is the request's, or null when it could not be read (JSON-RPC 2.0,
    section 5: parse error or invalid request)."""

    jsonrpc: Literal["2.0"] = "2.0"
    id: str | int | None
    error: JSONRPCError
