import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GUESTS = ROOT / "target" / "guests" / "wasm32-wasip2" / "release"


def guest(name):
    path = GUESTS / f"policy_{name.replace('-', '_')}.wasm"
    if not path.exists():
        pytest.fail(f"{path} is missing: build the guests first (`cargo test` or `cargo build -p allocbox-artifacts`)")
    return path


@pytest.fixture
def guest_path():
    return guest
