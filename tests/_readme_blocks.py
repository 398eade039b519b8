"""README.md's fenced code blocks, read the way tests/test_readme.py runs them.

- `blocks`: every fenced block with its language, first line and the ``readme-test``
  directive in the HTML comment right before it (``<!-- readme-test: skip (why) -->``);
- `commands`: a shell block as commands (``&&`` chains, a trailing ``&``, ``VAR=value``
  prefixes, quotes spanning lines, comments dropped), the way ``sh`` reads it;
- `free_names`: the names a Python block uses without defining them.
"""

from __future__ import annotations

import ast
import builtins
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

CODE_LANGUAGES = {"python", "sh", "bash", "console", "json"}
"""Languages of the blocks that are code; a block without one (or ``text``) is a diagram
or output and is not run."""

_FENCE = re.compile(r"^```(\S*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->$")
_SKIP = re.compile(r"^skip\s*\((.+)\)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: `lang` ('' when none), `line` (1-based, of the first line inside
    the fence), `text` (the lines inside), `skip` (the reason of a skip directive)."""

    lang: str
    line: int
    text: str
    skip: str | None = None

    @property
    def is_code(self) -> bool:
        return self.lang in CODE_LANGUAGES

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of README.md (or of `text`), in order.

    Raises:
        ValueError: a fence is not closed, or a ``readme-test`` comment is not a skip
            with a reason in parentheses.
    """
    lines = (README.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start = i + 1
        end = start
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"README.md:{i + 1}: the fence is not closed")
        found.append(Block(fence.group(1), start + 1, "\n".join(lines[start:end]) + "\n",
                           _directive(lines, i)))  # fmt: skip
        i = end + 1
    return found


def _directive(lines: list[str], fence: int) -> str | None:
    """The skip reason in the comment on the last non-blank line before line `fence`."""
    j = fence - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    comment = _DIRECTIVE.match(lines[j].strip()) if j >= 0 else None
    if comment is None:
        return None
    skip = _SKIP.match(comment.group(1))
    if skip is None or not skip.group(1).strip():
        raise ValueError(
            f"README.md:{j + 1}: a readme-test comment is `skip (the reason)`, "
            f"not {comment.group(1)!r}"
        )
    return skip.group(1).strip()


@dataclass
class Command:
    """One command of a shell block: `argv`, `env` (its ``VAR=value`` prefixes), whether it
    runs in the `background` (``&``), its README `line`, and the `comment` on that line."""

    argv: list[str]
    line: int
    env: dict[str, str] = field(default_factory=dict)
    background: bool = False
    comment: str = ""

    @property
    def text(self) -> str:
        words = [f"{k}={v}" for k, v in self.env.items()] + self.argv
        return shlex.join(words) + (" &" if self.background else "")


def commands(block: Block) -> list[Command]:
    """The commands of a shell block, in order. A line whose quotes are still open (or
    that ends with a backslash) continues on the next.

    Raises:
        ValueError: a quote is never closed, or an operator this reader does not run
            (pipes, redirections, ``;``, ``||``).
    """
    found: list[Command] = []
    pending, first = "", 0
    for offset, raw in enumerate(block.text.splitlines()):
        if not pending:
            first = block.line + offset
        pending += raw + "\n"
        if pending.rstrip("\n").endswith("\\"):
            pending = pending.rstrip("\n")[:-1] + " "
            continue
        try:
            words = _words(pending)
        except ValueError:  # a quote spans lines
            continue
        found.extend(_split(words, first, _comment(pending)))
        pending = ""
    if pending.strip():
        raise ValueError(f"README.md:{first}: a quote is not closed")
    return found


def _words(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def _comment(text: str) -> str:
    """The comment of a logical line: after the first ``#`` that starts a word outside
    quotes, up to the end of that line."""
    quote = ""
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[i + 1 :].split("\n", 1)[0].strip()
    return ""


_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _split(words: list[str], line: int, comment: str) -> list[Command]:
    found: list[Command] = []
    current: list[str] = []

    def flush(background: bool = False) -> None:
        env: dict[str, str] = {}
        while current and _ASSIGNMENT.match(current[0]):
            name, _, value = current.pop(0).partition("=")
            env[name] = value
        if current:
            found.append(Command(list(current), line, env, background, comment))
        current.clear()

    for word in words:
        if word == "&&":
            flush()
        elif word == "&":
            flush(background=True)
        elif word in ("|", "||", ";", ">", ">>", "<", "(", ")"):
            raise ValueError(f"README.md:{line}: {word!r} is not run by the README test")
        else:
            current.append(word)
    flush()
    return found


def free_names(block: Block) -> set[str]:
    """The names a Python block reads but neither assigns, imports nor defines (builtins
    excepted): what it needs from the code around it."""
    tree = ast.parse(block.text)
    loaded: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return loaded - bound - set(dir(builtins))


def inline_code(after: Block, starting: str, text: str | None = None) -> str:
    """The first inline code span (`like this`) starting with `starting` in the prose
    after the block `after` (up to the next block).

    Raises:
        LookupError: there is none.
    """
    lines = (README.read_text() if text is None else text).splitlines()
    prose: list[str] = []
    for raw in lines[after.line - 1 + after.text.count("\n") + 1 :]:
        if raw.startswith("```"):
            break
        prose.append(raw)
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
        if span.startswith(starting):
            return str(span)
    raise LookupError(f"no `{starting} ...` in the prose after {after.where}")
