"""A pytest plugin that makes an allocbox policy NumPy's handler for a whole run.

    ALLOCBOX_POLICY=size-classes pytest -p allocbox.pytest_plugin --pyargs numpy._core

`ALLOCBOX_POLICY` names the policy as everywhere else: a shipped policy's name
(`allocbox.policies()`, or `builtin`) or a component or WAT path. It is the handler of
every thread the tests start too, as `allocbox.use(policy, threads=True)` makes it.
`--allocbox-record TRACE` writes every allocation of the run as a trace for `allocbox
report` (under NumPy's default handler when no policy is named); the recording ends
with the last test. `ALLOCBOX_CONFIG` is
its configuration, `key=value,key=value`; `ALLOCBOX_GRANT` the kinds of memory it may
ask for, `guarded,numa` (as `grant=` at `allocbox.load` and `--grant` on the command
line; none by default). A policy, configuration or grant that cannot be used, or a
configuration or grant without a policy, is a one-line usage error before any test
runs.

Once the policy is stopped (it broke the contract, trapped or ran too long), every later
allocation would fail with `MemoryError` for that reason alone, so the run stops after
the test that stopped it, the cause is printed then and first in the summary, and the
run exits 1. At the end the plugin reports the policy's counters.
"""

import os

import pytest

import allocbox
from allocbox import _allocbox

_policy = None
_stopped_by = None
_restore_threads = None


def pytest_addoption(parser):
    parser.addoption(
        "--allocbox-record",
        metavar="TRACE",
        help="write every allocation of the run as a trace, for `allocbox report TRACE`",
    )


def _settings(text):
    settings = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise pytest.UsageError(
                f"ALLOCBOX_CONFIG item {item!r} is not key=value: "
                "write ALLOCBOX_CONFIG=key=value,key=value"
            )
        settings[key] = value
    return settings


def pytest_configure(config):
    global _policy, _restore_threads
    source = os.environ.get("ALLOCBOX_POLICY")
    record = config.getoption("allocbox_record", None)
    if record is not None:
        record = _trace_path(record)
    if not source:
        for variable in ("ALLOCBOX_CONFIG", "ALLOCBOX_GRANT"):
            if os.environ.get(variable):
                raise pytest.UsageError(
                    f"{variable} is set but ALLOCBOX_POLICY is not: name the policy it is "
                    "for (ALLOCBOX_POLICY=size-classes), or unset it"
                )
        if record is None:
            return
        try:
            _policy = allocbox.native_default(record=record)
        except allocbox.AllocboxError as error:
            raise pytest.UsageError(f"--allocbox-record {record}: {error}") from None
    else:
        settings = _settings(os.environ.get("ALLOCBOX_CONFIG", ""))
        grant = [kind.strip() for kind in os.environ.get("ALLOCBOX_GRANT", "").split(",") if kind.strip()]
        try:
            _policy = allocbox.load(source, settings, grant=grant, record=record)
        except allocbox.AllocboxError as error:
            raise pytest.UsageError(f"ALLOCBOX_POLICY={source}: {error}") from None
        except ValueError as error:
            raise pytest.UsageError(f"ALLOCBOX_GRANT={os.environ['ALLOCBOX_GRANT']}: {error}") from None
    allocbox.set_handler(_policy)
    _restore_threads = allocbox._start_threads_with(_policy)


def _trace_path(record):
    """The trace's path, absolute (tests may change directory), or a usage error
    naming what is wrong with it (judged as the recording will judge it, before any
    test runs)."""
    path = os.path.abspath(record)
    try:
        _allocbox.check_output(path)
    except allocbox.AllocboxError as error:
        raise pytest.UsageError(f"--allocbox-record {record}: {error}") from None
    return path


def pytest_unconfigure(config):
    if _restore_threads is not None:
        _restore_threads()


def pytest_report_header(config):
    if _policy is None:
        return None
    record = config.getoption("allocbox_record", None)
    recording = f"; recording to {record}" if record else ""
    source = os.environ.get("ALLOCBOX_POLICY")
    if source is None:
        return f"allocbox: NumPy's default handler{recording}"
    return f"allocbox: NumPy's handler is `{_policy.name}` ({source}){recording}"


def _cause():
    return allocbox._stop_sentence(_policy, during=_stopped_by)


def _note_a_stop(session, during):
    """After `during` (a test's id, or collection): if the policy has been stopped, end
    the session rather than fail every later test for the same reason."""
    global _stopped_by
    if _policy is None or _stopped_by is not None or _policy.failure is None:
        return
    _stopped_by = during
    session.shouldstop = "the allocbox policy was stopped"
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(f"{_cause()}; the run stops here", red=True, bold=True)


def pytest_collection_finish(session):
    # NumPy arrays made at import time go through the policy too.
    _note_a_stop(session, "collection")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    _note_a_stop(item.session, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(session, exitstatus):
    if _policy is not None:
        # The recording ends with the last test: what is live now is what leaked.
        try:
            _policy.finish_recording()
        except allocbox.AllocboxError as error:
            session.exitstatus = 1
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"allocbox: {error}", red=True, bold=True)
    if _policy is not None and _policy.failure is not None:
        session.exitstatus = 1
        # Before pytest's own summary (its failures are this one's consequences).
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("=", "allocbox", red=True, bold=True)
            reporter.write_line(_cause(), red=True, bold=True)
    yield


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
    counters = stats["counters"]
    if counters:
        counted = ", ".join(f"{name} {value}" for name, value in counters.items())
        terminalreporter.write_line(f"allocbox: {_policy.name} counted: {counted}")
    for link in _policy.link_stats():
        for kind, refused in link["ungranted"].items():
            terminalreporter.write_line(
                f"allocbox: policy `{link['name']}` asked for `{kind}` memory {refused} times "
                f"and was refused, as it was not granted, so the paths that use it did not "
                f"run; to test them, set ALLOCBOX_GRANT={kind}"
            )
    for failure in _policy.failures:
        if _stopped_by is None or failure != _policy.failure:
            terminalreporter.write_line(f"allocbox: failure inside NumPy: {failure}")
