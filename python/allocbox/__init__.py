"""Place NumPy array data with sandboxed, checked WebAssembly allocation policies.

    import allocbox, numpy as np
    allocbox.policies()               # {'size-classes': "NumPy's small-block cache: ...", ...}
    policy = allocbox.load("size-classes", {"bucket-depth": "7"})
    with allocbox.use(policy):
        a = np.arange(1000)           # a's data is placed by the wasm policy
    allocbox.handler_name(a)          # 'size-classes', also after the block

The handler is installed through NumPy's own `PyDataMem_SetHandler`, so it is
context-local exactly as NumPy's ContextVar is: asyncio tasks inherit it, new threads
start at NumPy's default.
"""

# The package's modules, and the two that run before it is imported, form layers: each
# imports (at its top or inside a function) only those after it here; this facade
# imports them all and they may all import it (python/tests/test_layers.py).
# Module order: __main__ > run > pytest_plugin > dask > _allocbox_startup > children > device_use > cuda > numba > _allocbox_hooks

import inspect
import json
import os
import sys
from contextlib import contextmanager
from importlib import resources

from ._allocbox import load_chain as _load_chain
from ._allocbox import load_hook as _load_hook
from ._allocbox import set_event_hook as _set_event_hook
from ._allocbox import shipped_hooks as _shipped_hooks
from ._allocbox import (
    DEFAULT_POLICY_WAT,
    AllocboxError,
    ClientError,
    ClientMisuseWarning,
    ContractViolation,
    EventHook,
    LoadError,
    PoisonedPolicy,
    Policy,
    get_handler,
)
from ._allocbox import native_default as _native_default
from ._allocbox import set_handler as _set_handler

__all__ = [
    "AllocboxError",
    "ClientError",
    "ClientMisuseWarning",
    "ContractViolation",
    "EventHook",
    "LoadError",
    "PoisonedPolicy",
    "Policy",
    "builtin",
    "get_handler",
    "handler_name",
    "hooks",
    "load",
    "load_chain",
    "load_hook",
    "native_default",
    "policies",
    "set_event_hook",
    "set_handler",
    "use",
]


def policies():
    """The policies shipped inside this package: {name: one-line description}."""
    index = resources.files(__name__) / "policies" / "index.json"
    if not index.is_file():
        return {}
    return json.loads(index.read_text())


# The built-in policy's names: what allocbox calls it, and what it calls itself (its
# handler name, as `handler_name` shows it).
_BUILTIN = ("builtin", "passthrough")


def _source(source):
    """A shipped policy's name becomes its packaged component (`builtin`, also called
    `passthrough` as it names itself, the built-in policy's source, as on the command
    line); paths and bytes stay."""
    if isinstance(source, str) and not os.path.exists(source):
        shipped = policies()
        if source in _BUILTIN:
            return DEFAULT_POLICY_WAT.encode()
        if source in shipped:
            # An extension module is never imported from a zip: the package is on disk.
            return str(resources.files(__name__) / "policies" / f"{source}.wasm")
        if os.sep not in source and "." not in source:
            raise LoadError(
                f"no shipped policy or file named {source!r}; shipped: builtin (the `passthrough` policy), "
                + (", ".join(sorted(shipped)) or "and no other (this build carries none)")
            )
    return source


