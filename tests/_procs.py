"""Processes the tests start: started and stopped together (`processes`), waited on
(`wait_until`), and what Linux's /proc says about them: children, states, liveness."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "alive",
    "children_of",
    "descendants",
    "log_tails",
    "processes",
    "thread_states",
    "wait_until",
]


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


@contextlib.contextmanager
def processes(*argvs: list[str], env: dict[str, str], logs: Path) -> Iterator[list[Path]]:
    """Start a process per argv (its output to ``logs/proc<i>.log``); yield the log files.
    On the way out each is sent SIGTERM, then waited on for 10 s (SIGKILL after)."""
    procs: list[subprocess.Popen[bytes]] = []
    paths = []
    with contextlib.ExitStack() as files:
        try:
            for i, argv in enumerate(argvs):
                path = logs / f"proc{i}.log"
                paths.append(path)
                log = files.enter_context(path.open("wb"))
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
            yield paths
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


def log_tails(paths: list[Path], lines: int = 40) -> str:
    """The last `lines` lines of each log file, each under its name (for a failure message)."""
    parts = []
    for path in paths:
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            tail = [f"(unreadable: {exc})"]
        parts.append(f"--- {path.name} ---\n" + "\n".join(tail))
    return "\n".join(parts)


def wait_until(
    probe: Callable[[], object],
    what: str,
    timeout_s: float = 30,
    interval_s: float = 0.2,
    explain: Callable[[], str] | None = None,
) -> None:
    """Call `probe` every `interval_s` seconds until it returns a truthy value.

    Raises:
        AssertionError: still falsy after `timeout_s` seconds (naming `what`, followed by
            what `explain` says then: e.g. the logs of the processes that should be ready).
    """
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            why = f"\n{explain()}" if explain is not None else ""
            raise AssertionError(f"not ready within {timeout_s}s: {what}{why}")
        time.sleep(interval_s)
