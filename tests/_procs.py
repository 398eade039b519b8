"""What Linux's /proc says about processes the tests start: children, states, liveness."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["alive", "children_of", "descendants", "thread_states"]


def _state(stat_path: str | Path) -> str:
    """The state letter of a ``stat`` file (``R``, ``S``, ``T`` stopped, ``Z`` zombie...);
    the command name before it may hold spaces and parentheses, hence the last ``)``."""
    return Path(stat_path).read_text().rsplit(")", 1)[1].split()[0]


def children_of(pid: int) -> list[int]:
    """The pids of the processes `pid` started."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(p) for p in (task / "children").read_text().split()]
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie waiting to be reaped has)."""
    try:
        return _state(f"/proc/{pid}/stat") != "Z"
    except OSError:
        return False


def thread_states(pid: int) -> list[str]:
    """The state letter of every thread of `pid` (``T``: stopped)."""
    task_dir = f"/proc/{pid}/task"
    return [_state(f"{task_dir}/{tid}/stat") for tid in os.listdir(task_dir)]
