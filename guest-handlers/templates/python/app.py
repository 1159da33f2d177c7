"""policy_name: an allocbox allocation policy (NumPy NEP 49) in Python, started by
`allocbox new`. A pass-through that counts the blocks it has lent out: every call goes
upstream (the next policy in the chain, or the host's memory) unchanged.

componentize-py builds it into a component of the `policy` world in wit/policy.wit
(contract 0.2.0): it generates the `wit_world` package from the WIT and imports this
module (`app`). For each exported interface there is a class named after it
(`Allocator`, `Lifecycle`, `Observer`); for each imported one a module of functions
(`allocator` is the upstream, `bytes` reads and writes the bytes of blocks this policy
holds, `memory` maps memory of a kind the embedder granted, `diagnostics` reports a
client's misuse).

What 0.2.0 adds, in this file: `Lifecycle.report` answers the policy's own counters
(`allocbox check` and Python's `stats()` show them), `init` is told the limits the host
enforces, and `Observer.observes` may ask to observe rather than be asked on every call.
A kind of memory, e.g. huge pages:
`memory.map_region(size, memory.Kind(memory.Pages.TRANSPARENT_HUGE, memory.Numa_Any(),
False, memory.Guard.NONE))` answers an `Err(memory.Refusal.NOT_GRANTED)` unless the
embedder granted `huge-pages`; a client's misuse:
`diagnostics.client_misuse(block, size, offset, "what happened")`.

The rules the host enforces (it stops the policy at the first break):
- every address you return lies inside a block you got from upstream and have not
  freed, overlaps no other block you have lent out, and is aligned to the `alignment`
  you promise in `init` (16 here: what upstream gives);
- give blocks back upstream with exactly the size you got them with;
- touch the bytes of blocks only through `wit_world.imports.bytes`, and only of blocks
  you hold and have not lent;
- `trim` gives back everything you cache: `allocbox check` calls it last and counts
  whatever is still held upstream as a leak.

An exception other than `wit_world.Err` (init's error) traps: the host stops the policy
and reports it. The host calls a policy on one thread at a time: module-level state
needs no lock.
"""

from typing import List, Optional, Tuple

import wit_world
from wit_world.exports import lifecycle, observer
from wit_world.imports import allocator as upstream

NAME = "policy_name"

# Blocks lent to the client and not given back yet.
lent = 0


def lend(ptr: int) -> int:
    """Counts a block handed to the client (0 means the allocation failed)."""
    global lent
    if ptr:
        lent += 1
    return ptr


class Allocator(wit_world.exports.Allocator):
    def malloc(self, size: int) -> int:
        return lend(upstream.malloc(size))

    def calloc(self, nelem: int, elsize: int) -> int:
        return lend(upstream.calloc(nelem, elsize))

    def realloc(self, ptr: int, old_size: int, new_size: int) -> int:
        moved = upstream.realloc(ptr, old_size, new_size)
        # Only `realloc(0, ..)` lends a new block; otherwise the count is unchanged.
        return moved if ptr else lend(moved)

    def free(self, ptr: int, size: int) -> None:
        global lent
        lent -= 1
        upstream.free(ptr, size)

    def malloc_many(self, size: int, count: int) -> List[int]:
        global lent
        ptrs = upstream.malloc_many(size, count)
        lent += len(ptrs)
        return ptrs

    def free_many(self, ptrs: List[int], size: int) -> None:
        global lent
        lent -= len(ptrs)
        upstream.free_many(ptrs, size)


class Lifecycle(wit_world.exports.Lifecycle):
    def init(
        self, config: List[Tuple[str, str]], limits: lifecycle.Limits
    ) -> lifecycle.Info:
        # This policy reads no settings.
        if config:
            raise wit_world.Err(f"{NAME} takes no configuration")
        # batch: the host may fetch blocks ahead with `malloc-many`; diagnoses: this
        # policy reports no misuse of its client.
        return lifecycle.Info(
            name=NAME, version=1, alignment=16, batch=True, diagnoses=False
        )

    def trim(self) -> None:
        # Nothing cached, so nothing to give back.
        pass

    def report(self) -> List[Tuple[str, int]]:
        return [("lent-blocks", lent)]


class Observer(wit_world.exports.Observer):
    def observes(self) -> Optional[observer.Observing]:
        # None: asked on every call (or batched, as `init` says). To observe instead,
        # answer `observer.Observing(batch=..., detail=observer.Detail.TOTALS,
        # lease=None)` and count in `observe` (`Detail.SURVIVORS` to follow blocks:
        # those that outlive a batch are listed).
        return None

    def observe(self, observed: observer.Observation) -> None:
        pass

    def renew(self, size: int) -> int:
        return 0
