"""Numba's arrays under allocbox policies.

    import allocbox, numba, numpy as np

    @numba.njit
    def double(a):
        return a * 2                  # a new array, made by Numba's runtime

    with allocbox.use(allocbox.load("size-classes")):
        b = double(np.arange(1000))
    allocbox.handler_name(b)          # 'size-classes'

Arrays that `@njit` code makes (`np.empty`, `np.zeros`, array expressions, arrays it
returns) come from Numba's runtime (NRT), not from NumPy's handler. `allocbox.use` and
`allocbox.set_handler` route them too, once Numba is imported (before or after the
policy was set: an import hook waits for it; `enable()` does it by hand): each is placed by the handler NumPy has current — the same context rule —
and freed by the policy that made it, with its size (NRT's free says none; the host's
ledger knows it), however long it lives.

How: Numba's compiled code reaches `NRT_MemInfo_alloc_aligned` (and its debugging
twin) through symbols llvmlite resolves when a function is linked; `enable()` binds
them to allocbox's functions, which place the array with NumPy's current handler when
it is an allocbox policy (through NRT's own `NRT_MemInfo_alloc_external`, so that the
MemInfo remembers its maker) and otherwise call Numba's own. Functions compiled before
are compiled again (or loaded again from `cache=True`'s cache) on their next call.

Threads that run no Python (`parallel=True`'s workers, `nogil` functions) cannot read
a context: they use the policy of the innermost `allocbox.use` block open in the
process. While no `use` block is open and `set_handler` was never given a handler, no
allocbox handler can be current, and the route hands every array to Numba's own
allocator after one load of a counter, without asking NumPy (a context copied inside
a block and run after it, an asyncio task the block started that outlives it, places
its NumPy arrays with the policy and its Numba arrays with Numba's own). `use(policy)`
here places every array of the process with `policy`, without asking NumPy on each
(what `allocbox run` does). Not covered: `@cfunc` callbacks compiled before `enable()`, and what NRT
allocates other than arrays (lists, dicts, strings).

Needs Numba (`pip install allocbox[numba]`); tested with Numba 0.68.
"""

import gc
import sys
import threading
import warnings
from contextlib import contextmanager

from _allocbox_hooks import AfterImport

from ._allocbox import numba_maker as _numba_maker
from ._allocbox import numba_process_wide_use as _numba_process_wide_use
from ._allocbox import numba_route as _numba_route
from ._allocbox import numba_route_hold as _numba_route_hold
from ._allocbox import numba_statistics as _numba_statistics
from ._allocbox import numba_threads_done as _numba_threads_done
from ._allocbox import numba_threads_use as _numba_threads_use

__all__ = ["enable", "enabled", "use"]

_enabled = False
_enabling = threading.RLock()
# Compiled code replaced by `enable()`, kept so that nothing still running it loses it.
_retired = []


def enabled():
    """Whether Numba's arrays are routed through allocbox in this process."""
    return _enabled


def enable():
    """Route the arrays Numba's compiled code makes through NumPy's current handler
    from now on (idempotent). `allocbox.use` and `set_handler` call it once Numba is
    imported. Raises `AllocboxError` when this Numba's runtime is not one allocbox
    knows how to route (its arrays then stay with Numba's own allocator)."""
    global _enabled
    if _enabled:
        return
    # Two threads enabling at once (no GIL orders them on a free-threaded build) would
    # replace Numba's functions twice: the second waits and finds it done.
    with _enabling:
        if _enabled:
            return
        try:
            from llvmlite import binding as ll
            from numba.core.registry import cpu_target
            from numba.core.runtime import _nrt_python
            from numba.core.runtime.nrt import rtsys
        except ImportError as e:
            from . import AllocboxError

            raise AllocboxError(
                f"allocbox.numba needs Numba, which cannot be imported ({e}): "
                "install it with `pip install allocbox[numba]`"
            ) from None
        # Numba registers its runtime's symbols when it first compiles; ours must come
        # after, or they would be overwritten.
        rtsys.initialize(cpu_target.target_context)
        helpers = _nrt_python.c_helpers
        try:
            aligned, safe_aligned = _numba_route(
                {
                    "get_api": helpers.get("get_api", 0),
                    "alloc_aligned": helpers.get("MemInfo_alloc_aligned", 0),
                    "alloc_safe_aligned": helpers.get("MemInfo_alloc_safe_aligned", 0),
                    "alloc_safe_aligned_external": helpers.get("MemInfo_alloc_safe_aligned_external", 0),
                    "release": helpers.get("MemInfo_release", 0),
                    "data": helpers.get("MemInfo_data", 0),
                }
            )
        except RuntimeError as e:
            from . import AllocboxError

            raise AllocboxError(str(e)) from None
        _follow_statistics(_nrt_python)
        ll.add_symbol("NRT_MemInfo_alloc_aligned", aligned)
        ll.add_symbol("NRT_MemInfo_alloc_safe_aligned", safe_aligned)
        _enabled = True
        _recompile_later()


