"""deploy/ configs are validated offline by the real nats-server (`-t`), no Docker needed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hookbus.cli import find_nats_server

CONFIGS = sorted((Path(__file__).parents[1] / "deploy" / "nats").glob("*.conf"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"hookbus.conf", "cluster-node1.conf"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_nats_config_is_valid(config: Path) -> None:
    out = subprocess.run(
        [find_nats_server(), "-c", str(config), "-t"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr + out.stdout
    assert "is valid" in out.stderr + out.stdout


def test_a_broken_config_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.conf"
    bad.write_text("jetstream { store_dir: \n")
    out = subprocess.run(
        [find_nats_server(), "-c", str(bad), "-t"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode != 0
