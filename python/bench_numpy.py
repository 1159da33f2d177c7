"""NumPy's default handler against allocbox policies as NumPy handlers, in one run.

    python python/bench_numpy.py            # prints a table of medians and ratios
    python python/bench_numpy.py --workload small --policy binning --policy limit

Workloads: small-array arithmetic (1-100 elements, in a loop), mid-size (64 KiB), large
temporaries (`a + b + c` over 8-32 MiB and 64 MiB operands), and `np.zeros` of small,
64 KiB and 1 GiB arrays (made and dropped: a GiB of zeros must stay untouched pages). Each cell is the median of 9 rounds,
the handlers taking turns within each round.
`+large-cache` is size-classes with `large-cache=4` (keeps freed blocks >= 1 MiB).
`--recording` adds the first policy recording a trace with times (`recorded`), and with
times and the program's lines (`+sites`), to a temporary folder.
Build the extension with `maturin develop --release` first: a debug build measures
unoptimised host code.
"""

import argparse
import os
import pathlib
import statistics
import sys
import time

# OpenBLAS starts a thread per core that spins after each call; on a 2-core machine
# they took 40% of a short profile's samples from the workloads, which use no BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402 - after the BLAS thread count

import allocbox  # noqa: E402

GUESTS = pathlib.Path(__file__).resolve().parents[1] / "target" / "guests" / "wasm32-wasip2" / "release"


def small():
    arrays = [np.arange(n, dtype=np.float64) for n in range(1, 101)]
    # About 17 ms a round: at 20 repetitions (3.5 ms) the ratio moved by +-3% between
    # runs, as much as the differences being measured.
    for _ in range(100):
        for a in arrays:
            (a * 2.0 + 1.0).sum()


def mid():
    a = np.ones(8192)  # 64 KiB
    # About 15 ms a round: at 400 iterations (3 ms) the ratio moved by +-8% between
    # runs on a 2-core VM, more than the differences being measured.
    for _ in range(2000):
        b = a * 2.0
        c = b + a
        c.sum()


def temporaries(sizes_mib):
    """Operands made once per size, then the same expression over and over: each
    evaluation makes (and frees) one temporary of the operands' size."""

    def work():
        for mib in sizes_mib:
            n = mib * (1 << 20) // 8
            a = np.ones(n)
            b = np.full(n, 2.0)
            c = np.full(n, 3.0)
            for _ in range(5):
                (a + b + c).sum()

    return work


def zeros_small():
    for _ in range(100):
        for n in range(1, 101):
            np.zeros(n)


def zeros_mid():
    for _ in range(2000):
        np.zeros(8192)  # 64 KiB


def zeros_huge():
    for _ in range(5):
        np.zeros(1 << 27)  # 1 GiB, never touched


def gathers():
    """Random gathers over 1 GiB of 64 KiB - 4 MiB arrays, made under the handler each
    round: bound by TLB misses where those arrays sit in 4 KiB pages (NumPy's default
    advises huge pages only from 4 MiB)."""
    rng = np.random.default_rng(7)
    sizes = rng.integers(64 << 10, 4 << 20, size=500) // 8
    # Made under NumPy's default, once: the indices are not what is measured.
    picks = [rng.integers(0, n, 1 << 13) for n in sizes]

    def work():
        arrays = [np.ones(n) for n in sizes]
        for _ in range(2):
            for a, i in zip(arrays, picks):
                a[i].sum()

    return work


# glibc serves blocks up to 32 MiB from its heap once one was freed (its mmap threshold
# rises), so NumPy's default reuses them; larger ones are mapped and faulted in anew.
WORKLOADS = [
    ("small arrays (1-100 elements)", small),
    ("mid-size (64 KiB)", mid),
    ("large temporaries (8-32 MiB)", temporaries([8, 16, 32])),
    ("large temporaries (64 MiB)", temporaries([64])),
    ("np.zeros, 1-100 elements", zeros_small),
    ("np.zeros, 64 KiB", zeros_mid),
    ("np.zeros, 1 GiB", zeros_huge),
    ("random gathers, 64 KiB-4 MiB", gathers()),
]


def timed(work, policy):
    """Seconds `work` takes under `policy` (`allocbox.use`), or in the block a callable
    `policy` opens (`bench_numba.py`'s process-wide column), or with none."""
    if policy is None:
        start = time.perf_counter()
        work()
        return time.perf_counter() - start
    with policy() if callable(policy) else allocbox.use(policy):
        start = time.perf_counter()
        work()
        return time.perf_counter() - start


def medians(work, handlers, rounds=9):
    """Median seconds per handler; handlers take turns within each round, so a slow
    moment of the machine does not land on one column only."""
    times = [[] for _ in handlers]
    for _ in range(rounds):
        for i, (_, policy) in enumerate(handlers):
            times[i].append(timed(work, policy))
    return [statistics.median(t) for t in times]


# Policies that ask for a kind of memory get it granted here.
GRANTS = {"thp-arena": ["huge-pages"], "numa": ["numa"], "guard": ["guarded"]}

DEFAULT_POLICIES = (
    ("system", "system", None),
    ("size-classes", "size-classes", None),
    ("arena", "arena", None),
    ("+large-cache", "size-classes", {"large-cache": "4"}),
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", action="append", help="a built guest by name (repeatable); default: system, size-classes, arena, +large-cache")
    parser.add_argument("--recording", action="store_true", help="add the first policy recorded with time, and with time and sites (the cost of `allocbox run --record [--sites]`)")
    parser.add_argument("--workload", action="append", choices=["small", "mid", "large", "64mib", "zeros-small", "zeros-mid", "zeros-1gib", "gathers"], help="repeatable; default: all")
    args = parser.parse_args()
    policies = [(n, n, None) for n in args.policy] if args.policy else DEFAULT_POLICIES
    keys = ["small", "mid", "large", "64mib", "zeros-small", "zeros-mid", "zeros-1gib", "gathers"]
    workloads = [w for k, w in zip(keys, WORKLOADS) if not args.workload or k in args.workload]
    # "native, bridged": NumPy's default reimplemented natively, installed through the
    # same capsule and callbacks as the policies: the cost of any custom handler.
    handlers = [("numpy default", None), ("native, bridged", allocbox.native_default())]
    for label, name, config in policies:
        path = GUESTS / f"policy_{name.replace('-', '_')}.wasm"
        if not path.exists():
            sys.exit(f"{path} is missing: build the guests first (cargo test)")
        handlers.append((label, allocbox.load(path, config, grant=GRANTS.get(name, []))))
    if args.recording:
        import tempfile

        label, name, config = policies[0]
        path = GUESTS / f"policy_{name.replace('-', '_')}.wasm"
        traces = tempfile.mkdtemp()
        for suffix, sites in (("recorded", False), ("+sites", True)):
            record = os.path.join(traces, f"{suffix}.trace")
            handlers.append((f"{label} {suffix}", allocbox.load(path, config, record=record, record_sites=sites)))
    print(f"{'workload':<32}" + "".join(f"{name:>16}" for name, _ in handlers))
    for label, work in workloads:
        work()  # warm up caches and page tables
        results = medians(work, handlers)
        base = results[0]
        cells = [f"{t * 1e3:8.1f}ms {t / base:5.2f}x" for t in results]
        print(f"{label:<32}" + "".join(f"{c:>16}" for c in cells))
    for name, policy in handlers[1:]:
        policy.raise_if_failed()


if __name__ == "__main__":
    main()
