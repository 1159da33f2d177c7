"""policy_name: an allocbox allocation policy (NumPy NEP 49) in Python, started by
`allocbox new`. A pass-through that counts the blocks it has lent out: every call goes
upstream (the next policy in the chain, or the host's memory) unchanged.

componentize-py builds it into a component of the `policy` world in wit/policy.wit: it
generates the `wit_world` package from the WIT and imports this module (`app`). For
each exported interface there is a class named after it (`Allocator`, `Lifecycle`); for
each imported one a module of functions (`allocator` is the upstream, `bytes` reads and
writes the bytes of blocks this policy holds).

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

from typing import List, Tuple

import wit_world
from wit_world.exports import lifecycle
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
    def init(self, config: List[Tuple[str, str]]) -> lifecycle.Info:
        # This policy reads no settings.
        if config:
            raise wit_world.Err(f"{NAME} takes no configuration")
        # batch: the host may fetch blocks ahead with `malloc-many`.
        return lifecycle.Info(name=NAME, version=1, alignment=16, batch=True)

    def trim(self) -> None:
        # Nothing cached, so nothing to give back.
        pass
