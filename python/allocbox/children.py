"""The children of a program under `allocbox run`: every Python process it starts runs
under its policy and records beside its trace.

A forked child (`os.fork`, multiprocessing's `fork`) has the policy already: the
recording takes part in the fork, and the child records into `TRACE.PID`
(`TRACE.PID.gz` for `TRACE.gz`), ended as the child ends (`finish_in_forked_children`).
A child that starts an interpreter of its own (multiprocessing's `spawn` and
`forkserver`, a `subprocess` running Python from this environment) finds what `run`
handed down (`hand_down`) in its environment, and `_allocbox_startup` takes it up once
the child imports NumPy (`inherit`): the same chain, its own instance, recording into
`TRACE.PID`. A child prints no summary: the process `run` started says what its policy
saw and names the children's traces (`traces`).
"""

import json
import os
import re
import sys

from _allocbox_hooks import CHILD

# What a child keeps alive for its whole life: its policy.
_inherited = []


def hand_down(chain, grant, record, sites, device=None):
    """Let the program's Python children run under `chain` (`[(source, config)]`; empty
    for NumPy's default, recorded), with `grant`, recording beside `record` when it is
    not None, and the device policy `device` (`(source, config)`) when there is one. A
    path is made absolute: a child may start in another directory."""

    def absolute(source):
        return os.path.abspath(source) if os.path.exists(source) else source

    chain = [[absolute(source), config] for source, config in chain]
    device = None if device is None else [absolute(device[0]), device[1]]
    handed = {"chain": chain, "grant": grant, "record": record, "sites": sites, "device": device}
    os.environ[CHILD] = json.dumps(handed)


def inherit():
    """In a child: put the policy its parent handed down in place, for the whole
    process (this thread and every thread started from now on, Numba's included). One
    that will not load here is said in one line, and the child runs under NumPy's
    default, as it would without allocbox."""
    import allocbox

    from . import numba as _numba

    pid = os.getpid()
    try:
        handed = json.loads(os.environ[CHILD])
        chain = [(str(source), dict(config)) for source, config in handed["chain"]]
        grant, record, sites = list(handed["grant"]), handed["record"], bool(handed["sites"])
    except (KeyError, ValueError, TypeError):
        say(
            f"allocbox: process {pid} runs under NumPy's default: {CHILD} is not what allocbox run "
            "sets; unset it, or start the program with allocbox run"
        )
        return
    trace = None if record is None else str(allocbox._allocbox.child_trace_path(record, pid))
    try:
        if chain:
            policy = allocbox.load_chain(*chain, record=trace, record_sites=sites, grant=grant)
        else:
            policy = allocbox.native_default(record=trace, record_sites=sites)
    except (allocbox.AllocboxError, ValueError) as e:
        names = ", ".join(source for source, _ in chain) or "default"
        say(f"allocbox: process {pid} runs under NumPy's default: the policy {names} will not load in it: {e}")
        return
    _inherited.append(policy)
    # As `allocbox run` places the parent's arrays (`run._placing`), for good.
    allocbox._set_handler(policy)
    _numba._use_for_good(policy)
    allocbox._start_threads_with(policy, hold=False)
    if trace is not None:
        finish_in_forked_children(policy)
    if handed.get("device"):
        _inherit_device(handed["device"], grant, policy if trace is not None else None)


def _inherit_device(device, grant, recording):
    """In a child: the parent's device policy, installed for the GPU libraries as in the
    parent (`allocbox.device_use`), recording into the child's trace."""
    import allocbox

    from . import device_use

    source, config = str(device[0]), dict(device[1])
    try:
        pool = device_use.load(source, config, grant, recording)
    except (allocbox.AllocboxError, ValueError) as e:
        say(f"allocbox: process {os.getpid()} keeps its GPU libraries' own allocators: device policy {source} will not load in it: {e}")
        return
    if pool is not None:
        _inherited.append(pool)
        device_use.install(pool)


def traces(record, since):
    """The traces the children of a run that started at `since` (a `time.time()`)
    wrote beside `record`, grandchildren's too, in the order of their names: older ones
    of the same names are an earlier run's."""
    folder, name = os.path.split(record)
    stem, gz = (name[:-3], r"\.gz") if name.endswith(".gz") else (name, "")
    pattern = re.compile(re.escape(stem) + r"(\.[0-9]+)+" + gz)
    found = []
    try:
        entries = list(os.scandir(folder or "."))
    except OSError:
        return []
    for entry in entries:
        if pattern.fullmatch(entry.name):
            try:
                if entry.stat().st_mtime >= since:
                    found.append(entry.path)
            except OSError:
                continue
    return sorted(found)


class _ForkedRecording:
    """A forked child's recording, ended as the child ends: by `atexit` where it exits,
    or, for a `multiprocessing` child, which leaves by `os._exit`, by one of
    multiprocessing's own exit finalizers."""

    def __init__(self, handler):
        self.handler = handler
        self.registered = False

    def before_fork(self):
        # Only once multiprocessing is there: importing it for a program that does not
        # would change what the program sees.
        util = sys.modules.get("multiprocessing.util")
        if util is not None and not self.registered:
            self.registered = True
            util.register_after_fork(self, _ForkedRecording.in_child)

    def in_child(self):
        import multiprocessing.util

        multiprocessing.util.Finalize(None, self.finish, exitpriority=0)

    def finish(self):
        try:
            self.handler.finish_recording()
        except Exception as e:  # noqa: BLE001 - said in one line, as the parent would
            say(f"allocbox: {e}")


_forked_recordings = []


def finish_in_forked_children(handler):
    """End `handler`'s recording in each child forked from now on as that child ends."""
    recording = _ForkedRecording(handler)
    _forked_recordings.append(recording)
    os.register_at_fork(before=recording.before_fork)


def say(*lines):
    """allocbox's own lines on the program's standard error, if it still has one (a
    program may close or replace it)."""
    stream = sys.stderr
    if stream is None or getattr(stream, "closed", False):
        return
    try:
        for line in lines:
            print(line, file=stream)
        stream.flush()
    except (OSError, ValueError):
        pass
