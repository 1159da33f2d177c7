"""A pytest plugin that makes an allocbox policy NumPy's handler for a whole run.

    ALLOCBOX_POLICY=size-classes pytest -p allocbox.pytest_plugin --pyargs numpy._core

`ALLOCBOX_POLICY` is a shipped policy's name (`allocbox.policies()`), a component or
WAT path, or `builtin`; `ALLOCBOX_CONFIG` is `key=value,key=value`. At the end the plugin reports the policy's counters and fails the
run if the policy broke the contract.
"""

import os

import allocbox

_policy = None


def pytest_configure(config):
    global _policy
    source = os.environ.get("ALLOCBOX_POLICY")
    if not source:
        return
    settings = dict(
        item.split("=", 1) for item in os.environ.get("ALLOCBOX_CONFIG", "").split(",") if item
    )
    _policy = allocbox.builtin() if source == "builtin" else allocbox.load(source, settings)
    allocbox.set_handler(_policy)


def pytest_report_header(config):
    if _policy is not None:
        return f"allocbox: NumPy's handler is `{_policy.name}` ({os.environ['ALLOCBOX_POLICY']})"


def pytest_terminal_summary(terminalreporter):
    if _policy is None:
        return
    stats = _policy.stats()
    terminalreporter.write_line(
        "allocbox: {name}: {mallocs} malloc, {callocs} calloc, {reallocs} realloc, {frees} free, "
        "peak {peak_bytes} bytes, {size_corrections} wrong-size frees corrected".format(
            name=_policy.name, **stats
        )
    )
    for failure in _policy.failures():
        terminalreporter.write_line(f"allocbox: FAILURE inside NumPy: {failure}")


def pytest_sessionfinish(session, exitstatus):
    if _policy is not None and _policy.failure is not None:
        session.exitstatus = 1
