// Unit tests of tracker.js's bookkeeping, run in Node against a fake upstream:
//
//   node --test guest-handlers/policies/js/tracker/test.mjs
//
// `allocbox check` proves the handler contract on the built component; these tests
// prove what it cannot see from outside: the index, the counters, the refusals at
// `max-blocks`, `min-size`, and the oldest-first order of `report()` (which the
// `policy` world does not export as such), and the events `observe` takes in. The
// world's import is replaced by a fake that hands out fresh 16-aligned addresses and
// records every call.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';

const source = readFileSync(new URL('./tracker.js', import.meta.url), 'utf8');
const IMPORT = "import * as upstream from 'allocbox:policy/allocator@0.2.0';";
assert.ok(source.includes(IMPORT), 'tracker.js imports its upstream as expected');

// A fresh module instance per test: its state is module-level.
let instances = 0;
async function load({ base = 1n << 20n } = {}) {
  const fake = {
    next: base,
    log: [],
    refuse: false,
    take(size) {
      const a = this.next;
      this.next += ((size + 15n) & ~15n) + 16n;
      return a;
    },
    malloc(size) {
      this.log.push(['malloc', size]);
      return this.refuse ? 0n : this.take(size);
    },
    calloc(n, e) {
      this.log.push(['calloc', n, e]);
      const size = n * e;
      return this.refuse || size >= 1n << 64n ? 0n : this.take(size);
    },
    realloc(p, o, n) {
      this.log.push(['realloc', p, o, n]);
      return this.refuse ? 0n : this.take(n);
    },
    free(p, s) {
      this.log.push(['free', p, s]);
    },
    mallocMany(size, count) {
      this.log.push(['malloc-many', size, count]);
      const out = new BigUint64Array(count);
      for (let i = 0; i < count; i++) out[i] = this.take(size);
      return out;
    },
    freeMany(ptrs, size) {
      this.log.push(['free-many', [...ptrs], size]);
    },
  };
  const key = `__trackerUpstream${instances++}`;
  globalThis[key] = fake;
  const text = source.replace(IMPORT, `const upstream = globalThis.${key};`);
  const mod = await import(`data:text/javascript,${encodeURIComponent(text)}`);
  return { ...mod, fake };
}

const LIMITS = { batch: 4096, memory: 128n << 20n, overhead: 256n << 20n };

function init(mod, config = []) {
  return mod.lifecycle.init(config, LIMITS);
}

// A batch as the host delivers it to a policy observing `survivors`: the listed events
// (those of blocks that outlived the batch) as [op, address, size, place] in columns of
// bytes (addresses and sizes 8 bytes little-endian each, places 4), and the sums.
function survivors(list, { count, transientBlocks = 0n, transientBytes = 0n, peakBytesRise = 0n, peakBlocksRise = 0n }) {
  const ops = new Uint8Array(list.length);
  const addrs = new Uint8Array(8 * list.length);
  const sizes = new Uint8Array(8 * list.length);
  const places = new Uint8Array(4 * list.length);
  const a = new DataView(addrs.buffer);
  const z = new DataView(sizes.buffer);
  const p = new DataView(places.buffer);
  list.forEach(([op, addr, size, place], k) => {
    ops[k] = { malloc: 0, calloc: 1, free: 2 }[op];
    a.setBigUint64(8 * k, addr, true);
    z.setBigUint64(8 * k, size, true);
    p.setUint32(4 * k, place, true);
  });
  return {
    tag: 'survivors',
    val: { events: { ops, addrs, sizes }, places, count, transientBlocks, transientBytes, peakBytesRise, peakBlocksRise },
  };
}

