"""Debian packages the tests need (chromium, nodejs and npm, kubectl), installed with apt-get
when missing: CI runs on a clean machine where nothing was installed by hand, and a test that
needs one must not skip for want of it."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

__all__ = ["apt_install"]

# waits (up to 10 minutes) for another apt-get or dpkg holding the lock, instead of failing
APT_GET = ("apt-get", "-o", "DPkg::Lock::Timeout=600")


def apt_install(*packages: str, binary: str) -> str:
    """The path of `binary`, after ``apt-get install`` of `packages` if it is missing.

    Fails the test (never skips) when it cannot be installed here.
    """
    found = shutil.which(binary)
    if found:
        return found
    wanted = " ".join(packages)
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.fail(f"{binary} is missing and cannot be installed here: apt-get install {wanted}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = [*APT_GET, "install", "-y", "-q", "--no-install-recommends", *packages]
    done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # a clean machine has no package lists yet
        subprocess.run([*APT_GET, "update", "-q"], env=env, capture_output=True, check=False)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
    found = shutil.which(binary)
    if done.returncode != 0 or not found:
        pytest.fail(f"apt-get install {wanted} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return found
