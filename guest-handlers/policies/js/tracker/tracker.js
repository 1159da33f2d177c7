// `tracker`: a tracking adaptor (a leak finder) for NumPy's data allocations, in
// JavaScript.
//
// It sits between its client and its upstream, like RMM's tracking_resource_adaptor.
// It speaks contract 0.2.0 and observes rather than being asked on every call: the
// host serves NumPy's small arrays from magazines of blocks this policy placed and tells
// it, a few thousand events at a time, of every block that outlived the batch it was
// lent or taken back in (`observer`, detail `survivors`: ops, addresses, sizes and
// places as columns of bytes), and sums the blocks that came and went within one (most
// of them: they can be neither live nor leaked at any delivery). Every call that does reach
// it goes upstream unchanged (the exact sizes, so the sized-free rule holds towards
// upstream because the client keeps it towards us). It keeps:
//
// - every block lent: address -> size and the sequence number of the call that
//   (re)allocated it (`report()` lists the oldest live ones first: the leak
//   suspects);
// - the bytes and blocks lent now, and their peaks;
// - how many blocks it lent or took back (the sequence numbers), and how many that
//   outlived their batch it counted without tracking them one by one because the index
//   was full.
//
// Its counters are the policy's `report` (`allocbox check`, Python's `stats()`).
//
// Knobs (`init` configuration; each key at most once):
//
// - `max-blocks`: most blocks tracked one by one at once (default 100000, or
//   `unlimited`). Each tracked block costs guest memory; past the bound a new block is
//   only counted (`untracked`), so the policy's own memory stays bounded instead of
//   meeting the host's `--guest-memory` cap, which stops the policy. (A request is never
//   refused for it: one served from a magazine cannot be.) README.md has the memory
//   each bound needs.
// - `min-size`: only blocks of at least this many bytes are tracked one by one
//   (default 1: all). Smaller blocks are only counted (blocks and bytes), so a program
//   with millions of tiny arrays can still have its big ones watched. The sized-free
//   rule tells which kind a freed block is: its size decides.
//
// It caches nothing: `trim` has nothing to give back and forwards nothing. It promises
// 16-byte alignment: its blocks are upstream's blocks, and the host's memory and every
// shipped policy align to 16.
//
// Numbers: the canonical ABI hands every u64 to JavaScript as a BigInt. Comparisons
// against requests, which may be any u64, stay BigInt. What is stored and counted is
// a plain Number, which is exact here: a block that exists has a size far below 2^53,
// and so do the sums of live sizes and the call counter, and so does every address
// on today's 48- and 57-bit machines (larger ones get a side table of their own).
//
// The host calls a policy on one thread at a time, so module state needs no lock.
// The hot state is module-level `let`s rather than fields of an object: the engine
// runs this code in an interpreter (no JIT inside wasm), where a variable is a step
// cheaper than a property.

import * as upstream from 'allocbox:policy/allocator@0.2.0';

const NAME = 'tracker';
const U64_MAX = (1n << 64n) - 1n;
const SAFE = BigInt(Number.MAX_SAFE_INTEGER);
const UNITS = { '': 1n, kib: 1n << 10n, mib: 1n << 20n, gib: 1n << 30n, tib: 1n << 40n };
const KEYS = ['max-blocks', 'min-size'];
const DEFAULT_MAX_BLOCKS = 100000;

// Knobs.
let maxBlocks = DEFAULT_MAX_BLOCKS; // a Number; Infinity for `unlimited`
let minSize = 1n; // a BigInt

// Counters.
let calls = 0; // every allocator call, 1-based: the sequence numbers
let liveBytes = 0; // all blocks lent now, tracked or only counted
let liveBlocks = 0;
let peakBytes = 0;
let peakBlocks = 0;
let smallBytes = 0; // the part of the above below `min-size`
let smallBlocks = 0;
let allocated = 0; // blocks ever lent (a realloc counts as the same block)
let untracked = 0; // blocks counted but not tracked: the index was full
let batch = 4096; // events per delivery, set at `init` within the host's batch limit

