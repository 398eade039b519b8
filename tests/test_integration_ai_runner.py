"""Run `tests/test_integration_ai.py` on a Python >= 3.12 (the ``ai`` package needs it).

On 3.11 that file skips itself, and this test runs it elsewhere; on 3.12 and newer the
suite runs that file itself, and this module skips. This test makes (or reuses) a venv of
a >= 3.12 interpreter, installs hookbus with its ``test`` extra there (which brings
``ai``), runs that file with pytest against this session's nats-server, and requires every
test of it to pass, none skipped.

The interpreter: ``HOOKBUS_PY312`` if set, else what ``tests/python312.sh`` finds or
installs (one already on the machine, else Debian's python3.13 unpacked beside the system;
see the script). When it finds none, this test skips — but fails when ``CI`` is set, so a
machine without one cannot pass unnoticed. The venv: ``HOOKBUS_PY312_VENV``, default
`ai_venv` (a per-checkout folder under the user's cache, outside the work tree); it is
rebuilt when the interpreter or ``pyproject.toml`` changed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _lock import CONSTRAINTS, pip_constraints

from hookbus.cli import EmbeddedNatsServer
from hookbus.demo._agents import ai_venv

if sys.version_info >= (3, 12):
    pytest.skip("this Python runs tests/test_integration_ai.py itself, in the suite",
                allow_module_level=True)  # fmt: skip

ROOT = Path(__file__).resolve().parent.parent
AI_TESTS = ROOT / "tests" / "test_integration_ai.py"
FIND_PYTHON = ROOT / "tests" / "python312.sh"
VENV = Path(os.environ.get("HOOKBUS_PY312_VENV") or ai_venv(ROOT))
INSTALL_TIMEOUT_S = 600
RUN_TIMEOUT_S = 600
FIND_TIMEOUT_S = 600


def _interpreter() -> str:
    given = os.environ.get("HOOKBUS_PY312")
    if given:
        return given
    found = _run(["bash", str(FIND_PYTHON)], FIND_TIMEOUT_S)
    if found.returncode == 0 and found.stdout.strip():
        return found.stdout.strip().splitlines()[-1]
    reason = (
        "no Python >= 3.12 for the ai integration tests: tests/python312.sh found none"
        f" ({found.stderr.strip().splitlines()[-1:]})"
    )
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must have one")
    pytest.skip(reason)


def _run(
    cmd: list[str], timeout: int, *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd, env=env
    )


def _venv(python: str) -> Path:
    """The venv's python, made or reused (see the module docstring)."""
    version = _run([python, "-c", "import sys; print(sys.version_info >= (3, 12))"], 60)
    assert version.stdout.strip() == "True", (
        f"HOOKBUS_PY312={python} is not a working Python >= 3.12: {version.stdout}{version.stderr}"
    )
    stamp = hashlib.sha256(
        b"\0".join([
            os.path.realpath(python).encode(), str(ROOT).encode(),
            (ROOT / "pyproject.toml").read_bytes(), CONSTRAINTS.read_bytes(),
            " ".join(pip_constraints()).encode(),
        ])
    ).hexdigest()  # fmt: skip
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / f".{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = VENV / ".hookbus-stamp"
        venv_python = VENV / "bin" / "python"
        if marker.exists() and marker.read_text() == stamp and venv_python.exists():
            return venv_python
        shutil.rmtree(VENV, ignore_errors=True)
        made = _run([python, "-m", "venv", str(VENV)], 120)
        assert made.returncode == 0, f"venv failed:\n{made.stdout}{made.stderr}"
        installed = _run(
            [
                str(venv_python),
                "-m",
                "pip",
                "install",
                "-q",
                *pip_constraints(),
                "-e",
                f"{ROOT}[test]",
            ],
            INSTALL_TIMEOUT_S,
        )
        assert installed.returncode == 0, f"pip install failed:\n{installed.stderr[-4000:]}"
        marker.write_text(stamp)
        return venv_python


@pytest.mark.timeout(INSTALL_TIMEOUT_S + RUN_TIMEOUT_S + 60)
def test_ai_integration_passes_on_python312() -> None:
    """On a server of its own: every ``ai`` run emits ``tool:pre``, which the handlers other
    test files declare on the session's shared server (some of them with a deny policy and
    their worker gone) would decide too."""
    venv_python = _venv(_interpreter())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("VIRTUAL_ENV", None)
    with EmbeddedNatsServer() as server:
        env["HOOKBUS_TEST_NATS_URL"] = server.url
        result = _run(
            [str(venv_python), "-m", "pytest", str(AI_TESTS), "-q", "-p", "no:cacheprovider"],
            RUN_TIMEOUT_S,
            cwd=ROOT,
            env=env,
        )
    output = result.stdout + result.stderr
    tail = "\n".join(output.splitlines()[-60:])
    assert result.returncode == 0, f"tests/test_integration_ai.py failed on {venv_python}:\n{tail}"
    summary = output.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, f"no test passed:\n{tail}"
    for bad in ("skipped", "failed", "error", "xfail", "deselected"):
        assert bad not in summary, f"{bad} in the ai integration run:\n{tail}"
