"""`limit`: a memory cap and statistics for NumPy's data allocations, in Python.

The adaptor a NumPy user writes first. It observes rather than being asked on every
call (contract 0.2.0 `observer`): the host serves NumPy's small arrays from magazines of
blocks this policy placed, and tells it the sums of what it served (`totals`: blocks and
bytes lent and given back, sizes by power of two) once per thousands of events. On the
way it

- caps the bytes lent to its client at `max-bytes`, through a lease: the host lends
  without asking while the lease covers a request and asks `renew` when it does not,
  which answers the bytes left under the cap, so a request that would take the client
  past the cap is refused exactly where a per-call check would refuse it; NumPy raises
  `MemoryError` instead of the process being killed by the OOM killer;
- optionally refuses any single request above `max-request` bytes that it serves itself
  (every request above the host's magazine sizes, 64 KiB: a runaway shape,
  `np.empty((n, n))` with the wrong `n`, fails alone while small arrays still work);
- counts what it sees, and reports it (`lifecycle.report`, shown by `allocbox check`
  and Python's `stats()`): the bytes and blocks lent now, the peak, the refusals, and a
  log2 histogram of request sizes.

It caches nothing, so `trim` has nothing to give back. It passes every size through
exactly, so the sized-free rule towards upstream holds because the client keeps it
towards us. Its blocks are upstream's blocks, so it promises upstream's alignment, 16.
The host calls a policy on one thread at a time, so plain module-level state needs no
lock.

Config keys (each at most once; sizes are bytes, or a number with a KiB/MiB/GiB/TiB
suffix, or `unlimited`):

- `max-bytes`   most bytes lent to the client at once (default: unlimited);
- `max-request` largest single request served (default: unlimited).
"""

from typing import List, Optional, Tuple

import wit_world
from componentize_py_types import Err
from wit_world.exports import lifecycle, observer
from wit_world.imports import allocator as upstream

NAME = "limit"
U64_MAX = (1 << 64) - 1
UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
KEYS = ("max-bytes", "max-request")
# Events per `observe`, set at `init` within the host's batch limit.
BATCH = 4096


class Stats:
    """Everything the policy keeps. One instance, replaced by `init`.

    `__slots__`: each call reads and writes several of these fields, and a slot is
    cheaper to reach than an instance dict entry (every call crosses into CPython,
    so the few hundred nanoseconds matter; see README.md).
    """

    __slots__ = (
        "max_bytes", "max_request", "lent", "blocks", "peak", "refusals", "histogram",
    )

    def __init__(self) -> None:
        # Limits; U64_MAX stands for "unlimited" (no request can exceed it).
        self.max_bytes = U64_MAX
        self.max_request = U64_MAX
        # Bytes and blocks the client holds now, and the most bytes it ever held.
        self.lent = 0
        self.blocks = 0
        self.peak = 0
        # Requests answered 0 by this policy (upstream's own 0s are not ours).
        self.refusals = 0
        # histogram[k] counts requests of 2**k ..= 2**(k+1)-1 bytes, refused ones
        # included (it records demand); a u64 size has at most 64 bits, so 64 buckets
        # cover every size. The host never sends size 0.
        self.histogram = [0] * 64


S = Stats()


def parse_size(key: str, value: str) -> int:
    """`value` as a byte count, or an `Err` naming `key` and why."""
    text = value.strip().lower()
    if text == "unlimited":
        return U64_MAX
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text[len(digits):].strip()
    if unit not in UNITS or not (digits.isascii() and digits.isdigit()):
        raise Err(
            f"{NAME}: `{key}` = `{value}` is not a size: give bytes, a number with "
            "KiB/MiB/GiB/TiB, or `unlimited`"
        )
    size = int(digits) * UNITS[unit]
    if size > U64_MAX:
        raise Err(f"{NAME}: `{key}` = `{value}` is more than 2^64-1 bytes")
    return size


def lend(s: Stats, size: int) -> None:
    """Count a block of `size` bytes lent to the client."""
    s.histogram[size.bit_length() - 1] += 1
    s.lent += size
    s.blocks += 1
    if s.lent > s.peak:
        s.peak = s.lent