def _follow_statistics(nrt):
    """Keep the route told whether Numba's runtime counts its allocations: while it
    does, the route makes each MemInfo through the runtime, which counts it; while it
    does not, the route makes it itself, which is faster. Numba switches its counting
    only through these two functions of its `_nrt_python` module (`NUMBA_NRT_STATS`,
    its tests' leak checks), looked up there at each call; the route is told it is on
    before the runtime starts counting and off after it stops."""
    enable, disable = nrt.memsys_enable_stats, nrt.memsys_disable_stats

    def memsys_enable_stats():
        _numba_statistics(True)
        enable()

    def memsys_disable_stats():
        disable()
        _numba_statistics(bool(nrt.memsys_stats_enabled()))

    nrt.memsys_enable_stats = memsys_enable_stats
    nrt.memsys_disable_stats = memsys_disable_stats
    _numba_statistics(bool(nrt.memsys_stats_enabled()))


def _recompile_later():
    """Make every function compiled so far link again on its next call: its machine
    code holds the addresses of Numba's own allocation functions."""
    from numba.core.dispatcher import Dispatcher

    for dispatcher in gc.get_objects():
        if isinstance(dispatcher, Dispatcher) and dispatcher.overloads:
            _retired.append(dict(dispatcher.overloads))
            dispatcher._reset_overloads()


def _made_by(meminfo):
    """The allocbox handler that made the data of an array whose `base` is a Numba
    MemInfo, or None (Numba's own allocator, or a view of an array Numba was
    handed)."""
    return _numba_maker(meminfo)


def _route_if_imported():
    """Enable the route if Numba is imported, or as soon as it is (a policy in use
    before the program imports Numba places its arrays too); a Numba allocbox cannot
    route is said once, as a warning, and leaves NumPy's side as it is. Returns whether
    it is on."""
    global _refused
    if "numba" not in sys.modules:
        _route_when_imported()
        return _enabled
    if _refused:
        return _enabled
    try:
        enable()
    except Exception as e:
        _refused = True
        warnings.warn(f"{e}", RuntimeWarning, stacklevel=3)
    return _enabled


_refused = False


@contextmanager
def use(policy):
    """Place every array Numba's compiled code makes in this process with `policy` for
    the block: on every thread, in every context, without asking NumPy for its handler
    on each array (NumPy's own arrays keep following NumPy's context). `allocbox run`
    runs the program in such a block. While an `allocbox.use` block is open anywhere,
    or once `set_handler` was given a handler, Numba's arrays follow NumPy's context
    again, as they do without this block; the innermost of nested blocks wins. `policy`
    is a policy or a handler `set_handler` returned for one."""
    token = _numba_process_wide_use(policy)
    try:
        _route_if_imported()
        yield policy
    finally:
        _numba_threads_done(token)


def _use_for_good(policy):
    """`use(policy)` for the rest of the process (a child of `allocbox run`)."""
    _numba_process_wide_use(policy)
    _route_if_imported()


def _hold():
    """`set_handler` installed a handler: the route asks NumPy for the current handler
    on every array from now on (other contexts may keep it), once it is on."""
    _route_if_imported()
    _numba_route_hold()


def _threads_use(handler):
    """Make `handler` the one of Numba's threads that run no Python (once the route is
    on, now or when Numba is imported); returns what ends that."""
    _route_if_imported()
    token = _numba_threads_use(handler)
    return lambda: _numba_threads_done(token)


# A policy set before the program imports Numba places its arrays too.
_after_numba_imports = AfterImport("numba", lambda: _route_if_imported())


def _route_when_imported():
    _after_numba_imports.arm()
