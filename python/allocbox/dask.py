"""Run every Dask worker's NumPy allocations through an allocbox policy.

    from dask.distributed import Client
    import allocbox.dask

    client = Client(...)
    client.register_plugin(allocbox.dask.AllocboxPlugin("size-classes"))
    (da.ones((2000, 2000), chunks=500) * 2).sum().compute()   # placed by the policy
    allocbox.dask.gather(client)          # {worker address: {"policy", "stats", ...}}
    allocbox.dask.raise_if_failed(client) # a policy failure on any worker, as an error

Each worker loads its own copy of the policy when the plugin is registered (and when a
worker joins later). A policy given by path is read here and its bytes are shipped, so
the workers need not see the file; a shipped policy's name is resolved by each worker's
own allocbox.

A policy failure inside a task makes NumPy raise `MemoryError` there; the plugin turns
that error into the policy's own (`allocbox.ContractViolation`, `PoisonedPolicy` or
`ClientError`), naming the worker, the policy and the rule it broke, and that is the error
the client gets. `raise_if_failed(client)` raises the same for failures that no task
reported (a task that caught its `MemoryError`, say).

Needs Dask's `distributed` (`pip install allocbox[dask]`).
"""

import os

import allocbox
from allocbox import AllocboxError, _start_threads_with

try:
    from distributed import WorkerPlugin
except ImportError as _missing:
    raise ImportError(
        "allocbox.dask needs Dask's `distributed` package, which is not installed: "
        "install it with `pip install allocbox[dask]`"
    ) from _missing

__all__ = ["AllocboxPlugin", "gather", "raise_if_failed"]

_DEFAULT_NAME = "allocbox"


def _portable(source):
    """The source as it travels to the workers: bytes as they are, a file that exists
    here as its bytes, any other string (a shipped policy's name, or a path on the
    workers) as it is."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isfile(path):
            with open(path, "rb") as file:
                return file.read()
        return path
    raise TypeError(
        f"an allocbox policy source is a shipped policy's name, a path or bytes, not {type(source).__name__}"
    )


class AllocboxPlugin(WorkerPlugin):
    """A worker plugin that makes a policy NumPy's handler for every task a worker runs
    and every thread it starts: `AllocboxPlugin(source, config=None, **limits)` takes
    what `allocbox.load` takes (a shipped policy's name, a path or bytes; the policy's
    `{key: value}` config; the bounds `call_time`, `memory`, `batch`, `overhead`,
    `host_memory_limit`). Register it with `client.register_plugin(plugin)`.

    Each worker loads its own policy; registering a plugin of the same `name` (default
    `"allocbox"`) replaces it. A policy that cannot be loaded fails the registration
    with the worker's address in the message."""

    def __init__(self, source, config=None, *, name=_DEFAULT_NAME, **limits):
        self.source = _portable(source)
        self.config = {str(key): str(value) for key, value in (config or {}).items()}
        self.limits = limits
        self.name = name
        self._runtime = None

    def __getstate__(self):
        # Only what a worker needs to load the policy travels; never a loaded one.
        state = self.__dict__.copy()
        state["_runtime"] = None
        return state

    def __repr__(self):
        source = (
            f"<{len(self.source)} bytes>" if isinstance(self.source, bytes) else repr(self.source)
        )
        extra = "".join(f", {key}={value!r}" for key, value in self.limits.items())
        return f"AllocboxPlugin({source}, config={self.config!r}{extra})"

    @property
    def policy(self):
        """The policy this worker loaded (None before `setup`, and on the client)."""
        return self._runtime.policy if self._runtime is not None else None

    def setup(self, worker):
        try:
            policy = allocbox.load(self.source, self.config or None, **self.limits)
        except AllocboxError as error:
            raise type(error)(f"worker {worker.address}: {error}") from None
        self._runtime = _Runtime(worker, policy)

    def teardown(self, worker):
        if self._runtime is not None:
            self._runtime.stop()
            self._runtime = None


