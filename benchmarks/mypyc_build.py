"""Compile the emit path's modules with mypyc, in place, for an A/B against the pure code.

    .venv/bin/pip install mypy==2.4.1 setuptools     # not a dependency of hookbus
    .venv/bin/python benchmarks/mypyc_build.py build              # the default modules
    .venv/bin/python benchmarks/mypyc_build.py build hookbus.dispatcher._fold ...
    .venv/bin/python benchmarks/mypyc_build.py list               # the .so files in place
    .venv/bin/python benchmarks/mypyc_build.py clean              # remove them: pure again

`build` runs `mypyc.build.mypycify` on the named modules as one compilation group (calls
between them are native), in a temporary directory, then copies each extension beside its
``.py`` in this checkout's package folders, where it shadows the ``.py`` on import; the
group's shared library (``<hash>__mypyc.*.so``, a top-level module) goes into ``core/``,
which the editable install puts on ``sys.path``. mypy type-checks the modules first (its
strict settings from pyproject.toml) and the build stops at the first error it reports.
`clean` removes every extension this script placed (it lists them in ``.mypyc-built``).

An experiment's tool, not a build of a wheel: docs/performance.md ("mypyc, measured") has
what compiled, what did not, and the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("core", "schemas", "dispatcher", "workers")
"""The package folders (namespace portions of ``hookbus``) a module may live in."""
MANIFEST = ROOT / ".mypyc-built"

HOT = (
    # the agent's emit path
    "hookbus.dispatcher._emitter",
    "hookbus.dispatcher._folding",
    "hookbus.dispatcher._fold",
    "hookbus.dispatcher._call_router",
    "hookbus.dispatcher._outcomes",
    "hookbus.dispatcher._requester",
    "hookbus.dispatcher._reply_inbox",
    "hookbus.schemas.event_data",
    "hookbus.schemas._codec",
    # the worker's serving loop
    "hookbus._core.serving",
    "hookbus.workers._handler_call",
    "hookbus.workers._replies",
)
"""The modules `build` compiles when none are named: those that load and run compiled.
Also on the path, and left out because their compiled build breaks (docs/performance.md):
``dispatcher._dispatcher``, ``dispatcher._calls`` (a segfault), ``_core.results``,
``schemas._types`` and ``workers._requests`` (both fail at import)."""


def source_of(module: str) -> Path:
    """The ``.py`` file of a dotted module name in this checkout; `SystemExit` if none."""
    rel = Path(*module.split(".")).with_suffix(".py")
    for folder in FOLDERS:
        path = ROOT / folder / rel
        if path.is_file():
            return path
    raise SystemExit(f"no {rel} in {', '.join(FOLDERS)}")


def build(modules: list[str]) -> list[Path]:
    """Compile `modules` as one group and place the extensions; returns the files placed."""
    from mypyc.build import mypycify  # the build needs mypy; the import stays here
    from setuptools import setup

    sources = [str(source_of(m).relative_to(ROOT)) for m in modules]
    os.environ["MYPYPATH"] = os.pathsep.join(FOLDERS)
    placed: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="mypyc-") as tmp:
        os.chdir(ROOT)  # mypy reads pyproject.toml and resolves the sources from here
        extensions = mypycify(
            ["--explicit-package-bases", *sources],
            opt_level="3",
            target_dir=str(Path(tmp) / "c"),
        )
        os.chdir(tmp)  # setuptools must not read hookbus's own pyproject.toml
        setup(
            name="hookbus-mypyc",
            ext_modules=extensions,
            script_args=[
                "-q",
                "build_ext",
                "--build-lib",
                str(Path(tmp) / "lib"),
                "--build-temp",
                str(Path(tmp) / "obj"),
            ],
        )
        for ext in extensions:
            built = next((Path(tmp) / "lib").glob(ext.name.replace(".", "/") + ".*.so"))
            if "." in ext.name:
                target = source_of(ext.name).with_name(built.name)
            else:
                target = ROOT / FOLDERS[0] / built.name
            shutil.copy2(built, target)
            placed.append(target)
    MANIFEST.write_text("".join(f"{p.relative_to(ROOT)}\n" for p in placed))
    return placed


def built() -> list[Path]:
    """The extensions the last `build` placed (from the manifest) that are still there."""
    if not MANIFEST.is_file():
        return []
    return [ROOT / line for line in MANIFEST.read_text().split() if (ROOT / line).is_file()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("build", "list", "clean"))
    parser.add_argument("modules", nargs="*", help=f"dotted names (default: {len(HOT)} hot ones)")
    args = parser.parse_args()
    if args.command == "build":
        for path in build(args.modules or list(HOT)):
            print(path.relative_to(ROOT))
    elif args.command == "list":
        for path in built():
            print(path.relative_to(ROOT))
    else:
        for path in built():
            path.unlink()
        MANIFEST.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
