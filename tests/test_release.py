"""The release: the sdist and the wheel as they are uploaded to a package index.

Both are built by ``python -m build`` (the sdist, then the wheel built from the sdist, each
in an isolated environment with pyproject.toml's build requirements), the README's release
steps. Then:

- ``twine check --strict`` passes on both (the long description renders on the index);
- the MIT ``LICENSE`` is in both, and the metadata says ``License-Expression: MIT``;
- every package folder the wheel takes (pyproject.toml's sources) is in the sdist, and the
  wheel built from it carries each folder's package;
- the long description is README.md with every relative link (``docs/install.md``) made
  absolute under the repository's URL, each to a file that exists here;
- the project URLs are pyproject.toml's, all under one base URL, and the classifiers name
  the supported Pythons;
- one version: the built metadata's, ``hookbus --version``'s and pyproject.toml's agree.

The module starts processes (tests/conftest.py marks it ``processes``).
"""

from __future__ import annotations

import email
import re
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 240

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
VERSION = PROJECT["version"]
BASE_URL = PROJECT["urls"]["Repository"]
"""The repository's URL: every URL of the metadata is under it."""

_LINK = re.compile(r"\]\(([^)\s]+)\)")
"""An inline link's or image's target: ``[text](target)``, ``![alt](target)``."""
_OTHER_LINKS = re.compile(
    r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)"  # a reference definition: [name]: target
    r"|\b(?:href|src)\s*=\s*[\"']([^\"']+)",  # inline HTML
    re.M,
)
_ABSOLUTE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*:|#)")


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path

    def metadata(self) -> dict[str, Message]:
        """The wheel's METADATA and the sdist's PKG-INFO, parsed."""
        with zipfile.ZipFile(self.wheel) as zf:
            wheel = zf.read(f"hookbus-{VERSION}.dist-info/METADATA")
        with tarfile.open(self.sdist) as tf:
            member = tf.extractfile(f"hookbus-{VERSION}/PKG-INFO")
            assert member is not None
            sdist = member.read()
        return {
            "wheel": email.message_from_string(wheel.decode("utf-8")),
            "sdist": email.message_from_string(sdist.decode("utf-8")),
        }


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    out = tmp_path_factory.mktemp("release")
    started = time.monotonic()
    built = _run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], timeout=BUILD_TIMEOUT_S
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (sdist,) = out.glob("hookbus-*.tar.gz")
    (wheel,) = out.glob("hookbus-*.whl")
    print(f"\nsdist and wheel built in {time.monotonic() - started:.1f} s")
    return Dists(sdist, wheel)


@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_twine_check_strict_passes_on_both(dists: Dists) -> None:
    checked = _run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dists.sdist), str(dists.wheel)]
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2, checked.stdout


@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_the_license_is_in_both(dists: Dists) -> None:
    license_text = (ROOT / "LICENSE").read_bytes()
    assert b"MIT License" in license_text and b"The hookbus authors" in license_text
    with zipfile.ZipFile(dists.wheel) as zf:
        assert zf.read(f"hookbus-{VERSION}.dist-info/licenses/LICENSE") == license_text
    with tarfile.open(dists.sdist) as tf:
        names = set(tf.getnames())
        member = tf.extractfile(f"hookbus-{VERSION}/LICENSE")
        assert member is not None and member.read() == license_text
    for name in ("README.md", "CHANGELOG.md", "pyproject.toml"):
        assert f"hookbus-{VERSION}/{name}" in names, name
    assert not any("/.hypothesis/" in n or "/.venv/" in n for n in names)
    for where, meta in dists.metadata().items():
        assert meta["License-Expression"] == "MIT", where
        assert meta.get_all("License-File") == ["LICENSE"], where
        assert not [c for c in meta.get_all("Classifier", []) if c.startswith("License ::")]


@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_every_package_folder_is_in_both(dists: Dists) -> None:
    """The sdist keeps each package folder (``<folder>/hookbus/<package>``), and the wheel
    built from it has each package at ``hookbus/<package>``."""
    hatch = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["hatch"]
    folders = [f for f in hatch["build"]["targets"]["wheel"]["sources"] if f != "examples"]
    assert len(folders) == 9, folders
    with tarfile.open(dists.sdist) as tf:
        in_sdist = set(tf.getnames())
    with zipfile.ZipFile(dists.wheel) as zf:
        in_wheel = set(zf.namelist())
    for folder in folders:
        (package,) = [
            p.name for p in (ROOT / folder / "hookbus").iterdir() if p.name != "__pycache__"
        ]
        assert f"hookbus-{VERSION}/{folder}/hookbus/{package}/__init__.py" in in_sdist, folder
        assert f"hookbus/{package}/__init__.py" in in_wheel, folder