test('init: info, and errors that name the key and why', async () => {
  const m = await load();
  assert.deepEqual(init(m), {
    name: 'tracker', version: 1, alignment: 16n, batch: true, diagnoses: false,
  });
  assert.deepEqual(m.observer.observes(), { batch: 4096, detail: 'survivors', lease: undefined });
  assert.throws(() => init(m, [['max-block', '1']]), /unknown config key `max-block` \(value `1`\); known: max-blocks, min-size/);
  assert.throws(() => init(m, [['max-blocks', '1e6']]), /`max-blocks` = `1e6` is not a count/);
  assert.throws(() => init(m, [['max-blocks', '99999999999999999999']]), /too large/);
  assert.throws(() => init(m, [['min-size', '4XB']]), /`min-size` = `4XB` is not a size/);
  assert.throws(() => init(m, [['min-size', '99999999TiB']]), /more than 2\^64-1 bytes/);
  assert.throws(() => init(m, [['min-size', '1'], ['min-size', '2']]), /given more than once/);
  // The errors are strings (componentize-js makes them `err(...)`), not Errors (a trap).
  try {
    init(m, [['nope', 'x']]);
  } catch (e) {
    assert.equal(typeof e, 'string');
  }
  init(m, [['max-blocks', 'unlimited'], ['min-size', '4 KiB']]);
  init(m, [['max-blocks', '0'], ['min-size', '0']]);
});

test('forwards every call with the exact sizes, and counts', async () => {
  const m = await load();
  init(m);
  const A = m.allocator;
  const a = A.malloc(100n);
  const b = A.calloc(3n, 7n);
  const c = A.realloc(a, 100n, 300n);
  A.free(b, 21n);
  assert.deepEqual(m.fake.log, [
    ['malloc', 100n],
    ['calloc', 3n, 7n],
    ['realloc', a, 100n, 300n],
    ['free', b, 21n],
  ]);
  const r = m.report();
  assert.equal(r.calls, 4);
  assert.equal(r.liveBlocks, 1);
  assert.equal(r.liveBytes, 300);
  assert.equal(r.peakBytes, 321);
  assert.equal(r.peakBlocks, 2);
  assert.equal(r.allocated, 2);
  assert.deepEqual(r.oldest, [[c, 300, 3]]);
  A.free(c, 300n);
  assert.equal(m.report().liveBytes, 0);
  assert.equal(m.report().trackedBlocks, 0);
});

test('oldest first; a realloc makes the block the newest', async () => {
  const m = await load();
  init(m);
  const A = m.allocator;
  const x = A.malloc(16n); // call 1
  const y = A.malloc(32n); // call 2
  const z = A.malloc(48n); // call 3
  const x2 = A.realloc(x, 16n, 64n); // call 4
  A.free(y, 32n); // call 5
  assert.deepEqual(m.report().oldest, [
    [z, 48, 3],
    [x2, 64, 4],
  ]);
  assert.deepEqual(m.report(1).oldest, [[z, 48, 3]]);
});

test('max-blocks: past it blocks are counted, not tracked, and nothing is refused', async () => {
  const m = await load();
  init(m, [['max-blocks', '2']]);
  const A = m.allocator;
  const a = A.malloc(10n);
  const b = A.malloc(10n);
  const c = A.malloc(10n);
  assert.notEqual(c, 0n, 'served: a magazine could not have refused it either');
  let r = m.report();
  assert.equal(r.trackedBlocks, 2);
  assert.equal(r.untracked, 1);
  assert.equal(r.liveBlocks, 3);
  A.free(b, 10n);
  assert.notEqual(A.malloc(10n), 0n);
  r = m.report();
  assert.equal(r.trackedBlocks, 2, 'room again after a free');
  assert.deepEqual(m.report().oldest.map(([p]) => p)[0], a);
  A.free(c, 10n); // untracked: only counted
  assert.equal(m.report().liveBlocks, 2);
});

test('min-size: small blocks are counted, not tracked, and not bounded', async () => {
  const m = await load();
  init(m, [['max-blocks', '1'], ['min-size', '1KiB']]);
  const A = m.allocator;
  const smalls = [];
  for (let i = 0; i < 5; i++) smalls.push(A.malloc(100n));
  assert.ok(smalls.every((p) => p !== 0n));
  const big = A.malloc(2048n);
  assert.notEqual(big, 0n);
  const second = A.malloc(1024n);
  assert.notEqual(second, 0n, 'past max-blocks: counted, not refused');
  let r = m.report();
  assert.equal(r.smallBlocks, 5);
  assert.equal(r.smallBytes, 500);
  assert.equal(r.liveBlocks, 7);
  assert.equal(r.trackedBlocks, 1);
  assert.equal(r.untracked, 1);
  A.free(second, 1024n);
  // A tracked block shrinking below min-size leaves the index.
  const shrunk = A.realloc(big, 2048n, 10n);
  r = m.report();
  assert.equal(r.trackedBlocks, 0);
  assert.equal(r.smallBlocks, 6);
  const grown = A.realloc(smalls[0], 100n, 4096n);
  assert.notEqual(grown, 0n);
  assert.deepEqual(m.report().oldest.map(([p]) => p), [grown]);
  A.free(shrunk, 10n);
  A.free(grown, 4096n);
  for (const p of smalls.slice(1)) A.free(p, 100n);
  r = m.report();
  assert.equal(r.liveBlocks, 0);
  assert.equal(r.liveBytes, 0);
  assert.equal(r.smallBlocks, 0);
  assert.equal(r.trackedBlocks, 0);
});

