"""npm packages for the tests that run Node.js, installed outside the work tree.

`node_packages(manifest, name)` installs the dependencies of a ``package.json`` with
``npm install --prefix`` into ``~/.cache/hookbus/<name>-<hash of the manifest>/``
(``XDG_CACHE_HOME`` respected), once per manifest version; a file lock keeps concurrent
test sessions apart. ``node`` and ``npm`` are Debian's, installed with apt-get when missing
(`_debian.apt_install`): these checks never skip for want of them.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
from pathlib import Path

from _debian import apt_install

__all__ = ["node_packages"]


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hookbus"


def node_packages(manifest: Path, name: str) -> Path:
    """The ``node_modules`` folder with `manifest`'s dependencies installed (see the module
    docstring). Fails the test if ``npm install`` fails (its output in the message)."""
    apt_install("nodejs", binary="node")
    npm = apt_install("npm", binary="npm")
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