// The index: an open-addressing hash table (linear probing) in typed arrays, keyed by
// the address as a Number. Not a Map: the collector walks every entry of a Map at
// each major collection, and this engine collects often (the generated bindings make
// a little garbage on every call), so with 100,000 blocks in a Map a call cost three
// times what it costs with none. The contents of typed arrays are opaque to the
// collector.
//
// keys[i] is an address, or 0 for an empty slot (0 is never a block); data[2i] and
// data[2i + 1] are its size and the seq of the call that (re)allocated it. Deletion
// shifts the following entries back (no tombstones), so a probe ends at the first
// empty slot.
const MIN_CAPACITY = 1 << 10;
let capacity = 0; // a power of two, or 0 before the first block
let shift = 32; // 32 - log2(capacity): the hash's top bits pick the slot
let mask = 0;
let keys = new Float64Array(0);
let data = new Float64Array(0);
let tracked = 0; // blocks in the table
// Addresses above 2^53 would not be exact as Numbers: they get a Map with BigInt keys
// -> [size, seq], so every u64 is right. None come on today's machines.
let far = new Map();

// The slot an address hashes to: Fibonacci hashing of its 16-byte granule, folded
// from its low 32 and its high bits. `>>> 0` takes a Number's low 32 bits, exactly,
// below 2^53.
function home(a) {
  return Math.imul(((a / 16) >>> 0) ^ ((a / 68719476736) >>> 0), 0x9e3779b1) >>> shift;
}

// Double the table (or make the first one) and re-insert every entry.
function grow() {
  const oldKeys = keys;
  const oldData = data;
  capacity = capacity === 0 ? MIN_CAPACITY : capacity * 2;
  shift = 32 - Math.log2(capacity);
  mask = capacity - 1;
  keys = new Float64Array(capacity);
  data = new Float64Array(capacity * 2);
  for (let j = 0; j < oldKeys.length; j++) {
    const a = oldKeys[j];
    if (a === 0) continue;
    let i = home(a);
    while (keys[i] !== 0) i = (i + 1) & mask;
    keys[i] = a;
    data[2 * i] = oldData[2 * j];
    data[2 * i + 1] = oldData[2 * j + 1];
  }
}

// Record a block lent at `addr` (a BigInt; `size` a Number) with this call's seq.
function track(addr, size) {
  if (addr > SAFE) {
    far.set(addr, [size, calls]);
    return;
  }
  trackNumber(Number(addr), size);
}

// `track` for an address already a Number (below 2^53), or a BigInt above.
function trackNumber(a, size) {
  if (typeof a === 'bigint') {
    far.set(a, [size, calls]);
    return;
  }
  // Grow at 3/4 full: linear probing stays short below that.
  if (4 * (tracked + 1) > 3 * capacity) grow();
  let i = home(a);
  let k;
  while ((k = keys[i]) !== 0 && k !== a) i = (i + 1) & mask;
  // An address already here cannot come (the host checks that a block lent is not
  // lent already); were it to, overwriting keeps the count right.
  if (k === 0) tracked += 1;
  keys[i] = a;
  data[2 * i] = size;
  data[2 * i + 1] = calls;
}

// Forget a tracked block. A block the index does not know cannot come (the host checks
// every free against its own ledger before it reaches us, and every block of a tracked
// size was tracked when lent), so a miss changes nothing here.
function untrack(addr) {
  if (addr > SAFE) {
    far.delete(addr);
    return;
  }
  untrackNumber(Number(addr));
}

// `untrack` for an address already a Number (below 2^53), or a BigInt above.
function untrackNumber(a) {
  if (typeof a === 'bigint') {
    far.delete(a);
    return;
  }
  if (tracked === 0) return;
  let i = home(a);
  let k;
  while ((k = keys[i]) !== a) {
    if (k === 0) return;
    i = (i + 1) & mask;
  }
  // Backward-shift deletion: move each later entry of the run into the hole unless
  // its home lies cyclically in (hole, its slot].
  let j = i;
  for (;;) {
    j = (j + 1) & mask;
    const b = keys[j];
    if (b === 0) break;
    const h = home(b);
    if (i <= j ? i < h && h <= j : i < h || h <= j) continue;
    keys[i] = b;
    data[2 * i] = data[2 * j];
    data[2 * i + 1] = data[2 * j + 1];
    i = j;
  }
  keys[i] = 0;
  tracked -= 1;
}

// Count a block lent (`size` a Number) and lift the peaks.
function lent(size, small) {
  liveBytes += size;
  liveBlocks += 1;
  allocated += 1;
  if (small) {
    smallBytes += size;
    smallBlocks += 1;
  }
  if (liveBytes > peakBytes) peakBytes = liveBytes;
  if (liveBlocks > peakBlocks) peakBlocks = liveBlocks;
}

// Count a block given back.
function given(size, small) {
  liveBytes -= size;
  liveBlocks -= 1;
  if (small) {
    smallBytes -= size;
    smallBlocks -= 1;
  }
}

