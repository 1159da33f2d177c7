"""A NumPy job with a visible peak and a leak, for `allocbox run` and `allocbox report`:

    allocbox run -p size-classes --record peak.trace --sites examples/python/peak.py
    allocbox report peak.trace -p default -p size-classes -o peak.html

`build_cube` makes the peak (a 64 MiB temporary alive with its result); `remember`
keeps a few arrays in a module-level list that is never emptied, so they appear in the
report's table of lines whose blocks were never freed.
"""

import numpy as np

SEEN = []


def build_cube(n):
    cube = np.ones((n, n, n))  # the peak: n**3 doubles
    return float((cube * 2.0).sum())


def remember(i):
    SEEN.append(np.full(1000, i))  # never freed: the list outlives the job


def small_work(rounds):
    total = 0.0
    for i in range(rounds):
        total += float(np.arange(100).sum())
    return total


def main():
    small_work(200)
    for i in range(3):
        remember(i)
    result = build_cube(200)
    small_work(200)
    print(f"cube sum {result:.0f}, {len(SEEN)} arrays kept")


if __name__ == "__main__":
    main()
