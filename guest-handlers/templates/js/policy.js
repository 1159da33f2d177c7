// policy_name: an allocbox allocation policy (NumPy NEP 49) in JavaScript, started by
// `allocbox new`. A pass-through that counts the blocks it has lent out: every call goes
// upstream (the next policy in the chain, or the host's memory) unchanged.
//
// componentize-js builds it into a component of the `policy` world in wit/policy.wit
// (contract 0.2.0): the SpiderMonkey engine with this module already evaluated. It
// binds the world to ES module exports:
// - each exported interface is an exported object named after it in lowerCamelCase
//   (`allocator`, `lifecycle`, `observer`), its functions methods in lowerCamelCase
//   (`mallocMany`);
// - an imported interface is a module imported by its full name: `allocator` below is
//   the upstream, `allocbox:policy/bytes@0.2.0` (`read`, `write`, `fill`, `copy`,
//   `readU64`, `writeU64`) reads and writes the bytes of blocks this policy holds,
//   `allocbox:policy/memory@0.2.0` maps memory of a kind the embedder granted
//   (`mapRegion(size, { pages: 'transparent-huge', numa: { tag: 'any' }, locked: false,
//   guard: 'none' })` throws `'not-granted'` unless `huge-pages` was granted), and
//   `allocbox:policy/diagnostics@0.2.0` reports a client's misuse
//   (`clientMisuse(block, size, offset, 'what happened')`);
// - `lifecycle.report` answers the policy's own counters (`allocbox check` and Python's
//   `stats()` show them); `init` is told the limits the host enforces;
//   `observer.observes` may ask to observe rather than be asked on every call;
// - a `u64` is a BigInt both ways (`size` arrives as `100n`; return addresses as
//   BigInts, `0n` for none); a `u32` is a Number; a `list<u64>` arrives as a
//   `BigUint64Array`; the configuration is an array of `[key, value]` arrays.
//
// The rules the host enforces (it stops the policy at the first break):
// - every address you return lies inside a block you got from upstream and have not
//   freed, overlaps no other block you have lent out, and is aligned to the `alignment`
//   you promise in `init` (16 here: what upstream gives);
// - give blocks back upstream with exactly the size you got them with;
// - touch the bytes of blocks only through the `bytes` imports, and only of blocks you
//   hold and have not lent;
// - `trim` gives back everything you cache: `allocbox check` calls it last and counts
//   whatever is still held upstream as a leak.
//
// `init`'s error is a thrown string. Any other exception that escapes an export traps:
// the host stops the policy (with no JavaScript message: the component has no stderr).
// The host calls a policy on one thread at a time: module state needs no lock.

import * as upstream from 'allocbox:policy/allocator@0.2.0';

const NAME = 'policy_name';

// Blocks lent to the client and not given back yet.
let lent = 0;

// Counts a block handed to the client (0n means the allocation failed).
function lend(ptr) {
  if (ptr !== 0n) lent += 1;
  return ptr;
}

export const allocator = {
  malloc(size) {
    return lend(upstream.malloc(size));
  },
  calloc(nelem, elsize) {
    return lend(upstream.calloc(nelem, elsize));
  },
  realloc(ptr, oldSize, newSize) {
    const moved = upstream.realloc(ptr, oldSize, newSize);
    // Only `realloc(0n, ..)` lends a new block; otherwise the count is unchanged.
    return ptr === 0n ? lend(moved) : moved;
  },
  free(ptr, size) {
    lent -= 1;
    upstream.free(ptr, size);
  },
  mallocMany(size, count) {
    const ptrs = upstream.mallocMany(size, count);
    lent += ptrs.length;
    return ptrs;
  },
  freeMany(ptrs, size) {
    lent -= ptrs.length;
    upstream.freeMany(ptrs, size);
  },
};

export const lifecycle = {
  init(config, limits) {
    // This policy reads no settings. A thrown string is init's `err`.
    if (config.length !== 0) throw `${NAME} takes no configuration`;
    // batch: the host may fetch blocks ahead with `malloc-many`; diagnoses: this
    // policy reports no misuse of its client.
    return { name: NAME, version: 1, alignment: 16n, batch: true, diagnoses: false };
  },
  trim() {
    // Nothing cached, so nothing to give back.
  },
  report() {
    return [['lent-blocks', BigInt(lent)]];
  },
};

export const observer = {
  // Undefined (none): asked on every call, or batched as `init` says. To observe
  // instead, answer `{ batch: 4096, detail: 'totals', lease: undefined }` and count in
  // `observe` (`'survivors'` to follow blocks: those that outlive a batch are listed).
  observes() {
    return undefined;
  },
  observe(observed) {},
  renew(size) {
    return 0n;
  },
};