// Count a block lent at `addr` (`size` a BigInt) as the `calls`-th, tracked unless it
// is small or the index is full.
function lendBlock(addr, size) {
  calls += 1;
  const small = size < minSize;
  if (!small) {
    if (tracked + far.size < maxBlocks) track(addr, Number(size));
    else untracked += 1;
  }
  lent(Number(size), small);
}

// Count a block taken back (`size` a BigInt).
function takeBack(addr, size) {
  calls += 1;
  const small = size < minSize;
  if (!small) untrack(addr);
  given(Number(size), small);
}

// Only what the host does not serve from its magazines reaches these: requests above
// 64 KiB, every realloc, and the magazines' own refills and flushes (not the client's
// blocks yet, or no more: the events say which reach the client).
export const allocator = {
  malloc(size) {
    const addr = upstream.malloc(size);
    if (addr !== 0n) lendBlock(addr, size);
    return addr;
  },

  calloc(nelem, elsize) {
    // BigInts do not wrap: an overflowing product is simply > U64_MAX, and upstream
    // answers it 0, as the contract says.
    const addr = upstream.calloc(nelem, elsize);
    if (addr !== 0n) lendBlock(addr, nelem * elsize);
    return addr;
  },

  realloc(ptr, oldSize, newSize) {
    const addr = upstream.realloc(ptr, oldSize, newSize);
    if (addr === 0n) return 0n; // upstream kept the old block: nothing changed
    // ptr = 0 is a malloc (old-size is then 0): there is no old block. One call: the
    // old block leaves without a sequence number of its own.
    if (ptr !== 0n) {
      const oldSmall = oldSize < minSize;
      if (!oldSmall) untrack(ptr);
      given(Number(oldSize), oldSmall);
      allocated -= 1; // the same block, resized
    }
    // Recorded anew even when it stayed in place: it is now the newest block.
    lendBlock(addr, newSize);
    return addr;
  },

  free(ptr, size) {
    takeBack(ptr, size);
    upstream.free(ptr, size);
  },

  mallocMany(size, count) {
    return upstream.mallocMany(size, count);
  },

  freeMany(ptrs, size) {
    upstream.freeMany(ptrs, size);
  },
};

// The u64 at byte `i` of a column as a Number: exact below 2^53 (every size, every
// address on today's machines); larger ones as the BigInt `far` keys them by.
function word(view, i) {
  const lo = view.getUint32(i, true);
  const hi = view.getUint32(i + 4, true);
  return hi < 0x200000 ? hi * 4294967296 + lo : view.getBigUint64(i, true);
}

export const observer = {
  observes() {
    return { batch, detail: 'survivors', lease: undefined };
  },

  // What the host lent or took back without asking, as `detail: survivors` tells it:
  // the events of blocks that outlived the batch, in order, each with its place among
  // the batch's events (ops 0 malloc, 1 calloc, 2 free; addresses and sizes 8 bytes
  // little-endian each, places 4); the blocks that came and went within the batch only
  // as sums. Those change no live count and are never leak suspects, and most of a
  // program's blocks are among them: this loop runs for a few events of the thousands.
  observe(observed) {
    if (observed.tag !== 'survivors') return;
    const s = observed.val;
    const { ops, addrs, sizes } = s.events;
    const at = new DataView(addrs.buffer, addrs.byteOffset, addrs.byteLength);
    const of = new DataView(sizes.buffer, sizes.byteOffset, sizes.byteLength);
    const places = new DataView(s.places.buffer, s.places.byteOffset, s.places.byteLength);
    const small = Number(minSize);
    const before = calls;
    const startBytes = liveBytes;
    const startBlocks = liveBlocks;
    for (let k = 0; k < ops.length; k++) {
      const a = word(at, 8 * k);
      const n = Number(word(of, 8 * k));
      const addr = typeof a === 'bigint' || a > Number.MAX_SAFE_INTEGER ? BigInt(a) : a;
      // Its sequence number, as if every event of the batch had been told.
      calls = before + places.getUint32(4 * k, true) + 1;
      if (ops[k] === 2) {
        if (n >= small) untrackNumber(addr);
        given(n, n < small);
      } else {
        if (n >= small) {
          if (tracked + far.size < maxBlocks) trackNumber(addr, n);
          else untracked += 1;
        }
        lent(n, n < small);
      }
    }
    calls = before + s.count;
    allocated += Number(s.transientBlocks);
    // The peaks the transient blocks made, which the survivors alone do not reach.
    const bytesAtPeak = startBytes + Number(s.peakBytesRise);
    const blocksAtPeak = startBlocks + Number(s.peakBlocksRise);
    if (bytesAtPeak > peakBytes) peakBytes = bytesAtPeak;
    if (blocksAtPeak > peakBlocks) peakBlocks = blocksAtPeak;
  },

  renew(size) {
    return 0n; // no lease: never asked
  },
};

