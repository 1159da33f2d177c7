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

import json
import os
from contextlib import contextmanager
from importlib import resources

from ._allocbox import load_chain as _load_chain
from ._allocbox import (
    DEFAULT_POLICY_WAT,
    AllocboxError,
    ClientError,
    ContractViolation,
    LoadError,
    PoisonedPolicy,
    Policy,
    get_handler,
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
    "policies",
    "set_handler",
    "use",
]


def policies():
    """The policies shipped inside this package: {name: one-line description}."""
    index = resources.files(__name__) / "policies" / "index.json"
    if not index.is_file():
        return {}
    return json.loads(index.read_text())


def _source(source):
    """A shipped policy's name becomes its packaged component (`builtin` the built-in
    policy's source, as on the command line); paths and bytes stay."""
    if isinstance(source, str) and not os.path.exists(source):
        shipped = policies()
        if source == "builtin":
            return DEFAULT_POLICY_WAT.encode()
        if source in shipped:
            # An extension module is never imported from a zip: the package is on disk.
            return str(resources.files(__name__) / "policies" / f"{source}.wasm")
        if os.sep not in source and "." not in source:
            raise LoadError(
                f"no shipped policy or file named {source!r}; shipped: builtin, "
                + (", ".join(sorted(shipped)) or "and no other (this build carries none)")
            )
    return source


def load(source, config=None, *, record=None, **limits):
    """One policy, started with its key/value `config`: a shipped policy by name (see
    `policies()`), a path (a .wasm component or .wat source) or bytes. `record` writes every call to a trace file. Bounds, each
    defaulting to allocbox's: `call_time` (seconds per call, imports included),
    `memory` (the guest's own memory), `batch` (blocks in one batch call), `overhead`
    (bytes the policy may hold beyond what NumPy holds), `host_memory_limit`."""
    item = (source, {str(k): str(v) for k, v in config.items()}) if config else source
    return load_chain(item, record=record, **limits)


def load_chain(*chain, record=None, **limits):
    """A chain of policies, top first, as one handler. Each item is a source (as for
    `load`) or a `(source, {key: value})` pair; `record` and the bounds as for `load`."""
    items = [
        (_source(item[0]), item[1]) if isinstance(item, tuple) else _source(item)
        for item in chain
    ]
    return _load_chain(*items, record=record, **limits)


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