test('malloc-many and free-many only forward: magazine blocks are not the client\'s', async () => {
  const m = await load();
  init(m, [['max-blocks', '3']]);
  const A = m.allocator;
  A.malloc(64n);
  const got = A.mallocMany(64n, 5);
  assert.equal(got.length, 5);
  assert.deepEqual(m.fake.log.at(-1), ['malloc-many', 64n, 5]);
  A.freeMany(got, 64n);
  const r = m.report();
  assert.equal(r.trackedBlocks, 1);
  assert.equal(r.liveBytes, 64);
  assert.equal(r.liveBlocks, 1);
});

test('observe: survivors are tracked as calls are, in order, and transient blocks counted', async () => {
  const m = await load();
  init(m);
  const O = m.observer;
  // malloc 0x1000 (16), calloc 0x2000 (64), free 0x1000, malloc 0x3000 (32): the first
  // block came and went within the batch.
  O.observe(survivors([
    ['calloc', 0x2000n, 64n, 1],
    ['malloc', 0x3000n, 32n, 3],
  ], { count: 4, transientBlocks: 1n, transientBytes: 16n, peakBytesRise: 96n, peakBlocksRise: 2n }));
  let r = m.report();
  assert.equal(r.calls, 4);
  assert.equal(r.allocated, 3);
  assert.equal(r.liveBlocks, 2);
  assert.equal(r.liveBytes, 96);
  assert.equal(r.peakBytes, 96);
  assert.equal(r.peakBlocks, 2);
  assert.deepEqual(r.oldest, [[0x2000n, 64, 2], [0x3000n, 32, 4]]);
  // A batch of transient blocks only: no live count moves, the peak they made is kept.
  O.observe(survivors([], { count: 2, transientBlocks: 1n, transientBytes: 1000n, peakBytesRise: 1000n, peakBlocksRise: 1n }));
  r = m.report();
  assert.equal(r.calls, 6);
  assert.equal(r.allocated, 4);
  assert.equal(r.liveBytes, 96);
  assert.equal(r.peakBytes, 1096);
  assert.equal(r.peakBlocks, 3);
  assert.equal(r.trackedBlocks, 2);
  // A block lent by an event and freed by the policy's own call leaves the index.
  m.allocator.free(0x2000n, 64n);
  O.observe(survivors([['free', 0x3000n, 32n, 0]], { count: 1 }));
  r = m.report();
  assert.equal(r.liveBlocks, 0);
  assert.equal(r.trackedBlocks, 0);
  // Addresses above 2^53 keep exact keys.
  const far = (1n << 60n) + 16n;
  O.observe(survivors([['malloc', far + 32n, 16n, 1]], { count: 3, transientBlocks: 1n, transientBytes: 16n, peakBytesRise: 32n, peakBlocksRise: 2n }));
  assert.deepEqual(m.report().oldest.map(([p]) => p), [far + 32n]);
  // The lifecycle report is the counters, by name.
  const counters = Object.fromEntries(m.lifecycle.report());
  assert.equal(counters['live-blocks'], 1n);
  assert.equal(counters['tracked-blocks'], 1n);
});

test('observe: other forms of observation are not this policy\'s and change nothing', async () => {
  const m = await load();
  init(m);
  m.observer.observe({ tag: 'totals', val: { lentBlocks: 1n, lentBytes: 8n, freedBlocks: 0n, freedBytes: 0n, lentByBits: [] } });
  assert.equal(m.report().calls, 0);
});

