"""`limit`: a memory cap and statistics for NumPy's data allocations, in Python.

The adaptor a NumPy user writes first. It forwards every call to its upstream
unchanged, and on the way:

- caps the bytes lent to its client at `max-bytes`: a request that would take the
  client past the cap is answered 0 (out of memory) without asking upstream, exactly
  as a NEP 49 handler reports failure, so NumPy raises `MemoryError` instead of the
  process being killed by the OOM killer;
- optionally refuses any single request above `max-request` bytes (a runaway shape,
  `np.empty((n, n))` with the wrong `n`, fails alone while small arrays still work);
- counts what it sees: a log2 histogram of request sizes, the bytes lent now and at
  their peak, the number of blocks lent, and the number of refusals.

It caches nothing, so `trim` has nothing to give back. It passes every size through
exactly, so the sized-free rule towards upstream holds because the client keeps it
towards us. Its blocks are upstream's blocks, so it promises upstream's alignment, 16.
It declares `batch: false`: a cap must see each call, and host-side magazines would
hold blocks that the cap has counted but the client has not asked for.

The statistics live in the guest (the world has no export to read them; see
README.md). The host calls a policy on one thread at a time, so plain module-level
state needs no lock.

Config keys (each at most once; sizes are bytes, or a number with a KiB/MiB/GiB/TiB
suffix, or `unlimited`):

- `max-bytes`   most bytes lent to the client at once (default: unlimited);
- `max-request` largest single request served (default: unlimited).
"""

from typing import List, Tuple

import wit_world
from componentize_py_types import Err
from wit_world.exports import lifecycle
from wit_world.imports import allocator as upstream

NAME = "limit"
U64_MAX = (1 << 64) - 1
UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
KEYS = ("max-bytes", "max-request")


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


class Allocator(wit_world.exports.Allocator):
    # The hot paths are written out rather than shared through helpers: a Python call
    # costs more than the bookkeeping it would hold. Each method reads the state into
    # a local `s` once.

    def malloc(self, size: int) -> int:
        s = S
        s.histogram[size.bit_length() - 1] += 1
        lent = s.lent + size
        if size > s.max_request or lent > s.max_bytes:
            s.refusals += 1
            return 0
        ptr = upstream.malloc(size)
        if ptr:  # 0: upstream is out of memory; nothing is lent.
            s.lent = lent
            s.blocks += 1
            if lent > s.peak:
                s.peak = lent
        return ptr

    def calloc(self, nelem: int, elsize: int) -> int:
        s = S
        # Python ints do not wrap: an overflowing product is simply > U64_MAX, which
        # the contract says is answered 0. Upstream is not asked what it must refuse.
        size = nelem * elsize
        if size == 0 or size > U64_MAX:
            # Size 0 never comes (the host sends at least 1 byte), but it has no
            # histogram bucket: refuse it rather than fail.
            s.refusals += 1
            return 0
        s.histogram[size.bit_length() - 1] += 1
        lent = s.lent + size
        if size > s.max_request or lent > s.max_bytes:
            s.refusals += 1
            return 0
        ptr = upstream.calloc(nelem, elsize)
        if ptr:
            s.lent = lent
            s.blocks += 1
            if lent > s.peak:
                s.peak = lent
        return ptr

    def realloc(self, ptr: int, old_size: int, new_size: int) -> int:
        if ptr == 0:
            return self.malloc(new_size)
        s = S
        s.histogram[new_size.bit_length() - 1] += 1
        # The client gives back old_size and takes new_size: a shrink always fits. On
        # a refusal the old block stays live, unchanged and counted, as the contract
        # says of a 0 answer.
        lent = s.lent - old_size + new_size
        if new_size > s.max_request or lent > s.max_bytes:
            s.refusals += 1
            return 0
        new = upstream.realloc(ptr, old_size, new_size)
        if new:
            s.lent = lent
            if lent > s.peak:
                s.peak = lent
        return new

    def free(self, ptr: int, size: int) -> None:
        s = S
        s.lent -= size
        s.blocks -= 1
        # The exact size the client gave: the sized-free rule holds upstream because
        # the client keeps it towards us.
        upstream.free(ptr, size)

    def malloc_many(self, size: int, count: int) -> List[int]:
        # With `batch: false` the host does not prefetch, but a client may still ask
        # for several blocks at once: serve as many as fit under the limits ("fewer"
        # is allowed by the contract) and count the rest as refused.
        if count == 0:
            return []
        s = S
        s.histogram[size.bit_length() - 1] += count
        fit = count if size <= s.max_request else 0
        if s.max_bytes != U64_MAX:
            fit = min(fit, max(0, s.max_bytes - s.lent) // size)
        s.refusals += count - fit
        if fit == 0:
            return []
        ptrs = upstream.malloc_many(size, fit)
        s.lent += len(ptrs) * size
        s.blocks += len(ptrs)
        if s.lent > s.peak:
            s.peak = s.lent
        return ptrs

    def free_many(self, ptrs: List[int], size: int) -> None:
        s = S
        s.lent -= len(ptrs) * size
        s.blocks -= len(ptrs)
        upstream.free_many(ptrs, size)


class Lifecycle(wit_world.exports.Lifecycle):
    def init(self, config: List[Tuple[str, str]]) -> lifecycle.Info:
        global S
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
        return lifecycle.Info(name=NAME, version=1, alignment=16, batch=False)

    def trim(self) -> None:
        # Nothing is cached: every block we hold is lent to the client.
        pass
