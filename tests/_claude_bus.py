"""What the Claude Code door tests share: the hook inputs of tests/fixtures/claude_code/, the
``hookbus`` console script, an environment without the developer's NATS settings, and the
bus behind the doors: a private nats-server, a ``hookbus dispatcher`` process and a
``hookbus worker`` process serving tests/fixtures/claude_code/policy.py."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from _procs import log_tails, processes, wait_until

from hookbus.cli import EmbeddedNatsServer

__all__ = ["ENV", "FIXTURES", "HOOKBUS", "PolicyBus", "policy_bus"]

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "claude_code"
HOOKBUS = str(Path(sys.executable).with_name("hookbus"))
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))},
    "NATS_CONTEXT": "",
}


@dataclass
class PolicyBus:
    """The bus `policy_bus` started: the server's `url`, the file each policy handler
    appends what it received to (`seen`, JSON lines), the processes' environment (`env`)
    and their log files (`logs`, in the order started)."""

    url: str
    seen: Path
    env: dict[str, str]
    logs: list[Path]

    def wait_until(
        self,
        probe: Callable[[], object],
        what: str,
        interval_s: float = 0.2,
        last: Callable[[], str] = lambda: "",
    ) -> None:
        """`_procs.wait_until` with the margin of a busy machine (90 s: the processes start
        in about 2 s on a quiet one) and, when it fails, what `last` says (e.g. the last
        answer probed) and the processes' logs."""
        wait_until(
            probe, what, timeout_s=90, interval_s=interval_s,
            explain=lambda: f"{last()}\n{log_tails(self.logs)}",
        )  # fmt: skip


@contextlib.contextmanager
def policy_bus(folder: Path, *more: list[str]) -> Iterator[PolicyBus]:
    """A private nats-server, a ``hookbus dispatcher`` and the policy worker, plus each of
    `more` (an argv, ``--url URL`` appended), logging into `folder`; all stopped on exit.
    Nothing waits here for the worker to be routed: each caller probes that its own way."""
    seen = folder / "seen.jsonl"
    with EmbeddedNatsServer() as server:
        url = server.url
        env = {**ENV, "HOOKBUS_TEST_SEEN": str(seen)}
        with processes(
            [HOOKBUS, "dispatcher", "--url", url, "--grace-period", "1"],
            [HOOKBUS, "worker", f"{FIXTURES / 'policy.py'}:worker", "--url", url],
            *([*argv, "--url", url] for argv in more),
            env=env,
            logs=folder,
        ) as logs:
            yield PolicyBus(url, seen, env, list(logs))
