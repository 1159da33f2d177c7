"""The pytest plugin as its users meet it: a run under a policy, a bad policy or
configuration refused in one line, and a run that stops once its policy is stopped."""

import os
import subprocess
import sys

import pytest

from conftest import guest

TESTS = """
import numpy as np

def test_arrays(n=0):
    for size in range(1, 40):
        assert np.ones(size * 8).sum() == size * 8
"""


def _pytest(tmp_path, policy, config=None, tests=40, grant=None, options=()):
    (tmp_path / "test_many.py").write_text(
        TESTS + "".join(f"\n\ndef test_{i}():\n    test_arrays()\n" for i in range(tests))
    )
    env = dict(os.environ)
    for variable in ("ALLOCBOX_POLICY", "ALLOCBOX_CONFIG", "ALLOCBOX_GRANT"):
        env.pop(variable, None)
    if policy is not None:
        env["ALLOCBOX_POLICY"] = str(policy)
    if config is not None:
        env["ALLOCBOX_CONFIG"] = config
    if grant is not None:
        env["ALLOCBOX_GRANT"] = grant
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "allocbox.pytest_plugin", "-p", "no:cacheprovider", *options, "test_many.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.returncode, done.stdout + done.stderr


def test_a_run_under_a_shipped_policy_passes_and_reports_its_counters(tmp_path):
    code, out = _pytest(tmp_path, "size-classes", "bucket-depth=7")
    assert code == 0, out
    assert "NumPy's handler is `size-classes`" in out
    assert "41 passed" in out, out
    assert "allocbox: size-classes: " in out and " malloc, " in out, out


def test_a_misspelt_policy_is_one_line_of_usage_error(tmp_path):
    code, out = _pytest(tmp_path, "size-clases")
    assert code == 4, out
    assert "INTERNALERROR" not in out, out
    assert "ALLOCBOX_POLICY=size-clases: no shipped policy or file named 'size-clases'" in out, out


def test_a_config_that_is_not_key_value_is_a_usage_error(tmp_path):
    code, out = _pytest(tmp_path, "size-classes", "depth")
    assert code == 4, out
    assert "ALLOCBOX_CONFIG item 'depth' is not key=value" in out, out
    assert "dictionary update sequence" not in out


def test_a_config_the_policy_refuses_is_a_usage_error_naming_the_policy(tmp_path):
    code, out = _pytest(tmp_path, "size-classes", "bukket-depth=7")
    assert code == 4, out
    assert "INTERNALERROR" not in out, out
    assert "ALLOCBOX_POLICY=size-classes: " in out and "size-classes" in out.split("ALLOCBOX_POLICY=")[1], out


def test_a_config_without_a_policy_is_a_usage_error_not_ignored(tmp_path):
    code, out = _pytest(tmp_path, None, "bucket-depth=7")
    assert code == 4, out
    assert "ALLOCBOX_CONFIG is set but ALLOCBOX_POLICY is not" in out, out


def test_a_granted_kind_reaches_the_policy_and_an_unknown_one_is_a_usage_error(tmp_path):
    code, out = _pytest(tmp_path, "guard", "sample=1", tests=2)
    assert code == 0, out
    assert "allocbox: guard counted: guarded 0," in out, out
    assert "asked for `guarded` memory" in out and "set ALLOCBOX_GRANT=guarded" in out, out
    code, out = _pytest(tmp_path, "guard", "sample=1", tests=2, grant="guarded")
    assert code == 0, out
    # Granted, guard maps a region per sampled array.
    counted = out.split("allocbox: guard counted: guarded ")[1]
    assert int(counted.split(",")[0]) > 0, out
    assert "not granted" not in out, out
    code, out = _pytest(tmp_path, "guard", grant="gpu")
    assert code == 4, out
    assert "ALLOCBOX_GRANT=gpu: `gpu` is not a kind of memory allocbox can grant" in out, out


def test_a_stopped_policy_ends_the_run_with_its_cause_first(tmp_path):
    code, out = _pytest(tmp_path, guest("broken"), "fault=misaligned-after-300", tests=200)
    assert code == 1, out
    cause = "allocbox: policy `broken` was stopped during test_many.py::"
    assert cause in out, out
    # The cause comes before pytest's own account of the failures it caused.
    assert out.index(cause) < out.index("short test summary info"), out
    passed_or_failed = out.count("PASSED") + out.count("FAILED")
    summary = out.strip().splitlines()[-1]
    assert "200 passed" not in summary and "failed" in summary, summary
    assert int(summary.split(" failed")[0].split()[-1]) <= 2, summary
    del passed_or_failed


@pytest.mark.parametrize(
    "policy, record, says",
    [
        (None, ".", "it is a folder"),
        ("size-classes", ".", "it is a folder"),
        (None, "no/such/folder/t.trace", "/no/such/folder` does not exist"),
        (None, "/dev/full", "it is a character device, not a regular file"),
        ("size-classes", "/dev/full", "it is a character device, not a regular file"),
    ],
)
def test_a_trace_that_cannot_be_written_is_one_usage_line_before_the_session(tmp_path, policy, record, says):
    # Found in issue 52: a folder ended in an INTERNALERROR traceback (exit 3), /dev/full
    # in a traceback from pytest_sessionfinish and "Exception ignored in atexit callback".
    code, out = _pytest(tmp_path, policy, tests=1, options=("--allocbox-record", record))
    assert code == 4, out
    assert "Traceback" not in out and "INTERNALERROR" not in out and "Exception ignored" not in out, out
    assert f"--allocbox-record {record}: " in out and says in out, out
    assert "passed" not in out, "no test ran"