// What the tracker knows, for a debugger or a future `report` export (the `policy`
// world has none, see README.md): the counters, and the `n` oldest live tracked blocks
// as [address (BigInt), size, seq], oldest first. A scan and a sort of the table:
// rare, so it may be slow.
export function report(n = 10) {
  const live = [];
  for (let i = 0; i < capacity; i++) {
    if (keys[i] !== 0) live.push([BigInt(keys[i]), data[2 * i], data[2 * i + 1]]);
  }
  for (const [addr, [size, seq]] of far) live.push([addr, size, seq]);
  live.sort((x, y) => x[2] - y[2]);
  return {
    calls, liveBytes, liveBlocks, trackedBlocks: tracked + far.size, smallBytes, smallBlocks,
    peakBytes, peakBlocks, allocated, untracked, oldest: live.slice(0, n),
  };
}

// `init`'s err: componentize-js turns a thrown value that is not an `Error` into
// `err(value)` (a thrown `Error` would trap instead).
function fail(message) {
  throw `${NAME}: ${message}`;
}

// `value` as a u64 byte count (BigInt): bytes, or a number with a binary unit.
function parseSize(k, value) {
  const m = /^\s*([0-9]+)\s*([a-z]*)\s*$/i.exec(value);
  const unit = m ? UNITS[m[2].toLowerCase()] : undefined;
  if (unit === undefined) {
    fail(`\`${k}\` = \`${value}\` is not a size: give bytes, or a number with KiB/MiB/GiB/TiB`);
  }
  const size = BigInt(m[1]) * unit;
  if (size > U64_MAX) fail(`\`${k}\` = \`${value}\` is more than 2^64-1 bytes`);
  return size;
}

// `value` as a block count (Number), or Infinity for `unlimited`.
function parseCount(k, value) {
  const text = value.trim().toLowerCase();
  if (text === 'unlimited') return Infinity;
  if (!/^[0-9]+$/.test(text)) {
    fail(`\`${k}\` = \`${value}\` is not a count: give a whole number of blocks, or \`unlimited\``);
  }
  const n = Number(text);
  if (!Number.isSafeInteger(n)) {
    const most = Number.MAX_SAFE_INTEGER;
    fail(`\`${k}\` = \`${value}\` is too large: give at most ${most}, or \`unlimited\``);
  }
  return n;
}

export const lifecycle = {
  init(config, limits) {
    let max = DEFAULT_MAX_BLOCKS;
    let min = 1n;
    const seen = new Set();
    for (const [k, value] of config) {
      if (!KEYS.includes(k)) {
        fail(`unknown config key \`${k}\` (value \`${value}\`); known: ${KEYS.join(', ')}`);
      }
      if (seen.has(k)) fail(`\`${k}\` given more than once`);
      seen.add(k);
      if (k === 'max-blocks') max = parseCount(k, value);
      else min = parseSize(k, value);
    }
    // Only now, when the whole configuration is good: a fresh state.
    maxBlocks = max;
    minSize = min;
    capacity = 0;
    shift = 32;
    mask = 0;
    keys = new Float64Array(0);
    data = new Float64Array(0);
    tracked = 0;
    far = new Map();
    calls = liveBytes = liveBlocks = peakBytes = peakBlocks = 0;
    smallBytes = smallBlocks = allocated = untracked = 0;
    // Each delivery is a call into the interpreter: as many events at once as allowed.
    batch = Math.min(4096, limits.batch);
    return { name: NAME, version: 1, alignment: 16n, batch: true, diagnoses: false };
  },

  trim() {
    // Nothing is cached: every block upstream lent us is lent to the client.
  },

  report() {
    return [
      ['live-bytes', liveBytes], ['live-blocks', liveBlocks], ['tracked-blocks', tracked + far.size],
      ['untracked-blocks', untracked], ['small-bytes', smallBytes], ['small-blocks', smallBlocks],
      ['peak-bytes', peakBytes], ['peak-blocks', peakBlocks], ['allocated', allocated],
      ['calls', calls],
    ].map(([name, n]) => [name, BigInt(n)]);
  },
};
