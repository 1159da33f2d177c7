#!/usr/bin/env bash
# Installs the toolchain of the AssemblyScript `slab` policy: Node.js >= 20 and the
# pinned npm packages of package-lock.json (assemblyscript 0.28.20, which brings
# binaryen.js) into this folder's node_modules. Idempotent, and quick when everything
# is there already.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"

ASC_VERSION="0.28.20"

npm_setup assemblyscript "$ASC_VERSION" binaryen/index.js
