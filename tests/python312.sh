#!/usr/bin/env bash
# Print the path of a CPython >= 3.12 on stdout (its real path, symlinks resolved;
# everything else goes to stderr).
#
# hookbus itself runs on 3.11; its adapter for the Vercel AI SDK for Python (the `ai`
# package, Python >= 3.12) is tested on this interpreter. Idempotent: the result is kept
# under $HOOKBUS_PY312_DIR (default /opt/hookbus-py312), so a second run is instant.
#
# Where the interpreter comes from, first that works:
#   1. the cache: $HOOKBUS_PY312_DIR/bin/python3 (a symlink or the unpacked Debian build);
#   2. $HOOKBUS_PY312, if it names a working >= 3.12 interpreter;
#   3. one already on the machine: python3.13 / python3.12 on PATH, or a pyenv version
#      (${PYENV_ROOT:-~/.pyenv}/versions/3.1[2-9]*);
#   4. Debian trixie's python3.13, fetched from Debian's archive with a *private* apt
#      configuration (the system's sources, lists and libc are left alone), unpacked with
#      `dpkg -x` under $HOOKBUS_PY312_DIR/root together with trixie's glibc and libraries,
#      and pointed at them with patchelf (its loader as ELF interpreter, its library
#      directory as DT_RPATH), so it runs beside bookworm's glibc 2.36.
# HOOKBUS_PY312_SOURCE=debian skips 2 and 3 (to test step 4).
#
# Every candidate must import ssl, sqlite3, ctypes, venv and ensurepip. Exit status 1,
# with the reason on stderr, if none is found.
set -euo pipefail

DIR=${HOOKBUS_PY312_DIR:-/opt/hookbus-py312}
SOURCE=${HOOKBUS_PY312_SOURCE:-any}
SUITE=${HOOKBUS_PY312_SUITE:-trixie}
MIRROR=${HOOKBUS_PY312_MIRROR:-http://deb.debian.org/debian}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

log() { echo "python312.sh: $*" >&2; }

works() {
    [ -n "${1:-}" ] && [ -x "$1" ] || return 1
    "$1" - >/dev/null 2>&1 <<'EOF'
import sys
assert sys.version_info >= (3, 12), sys.version
import ctypes, ensurepip, sqlite3, ssl, venv  # noqa: F401
EOF
}

done_with() {  # cache $1 (an interpreter found on the machine) and print it
    mkdir -p "$DIR/bin"
    ln -sfn "$1" "$DIR/bin/python3"
    readlink -f "$DIR/bin/python3"
    exit 0
}

if works "$DIR/bin/python3"; then
    readlink -f "$DIR/bin/python3"
    exit 0
fi

if [ "$SOURCE" != debian ]; then
    if [ -n "${HOOKBUS_PY312:-}" ] && [ "$HOOKBUS_PY312" != "$DIR/bin/python3" ]; then
        if works "$HOOKBUS_PY312"; then done_with "$(readlink -f "$HOOKBUS_PY312")"; fi
        log "HOOKBUS_PY312=$HOOKBUS_PY312 is not a working Python >= 3.12; looking further"
    fi
    for name in python3.13 python3.12; do
        found=$(command -v "$name" 2>/dev/null || true)
        # a pyenv shim answers for a version that is not selected: resolve to a real binary
        if [ -n "$found" ] && works "$found" && ! grep -qs pyenv "$found"; then
            done_with "$(readlink -f "$found")"
        fi
    done
    for found in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]* 2>/dev/null | sort -rV); do
        if works "$found/bin/python3"; then done_with "$found/bin/python3"; fi
    done
    log "no Python >= 3.12 on this machine; fetching Debian $SUITE's python3.13"
fi

# -- step 4: Debian trixie's python3.13 with its own glibc -------------------------------
case "$(dpkg --print-architecture)" in
    amd64) TRIPLET=x86_64-linux-gnu; LOADER=ld-linux-x86-64.so.2 ;;
    arm64) TRIPLET=aarch64-linux-gnu; LOADER=ld-linux-aarch64.so.1 ;;
    *) log "unsupported architecture $(dpkg --print-architecture)"; exit 1 ;;
esac
PACKAGES=(
    python3.13 python3.13-minimal libpython3.13-minimal libpython3.13-stdlib python3.13-venv
    python3-pip-whl python3-setuptools-whl media-types
    libc6 libgcc-s1 libbz2-1.0 libdb5.3t64 libexpat1 libffi8 liblzma5 libncursesw6 libtinfo6
    libreadline8t64 libsqlite3-0 libssl3t64 libuuid1 libzstd1 zlib1g
)

mkdir -p "$(dirname "$DIR")"
exec 9>"$DIR.lock"
flock 9
if works "$DIR/bin/python3"; then  # another run finished it while we waited
    readlink -f "$DIR/bin/python3"
    exit 0
fi

if ! command -v patchelf >/dev/null; then
    log "installing patchelf (Debian package)"
    apt-get install -y -q patchelf >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q patchelf >/dev/null; }
fi

WORK=$(mktemp -d "$DIR.work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial" "$WORK/debs"
echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" >"$WORK/apt/sources.list"
: >"$WORK/apt/status"
APT=(
    -o "Dir::Etc::sourcelist=$WORK/apt/sources.list" -o "Dir::Etc::sourceparts=-"
    -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache=$WORK/apt/cache"
    -o "Dir::State::status=$WORK/apt/status" -o "APT::Sandbox::User=root" -q
)
log "apt-get update ($SUITE, private lists)"
apt-get "${APT[@]}" update >&2
log "downloading ${#PACKAGES[@]} packages"
(cd "$WORK/debs" && apt-get "${APT[@]}" download "${PACKAGES[@]}" >&2)

ROOT="$DIR/root"
STAGE="$WORK/root"
mkdir -p "$STAGE"
for deb in "$WORK"/debs/*.deb; do
    dpkg -x "$deb" "$STAGE"
done
# the paths patched in below are final: unpack in place of any earlier (broken) attempt
rm -rf "$ROOT"
mkdir -p "$DIR"
mv "$STAGE" "$ROOT"
LIBDIR="$ROOT/usr/lib/$TRIPLET"
patchelf --set-interpreter "$LIBDIR/$LOADER" --force-rpath --set-rpath "$LIBDIR" \
    "$ROOT/usr/bin/python3.13"
# ensurepip (so `python -m venv` installs pip) must use trixie's pip wheel, not the host's
for sysconfigdata in "$ROOT"/usr/lib/python3.13/_sysconfigdata__*"$TRIPLET".py; do
    [ -L "$sysconfigdata" ] && continue
    sed -i "s|'WHEEL_PKG_DIR': '/usr/share/python-wheels/\\?'|'WHEEL_PKG_DIR': '$ROOT/usr/share/python-wheels'|" \
        "$sysconfigdata"
    grep -q "'WHEEL_PKG_DIR': '$ROOT/" "$sysconfigdata" \
        || { log "could not point WHEEL_PKG_DIR at $ROOT in $sysconfigdata"; exit 1; }
done
mkdir -p "$DIR/bin"
ln -sfn "$ROOT/usr/bin/python3.13" "$DIR/bin/python3"
if ! works "$DIR/bin/python3"; then
    log "the unpacked python3.13 does not run:"
    "$DIR/bin/python3" -c 'import ctypes, ensurepip, sqlite3, ssl, venv' >&2 || true
    rm -f "$DIR/bin/python3"
    exit 1
fi
readlink -f "$DIR/bin/python3"
