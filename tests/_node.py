"""npm packages for the tests that run Node.js, installed outside the work tree.

`node_packages(manifest, name)` installs the dependencies of a ``package.json`` with
``npm install --prefix`` into ``~/.cache/hookbus/<name>-<hash of the manifest>/``
(``XDG_CACHE_HOME`` respected), once per manifest version; a file lock keeps concurrent
test sessions apart. Without ``node`` or ``npm`` the calling test is skipped with the
reason, or failed when ``CI`` is set (CI must run these checks).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["node_packages"]


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hookbus"


def node_packages(manifest: Path, name: str) -> Path:
    """The ``node_modules`` folder with `manifest`'s dependencies installed (see the module
    docstring). Fails the test if ``npm install`` fails (its output in the message)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        reason = f"node and npm are needed for these checks ({manifest.parent.name}/package.json)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}, and CI is set")
        pytest.skip(reason)
    content = manifest.read_bytes()
    prefix = _cache_root() / f"{name}-{hashlib.sha256(content).hexdigest()[:12]}"
    prefix.mkdir(parents=True, exist_ok=True)
    done = prefix / ".installed"
    with open(prefix / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            (prefix / "package.json").write_bytes(content)
            proc = subprocess.run(
                [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                 "--loglevel=error"],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert proc.returncode == 0, f"npm install failed:\n{proc.stdout}\n{proc.stderr}"
            done.write_text("ok\n")
    return prefix / "node_modules"
