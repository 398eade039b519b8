"""amplifier-core 2.0.2's in-process emit beside hookbus's, without amplifier-core in
hookbus's venv (its pytest plugin would load into every test run there).

`amplifier_python` makes (once) and reuses a venv of its own, by default
``~/.cache/hookbus/bench-amplifier`` (``python -m venv`` and ``pip install
amplifier-core==2.0.2``); `amplifier_child` is the measuring process
(`_amplifier_emit.py`) run with that venv's python, and `amplifier_sampler` asks it for
samples, so its rounds interleave with the hookbus rows of the same run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _measure import Sampler
from _procs import JsonChild

__all__ = [
    "AMPLIFIER_VERSION",
    "DEFAULT_VENV",
    "Unavailable",
    "amplifier_child",
    "amplifier_python",
    "amplifier_sampler",
]

AMPLIFIER_VERSION = "2.0.2"
DEFAULT_VENV = Path.home() / ".cache" / "hookbus" / "bench-amplifier"
CHILD = Path(__file__).resolve().parent / "_amplifier_emit.py"
INSTALL_TIMEOUT_S = 600.0


class Unavailable(Exception):
    """amplifier-core cannot be measured here; the message says why."""


def _run(argv: list[str], what: str, timeout_s: float) -> str:
    """Run `argv`; its stdout, or Unavailable naming `what` and the last error line."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{what}: {exc}") from None
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        raise Unavailable(f"{what} failed: {lines[-1] if lines else f'exit {done.returncode}'}")
    return done.stdout


def _installed(python: Path) -> str | None:
    """The amplifier-core version installed for `python`, or None."""
    if not python.exists():
        return None
    try:
        out = _run(
            [str(python), "-c", "from importlib.metadata import version as v;"
             "print(v('amplifier-core'))"],
            "version check", 60,
        )  # fmt: skip
    except Unavailable:
        return None
    return out.strip()


def amplifier_python(venv: Path = DEFAULT_VENV, say: Callable[[str], None] = print) -> Path:
    """The python of `venv` with amplifier-core `AMPLIFIER_VERSION`, made if missing.

    Raises:
        Unavailable: the venv could not be made or the package installed (no network,
            no wheel for this platform, ...); the message gives pip's last error line.
    """
    python = venv / "bin" / "python"
    if _installed(python) == AMPLIFIER_VERSION:
        return python
    say(f"making {venv} (python -m venv; pip install amplifier-core=={AMPLIFIER_VERSION}) ...")
    base = getattr(sys, "_base_executable", None) or sys.executable
    _run([base, "-m", "venv", "--clear", str(venv)], "python -m venv", 120)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, f"amplifier-core=={AMPLIFIER_VERSION}"], "pip install", INSTALL_TIMEOUT_S)
    got = _installed(python)
    if got != AMPLIFIER_VERSION:
        raise Unavailable(f"pip installed amplifier-core {got}, not {AMPLIFIER_VERSION}")
    return python


def amplifier_child(python: Path, data: dict[str, Any]) -> JsonChild:
    """The measuring process (not started): 3 async handlers on amplifier-core's
    `HookRegistry`, emitting `data`."""
    # -E -s: no PYTHONPATH and no user site from the parent (the script's folder stays on
    # sys.path, for `_inprocess`)
    argv = [str(python), "-E", "-s", str(CHILD), "--data", json.dumps(data)]
    return JsonChild("amplifier-core", argv)


def amplifier_sampler(child: JsonChild, shape: str = "result") -> Sampler:
    """``await sample(n)``: n sequential in-process emits timed in the child (seconds), of
    the registry whose handlers return ``HookResult`` (`shape` "result") or None ("none")."""

    async def sample(n: int) -> list[float]:
        if n <= 0:
            return []
        samples = (await child.ask({"n": n, "shape": shape}))["samples"]
        return [float(x) for x in samples]

    return sample
