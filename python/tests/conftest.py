import pathlib
import subprocess
import sys
import textwrap

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


def allocbox_run(tmp_path, *args, program=None, name="program.py"):
    """Run `python -m allocbox run ARGS` in `tmp_path`, with `program` written to
    `name` there first."""
    if program is not None:
        (tmp_path / name).write_text(textwrap.dedent(program))
    return subprocess.run(
        [sys.executable, "-m", "allocbox", "run", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )


def trace_text(path):
    """A recorded trace (the binary form) as text, by `allocbox trace-convert`: the
    lines a person reads (written to a folder of its own, not beside the trace, where
    tests count the traces)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        text = pathlib.Path(folder) / "trace.txt"
        done = subprocess.run(
            [sys.executable, "-m", "allocbox", "trace-convert", str(path), str(text), "--to", "text"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        return text.read_text()
