"""Place NumPy array data with sandboxed, checked WebAssembly allocation policies.

    import allocbox, numpy as np
    policy = allocbox.load("policy_size_classes.wasm", {"bucket-depth": "7"})
    with allocbox.use(policy):
        a = np.arange(1000)           # a's data is placed by the wasm policy
    allocbox.handler_name(a)          # 'size-classes', also after the block

The handler is installed through NumPy's own `PyDataMem_SetHandler`, so it is
context-local exactly as NumPy's ContextVar is: asyncio tasks inherit it, new threads
start at NumPy's default.
"""

from contextlib import contextmanager

from ._allocbox import (
    DEFAULT_POLICY_WAT,
    AllocboxError,
    ClientError,
    ContractViolation,
    LoadError,
    PoisonedPolicy,
    Policy,
    get_handler,
    load_chain,
    native_default,
    set_handler,
)

__all__ = [
    "AllocboxError",
    "ClientError",
    "ContractViolation",
    "LoadError",
    "PoisonedPolicy",
    "Policy",
    "builtin",
    "get_handler",
    "handler_name",
    "load",
    "load_chain",
    "native_default",
    "set_handler",
    "use",
]


def load(source, config=None, *, record=None, **limits):
    """One policy from a path (a .wasm component or .wat source) or bytes, started with
    its key/value `config`. `record` writes every call to a trace file. Bounds, each
    defaulting to allocbox's: `call_time` (seconds per call, imports included),
    `memory` (the guest's own memory), `batch` (blocks in one batch call), `overhead`
    (bytes the policy may hold beyond what NumPy holds), `host_memory_limit`."""
    item = (source, {str(k): str(v) for k, v in config.items()}) if config else source
    return load_chain(item, record=record, **limits)


def builtin():
    """The built-in default policy (hand-written WAT; needs no wasm toolchain)."""
    return load(DEFAULT_POLICY_WAT.encode())


@contextmanager
def use(policy):
    """Make `policy` NumPy's handler for the block (in this context only)."""
    previous = set_handler(policy)
    try:
        yield policy
    finally:
        set_handler(previous)


def handler_name(array=None):
    """The name of the handler that placed `array`'s data (None for a view), or of the
    current handler."""
    from numpy._core.multiarray import get_handler_name

    return get_handler_name(array) if array is not None else get_handler_name()