@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_the_long_description_has_no_relative_link(dists: Dists) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    relative = sorted({t for t in _LINK.findall(readme) if not _ABSOLUTE.match(t)})
    assert relative, "README.md has relative links: the substitution is what is tested"
    for where, meta in dists.metadata().items():
        assert meta["Description-Content-Type"] == "text/markdown", where
        description = meta.get_payload()
        assert isinstance(description, str)
        left = [t for t in _LINK.findall(description) if not _ABSOLUTE.match(t)]
        assert left == [], f"{where}: relative links left: {left}"
        for target in relative:
            assert f"]({BASE_URL}/blob/main/{target})" in description, (where, target)
            assert (ROOT / target.split("#")[0]).exists(), f"README.md links to {target}"
        # the substitution turns inline links only: a README with another kind of link
        # (a reference definition, an HTML tag) needs one more substitution
        other = [a or b for a, b in _OTHER_LINKS.findall(description)]
        assert not [t for t in other if not _ABSOLUTE.match(t)], f"{where}: {other}"
        # the rest of the README is as written: only the link targets changed
        assert _LINK.sub("]()", description).strip() == _LINK.sub("]()", readme).strip()


@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_the_urls_and_classifiers(dists: Dists) -> None:
    expected_urls = {f"{name}, {url}" for name, url in PROJECT["urls"].items()}
    assert {"Homepage", "Repository", "Documentation", "Changelog", "Issues"} <= set(
        PROJECT["urls"]
    )
    for where, meta in dists.metadata().items():
        urls = meta.get_all("Project-URL", [])
        assert set(urls) == expected_urls, where
        description = meta.get_payload()
        assert isinstance(description, str)
        github = re.findall(r"https://github\.com/[^\s)\"'>]+", description)
        github += [u.split(", ", 1)[1] for u in urls]
        outside = [u for u in github if not (u == BASE_URL or u.startswith(BASE_URL + "/"))]
        assert outside == [], f"{where}: URLs not under the one base {BASE_URL}: {outside}"
        classifiers = set(meta.get_all("Classifier", []))
        for wanted in (
            "Development Status :: 3 - Alpha",
            "Framework :: AsyncIO",
            "Programming Language :: Python :: 3.11",
            "Programming Language :: Python :: 3.12",
            "Programming Language :: Python :: 3.13",
        ):
            assert wanted in classifiers, (where, wanted)
        assert meta["Author"] == "The hookbus authors", where
        assert meta["Requires-Python"] == ">=3.11", where
        assert meta["Keywords"], where


# -- one version ----------------------------------------------------------------------------
@pytest.mark.timeout(BUILD_TIMEOUT_S)
def test_the_built_version_is_pyprojects(dists: Dists) -> None:
    assert dists.sdist.name == f"hookbus-{VERSION}.tar.gz"
    assert dists.wheel.name == f"hookbus-{VERSION}-py3-none-any.whl"
    for where, meta in dists.metadata().items():
        assert meta["Version"] == VERSION, where


@pytest.mark.parametrize(
    "argv",
    [
        [str(Path(sys.executable).parent / "hookbus"), "--version"],
        [sys.executable, "-m", "hookbus.cli", "--version"],
    ],
    ids=["hookbus", "python -m hookbus.cli"],
)
def test_hookbus_version_prints_pyprojects_version(argv: list[str]) -> None:
    """pyproject.toml's ``version`` is the one place: the command reads it from the installed
    distribution's metadata (``importlib.metadata.version("hookbus")``). An editable install
    keeps the metadata of its install: after a bump, ``pip install -e .`` again."""
    done = _run(argv)
    assert (done.returncode, done.stderr) == (0, ""), done
    assert done.stdout == f"hookbus, version {VERSION}\n", (
        f"{done.stdout!r}: not pyproject.toml's {VERSION} (reinstall after a version bump)"
    )
