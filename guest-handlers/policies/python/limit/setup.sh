#!/usr/bin/env bash
# Installs the toolchain for the `limit` Python policy: componentize-py from PyPI, into
# the repository's venv (.venv at the repo root, made here if missing).
#
# componentize-py carries everything else itself (a CPython built for WASI, its
# standard library, the component tooling), so no apt packages are needed.
# Idempotent: when the pinned version is installed it returns at once.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"

# Pinned: the version this policy was built and checked with.
VERSION=0.25.1

pip_setup componentize-py "$VERSION"
