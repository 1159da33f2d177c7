"""Numba's own allocator against allocbox policies placing the arrays Numba's compiled
code makes (`allocbox.numba`), in one run.

    python python/bench_numba.py            # prints a table of medians and ratios
    python python/bench_numba.py --policy binning --policy limit

The workload is an `@njit` kernel that makes an array, writes and reads it, and drops
it, in a loop: small arrays (8 elements) and 64 KiB arrays (8192). Each cell is the
median of 9 rounds. "numba's own" is measured first, before `allocbox.numba.enable()`
(which cannot be undone in a process); the other columns then take turns within each
round: "no policy" is Numba's own allocator behind the route (what the route costs
where no allocbox policy is current), "native, bridged" NumPy's default handler
reimplemented natively behind the route and the bridge (what they cost before a policy
does anything), and "process-wide" the last policy again, placing every array
under `allocbox.numba.use` (process-wide: no question to NumPy per array; what
`allocbox run` does). A second table runs a `prange` loop making arrays on every one of
Numba's workers at once, at 2 threads and at 16 (`NUMBA_NUM_THREADS`, 16 unless set),
under Numba's own allocator, `system` asked on every call by one instance
(`magazines=False, per_thread=False`), the same with an instance per thread (what
`magazines=False` gives by default), and `system` with magazines.
Build the extension with `maturin develop --release` first: a debug build measures
unoptimised host code.
"""

import argparse
import os
import pathlib
import sys

# Numba's pool has this many workers at most, fixed when it starts: 16, so that the
# parallel rows can oversubscribe a small machine.
os.environ.setdefault("NUMBA_NUM_THREADS", "16")
# OpenBLAS starts a thread per core that spins after each call; on a 2-core machine
# they took 40% of a short profile's samples from the workloads, which use no BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numba  # noqa: E402 - after its thread count
import numpy as np

import allocbox
import allocbox.numba
# The same timing as NumPy's benchmark beside it: handlers take turns within each round.
from bench_numpy import medians, timed

GUESTS = pathlib.Path(__file__).resolve().parents[1] / "target" / "guests" / "wasm32-wasip2" / "release"


@numba.njit
def make_and_drop(n, size):
    total = 0.0
    for i in range(n):
        a = np.empty(size)
        a[0] = i
        a[size - 1] = 1.0
        total += a[0] + a[size - 1]
    return total


@numba.njit(parallel=True)
def make_and_drop_in_parallel(n, size):
    total = 0.0
    for i in numba.prange(n):
        # A length that changes with `i`: Numba hoists a loop-invariant allocation out of
        # a `prange` loop, which would make one array per worker.
        length = size + i % 2
        a = np.empty(length)
        a[0] = i
        a[length - 1] = 1.0
        total += a[0] + a[length - 1]
    return total


def on_threads(count, n, size):
    """`make_and_drop_in_parallel` on `count` of Numba's workers."""

    def work():
        numba.set_num_threads(count)
        make_and_drop_in_parallel(n, size)

    return work


# Every worker makes and drops arrays at once: Numba's own allocator, a policy asked on
# every call (its threads' calls served in turn by whichever is inside it), and the same
# policy with per-thread magazines. Both policies place every array process-wide, as
# `allocbox run` does, so that Numba's workers use them.
PARALLEL_WORKLOADS = [
    (f"prange small arrays, {count} threads", on_threads(count, 100_000, 8)) for count in (2, 16)
]


# About 15 ms a round each, as in bench_numpy.py: shorter rounds moved the ratio by more
# than the differences being measured.
WORKLOADS = [
    ("@njit small arrays (8 elements)", lambda: make_and_drop(300_000, 8)),
    ("@njit 64 KiB arrays", lambda: make_and_drop(30_000, 8192)),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", action="append", help="a built guest by name (repeatable); default: system, size-classes")
    args = parser.parse_args()
    make_and_drop(10, 8)  # compiled before anything is timed
    make_and_drop_in_parallel(10, 8)
    own = []
    for _, work in WORKLOADS + PARALLEL_WORKLOADS:
        work()  # warm up caches and page tables
        own.append(medians(work, [("numba's own", None)])[0])
    allocbox.numba.enable()
    handlers = [("no policy", None), ("native, bridged", allocbox.native_default())]
    for name in args.policy or ["system", "size-classes"]:
        path = GUESTS / f"policy_{name.replace('-', '_')}.wasm"
        if not path.exists():
            sys.exit(f"{path} is missing: build the guests first (cargo test)")
        handlers.append((name, allocbox.load(path)))
    # The last policy again, process-wide: no question to NumPy per array.
    last = handlers[-1][1]
    handlers.append(("process-wide", lambda: allocbox.numba.use(last)))
    make_and_drop(10, 8)  # compiled again, through the route
    columns = ["numba's own", *(name for name, _ in handlers)]
    print(f"{'workload':<34}" + "".join(f"{name:>17}" for name in columns))
    for (label, work), base in zip(WORKLOADS, own):
        for _, policy in handlers:
            timed(work, policy)  # warm up caches and page tables
        results = [base, *medians(work, handlers)]
        cells = [f"{t * 1e3:8.1f}ms {t / base:5.2f}x" for t in results]
        print(f"{label:<34}" + "".join(f"{c:>17}" for c in cells))
    per_call = allocbox.load(GUESTS / "policy_system.wasm", magazines=False, per_thread=False)
    per_thread = allocbox.load(GUESTS / "policy_system.wasm", per_thread=True)
    magazines = allocbox.load(GUESTS / "policy_system.wasm")
    parallel = [
        ("system, per call", lambda: allocbox.numba.use(per_call)),
        ("system, per thread", lambda: allocbox.numba.use(per_thread)),
        ("system, magazines", lambda: allocbox.numba.use(magazines)),
    ]
    make_and_drop_in_parallel(10, 8)  # compiled again, through the route
    print()
    print(f"{'workload':<34}" + "".join(f"{name:>19}" for name in ["numba's own", *(n for n, _ in parallel)]))
    for (label, work), base in zip(PARALLEL_WORKLOADS, own[len(WORKLOADS):]):
        for _, policy in parallel:
            timed(work, policy)
        results = [base, *medians(work, parallel)]
        cells = [f"{t * 1e3:8.1f}ms {t / base:6.2f}x" for t in results]
        print(f"{label:<34}" + "".join(f"{c:>19}" for c in cells))
    print(f"system, per thread: {per_thread.instances} instances of `system` started")
    for name, policy in [
        ("system, per call", per_call),
        ("system, per call, per thread", per_thread),
        ("system, magazines", magazines),
    ]:
        policy.raise_if_failed()
        stats = policy.stats()
        if stats["live_blocks"] != 0 or stats["mallocs"] == 0:
            sys.exit(f"{name}: the parallel kernel's arrays did not all go through it: {stats}")
    for name, policy in handlers[1:]:
        if callable(policy):
            continue
        policy.raise_if_failed()
        stats = policy.stats()
        if stats["live_blocks"] != 0 or stats["mallocs"] == 0:
            sys.exit(f"{name}: the kernel's arrays did not all go through it: {stats}")


if __name__ == "__main__":
    main()
