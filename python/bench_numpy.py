"""NumPy's default handler against allocbox policies as NumPy handlers, in one run.

    python python/bench_numpy.py            # prints a table of medians and ratios

Workloads: small-array arithmetic (1-100 elements, in a loop), mid-size (64 KiB), and
large temporaries (8-64 MiB, `a + b + c` chains). Each cell is the median of 7 rounds.
"""

import pathlib
import statistics
import sys
import time

import numpy as np

import allocbox

GUESTS = pathlib.Path(__file__).resolve().parents[1] / "target" / "guests" / "wasm32-wasip2" / "release"


def small():
    arrays = [np.arange(n, dtype=np.float64) for n in range(1, 101)]
    for _ in range(20):
        for a in arrays:
            (a * 2.0 + 1.0).sum()


def mid():
    a = np.ones(8192)  # 64 KiB
    for _ in range(400):
        b = a * 2.0
        c = b + a
        c.sum()


def large():
    for mib in (8, 16, 32, 64):
        n = mib * (1 << 20) // 8
        a = np.ones(n)
        b = np.full(n, 2.0)
        c = np.full(n, 3.0)
        for _ in range(2):
            (a + b + c).sum()


WORKLOADS = [("small arrays (1-100 elements)", small), ("mid-size (64 KiB)", mid), ("large temporaries (8-64 MiB)", large)]


def median_seconds(work, policy, rounds=7):
    times = []
    for _ in range(rounds):
        if policy is None:
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        else:
            with allocbox.use(policy):
                start = time.perf_counter()
                work()
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    handlers = [("numpy default", None)]
    for name in ("system", "size-classes", "arena"):
        path = GUESTS / f"policy_{name.replace('-', '_')}.wasm"
        if not path.exists():
            sys.exit(f"{path} is missing: build the guests first (cargo test)")
        handlers.append((name, allocbox.load(path)))
    print(f"{'workload':<32}" + "".join(f"{name:>16}" for name, _ in handlers))
    for label, work in WORKLOADS:
        work()  # warm up caches and page tables
        base = median_seconds(work, None)
        cells = []
        for _, policy in handlers:
            t = base if policy is None else median_seconds(work, policy)
            cells.append(f"{t * 1e3:8.1f}ms {t / base:5.2f}x")
        print(f"{label:<32}" + "".join(f"{c:>16}" for c in cells))
    for name, policy in handlers[1:]:
        policy.raise_if_failed()


if __name__ == "__main__":
    main()
