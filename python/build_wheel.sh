#!/usr/bin/env bash
# The wheel with only what it needs: the Rust toolchain rust-toolchain.toml pins, with
# the wasm32-wasip2 target (rustup), and maturin (PyPI) in a venv of its own. No other
# language's toolchain, no browser, no test dependency:
#
#     python/build_wheel.sh      # prints target/wheels/allocbox-….whl
#
# `.ci/setup && .venv/bin/python python/build_wheel.py` builds the same wheel on a
# machine set up for the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

channel=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)
if ! rustup toolchain list | grep -q "^$channel-"; then
    rustup toolchain install "$channel" --profile minimal --no-self-update --target wasm32-wasip2
fi
rustup target list --installed --toolchain "$channel" | grep -qx wasm32-wasip2 ||
    rustup target add wasm32-wasip2 --toolchain "$channel"

venv=target/wheel-build-venv
if [ ! -x "$venv/bin/maturin" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "$(grep '^maturin==' python/requirements-dev.txt)"
fi
"$venv/bin/python" python/build_wheel.py