test('upstream out of memory changes nothing', async () => {
  const m = await load();
  init(m);
  const A = m.allocator;
  const a = A.malloc(100n);
  m.fake.refuse = true;
  assert.equal(A.malloc(100n), 0n);
  assert.equal(A.realloc(a, 100n, 200n), 0n);
  const r = m.report();
  assert.equal(r.liveBytes, 100);
  assert.deepEqual(r.oldest, [[a, 100, 1]]);
});

test('calloc with an overflowing product goes upstream and is answered 0', async () => {
  const m = await load();
  init(m, [['max-blocks', '1']]);
  assert.equal(m.allocator.calloc(1n << 40n, 1n << 40n), 0n);
  assert.deepEqual(m.fake.log, [['calloc', 1n << 40n, 1n << 40n]]);
  assert.equal(m.report().liveBlocks, 0);
});

test('addresses above 2^53 keep exact keys', async () => {
  const m = await load({ base: (1n << 60n) + 16n });
  init(m);
  const A = m.allocator;
  const a = A.malloc(16n); // 2^60 + 16
  const b = A.malloc(16n); // 2^60 + 48: the same Number as a, a different BigInt
  assert.equal(Number(a), Number(b));
  A.free(a, 16n);
  assert.deepEqual(m.report().oldest, [[b, 16, 2]]);
  A.free(b, 16n);
  assert.equal(m.report().trackedBlocks, 0);
});

test('slots are reused and chunks grow past one chunk', async () => {
  const m = await load();
  init(m, [['max-blocks', 'unlimited']]);
  const A = m.allocator;
  const held = [];
  for (let i = 0; i < 40000; i++) held.push(A.malloc(32n)); // > 32768 slots a chunk
  for (let i = 0; i < held.length; i += 2) A.free(held[i], 32n);
  for (let i = 0; i < 10; i++) A.malloc(32n);
  const r = m.report(3);
  assert.equal(r.trackedBlocks, 20010);
  assert.deepEqual(r.oldest.map(([p, s]) => [p, s]), [
    [held[1], 32],
    [held[3], 32],
    [held[5], 32],
  ]);
  assert.deepEqual(r.oldest.map(([, , seq]) => seq), [2, 4, 6]);
});

test('the index agrees with a Map through 200,000 random operations', async () => {
  const m = await load();
  init(m, [['max-blocks', 'unlimited']]);
  const A = m.allocator;
  let seed = 12345;
  const rand = (n) => {
    seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
    return seed % n;
  };
  // Remove and return a random element of an array (order does not matter).
  const takeRandom = (arr) => {
    const i = rand(arr.length);
    const x = arr[i];
    arr[i] = arr[arr.length - 1];
    arr.pop();
    return x;
  };
  // Addresses from a small range in a random order, so runs of neighbours collide in
  // the table and deletions shift entries back across them (and across its end).
  const pool = [];
  for (let i = 1; i <= 60000; i++) pool.push(BigInt(i) * 16n);
  m.fake.take = () => takeRandom(pool);
  const model = new Map(); // address -> [size, seq]
  const live = [];
  let call = 0;
  for (let op = 0; op < 200000; op++) {
    call += 1;
    if (live.length > 0 && (rand(100) < 45 || pool.length < 100)) {
      const p = takeRandom(live);
      const [size] = model.get(p);
      model.delete(p);
      if (rand(4) === 0) {
        // The fake takes the new address before the old one is back in the pool.
        const q = A.realloc(p, BigInt(size), BigInt(size + 1));
        model.set(q, [size + 1, call]);
        live.push(q);
      } else {
        A.free(p, BigInt(size));
      }
      pool.push(p);
    } else {
      const size = 1 + rand(1000);
      const p = A.malloc(BigInt(size));
      model.set(p, [size, call]);
      live.push(p);
    }
    if (op % 20000 === 0 || op === 199999) {
      const r = m.report(Infinity);
      assert.equal(r.trackedBlocks, model.size);
      const want = [...model].map(([p, [s, q]]) => [p, s, q]).sort((x, y) => x[2] - y[2]);
      assert.deepEqual(r.oldest, want);
    }
  }
});
