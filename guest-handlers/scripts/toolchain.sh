# What the setup.sh and build.sh of allocbox's policies in other languages have in common,
# sourced by each after `set -euo pipefail`:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"
#
# It finds the policy's folder and the repository from the sourcing script's own path, so
# a script runs the same from any working directory. It sets
#   HERE     the policy's folder (policies/<language>/<name>)
#   ROOT     the repository, whose .venv holds the toolchains pip installs
#   VENV PY  that venv and its python
#   SCRIPTS  this folder (stamp_language.py)
# and defines the functions below. The pins stay in each policy's setup.sh (`VERSION=`
# lines, which build.sh reads with `pin` and the host's tests compare with the
# templates'). The templates under templates/ do not use this: the project `allocbox new`
# writes from one has no repository around it.

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$SCRIPTS/../.." && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

# pin VAR: the value of `VAR=` in this policy's setup.sh, so build.sh looks for exactly
# the version setup.sh installs.
pin() {
    local value
    value=$(sed -n "s/^$1=//p" "$HERE/setup.sh")
    value=${value#\"}
    echo "${value%\"}"
}

# missing TOOL: the one line the artifacts build script shows for a missing toolchain,
# naming the setup.sh that installs it, and exit 3, which tells it that this is the cause.
missing() {
    echo "missing $1: run guest-handlers/${HERE#"$ROOT/guest-handlers/"}/setup.sh" >&2
    exit 3
}

# pip_has DIST VERSION: whether the venv holds DIST==VERSION. Reads pip's record of the
# install rather than starting the tool (componentize-py loads a 46 MB extension).
pip_has() {
    compgen -G "$VENV/lib/python3*/site-packages/${1//-/_}-$2.dist-info" >/dev/null
}

# pip_setup DIST VERSION: install DIST==VERSION from PyPI into the venv (made here if
# missing); returns at once when it is there.
pip_setup() {
    pip_has "$1" "$2" && return 0
    [ -x "$PY" ] || python3 -m venv "$VENV"
    "$PY" -m pip install --quiet --disable-pip-version-check "$1==$2"
    echo "$(basename "$HERE"): installed $1 $2 into $VENV" >&2
}

# pip_require DIST VERSION: exit 3 (see `missing`) unless the venv holds DIST==VERSION.
pip_require() {
    pip_has "$1" "$2" || missing "$1 $2"
}

# apt_install PACKAGE...: Debian packages, with sudo when not root. The package lists may
# be missing (a fresh container) or stale (an old image): refreshed only when the first
# try fails.
apt_install() {
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    local install=($sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq
        --no-install-recommends "$@")
    "${install[@]}" >/dev/null 2>&1 || { $sudo apt-get update -qq && "${install[@]}" >/dev/null; }
}

# npm_setup PACKAGE VERSION SENTINEL: Node.js >= 20 (Debian's package, only when there is
# no node at all) and this policy's package-lock.json installed with `npm ci` into its
# node_modules, skipped when that is what is there already. PACKAGE@VERSION is the pinned
# tool, checked in node_modules; SENTINEL is a file under node_modules that an
# interrupted install would lack.
npm_setup() {
    local package=$1 version=$2 sentinel=$3
    if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
        echo "setup: installing nodejs and npm (Debian packages)" >&2
        apt_install nodejs npm
    fi
    # Debian 12's own nodejs is 18: use a newer one (e.g. NodeSource's package), then run
    # this again.
    local major
    major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
    if [ "$major" -lt 20 ]; then
        echo "setup: node $(node --version) is too old: $package $version needs Node.js >= 20" >&2
        exit 1
    fi
    local lock="$HERE/node_modules/.package-lock.json"
    if [ -f "$lock" ] && [ "$lock" -nt "$HERE/package-lock.json" ] &&
        grep -q "\"version\": \"$version\"" "$HERE/node_modules/$package/package.json" 2>/dev/null &&
        [ -f "$HERE/node_modules/$sentinel" ]; then
        return 0
    fi
    echo "setup: npm ci in $HERE" >&2
    (cd "$HERE" && npm ci --no-audit --no-fund --loglevel=error)
}

# out_path "$@": the one argument of build.sh, OUT, made absolute (a build may run in
# another directory); exit 2 with the usage otherwise.
out_path() {
    if [ $# -ne 1 ]; then
        echo "usage: $0 OUT.wasm" >&2
        exit 2
    fi
    case "$1" in
        /*) echo "$1" ;;
        *) echo "$PWD/$1" ;;
    esac
}

# stamp_language FILE LANGUAGE: `allocbox inspect` shows the language, which most
# toolchains do not record themselves.
stamp_language() {
    python3 "$SCRIPTS/stamp_language.py" "$1" "$2"
}

# deliver FILE OUT: move a finished FILE to OUT, so OUT is never half written.
deliver() {
    mkdir -p "$(dirname "$2")"
    mv -f "$1" "$2"
}
