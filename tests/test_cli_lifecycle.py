"""How the CLI runs a command's event loop (`hookbus.cli._lifecycle.run_loop`): a serving
command's start is frozen out of the garbage collector's reach and its young generation
collected less often; another command's collector is left as it was."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from hookbus.cli._lifecycle import SERVING_GC_THRESHOLDS, run_async, run_loop


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The test process as it was: nothing frozen before, everything unfrozen and the
    collector's thresholds back after."""
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


async def _frozen_count() -> int:
    return gc.get_freeze_count()


def _tracked(obj: object) -> bool:
    """Whether `obj` is in one of the collector's generations (not frozen)."""
    return any(o is obj for o in gc.get_objects())


@pytest.mark.parametrize("runner", ["run_loop", "run_async"])
def test_a_serving_command_serves_with_its_start_frozen(unfrozen: None, runner: str) -> None:
    started = type("Started", (), {})()  # made before the loop: a container the collector tracks
    assert _tracked(started)
    assert gc.get_threshold() != SERVING_GC_THRESHOLDS
    if runner == "run_loop":
        frozen = run_loop(_frozen_count, serving=True)
    else:
        frozen = run_async(_frozen_count(), serving=True)
    assert frozen > 0
    assert not _tracked(started)  # frozen: no collection walks it again
    assert gc.get_threshold() == SERVING_GC_THRESHOLDS


def test_a_higher_threshold_an_operator_set_is_kept(unfrozen: None) -> None:
    gc.set_threshold(100_000, 5, 5)
    run_loop(_frozen_count, serving=True)
    assert gc.get_threshold() == (100_000, 5, 5)


def test_another_command_leaves_the_collector_as_it_was(unfrozen: None) -> None:
    thresholds = gc.get_threshold()
    assert run_loop(_frozen_count) == 0
    assert run_async(_frozen_count()) == 0
    assert gc.get_threshold() == thresholds