def _library_folders():
    """The folders of the standard library and of installed packages (each as given and
    as its real path, ending in a separator): code in them is a library's, not the
    program's own, for the lines a recording with sites names."""
    import site
    import sysconfig

    paths = [sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        paths += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # a virtualenv's old `site` module has neither
        pass
    folders = {os.path.join(form, "") for path in paths if path for form in (path, os.path.realpath(path))}
    return sorted(folders)


def _machinery_folders():
    """The folders NumPy, Numba and allocbox are installed in (each as given and as its
    real path, ending in a separator), found without importing them: code in them is
    never the program's line nor a library line to show."""
    import importlib.util

    folders = set()
    for package in ("numpy", "numba", "allocbox"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for folder in (spec.submodule_search_locations or []) if spec else []:
            for form in (folder, os.path.realpath(folder)):
                folders.add(os.path.join(form, ""))
    return sorted(folders)


def _shipped_name(source):
    """The name of a shipped policy `source` names (`builtin` included), else None."""
    if not isinstance(source, str) or os.path.exists(source):
        return None
    return source if source in _BUILTIN or source in policies() else None


def load(source, config=None, *, record=None, record_sites=False, **limits):
    """One policy, started with its key/value `config`: a shipped policy by name (see
    `policies()`), a path (a .wasm component or .wat source) or bytes. `record` writes
    every call to a trace file (the binary form, whatever the name) with its time, and
    with `record_sites=True` the line of the program's own code that asked (for
    `allocbox report`'s tables by line; it costs a walk of the Python stack per
    allocation). `finish_recording()` ends the trace. Bounds, each
    defaulting to allocbox's: `call_time` (seconds per call, imports included),
    `memory` (the guest's own memory), `batch` (blocks in one batch call), `overhead`
    (bytes the policy may hold beyond what NumPy holds), `host_memory_limit`. `grant`
    lists the kinds of memory the policy may ask the host for: "numa", "huge-pages",
    "locked", "guarded", "pinned" (none by default; "device" is `allocbox.cuda.load`'s),
    e.g.
    `load("guard", {"sample": "1"}, grant=["guarded"])`. `magazines=False` asks the
    policy on every call even when it declares `batch` (by default the host then keeps
    per-thread magazines of blocks it placed). A chain asked on every call gives each
    thread that calls it an instance of its own (up to one per core, then threads
    share them; `Policy.instances` counts them) when every policy of the chain says its
    state is per instance (`system`, `size-classes`, `arena`, `aligned`), each asked
    on every call and the bounds shared evenly between them; an array freed on another
    thread goes back to the instance that made it. Threads then run at once instead of
    in turn, for about a tenth more per call on one thread: `per_thread=False` keeps one
    instance, `per_thread=True` asks for instances even beside magazines. A chain with
    a policy that does not say so, or that diagnoses its client (`guard`), is loaded
    with one instance, `Policy.instances` 1."""
    item = (source, {str(k): str(v) for k, v in config.items()}) if config else source
    return load_chain(item, record=record, record_sites=record_sites, **limits)


# The bounds the bridge's `load_chain` takes, read from its own signature so the two
# never disagree.
_BOUNDS = tuple(
    name
    for name in inspect.signature(_load_chain).parameters
    if name not in ("chain", "record", "record_sites", "names")
)


def _check_bounds(limits, bounds, others):
    """Refuse a keyword that is not one of `bounds` in a sentence naming them (and the
    `others` the caller takes), before anything is loaded: `load`, `load_chain` and
    `allocbox.cuda.load` alike."""
    unknown = sorted(set(limits) - set(bounds))
    if unknown:
        raise TypeError(
            f"{unknown[0]!r} is not a bound allocbox knows; the bounds are "
            + ", ".join(bounds)
            + f" (and {others})"
        )


def load_chain(*chain, record=None, record_sites=False, **limits):
    """A chain of policies, top first, as one handler. Each item is a source (as for
    `load`) or a `(source, {key: value})` pair; `record`, `record_sites` and the bounds
    as for `load`."""
    _check_bounds(limits, _BOUNDS, "record=, record_sites=")
    items = [
        (_source(item[0]), item[1]) if isinstance(item, tuple) else _source(item)
        for item in chain
    ]
    # What to call a shipped policy in messages before it names itself: its name, not
    # the path of its packaged component.
    sources = [item[0] if isinstance(item, tuple) else item for item in chain]
    names = [_shipped_name(source) for source in sources]
    policy = _load_chain(*items, record=record, record_sites=record_sites, names=names, **limits)
    return _recording_ends_before_shutdown(policy) if record is not None else policy


def native_default(*, record=None, record_sites=False):
    """NumPy's own default handler, natively, behind the same bridge as the policies:
    what any handler installed through allocbox costs before a policy does anything
    (for benchmarks and comparisons), and a way to record what NumPy's default does
    (`record`, `record_sites` as for `load`)."""
    policy = _native_default(record=record, record_sites=record_sites)
    return _recording_ends_before_shutdown(policy) if record is not None else policy


def _recording_ends_before_shutdown(policy):
    """End `policy`'s recording at the program's last line, before the interpreter
    frees its modules' globals: what they still hold is what the trace never frees
    (what leaked). `finish_recording()` ends it earlier."""
    import atexit

    def finish():
        try:
            policy.finish_recording()
        except AllocboxError as e:
            # At exit there is no caller to raise to: said in one line, not a traceback.
            stream = sys.stderr
            if stream is not None and not getattr(stream, "closed", False):
                print(f"allocbox: {e}", file=stream)

    atexit.register(finish)
    return policy


def builtin():
    """The built-in default policy, `passthrough` (hand-written WAT; needs no wasm
    toolchain), as `load("builtin")` loads it."""
    return load(DEFAULT_POLICY_WAT.encode())


@contextmanager
def use(policy, *, threads=False):
    """Make `policy` NumPy's handler for the block.

    NumPy keeps its handler in a context variable, so this covers the current thread
    and the asyncio tasks it starts, not the threads it starts: on Python up to 3.13
    (and 3.14 unless `sys.flags.thread_inherit_context`) a new thread starts at NumPy's
    default. With `threads=True`, every thread started inside the block (a
    `threading.Thread`, a thread pool's worker) makes `policy` its handler before it
    runs anything, for its whole life, on every Python version. Threads that already
    run are not reached; give a pool made earlier `initializer=allocbox.set_handler,
    initargs=(policy,)`."""
    from . import numba as _numba

    # Not `set_handler`, whose hold on Numba's route is for good: the block's own hold
    # (`_threads_use`) ends with it.
    previous = _set_handler(policy)
    numba_threads_done = _numba._threads_use(policy)
    if threads:
        restore = _start_threads_with(policy)
    try:
        yield policy
    except BaseException as error:
        _name_a_stop(error, policy)
        raise
    finally:
        if threads:
            restore()
        numba_threads_done()
        _set_handler(previous)


def _stop_sentence(policy, during=None):
    """How a stopped policy is said, the same by `allocbox run`, the pytest plugin and
    the note on an allocation's `MemoryError`: its name, when it was stopped if known,
    why, and what follows."""
    when = f" during {during}" if during else ""
    return (
        f"allocbox: policy `{policy.name}` was stopped{when}: {policy.failure}; every "
        "allocation it would have served fails from then on"
    )


def _name_a_stop(error, policy):
    """Add to `error` a note naming `policy` and why it was stopped, when it was and
    the error came of an allocation that failed: the MemoryError NumPy or Numba raises
    for it (or the error Numba's parallel code makes of one) names neither. A policy
    that was not stopped but was refused the GPU memory it asked for (no CUDA driver,
    say) is named with that reason."""
    seen, cause = set(), error
    while cause is not None and not isinstance(cause, MemoryError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if cause is None or id(cause) in seen:
        return
    failure = getattr(policy, "failure", None)
    if failure is not None:
        note = _stop_sentence(policy)
    else:
        try:
            links = policy.link_stats()
        except Exception:  # a policy whose statistics cannot be read names nothing more
            return
        why = next((link["gpu_unavailable"] for link in links if link.get("gpu_unavailable")), None)
        if why is None:
            return
        note = f"allocbox: policy `{policy.name}` was refused the GPU memory it asked for: {why}"
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


def set_handler(handler):
    """Install a policy (or a capsule `set_handler` returned earlier, or `None` for
    NumPy's default) as NumPy's handler in the current context — and of the arrays
    Numba's compiled code makes in it (`allocbox.numba`), from when Numba is imported,
    whether before or after. Returns the previous capsule."""
    previous = _set_handler(handler)
    if handler is not None:
        from . import numba as _numba

        _numba._hold()
    return previous


def _start_threads_with(policy, hold=True):
    """Make `policy` the handler of every thread `threading` starts from now on, until
    the returned function is called; with `hold`, Numba's arrays in those threads follow
    their context for good (`set_handler`), where an `allocbox.numba.use` block that
    outlives them places them all. It rides on `threading.setprofile`, the one hook
    that runs inside each new thread before its target, and hands that thread on to the
    profiler that was set before (if any) once the policy is installed."""
    import sys
    import threading

    # The capsule, not the policy: once the policy is stopped, `set_handler` refuses it,
    # and a thread started then must run under it (failing allocations as this thread
    # does), not die in its first line or fall back to NumPy's default.
    handler = policy.capsule() if isinstance(policy, Policy) else policy
    outer = threading.getprofile()

    def first_call(frame, event, arg):
        # The first Python call in the new thread is its `run`, inside the context the
        # thread runs in (3.14 runs it in a context of its own); C calls come earlier.
        if event != "call":
            return
        sys.setprofile(outer)
        if hold:
            set_handler(handler)
        else:
            _set_handler(handler)
        if outer is not None:
            outer(frame, event, arg)

    threading.setprofile(first_call)

    def restore():
        if threading.getprofile() is first_call:
            threading.setprofile(outer)

    return restore


def handler_name(array=None):
    """The name of the handler that placed `array`'s data (None for a view), or of the
    current handler. An array whose data Numba's compiled code made is named by the
    policy that placed it (`allocbox.numba`); None when Numba's own allocator did."""
    from numpy._core.multiarray import get_handler_name

    if array is None:
        return get_handler_name()
    name = get_handler_name(array)
    base = getattr(array, "base", None)
    if name is None and type(base).__name__ == "_MemInfo" and "numba" in sys.modules:
        from . import numba as _numba

        return _numba._made_by(base)
    return name


def hooks():
    """The event hooks shipped inside this package: {name: what its report holds}."""
    return {name: about for name, (about, _) in _shipped_hooks().items()}


def load_hook(source, *, call_time=None):
    """A sandboxed event hook (a component of the `hook` world): a shipped hook by name
    (see `hooks()`), a path (.wasm or .wat) or bytes. `call_time` bounds each event, in
    seconds. Give it to `set_event_hook`; read what it kept with `.report()`."""
    shipped = _shipped_hooks()
    if isinstance(source, str) and not os.path.exists(source):
        if source in shipped:
            return _load_hook(shipped[source][1].encode(), source, call_time=call_time)
        if os.sep not in source and "." not in source:
            raise LoadError(
                f"no shipped hook or file named {source!r}; shipped hooks: " + ", ".join(sorted(shipped))
            )
    name = "hook" if isinstance(source, (bytes, bytearray)) else os.path.splitext(os.path.basename(source))[0]
    return _load_hook(source, name, call_time=call_time)


def set_event_hook(hook):
    """Make `hook` the event hook and return the previous one (`None` removes it), as
    NumPy's `PyDataMem_SetEventHook` did before NumPy 2.0 removed it.

    `hook` is a callable `hook(old, new, size)` with addresses as integers — new:
    `(0, new, size)`, free: `(old, 0, 0)`, resize: `(old, new, size)` — or a sandboxed
    hook: an `EventHook`, a shipped hook's name (`hooks()`), a path or bytes. It sees
    every event of arrays placed through allocbox's handlers (and `native_default()`),
    in every thread, but not arrays placed by NumPy's own default handler, and not the
    allocations it makes itself. A hook that raises (or a sandboxed one that traps or
    runs too long) is detached and reported through `sys.unraisablehook`; the allocation
    that called it stands."""
    if hook is not None and not callable(hook) and not isinstance(hook, EventHook):
        hook = load_hook(hook)
    return _set_event_hook(hook)
