"""allocbox's checks on a machine with a GPU (CI has none): run with the wheel
installed and PyTorch, CuPy and Numba with numba-cuda beside it.

    python -P python/gpu_check.py [--out FILE] [--quick]

(`-P`: the installed package, not the source folder beside this script, is imported.)

Each part prints its own lines and ends with `ok` or `FAILED: why`; the last line
counts them (`N passed, N failed`), and the exit status is 1 when one failed.

1. pinned vs pageable: copy a 256 MiB NumPy array to the GPU with PyTorch, CuPy and
   Numba, from ordinary pages and from the `gpu-pool` policy's pinned memory;
2. the device pool's speed: alloc+free pairs of 256 B, 1 MiB and 64 MiB from
   `gpu-pool` against CuPy's default pool and PyTorch's caching allocator;
3. CuPy under `cupy_allocator`: a set of CuPy operations (creation, arithmetic,
   matmul, reductions, FFT, sorting, two streams) against NumPy's answers, and pinned
   staging buffers from `cupy_pinned_allocator`;
4. PyTorch under `torch_allocator`: a small MLP trained for 20 steps, forward and
   backward on two streams (`record_stream`), in two processes, one with PyTorch's own
   allocator: the losses must be identical;
5. Numba under `allocbox.cuda`'s EMM plugin: a kernel writing device arrays, then
   Numba's own allocating test modules with and without the plugin: the same outcomes
   (numba-cuda's tests import `filecheck`, a PyPI package).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

RESULTS = []
OUT = []


def say(line=""):
    print(line, flush=True)
    OUT.append(line)


def part(name):
    def wrap(fn):
        def run(*args):
            say(f"== {name}")
            started = time.perf_counter()
            try:
                fn(*args)
            except Exception as e:  # a part's failure is reported, the others still run
                import traceback

                say(traceback.format_exc().rstrip())
                say(f"FAILED: {type(e).__name__}: {e}")
                RESULTS.append((name, False))
            else:
                say("ok")
                RESULTS.append((name, True))
            say(f"({time.perf_counter() - started:.1f} s)")

        return run

    return wrap


def numba_shim_dir():
    """numba-cuda 0.30 still calls np.row_stack, which NumPy 2.5 removed."""
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write("import numpy as np\nif not hasattr(np, 'row_stack'):\n    np.row_stack = np.vstack\n")
    return folder


def env_with_shim():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (numba_shim_dir(), env.get("PYTHONPATH")) if p)
    return env


def best_of(n, fn):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


@part("pinned vs pageable copies of a 256 MiB NumPy array")
def pinned_copies():
    import allocbox
    import torch

    size = 256 << 20
    pageable = np.ones(size, dtype=np.uint8)
    pinned_policy = allocbox.load("gpu-pool", {"memory": "pinned"}, grant=["pinned"])
    t = time.perf_counter()
    with allocbox.use(pinned_policy):
        pinned = np.ones(size, dtype=np.uint8)
    say(f"a 256 MiB pinned array made and filled in {1e3 * (time.perf_counter() - t):.1f} ms")
    say(f"gpu-pool (pinned) counters: {pinned_policy.stats()['counters']}")
    import cupy

    kinds = {0: "unregistered", 1: "host (pinned)", 2: "device", 3: "managed"}
    for label, a in (("pinned", pinned), ("ordinary", pageable)):
        kind = cupy.cuda.runtime.pointerGetAttributes(a.ctypes.data).type
        say(f"the driver calls the {label} array's memory {kinds.get(kind, kind)}")
    assert cupy.cuda.runtime.pointerGetAttributes(pinned.ctypes.data).type == 1
    torch.cuda.init()
    say(f"torch.from_numpy(...).is_pinned(): pinned {torch.from_numpy(pinned).is_pinned()}, ordinary {torch.from_numpy(pageable).is_pinned()}")

    def torch_copy(a):
        def go():
            torch.from_numpy(a).cuda(non_blocking=True)
            torch.cuda.synchronize()

        return go

    rates = {}
    for label, a in (("pageable", pageable), ("pinned", pinned)):
        torch_copy(a)()
        seconds = best_of(5, torch_copy(a))
        rates[label] = size / seconds / 1e9
        say(f"torch  {label:8s} {rates[label]:6.1f} GB/s (median of 5)")
    for label, a in (("pageable", pageable), ("pinned", pinned)):

        def go(a=a):
            cupy.asarray(a)
            cupy.cuda.Device().synchronize()

        go()
        say(f"cupy   {label:8s} {size / best_of(5, go) / 1e9:6.1f} GB/s (median of 5)")
    say(f"pinned/pageable with torch: {rates['pinned'] / rates['pageable']:.2f}x")
    del pinned
    assert rates["pinned"] > 1.5 * rates["pageable"], "pinned memory copied no faster"


@part("device pool speed: alloc+free pairs from Python")
def pool_speed():
    import allocbox.cuda
    import cupy
    import torch

    pool = allocbox.cuda.load("gpu-pool")
    sizes = (256, 1 << 20, 64 << 20)
    n = 2000
    say(f"{'size':>10} {'gpu-pool':>10} {'block()':>10} {'cupy pool':>10} {'torch':>10}   (us per pair, median of 3)")
    cupy_pool = cupy.cuda.MemoryPool()
    for size in sizes:

        def raw():
            for _ in range(n):
                pool.free(pool.malloc(size))

        def owned():
            for _ in range(n):
                pool.block(size).free()

        def cupy_default():
            for _ in range(n):
                cupy_pool.malloc(size)

        def torch_default():
            for _ in range(n):
                torch.empty(size, dtype=torch.uint8, device="cuda")

        row = [best_of(3, f) / n * 1e6 for f in (raw, owned, cupy_default, torch_default)]
        say(f"{size:>10} " + " ".join(f"{v:>10.2f}" for v in row))
    pool.synchronize()
    pool.trim()
    say(f"gpu-pool stats after: live {pool.stats()['live_blocks']}, counters {pool.stats()['counters']}")
    pool.leak_check()


@part("CuPy under allocbox.cuda.cupy_allocator")
def cupy_under_policy():
    import allocbox.cuda
    import cupy

    pool = allocbox.cuda.load("gpu-pool")
    pinned = allocbox.load("gpu-pool", {"memory": "pinned"}, grant=["pinned"])
    cupy.cuda.set_allocator(allocbox.cuda.cupy_allocator(pool))
    cupy.cuda.set_pinned_memory_allocator(allocbox.cuda.cupy_pinned_allocator(pinned))
    try:
        cupy_work(cupy)
        import cupyx

        staged = cupyx.empty_pinned((1 << 20,), dtype=np.float32)
        kind = cupy.cuda.runtime.pointerGetAttributes(staged.ctypes.data).type
        say(f"cupyx.empty_pinned from the pinned policy: the driver calls it {'pinned' if kind == 1 else kind}")
        assert kind == 1 and pinned.stats()["live_blocks"] >= 1
        staged[:] = 3
        assert float(cupy.asarray(staged).sum()) == 3 * (1 << 20)
        del staged
    finally:
        cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)
        cupy.cuda.set_pinned_memory_allocator(cupy.cuda.PinnedMemoryPool().malloc)
    import gc

    # cuFFT's plans keep their work areas, from the allocator that was current.
    cupy.fft.config.get_plan_cache().clear()
    gc.collect()
    cupy.cuda.Device().synchronize()
    pool.synchronize()
    stats = pool.stats()
    say(f"after: mallocs {stats['mallocs']}, frees {stats['frees']}, live {stats['live_blocks']}, pending {stats['pending_frees']}")
    assert stats["live_blocks"] == 0, stats
    pool.leak_check()


def cupy_work(cupy):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((512, 512)).astype(np.float32)
    b = rng.standard_normal((512, 512)).astype(np.float32)
    da, db = cupy.asarray(a), cupy.asarray(b)
    checks = {
        "add": (da + db, a + b),
        "matmul": (da @ db, a @ b),
        "sum": (da.sum(axis=0), a.sum(axis=0)),
        "sort": (cupy.sort(da, axis=1), np.sort(a, axis=1)),
        "fft": (cupy.fft.fft(da[0]), np.fft.fft(a[0])),
        "zeros": (cupy.zeros(1000), np.zeros(1000)),
        "empty0": (cupy.empty(0), np.empty(0)),
        "arange": (cupy.arange(10**6) % 7, np.arange(10**6) % 7),
    }
    for name, (got, want) in checks.items():
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=2e-3, atol=2e-3, err_msg=name)
    say(f"{len(checks)} operations agree with NumPy")
    # Two streams: a block freed on s1 while a kernel there reads it must not be
    # handed to s2 before that kernel ends.
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    total = 0.0
    for i in range(50):
        with s1:
            x = cupy.full(1 << 20, float(i), dtype=cupy.float32)
            y = (x * 2).sum()
            del x
        with s2:
            z = cupy.full(1 << 20, 1.0, dtype=cupy.float32)
            w = z.sum()
        s1.synchronize()
        s2.synchronize()
        total += float(y) + float(w)
    want = sum(2.0 * i * (1 << 20) + (1 << 20) for i in range(50))
    assert abs(total - want) / want < 1e-6, (total, want)
    say("two streams: 50 rounds agree")


TORCH_TRAINING = textwrap.dedent(
    """
    import sys, torch
    if sys.argv[1] == "allocbox":
        import allocbox.cuda
        pool = allocbox.cuda.load("gpu-pool")
        torch.cuda.memory.change_current_allocator(allocbox.cuda.torch_allocator(pool))
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    side = torch.cuda.Stream()
    losses = []
    for step in range(20):
        x = torch.randn(128, 256, device="cuda")
        y = torch.randint(0, 10, (128,), device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
        torch.cuda.current_stream().wait_stream(side)
        x.record_stream(side)
        out.record_stream(side)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(" ".join(f"{l:.9g}" for l in losses))
    if sys.argv[1] == "allocbox":
        del model, opt, x, y, out, loss
        import gc; gc.collect(); torch.cuda.synchronize()
        s = pool.stats()
        print(f"allocbox: mallocs {s['mallocs']} frees {s['frees']} live {s['live_blocks']} pending {s['pending_frees']} size corrections {s['size_corrections']}", file=sys.stderr)
    """
)


@part("PyTorch: a training step under torch_allocator, losses against PyTorch's own")
def torch_training():
    runs = {}
    for which in ("default", "allocbox"):
        done = subprocess.run(
            [sys.executable, "-c", TORCH_TRAINING, which], capture_output=True, text=True, timeout=150
        )
        if done.returncode != 0:
            raise RuntimeError(f"{which} run exited {done.returncode}:\n{done.stderr[-3000:]}")
        runs[which] = done.stdout.split()
        if done.stderr.strip():
            say(done.stderr.strip().splitlines()[-1])
    say(f"first and last loss: {runs['default'][0]} -> {runs['default'][-1]}")
    assert runs["default"] == runs["allocbox"], f"losses differ:\n{runs}"
    say("20 losses identical")


NUMBA_KERNEL = textwrap.dedent(
    """
    import numpy as np
    import allocbox.cuda
    pool = allocbox.cuda.load("gpu-pool")
    allocbox.cuda.use_with_numba(pool)
    from numba import cuda

    @cuda.jit
    def twice(a, out):
        i = cuda.grid(1)
        if i < a.size:
            out[i] = 2 * a[i]

    a = cuda.to_device(np.arange(1 << 20, dtype=np.float32))
    out = cuda.device_array(1 << 20, dtype=np.float32)
    twice[(1 << 20) // 256, 256](a, out)
    assert (out.copy_to_host() == 2 * np.arange(1 << 20, dtype=np.float32)).all()
    s = pool.stats()
    print(f"kernel ok; policy mallocs {s['mallocs']}, live {s['live_blocks']}")
    info = cuda.current_context().get_memory_info()
    print(f"memory info from the plugin: free {info.free >> 20} MiB of {info.total >> 20} MiB")
    del a, out
    import gc; gc.collect()
    """
)

NUMBA_MODULES = [
    "numba.cuda.tests.cudadrv.test_cuda_memory",
    "numba.cuda.tests.cudadrv.test_cuda_ndarray",
    "numba.cuda.tests.cudadrv.test_cuda_array_slicing",
    "numba.cuda.tests.cudadrv.test_array_attr",
    "numba.cuda.tests.cudapy.test_array",
    "numba.cuda.tests.cudapy.test_cuda_array_interface",
]


FIND_MODULES = textwrap.dedent(
    """
    import importlib, sys, traceback
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except Exception:
            print("missing", name, traceback.format_exc().strip().splitlines()[-1])
        else:
            print("found", name)
    """
)


def importable(modules, env):
    """The modules of `modules` that import (numba-cuda's tests need `filecheck`)."""
    done = subprocess.run(
        [sys.executable, "-c", FIND_MODULES, *modules], capture_output=True, text=True, env=env, timeout=120
    )
    found = []
    for line in done.stdout.splitlines():
        if line.startswith("found "):
            found.append(line.split()[1])
        else:
            say(line)
    if not found:
        say(done.stderr[-2000:])
        raise RuntimeError("none of Numba's CUDA test modules imports")
    return found


RUN_TESTS = textwrap.dedent(
    """
    import json, sys, traceback, unittest

    class Recorded(unittest.TestResult):
        def __init__(self):
            super().__init__()
            self.outcomes = {}
            self.details = {}

        def addSuccess(self, test):
            self.outcomes[test.id()] = "ok"

        def addFailure(self, test, err):
            self.outcomes[test.id()] = "FAIL"
            self.details[test.id()] = self._exc_info_to_string(err, test)

        def addError(self, test, err):
            self.outcomes[test.id()] = "ERROR"
            self.details[test.id()] = self._exc_info_to_string(err, test)

        def addSkip(self, test, reason):
            self.outcomes[test.id()] = "skipped"

        def addExpectedFailure(self, test, err):
            self.outcomes[test.id()] = "expected failure"

        def addUnexpectedSuccess(self, test):
            self.outcomes[test.id()] = "unexpected success"

    suite = unittest.defaultTestLoader.loadTestsFromNames(sys.argv[2:])
    result = Recorded()
    suite.run(result)
    with open(sys.argv[1], "w") as f:
        json.dump({"outcomes": result.outcomes, "details": result.details}, f)
    """
)


def unittest_outcomes(modules, env):
    """Each test's outcome (`ok`, `FAIL`, `ERROR`, `skipped`, ...) and the traceback of
    each that failed."""
    import json

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        done = subprocess.run(
            [sys.executable, "-c", RUN_TESTS, out.name, *modules],
            capture_output=True,
            text=True,
            env=env,
            timeout=200,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the test run exited {done.returncode}:\n{done.stderr[-3000:]}")
        recorded = json.load(open(out.name))
    return recorded["outcomes"], recorded["details"]


def summary(outcomes):
    counts = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))


@part("Numba: a kernel and Numba's own allocating tests under the EMM plugin")
def numba_under_plugin(quick):
    env = env_with_shim()
    done = subprocess.run([sys.executable, "-c", NUMBA_KERNEL], capture_output=True, text=True, env=env, timeout=150)
    if done.returncode != 0:
        raise RuntimeError(f"kernel run exited {done.returncode}:\n{done.stderr[-3000:]}")
    for line in done.stdout.strip().splitlines():
        say(line)
    modules = importable(NUMBA_MODULES[:3] if quick else NUMBA_MODULES, env)
    plain, plain_details = unittest_outcomes(modules, env)
    env_plugin = dict(env, NUMBA_CUDA_MEMORY_MANAGER="allocbox.cuda")
    under, under_details = unittest_outcomes(modules, env_plugin)
    say(f"without the plugin: {len(plain)} tests: {summary(plain)}")
    say(f"with the plugin:    {len(under)} tests: {summary(under)}")
    changed = sorted(k for k in set(plain) | set(under) if plain.get(k) != under.get(k))
    # Numba skips some of its tests under any external memory manager, by design
    # (`skip_if_external_memmgr`): a pass that becomes such a skip is no change.
    real = [k for k in changed if not (plain.get(k) == "ok" and under.get(k) == "skipped")]
    for name in changed:
        say(f"  changed: {name}: {plain.get(name)} -> {under.get(name)}")
        if name in under_details:
            say(textwrap.indent(under_details[name].rstrip()[-2500:], "    "))
    if not plain or all(outcome == "ERROR" for outcome in plain.values()):
        say(next(iter(plain_details.values()), "")[:3000])
        raise RuntimeError("Numba's test modules did not run (above: why)")
    say(f"{len(plain)} tests, {len(real)} outcomes changed ({len(changed) - len(real)} skipped under any external memory manager)")
    assert not real, "outcomes changed under the plugin"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the output to this file")
    parser.add_argument("--quick", action="store_true", help="fewer Numba test modules")
    args = parser.parse_args()
    import allocbox

    say(f"allocbox from {os.path.dirname(allocbox.__file__)}; NumPy {np.__version__}")
    pinned_copies()
    pool_speed()
    cupy_under_policy()
    torch_training()
    numba_under_plugin(args.quick)
    passed = sum(ok for _, ok in RESULTS)
    say(f"{passed} passed, {len(RESULTS) - passed} failed")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(OUT) + "\n")
    return 0 if passed == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
