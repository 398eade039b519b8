"""A handler's ``tool_filter``: which tool names it admits (the rule every implementation
matches by: whole-name `fnmatch` globs, ignoring case; see `ToolFilter`, also
``hookbus.schemas.ToolFilter``), and `HandlerOptionError`, what a handler option out of
its bounds raises (the tool filter's here, the others' where handler options are checked).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import Any

from ._bounds import MAX_TOOL_PATTERNS
from ._errors import BadRequestError
from ._subjects import MAX_NAME_LENGTH

__all__ = ["HandlerOptionError", "ToolFilter"]


class HandlerOptionError(BadRequestError, ValueError):
    """A handler option out of its bounds. A `BadRequestError`, and a `ValueError` as
    `HookWorker.handler` has always raised for a bad option."""


def _compile(patterns: Iterable[str] | None) -> re.Pattern[str] | None:
    """One regular expression for a tool filter's globs, over *casefolded* tool names: each
    glob is casefolded (`str.casefold`) and read with `fnmatch` syntax; the expression's
    `re.Pattern.fullmatch` of ``name.casefold()`` is the filter's answer (`ToolFilter`
    is the one place that does that). None for no filter (everything matches); an empty
    list matches nothing."""
    if patterns is None:
        return None
    globs = (fnmatch.translate(p.casefold()) for p in patterns)
    return re.compile("|".join(f"(?:{g})" for g in globs) or "(?!)")


class ToolFilter:
    """A handler's tool filter, bounded and compiled once: `matches` is how dispatchers
    (`Route.matches`) and workers (`HandlerSpec.matches`) alike judge a call, and
    `matches_name` is the same rule for a handler's own comparisons of tool names.

    The rule: a tool name matches when it matches one of the globs as a whole, in `fnmatch`
    syntax (``*``, ``?``, ``[seq]``, ``[!seq]``; no path separators are special), **ignoring
    case**: the name and each glob are compared casefolded (Unicode `str.casefold`, so
    ``bash`` matches ``Bash`` and ``BASH``, ``shell*`` matches ``Shell_exec``, ``straße``
    matches ``STRASSE``). Case-insensitive is the fail-safe choice: agents spell their
    tools as they like (Claude Code's ``Bash``, MCP's ``mcp__github__create_issue``), and
    a policy written for ``bash`` must not let ``Bash`` through. Only a string
    ``data["tool_name"]`` can match. The globs are kept as written (`patterns`, the
    declaration on the wire, and the chain steps a worker compares with its declaration).
    """

    __slots__ = ("_regex", "patterns")

    EVERY: ToolFilter
    """No filter: every call matches."""

    def __init__(self, patterns: tuple[str, ...] | None) -> None:
        """Use `of`, which checks the bounds."""
        self.patterns = patterns
        """The globs, or None for no filter."""
        self._regex = _compile(patterns)

    @classmethod
    def of(cls, patterns: ToolFilter | Iterable[str] | None) -> ToolFilter:
        """The filter of `patterns` (None: every call; a `ToolFilter` is returned as is).

        Raises:
            HandlerOptionError: a bare string, a non-string glob, an empty or too long
                glob, or more than `MAX_TOOL_PATTERNS` globs.
        """
        if isinstance(patterns, ToolFilter):
            return patterns
        if patterns is None:
            return cls.EVERY
        if isinstance(patterns, str | bytes):
            raise HandlerOptionError(f"tool_filter must be a list of globs, not {patterns!r}")
        globs = tuple(patterns)
        if len(globs) > MAX_TOOL_PATTERNS:
            raise HandlerOptionError(
                f"tool_filter has {len(globs)} globs, at most {MAX_TOOL_PATTERNS}"
            )
        for glob in globs:
            if not isinstance(glob, str) or not 1 <= len(glob) <= MAX_NAME_LENGTH:
                raise HandlerOptionError(
                    f"tool_filter globs must be strings of 1 to {MAX_NAME_LENGTH} characters"
                )
        return cls(globs)

    def matches(self, data: dict[str, Any]) -> bool:
        """Whether the filter admits ``data["tool_name"]``: no filter admits everything; a
        filter never admits data without a string tool name."""
        regex = self._regex
        if regex is None:
            return True
        tool = data.get("tool_name")
        return isinstance(tool, str) and regex.fullmatch(tool.casefold()) is not None

    def matches_name(self, tool: object) -> bool:
        """Whether the filter admits the tool name `tool` (the rule of `matches`: no filter
        admits everything; a filter admits only a string that matches a glob, ignoring
        case)."""
        return self.matches({"tool_name": tool})

    def as_list(self) -> list[str] | None:
        """The globs as a declaration holds them (None: no filter)."""
        return None if self.patterns is None else list(self.patterns)

    def __repr__(self) -> str:
        return f"ToolFilter({self.patterns!r})"


ToolFilter.EVERY = ToolFilter(None)