class _Runtime:
    """The policy installed in one worker.

    Where the policy must be installed: NumPy's handler lives in a context variable, and
    a worker does not run a task in its executor thread's own context but in a copy of
    the context of the asyncio task that awaits it (`Worker.execute` calls
    `run_in_executor_with_context`). So a handler set in the executor's threads (by a
    pool initializer, or as they start) would not be seen by the tasks. Instead the
    worker's `execute` is wrapped: each task gets an asyncio task of its own, the wrapper
    sets the handler in that task's private context, and the copy the executor thread
    runs the task in carries it — whichever executor thread runs it, however old, and
    nothing else on the event loop is touched.

    Threads the worker process starts from now on (the actor thread, threads a task
    starts itself, executors that run tasks without a context) get the policy as they
    start, through `threading.setprofile` as `allocbox.use(policy, threads=True)` does.

    What is installed is the policy's handler capsule, not the policy: `set_handler`
    refuses a stopped policy, but once the policy is stopped the worker's tasks should go
    on running under it and fail as they would in one process (NumPy's `MemoryError`),
    not quietly fall back to NumPy's default handler.

    The wrapper also gives a task's `MemoryError` its cause when the policy was stopped:
    the failure the client receives is the policy's own error, naming this worker."""

    def __init__(self, worker, policy):
        self.worker = worker
        self.policy = policy
        handler = policy.capsule()
        self._had_own_execute = "execute" in vars(worker)
        self._execute = worker.execute
        self._restore_threads = _start_threads_with(handler)
        runtime = self

        async def execute(*args, **kwargs):
            policy = runtime.policy
            if policy is None:  # stopped, but wrapped again by something after us
                return await runtime._execute(*args, **kwargs)
            allocbox.set_handler(handler)  # this asyncio task's own context only
            event = await runtime._execute(*args, **kwargs)
            if policy.failure is not None:
                runtime._name_the_cause(event, policy)
            return event

        self._wrapper = execute
        worker.execute = execute

    def stop(self):
        self._restore_threads()
        if vars(self.worker).get("execute") is self._wrapper:
            if self._had_own_execute:
                self.worker.execute = self._execute
            else:
                del self.worker.execute
        self.policy = None

    def report(self):
        policy = self.policy
        return {
            "policy": policy.name,
            "stats": policy.stats(),
            "link_stats": policy.link_stats(),
            "failures": policy.failures,
            "error": _error_of(policy),
        }

    def _name_the_cause(self, event, policy):
        """If `event` is a task's failure with `MemoryError`, make it the policy's error."""
        try:
            from distributed.protocol import pickle, to_serialize
            from distributed.worker_state_machine import ExecuteFailureEvent

            if not isinstance(event, ExecuteFailureEvent):
                return
            exception = pickle.loads(event.exception.data)
            if not isinstance(exception, MemoryError):
                return
            error = _error_of(policy)
            if error is None:
                return
            kind, message = error
            key = event.key if isinstance(event.key, str) else repr(event.key)
            raised = _error_class(kind)(
                f"worker {self.worker.address}: {message}; for that reason NumPy raised "
                f"MemoryError in task {key} ({exception})"
            )
            event.exception = to_serialize(pickle.dumps(raised))
            event.exception_text = repr(raised)
        except Exception:  # an unknown `distributed`: its own report stands
            return


def _error_of(policy):
    """The error `policy.raise_if_failed()` raises, as (class name, message), or None."""
    try:
        policy.raise_if_failed()
    except AllocboxError as error:
        return type(error).__name__, str(error)
    if policy.failure is not None:
        return AllocboxError.__name__, policy.failure
    return None


def _error_class(kind):
    error = getattr(allocbox, kind, None)
    return error if isinstance(error, type) and issubclass(error, AllocboxError) else AllocboxError


def _report(dask_worker, name):
    # Runs on each worker's event loop, through `client.run`.
    plugin = dask_worker.plugins.get(name)
    runtime = getattr(plugin, "_runtime", None)
    return runtime.report() if runtime is not None else None


def gather(client, *, name=_DEFAULT_NAME):
    """What each worker's policy did: `{worker address: {"policy": its name, "stats":
    policy.stats(), "link_stats": policy.link_stats(), "failures": policy.failures}}`;
    a worker without the plugin `name` (not registered, or not yet set up) maps to None."""
    reports = client.run(_report, name=name)
    return {
        address: None if report is None else {key: value for key, value in report.items() if key != "error"}
        for address, report in sorted(reports.items())
    }


def raise_if_failed(client, *, name=_DEFAULT_NAME):
    """Raise the first failure of any worker's policy as the error its
    `raise_if_failed()` raises (`allocbox.ContractViolation`, `PoisonedPolicy` or
    `ClientError`), its message naming the worker, the policy and the rule; and how
    many other workers failed. Returns None when no worker's policy failed."""
    reports = client.run(_report, name=name)
    failed = [
        (address, report["error"])
        for address, report in sorted(reports.items())
        if report is not None and report["error"] is not None
    ]
    if not failed:
        return
    (address, (kind, message)), others = failed[0], failed[1:]
    if others:
        more = ", ".join(address for address, _ in others)
        message += f" (the policy failed on {len(others)} more worker{'s' * (len(others) > 1)}: {more})"
    raise _error_class(kind)(f"worker {address}: {message}")
