#!/usr/bin/env bash
# Installs the toolchain of the JavaScript `tracker` policy: Node.js >= 20 and the
# pinned npm packages of package-lock.json (@bytecodealliance/componentize-js 0.23.0,
# which brings the SpiderMonkey engine built for WebAssembly, Wizer and jco) into this
# folder's node_modules. Idempotent, and quick when everything is there already.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../../scripts/toolchain.sh"

CJS_VERSION="0.23.0"

npm_setup @bytecodealliance/componentize-js "$CJS_VERSION" \
  @bytecodealliance/componentize-js/lib/starlingmonkey_embedding.wasm
