"""amplifier-core's in-process emit, measured in a process of its own.

Run by `_amplifier.py` with the python of a venv holding amplifier-core (never hookbus's
venv): ``python benchmarks/_amplifier_emit.py --data JSON``. It registers 3 async handlers
on each of two amplifier-core `HookRegistry` objects (`_inprocess.register_three`): one whose
handlers return ``HookResult(action="continue")``, one whose handlers return None (the
cheaper shape amplifier-core accepts). It speaks one JSON object per line: first
``{"ready": true, "version": ...}`` on stdout, then for each ``{"n": N, "shape": "result" |
"none"}`` read on stdin, ``{"samples": [...]}`` (N emits of that registry, seconds each).
It ends at end of input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from importlib.metadata import version

from _inprocess import register_three, sample_emits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="the event data, JSON")
    data = json.loads(parser.parse_args().data)
    from amplifier_core.hooks import HookRegistry, HookResult  # type: ignore[import-not-found]

    registries = {
        "result": register_three(HookRegistry(), lambda: HookResult(action="continue")),
        "none": register_three(HookRegistry(), lambda: None),
    }
    loop = asyncio.new_event_loop()

    def say(message: dict[str, object]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    say({"ready": True, "version": version("amplifier-core")})
    for line in sys.stdin:
        try:
            ask = json.loads(line)
            registry = registries[ask.get("shape", "result")]
            say({"samples": loop.run_until_complete(sample_emits(registry, data, int(ask["n"])))})
        except Exception as exc:  # reported to the parent, which stops the run
            say({"error": f"{type(exc).__name__}: {exc}"})
    # amplifier-core 2.0.2's engine aborts in interpreter finalisation (PyGILState_Release
    # from its runtime's thread): leave without finalising, everything said is flushed
    os._exit(0)


if __name__ == "__main__":
    main()
