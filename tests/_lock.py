"""The lock the suite is proven with, for the tests that build venvs of their own.

``constraints.txt`` (the repository's root) pins every package the ``test`` extra brings, on
every supported Python; the README's test command installs from it, and so do the venvs the
tests make (the wheel's clean installs, the Python >= 3.12 venv of the ``ai`` tests), so that
an upstream release never changes what the suite runs by surprise. ``HOOKBUS_TEST_UNLOCKED=1``
(set by ``.ci/newest``) leaves it out: the newest releases the extras' ranges admit.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CONSTRAINTS", "pip_constraints"]

CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"


def pip_constraints() -> list[str]:
    """pip's arguments that install from the lock (``["-c", path]``), or none when unlocked."""
    if os.environ.get("HOOKBUS_TEST_UNLOCKED") == "1":
        return []
    return ["-c", str(CONSTRAINTS)]
