"""What the Claude Code door tests share: the hook inputs of tests/fixtures/claude_code/, the
``hookbus`` console script, an environment without the developer's NATS settings, and the
bus behind the doors: a private nats-server, a ``hookbus dispatcher`` process and a
``hookbus worker`` process serving tests/fixtures/claude_code/policy.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
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
        answer probed), the processes' logs and `state` (where a decision could be lost)."""
        wait_until(
            probe, what, timeout_s=90, interval_s=interval_s,
            explain=lambda: f"{last()}\n{log_tails(self.logs)}\n{self.state()}",
        )  # fmt: skip

    def state(self) -> str:
        """What tells a dispatcher-service fault from a registry or worker fault: the handlers
        the registry and the live workers show (``hookbus handlers``), a ``tool:pre`` decided
        by a dispatcher of its own (``hookbus emit``: the service left out), and how many
        calls the policy handlers received."""
        calls: int | str
        try:  # before the emit below adds its own
            calls = len(self.seen.read_text().splitlines())
        except OSError as exc:
            calls = f"none ({exc})"
        parts = [f"--- calls the policy handlers received: {calls}"]
        rm = json.dumps({"tool_name": "Bash", "tool_input": {"command": "rm -rf /"}})
        for argv in (["handlers", "--json"], ["emit", "tool:pre", rm]):
            try:
                done = subprocess.run([HOOKBUS, *argv, "--url", self.url], capture_output=True,
                                      text=True, timeout=30, env=self.env)  # fmt: skip
                shown = done.stdout.strip()
                if argv[0] == "handlers":
                    with contextlib.suppress(ValueError, TypeError, KeyError):
                        shown = "\n".join(
                            f"{h['event']} {h['name']}: declared {h['declared']},"
                            f" {len(h['replicas'])} live replica(s)"
                            for h in json.loads(shown)
                        )
                out = f"exit {done.returncode}\n{shown}\n{done.stderr.strip()}"
            except (OSError, subprocess.TimeoutExpired) as exc:
                out = repr(exc)
            parts.append(f"--- hookbus {argv[0]} ---\n{out.strip()}")
        return "\n".join(parts)


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