class Allocator(wit_world.exports.Allocator):
    # Only what the host does not serve from its magazines reaches these: requests
    # above 64 KiB, every realloc, and the magazines' own refills and flushes. The host
    # admitted each request within the lease already: only `max-request` is checked.

    def malloc(self, size: int) -> int:
        s = S
        if size > s.max_request:
            s.histogram[size.bit_length() - 1] += 1
            s.refusals += 1
            return 0
        ptr = upstream.malloc(size)
        if ptr:  # 0: upstream is out of memory; nothing is lent.
            lend(s, size)
        return ptr

    def calloc(self, nelem: int, elsize: int) -> int:
        s = S
        # Python ints do not wrap: an overflowing product is simply > U64_MAX, which
        # the contract says is answered 0 (the host answers it without asking).
        size = nelem * elsize
        if size == 0 or size > U64_MAX or size > s.max_request:
            s.refusals += 1
            return 0
        ptr = upstream.calloc(nelem, elsize)
        if ptr:
            lend(s, size)
        return ptr

    def realloc(self, ptr: int, old_size: int, new_size: int) -> int:
        if ptr == 0:
            return self.malloc(new_size)
        s = S
        s.histogram[new_size.bit_length() - 1] += 1
        if new_size > s.max_request:
            s.refusals += 1
            return 0
        new = upstream.realloc(ptr, old_size, new_size)
        if new:
            s.lent += new_size - old_size
            if s.lent > s.peak:
                s.peak = s.lent
        return new

    def free(self, ptr: int, size: int) -> None:
        s = S
        s.lent -= size
        s.blocks -= 1
        upstream.free(ptr, size)

    # Refills and flushes of the host's magazines: blocks not lent to the client yet,
    # or given back by it already (the events say which reach the client).

    def malloc_many(self, size: int, count: int) -> List[int]:
        return upstream.malloc_many(size, count)

    def free_many(self, ptrs: List[int], size: int) -> None:
        upstream.free_many(ptrs, size)


class Observer(wit_world.exports.Observer):
    def observes(self) -> Optional[observer.Observing]:
        s = S
        lease = None if s.max_bytes == U64_MAX else s.max_bytes - s.lent
        return observer.Observing(
            batch=BATCH, detail=observer.Detail.TOTALS, lease=lease
        )

    def observe(self, observed: observer.Observation) -> None:
        # Sums, as `observes` asked: a delivery of thousands of events is a few numbers.
        t = observed.value
        s = S
        # The peak between deliveries is not seen event by event: the highest it can
        # have been is before the frees of the batch.
        if s.lent + t.lent_bytes > s.peak:
            s.peak = s.lent + t.lent_bytes
        s.lent += t.lent_bytes - t.freed_bytes
        s.blocks += t.lent_blocks - t.freed_blocks
        histogram = s.histogram
        for bits, n in enumerate(t.lent_by_bits):
            histogram[bits] += n

    def renew(self, size: int) -> int:
        s = S
        left = max(0, s.max_bytes - s.lent)
        if left < size:
            s.histogram[size.bit_length() - 1] += 1
            s.refusals += 1
        return left


class Lifecycle(wit_world.exports.Lifecycle):
    def init(
        self, config: List[Tuple[str, str]], limits: lifecycle.Limits
    ) -> lifecycle.Info:
        global S, BATCH
        fresh = Stats()
        seen = set()
        for key, value in config:
            if key not in KEYS:
                raise Err(
                    f"{NAME}: unknown config key `{key}` (value `{value}`); "
                    f"known: {', '.join(KEYS)}"
                )
            if key in seen:
                raise Err(f"{NAME}: `{key}` given more than once")
            seen.add(key)
            if key == "max-bytes":
                fresh.max_bytes = parse_size(key, value)
            else:
                fresh.max_request = parse_size(key, value)
        S = fresh
        # Events per delivery: each costs a call into CPython, so many at once, within
        # the host's batch limit.
        BATCH = min(4096, limits.batch)
        return lifecycle.Info(
            name=NAME, version=1, alignment=16, batch=True, diagnoses=False
        )

    def trim(self) -> None:
        # Nothing is cached: every block we hold is lent to the client.
        pass

    def report(self) -> List[Tuple[str, int]]:
        s = S
        counters = [
            ("lent-bytes", s.lent),
            ("lent-blocks", s.blocks),
            ("peak-bytes", s.peak),
            ("refusals", s.refusals),
        ]
        # Request sizes seen, by power of two.
        counters += [
            (f"sizes-{1 << k}-to-{(2 << k) - 1}", n) for k, n in enumerate(s.histogram) if n
        ]
        return counters
