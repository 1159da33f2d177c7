"""Build the allocbox wheel with the shipped policies inside.

    .venv/bin/python python/build_wheel.py      # prints target/wheels/allocbox-*.whl

`--profile dev` builds the host unoptimised, its dependencies as the test suite's
(`[profile.dev.package."*"]`), sharing their build: what CI tests, where a release build
of wasmtime would cost ten minutes more. A user's wheel is the default, release.

The guest crates that say `[package.metadata.allocbox] ship = true` in their Cargo.toml
are built for wasm32-wasip2 (Rust alone: no other language's toolchain) and copied into
the package as `allocbox/policies/<name>.wasm`, with `index.json` mapping each name to
its crate's `description`. The wheel is then built by maturin, in release mode.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUESTS = ROOT / "guest-handlers"
BUILT = ROOT / "target" / "guests" / "wasm32-wasip2" / "release"
STAGE = ROOT / "python" / "allocbox" / "policies"
WHEELS = ROOT / "target" / "wheels"


def run(*command, **kwargs):
    print("+", " ".join(str(c) for c in command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, **kwargs)


def shipped_guests():
    """(policy name, crate name, description) of each guest crate marked for shipping."""
    metadata = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=GUESTS,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for package in json.loads(metadata)["packages"]:
        allocbox = (package.get("metadata") or {}).get("allocbox") or {}
        if allocbox.get("ship"):
            if not package.get("description"):
                sys.exit(f"{package['name']} is shipped but its Cargo.toml has no description")
            policy = package["name"].removeprefix("policy-")
            yield policy, package["name"], package["description"]


def stage_policies():
    # Only the shipped guests, all Rust: the wheel needs no other language's toolchain
    # (the test artifacts' build, which builds every guest, is not this one's business).
    shipped = list(shipped_guests())
    packages = [arg for _, crate, _ in shipped for arg in ("-p", crate)]
    host_only = ("RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS", "CARGO_BUILD_RUSTFLAGS", "CARGO_TARGET_DIR", "CARGO_BUILD_TARGET")
    env = {k: v for k, v in os.environ.items() if k not in host_only}
    target = ROOT / "target" / "guests"
    run("cargo", "build", "--quiet", "--release", "--target", "wasm32-wasip2", "--target-dir", target, *packages, cwd=GUESTS, env=env)
    if STAGE.exists():
        shutil.rmtree(STAGE)
    STAGE.mkdir(parents=True)
    index = {}
    for policy, crate, description in shipped:
        component = BUILT / f"{crate.replace('-', '_')}.wasm"
        if not component.exists():
            sys.exit(f"{component} was not built: see the cargo build above")
        shutil.copyfile(component, STAGE / f"{policy}.wasm")
        index[policy] = description
    if not index:
        sys.exit("no guest crate is marked `[package.metadata.allocbox] ship = true`")
    (STAGE / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return index


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=("release", "dev"), default="release",
                        help="the host's cargo profile (default: release)")
    profile = parser.parse_args().profile
    index = stage_policies()
    print(f"shipping {', '.join(sorted(index))}", file=sys.stderr)
    WHEELS.mkdir(parents=True, exist_ok=True)
    for old in WHEELS.glob("allocbox-*.whl"):
        old.unlink()
    maturin = pathlib.Path(sys.executable).parent / "maturin"
    env = dict(os.environ, VIRTUAL_ENV=str(pathlib.Path(sys.executable).parents[1]))
    run(maturin, "build", "--profile", profile, "--quiet", "--out", WHEELS, cwd=ROOT / "python", env=env)
    (wheel,) = WHEELS.glob("allocbox-*.whl")
    print(wheel)


if __name__ == "__main__":
    main()
