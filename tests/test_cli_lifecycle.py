"""How the CLI runs a command's event loop (`hookbus.cli._lifecycle.run_loop`): a serving
command's start is frozen out of the garbage collector's reach; another command's is not."""

from __future__ import annotations

import gc

import pytest

from hookbus.cli._lifecycle import run_async, run_loop


@pytest.fixture
def unfrozen() -> object:
    """The test process as it was: nothing frozen before, everything unfrozen after."""
    gc.unfreeze()
    yield
    gc.unfreeze()


async def _frozen_count() -> int:
    return gc.get_freeze_count()


def _tracked(obj: object) -> bool:
    """Whether `obj` is in one of the collector's generations (not frozen)."""
    return any(o is obj for o in gc.get_objects())


def test_a_serving_command_serves_with_its_start_frozen(unfrozen: object) -> None:
    started = type("Started", (), {})()  # made before the loop: a container the collector tracks
    assert _tracked(started)
    assert run_loop(_frozen_count, serving=True) > 0
    assert not _tracked(started)  # frozen: no collection walks it again
    assert run_async(_frozen_count(), serving=True) > 0


def test_another_command_leaves_the_collector_as_it_was(unfrozen: object) -> None:
    assert run_loop(_frozen_count) == 0
    assert run_async(_frozen_count()) == 0
