// `slab`: a fixed-size slab allocator, as an allocbox policy in AssemblyScript.
//
// Requests of at most `object-size` bytes are served from slabs: blocks of `slab-size`
// bytes taken from the upstream and carved into equal objects. Larger requests go
// straight upstream. A slab's free objects are a bitmap kept in this module's own linear
// memory, so a small malloc or free is answered without a single call to the host;
// `calloc` costs one `bytes.fill`, and a move in `realloc` one `bytes.copy`.
//
// This file is a core module written to the canonical ABI of contract 0.2.0's
// `sharding-policy` world (wit/0.2.0/policy.wit). AssemblyScript can only export
// identifiers, so the exports here are named `malloc`, `malloc_many`, `init` ... and
// `rename.mjs` renames them to `allocbox:policy/allocator@0.2.0#malloc` ... after
// compiling; the host turns the module into a component when it loads it. The host
// calls an instance on one thread at a time, and everything below is this instance's
// alone, so the policy says it is shardable: the host may start one per thread.
//
// The rules the host enforces, and how this policy keeps them:
// - Every block it returns lies inside an upstream block it holds: an object lies inside
//   its slab, a large block is the upstream block itself.
// - The sized-free rule: a block's size decides where it came from. Every block whose
//   current size is at most `object-size` is a slab object, every larger one a whole
//   upstream block of exactly that size (realloc moves blocks that cross the line), so
//   `free(ptr, size)` always knows which kind it got. Slabs go back upstream with
//   `slab-size`, the size they were taken with.
// - Alignment 16: upstream blocks are 16-aligned and `object-size` is a multiple of 16.
// - Bytes are touched only through `bytes`: `fill` on an object not lent yet (calloc),
//   `copy` from the block being resized (readable during realloc) into one not lent yet.
// - `trim` gives back every slab with no live object, so after the checker frees
//   everything nothing stays held.
//
// Memory map (all of it this module's own; the host never sees these addresses):
//   static data  the `init` answer, the `malloc-many` answer buffer, strings
//   heapStart()  the slab table: `cap` i32 slot numbers sorted by slab address (the
//                index), then `cap` slab records of `recSize` bytes, by slot number
//   scratch      above the table: a bump area for what the host passes in through
//                `cabi_realloc` (the config list, `free-many`'s list, upstream lists),
//                emptied when a call is done with it
// The table grows (doubling `cap`) only in calls that take no list argument, while the
// scratch area is empty, so moving the scratch area up then loses nothing.

// ---------------------------------------------------------------------------------------
// Imports: the upstream allocator and checked byte access (canonical-ABI names).

@external("allocbox:policy/allocator@0.2.0", "malloc")
declare function upMalloc(size: u64): u64;
@external("allocbox:policy/allocator@0.2.0", "calloc")
declare function upCalloc(nelem: u64, elsize: u64): u64;
@external("allocbox:policy/allocator@0.2.0", "realloc")
declare function upRealloc(ptr: u64, oldSize: u64, newSize: u64): u64;
@external("allocbox:policy/allocator@0.2.0", "free")
declare function upFree(ptr: u64, size: u64): void;
// A returned list is written as (ptr, len) at `ret`; the host allocates its elements
// with our `cabi_realloc`, i.e. in the scratch area.
@external("allocbox:policy/allocator@0.2.0", "malloc-many")
declare function upMallocMany(size: u64, count: u32, ret: usize): void;
@external("allocbox:policy/allocator@0.2.0", "free-many")
declare function upFreeMany(list: usize, len: u32, size: u64): void;
@external("allocbox:policy/bytes@0.2.0", "fill")
declare function bytesFill(at: u64, len: u64, byte: u8): void;
@external("allocbox:policy/bytes@0.2.0", "copy")
declare function bytesCopy(dst: u64, src: u64, len: u64): void;

// ---------------------------------------------------------------------------------------
// Configuration. Mutable globals are initialised with literals only: an initialiser
// that names another constant or is an expression makes the compiler set every global
// in a wasm start function instead (which works, but costs code). `init` sets the
// configured ones anyway.

const DEFAULT_OBJECT_SIZE: u64 = 64;
const DEFAULT_SLAB_SIZE: u64 = 64 << 10;
const DEFAULT_KEEP_EMPTY: u64 = 1;
const MAX_OBJECT_SIZE: u64 = 1 << 20;
const MAX_SLAB_SIZE: u64 = 64 << 20;
// Bounds a slab record (its bitmap is objects/8 bytes) and the bitmap scan.
const MAX_OBJECTS: u64 = 65536;
const MAX_KEEP_EMPTY: u64 = 1 << 20;
// Most blocks one `malloc-many` returns ("fewer" is allowed; the host asks for 16).
const MAX_BATCH: u32 = 256;
/// Most blocks one upstream `malloc-many` or `free-many` may carry: the host's batch
/// bound, told at `init` (passing it stops the policy).
let upstreamBatch: u32 = 4096;

/// Largest request served from a slab; the size of every object.
let objSize: u64 = 64; // DEFAULT_OBJECT_SIZE
/// Size of every slab, as taken from and given back to the upstream.
let slabSize: u64 = 65536; // DEFAULT_SLAB_SIZE
/// Empty slabs kept for reuse when their last object is freed; more go back at once.
let keepEmpty: u64 = 1; // DEFAULT_KEEP_EMPTY
/// Objects per slab (slabSize / objSize), the u64 words of its bitmap, and the bytes of
/// a slab record (REC_BITMAP + 8 * nWords), for the defaults.
let nObj: u32 = 1024;
let nWords: u32 = 16;
let recSize: usize = 152;

// ---------------------------------------------------------------------------------------
// The slab table.
//
// A slab record: the slab's upstream address, its live objects, the first bitmap word
// that may hold a free bit (a lower bound: no word before it has one), and its links in
// the list of slabs with a free object ("partial" slabs, empty ones included); then the
// bitmap, one bit per object, 1 = free.

const REC_BASE: usize = 0; // u64
const REC_USED: usize = 8; // u32
const REC_HINT: usize = 12; // u32, a word index
const REC_NEXT: usize = 16; // i32 slot, -1 = none
const REC_PREV: usize = 20; // i32 slot, -1 = none
const REC_BITMAP: usize = 24; // nWords u64 words

const NONE: i32 = -1;

/// Slots the table has room for, and slots in use (slabs held): slots 0..count.
let cap: u32 = 0;
let count: u32 = 0;
/// Address of record 0; the index starts at heapStart().
let recBase: usize = 0;
/// Head of the partial list.
let partialHead: i32 = -1; // NONE
/// Slabs held with no live object.
let emptyCount: u64 = 0;
/// What `lifecycle.report` answers: slabs taken from upstream, and the most held at once.
let slabsTaken: u64 = 0;
let peakSlabs: u64 = 0;

// @ts-ignore: decorator
@inline function heapStart(): usize {
  return (__heap_base + 15) & ~(<usize>15);
}
// @ts-ignore: decorator
@inline function rec(slot: i32): usize {
  return recBase + <usize>slot * recSize;
}
// @ts-ignore: decorator
@inline function indexAt(i: u32): i32 {
  return load<i32>(heapStart() + (<usize>i << 2));
}
// @ts-ignore: decorator
@inline function setIndexAt(i: u32, slot: i32): void {
  store<i32>(heapStart() + (<usize>i << 2), slot);
}
// @ts-ignore: decorator
@inline function slabAddr(slot: i32): u64 {
  return load<u64>(rec(slot), REC_BASE);
}

/// Index positions whose slab starts at or below `addr` (binary search): the slab that
/// may hold `addr` is at the position before the answer.
function upperBound(addr: u64): u32 {
  let lo: u32 = 0;
  let hi = count;
  while (lo < hi) {
    let mid = (lo + hi) >> 1;
    if (slabAddr(indexAt(mid)) <= addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/// The slot of the slab that holds `addr`, or NONE.
function slabOf(addr: u64): i32 {
  let pos = upperBound(addr);
  if (pos == 0) return NONE;
  let slot = indexAt(pos - 1);
  // Only the first nObj * objSize bytes are carved; the tail is never lent.
  if (addr - slabAddr(slot) >= <u64>nObj * objSize) return NONE;
  return slot;
}

function pushPartial(slot: i32): void {
  let r = rec(slot);
  store<i32>(r, partialHead, REC_NEXT);
  store<i32>(r, NONE, REC_PREV);
  if (partialHead != NONE) store<i32>(rec(partialHead), slot, REC_PREV);
  partialHead = slot;
}

function unlinkPartial(slot: i32): void {
  let r = rec(slot);
  let next = load<i32>(r, REC_NEXT);
  let prev = load<i32>(r, REC_PREV);
  if (prev != NONE) store<i32>(rec(prev), next, REC_NEXT);
  else partialHead = next;
  if (next != NONE) store<i32>(rec(next), prev, REC_PREV);
}

// ---------------------------------------------------------------------------------------
// Scratch area for the host's `cabi_realloc` calls.

/// Where the scratch area starts (just above the table) and its bump pointer; 0 until
/// the first use.
let scratchBase: usize = 0;
let scratchTop: usize = 0;

function scratchStart(): usize {
  if (scratchBase == 0) scratchBase = heapStart();
  return scratchBase;
}

/// Forget everything in the scratch area (the call that used it is done with it).
// @ts-ignore: decorator
@inline function resetScratch(): void {
  scratchTop = scratchStart();
}

/// Makes linear memory at least `end` bytes long; false when it cannot grow.
function ensureMemory(end: usize): bool {
  let have = <usize>memory.size() << 16;
  if (end <= have) return true;
  let pages = <i32>((end - have + 0xffff) >>> 16);
  return memory.grow(pages) >= 0;
}

/// The host allocates the lists and strings it passes in here.
export function cabi_realloc(old: usize, oldSize: usize, align: usize, newSize: usize): usize {
  if (scratchTop == 0) scratchTop = scratchStart();
  let at = (scratchTop + align - 1) & ~(align - 1);
  let end = at + newSize;
  // The host cannot be told "no" here; a trap is the only answer.
  if (!ensureMemory(end)) unreachable();
  if (oldSize != 0) memory.copy(at, old, min(oldSize, newSize));
  scratchTop = end;
  return at;
}

/// Doubles the table: the index stays where it is, the records move up behind it, and
/// the (empty) scratch area moves above them. False when memory cannot grow.
function growTable(): bool {
  let newCap: u32 = cap == 0 ? 16 : cap << 1;
  let newRecBase = heapStart() + (<usize>newCap << 2);
  let end = newRecBase + <usize>newCap * recSize;
  if (!ensureMemory(end)) return false;
  if (count != 0) memory.copy(newRecBase, recBase, <usize>count * recSize);
  recBase = newRecBase;
  cap = newCap;
  scratchBase = (end + 15) & ~(<usize>15);
  scratchTop = scratchBase;
  return true;
}

// ---------------------------------------------------------------------------------------
// Slabs.

/// Takes a new slab from the upstream and makes it the head of the partial list; the
/// new slot, or NONE when the table or the upstream is out of memory.
function newSlab(): i32 {
  // Grow the table first: a slab taken and then not recorded would leak.
  if (count == cap && !growTable()) return NONE;
  let base = upMalloc(slabSize);
  if (base == 0) return NONE;
  // Keep the index sorted by address: find the place before the slab is counted.
  let pos = upperBound(base);
  let at = heapStart() + (<usize>pos << 2);
  memory.copy(at + 4, at, <usize>(count - pos) << 2);
  let slot = <i32>count;
  store<i32>(at, slot);
  count++;
  let r = rec(slot);
  store<u64>(r, base, REC_BASE);
  store<u32>(r, 0, REC_USED);
  store<u32>(r, 0, REC_HINT);
  // Every object free: full words of ones, then the bits of a last partial word.
  let words = r + REC_BITMAP;
  let full = nObj >> 6;
  memory.fill(words, 0xff, <usize>full << 3);
  if ((nObj & 63) != 0) store<u64>(words + (<usize>full << 3), (<u64>1 << (nObj & 63)) - 1);
  pushPartial(slot);
  emptyCount++;
  slabsTaken++;
  if (<u64>count > peakSlabs) peakSlabs = count;
  return slot;
}

/// Gives an empty slab back upstream and fills its slot with the last record, so the
/// slots in use stay 0..count.
function releaseSlab(slot: i32): void {
  let base = slabAddr(slot);
  unlinkPartial(slot);
  upFree(base, slabSize);
  // Drop its index entry.
  let pos = upperBound(base) - 1;
  let at = heapStart() + (<usize>pos << 2);
  memory.copy(at, at + 4, <usize>(count - 1 - pos) << 2);
  count--;
  let last = <i32>count;
  if (slot == last) return;
  // Move the last record into the hole, then point its index entry and list links at
  // the new slot.
  memory.copy(rec(slot), rec(last), recSize);
  setIndexAt(upperBound(slabAddr(slot)) - 1, slot);
  let r = rec(slot);
  if (load<u32>(r, REC_USED) < nObj) {
    let next = load<i32>(r, REC_NEXT);
    let prev = load<i32>(r, REC_PREV);
    if (prev != NONE) store<i32>(rec(prev), slot, REC_NEXT);
    else partialHead = slot;
    if (next != NONE) store<i32>(rec(next), slot, REC_PREV);
  }
}

/// A free object, or 0 when no slab has one and no new slab can be had.
function allocObject(): u64 {
  let slot = partialHead;
  if (slot == NONE) {
    slot = newSlab();
    if (slot == NONE) return 0;
  }
  let r = rec(slot);
  // A partial slab has a free bit at or after its hint, so the scan ends.
  let w = load<u32>(r, REC_HINT);
  let at = r + REC_BITMAP + (<usize>w << 3);
  let word = load<u64>(at);
  while (word == 0) {
    w++;
    at += 8;
    word = load<u64>(at);
  }
  let bit = <u32>ctz(word);
  store<u64>(at, word & (word - 1));
  store<u32>(r, w, REC_HINT);
  let used = load<u32>(r, REC_USED) + 1;
  store<u32>(r, used, REC_USED);
  if (used == 1) emptyCount--;
  if (used == nObj) unlinkPartial(slot);
  return load<u64>(r, REC_BASE) + <u64>((w << 6) + bit) * objSize;
}

/// Returns the object at `ptr` to its slab. False when `ptr` is in no slab (which the
/// sized-free rule rules out; the caller then hands it upstream, where the host judges).
function freeObject(ptr: u64): bool {
  let slot = slabOf(ptr);
  if (slot == NONE) return false;
  let r = rec(slot);
  let i = <u32>((ptr - load<u64>(r, REC_BASE)) / objSize);
  let w = i >> 6;
  let at = r + REC_BITMAP + (<usize>w << 3);
  store<u64>(at, load<u64>(at) | (<u64>1 << (i & 63)));
  if (w < load<u32>(r, REC_HINT)) store<u32>(r, w, REC_HINT);
  let used = load<u32>(r, REC_USED);
  // A full slab has a free object again.
  if (used == nObj) pushPartial(slot);
  used--;
  store<u32>(r, used, REC_USED);
  if (used == 0) {
    // Keep a few empty slabs so that one object allocated and freed over and over at
    // a slab's edge does not take and give back a whole slab each time.
    if (emptyCount >= keepEmpty) releaseSlab(slot);
    else emptyCount++;
  }
  return true;
}

// @ts-ignore: decorator
@inline function small(size: u64): bool {
  return size <= objSize;
}

// ---------------------------------------------------------------------------------------
// allocbox:policy/allocator@0.2.0

export function malloc(size: u64): u64 {
  resetScratch();
  return small(size) ? allocObject() : upMalloc(size);
}

export function calloc(nelem: u64, elsize: u64): u64 {
  resetScratch();
  // An overflowing product goes upstream, which answers 0 as the contract says.
  let overflows = elsize != 0 && nelem > U64.MAX_VALUE / elsize;
  if (overflows || !small(nelem * elsize)) return upCalloc(nelem, elsize);
  let size = nelem * elsize;
  let ptr = allocObject();
  // An object may hold a previous owner's bytes; it is not lent yet, so we may fill it.
  if (ptr != 0 && size != 0) bytesFill(ptr, size, 0);
  return ptr;
}

export function realloc(ptr: u64, oldSize: u64, newSize: u64): u64 {
  resetScratch();
  if (ptr == 0) return malloc(newSize);
  let wasSmall = small(oldSize);
  let isSmall = small(newSize);
  // Within the object size the object already has room: stay in place.
  if (wasSmall && isSmall) return ptr;
  // Both large: the block is a plain upstream block of oldSize.
  if (!wasSmall && !isSmall) return upRealloc(ptr, oldSize, newSize);
  // Crossing the object size: the block must change kind (the sized-free rule), so it
  // moves. The new block is not lent yet and the old one is readable during realloc.
  let moved = isSmall ? allocObject() : upMalloc(newSize);
  if (moved == 0) return 0; // the old block stays live and unchanged
  bytesCopy(moved, ptr, min(oldSize, newSize));
  if (wasSmall) {
    if (!freeObject(ptr)) upFree(ptr, oldSize);
  } else {
    upFree(ptr, oldSize);
  }
  return moved;
}

export function free(ptr: u64, size: u64): void {
  resetScratch();
  if (ptr == 0) return;
  if (!small(size) || !freeObject(ptr)) upFree(ptr, size);
}

/// The answer of `malloc-many`: (ptr, len) of the list, then room for its addresses.
const manyRet = memory.data(8 + (<i32>MAX_BATCH << 3), 8);

export function malloc_many(size: u64, wanted: u32): usize {
  resetScratch();
  if (!small(size)) {
    // One upstream call; its list lands in the scratch area, and its (ptr, len) is
    // exactly our answer's layout.
    upMallocMany(size, min(wanted, upstreamBatch), manyRet);
    return manyRet;
  }
  let n = min(wanted, MAX_BATCH);
  let list = manyRet + 8;
  let i: u32 = 0;
  while (i < n) {
    let ptr = allocObject();
    if (ptr == 0) break; // fewer blocks when memory runs out
    store<u64>(list + (<usize>i << 3), ptr);
    i++;
  }
  store<u32>(manyRet, <u32>list);
  store<u32>(manyRet, i, 4);
  return manyRet;
}

export function free_many(list: usize, len: u32, size: u64): void {
  if (!small(size)) {
    for (let done: u32 = 0; done < len; done += upstreamBatch) {
      upFreeMany(list + (<usize>done << 3), min(len - done, upstreamBatch), size);
    }
  } else {
    for (let i: u32 = 0; i < len; i++) {
      let ptr = load<u64>(list + (<usize>i << 3));
      if (ptr != 0 && !freeObject(ptr)) upFree(ptr, size);
    }
  }
  resetScratch();
}

// ---------------------------------------------------------------------------------------
// allocbox:policy/lifecycle@0.2.0

/// The `init` answer, result<info, string>: tag u8 at 0; ok: name (ptr, len) at 8,
/// version u8 at 16, alignment u64 at 24, batch bool at 32, diagnoses bool at 33 (0.2.0
/// put it in batch's 8-byte slot, so the answer is 40 bytes as in 0.1.0); err: message
/// (ptr, len) at 8.
const initRet = memory.data(40, 8);
/// Where error messages are written (UTF-8).
const MSG_CAP: usize = 512;
const msgBuf = memory.data(<i32>MSG_CAP, 8);
let msgLen: usize = 0;

/// Appends an ASCII string literal (AssemblyScript strings are UTF-16 in memory).
function say(s: string): void {
  let p = changetype<usize>(s);
  let n = <usize>s.length;
  for (let i: usize = 0; i < n && msgLen < MSG_CAP; i++) {
    store<u8>(msgBuf + msgLen++, <u8>load<u16>(p + (i << 1)));
  }
}

/// Appends at most 64 bytes of host-given UTF-8, cut at a character boundary.
function sayBytes(p: usize, n: usize): void {
  if (n > 64) {
    n = 64;
    while (n > 0 && (load<u8>(p + n) & 0xc0) == 0x80) n--;
  }
  if (msgLen + n > MSG_CAP) return;
  memory.copy(msgBuf + msgLen, p, n);
  msgLen += n;
}

function sayNum(v: u64): void {
  let digits = 1;
  for (let t = v; t >= 10; t /= 10) digits++;
  if (msgLen + <usize>digits > MSG_CAP) return;
  let at = msgBuf + msgLen + <usize>digits;
  msgLen += <usize>digits;
  do {
    store<u8>(--at, <u8>(48 + v % 10));
    v /= 10;
  } while (v != 0);
}

/// Answers err(message so far).
function fail(): usize {
  store<u8>(initRet, 1);
  store<u32>(initRet, <u32>msgBuf, 8);
  store<u32>(initRet, <u32>msgLen, 12);
  resetScratch();
  return initRet;
}

/// Whether the `n` bytes at `p` spell the ASCII literal `s`.
function eq(p: usize, n: usize, s: string): bool {
  if (n != <usize>s.length) return false;
  let q = changetype<usize>(s);
  for (let i: usize = 0; i < n; i++) {
    if (<u16>load<u8>(p + i) != load<u16>(q + (i << 1))) return false;
  }
  return true;
}

const BAD: u64 = U64.MAX_VALUE;

/// A byte count: decimal digits, then optionally K/KiB or M/MiB (either case). BAD
/// when it is anything else or larger than 2^40.
function parseSize(p: usize, n: usize): u64 {
  let v: u64 = 0;
  let i: usize = 0;
  while (i < n) {
    let c = load<u8>(p + i);
    if (c < 48 || c > 57) break;
    v = v * 10 + <u64>(c - 48);
    if (v > (<u64>1 << 40)) return BAD;
    i++;
  }
  if (i == 0) return BAD;
  let rest = n - i;
  if (rest == 0) return v;
  let c = load<u8>(p + i) | 0x20; // lower case
  let shift: u64 = c == 0x6b ? 10 : c == 0x6d ? 20 : 0;
  if (shift == 0) return BAD;
  if (rest != 1 && !(rest == 3 && eq(p + i + 1, 2, "iB"))) return BAD;
  return v << shift;
}

/// Reads one numeric key: err names the key, the value and what is wanted. Returns the
/// value, or BAD after writing the message.
function setting(val: usize, valLen: usize, key: string, min: u64, max: u64, unit: u64): u64 {
  let v = parseSize(val, valLen);
  if (v != BAD && v >= min && v <= max && v % unit == 0) return v;
  say("slab: bad value `");
  sayBytes(val, valLen);
  say("` for `");
  say(key);
  say("`: want ");
  if (unit > 1) {
    say("a multiple of ");
    sayNum(unit);
    say(" ");
  } else {
    say("an integer ");
  }
  say("in ");
  sayNum(min);
  say("..=");
  sayNum(max);
  if (unit > 1) say(" (K/KiB and M/MiB suffixes allowed)");
  return BAD;
}

const NAME = "slab";
const nameBuf = memory.data(8, 8);

/// `limits` is a record, so the canonical ABI passes its fields one by one after the
/// configuration list: batch (u32), memory and overhead (u64). A `memory.grow` past
/// `memory` answers -1, which `ensureMemory` already takes as out of memory, and the
/// host enforces the overhead budget.
export function init(config: usize, len: u32, batchLimit: u32, memoryLimit: u64, overheadLimit: u64): usize {
  msgLen = 0;
  let obj = DEFAULT_OBJECT_SIZE;
  let slab = DEFAULT_SLAB_SIZE;
  let keep = DEFAULT_KEEP_EMPTY;
  // Bit per key: given already.
  let seen = 0;
  for (let i: u32 = 0; i < len; i++) {
    // A list<tuple<string, string>> element: key (ptr, len), value (ptr, len).
    let e = config + (<usize>i << 4);
    let key = <usize>load<u32>(e);
    let keyLen = <usize>load<u32>(e, 4);
    let val = <usize>load<u32>(e, 8);
    let valLen = <usize>load<u32>(e, 12);
    let bit = 0;
    let v: u64 = 0;
    if (eq(key, keyLen, "object-size")) {
      bit = 1;
      v = obj = setting(val, valLen, "object-size", 16, MAX_OBJECT_SIZE, 16);
    } else if (eq(key, keyLen, "slab-size")) {
      bit = 2;
      v = slab = setting(val, valLen, "slab-size", 16, MAX_SLAB_SIZE, 16);
    } else if (eq(key, keyLen, "keep-empty")) {
      bit = 4;
      v = keep = setting(val, valLen, "keep-empty", 0, MAX_KEEP_EMPTY, 1);
    } else {
      say("slab: unknown config key `");
      sayBytes(key, keyLen);
      say("`; known: object-size, slab-size, keep-empty");
      return fail();
    }
    if (v == BAD) return fail();
    if (seen & bit) {
      say("slab: `");
      sayBytes(key, keyLen);
      say("` given more than once");
      return fail();
    }
    seen |= bit;
  }
  if (slab < obj || slab / obj > MAX_OBJECTS) {
    say("slab: `slab-size` ");
    sayNum(slab);
    say(" must hold 1..=");
    sayNum(MAX_OBJECTS);
    say(" objects of `object-size` ");
    sayNum(obj);
    return fail();
  }
  objSize = obj;
  slabSize = slab;
  keepEmpty = keep;
  // Never 0: the loop in `free_many` that splits a batch would not advance.
  upstreamBatch = max(batchLimit, 1);
  nObj = <u32>(slab / obj);
  nWords = (nObj + 63) >> 6;
  recSize = REC_BITMAP + (<usize>nWords << 3);

  // "slab" as UTF-8.
  for (let i = 0; i < NAME.length; i++) store<u8>(nameBuf + i, <u8>NAME.charCodeAt(i));
  store<u8>(initRet, 0);
  store<u32>(initRet, <u32>nameBuf, 8);
  store<u32>(initRet, <u32>NAME.length, 12);
  store<u8>(initRet, 1, 16); // contract version
  store<u64>(initRet, 16, 24); // alignment: see the header comment
  // The host may fetch objects ahead and give them back later: order does not matter
  // to a bitmap, and trim still sees every slab whose objects all came back.
  store<u8>(initRet, 1, 32);
  // diagnoses: it checks nothing of how the client uses its objects.
  store<u8>(initRet, 0, 33);
  resetScratch();
  return initRet;
}

export function trim(): void {
  resetScratch();
  // Downwards: releasing slot s moves the last record (already looked at) into s.
  let s = <i32>count - 1;
  while (s >= 0) {
    if (load<u32>(rec(s), REC_USED) == 0) releaseSlab(s);
    s--;
  }
  emptyCount = 0;
}

/// `report`'s answer, list<tuple<string, u64>>: (ptr, len) here, the elements (16 bytes
/// each: the name's ptr and len, the value at 8) in `counters`, their names in `names`.
const reportRet = memory.data(8, 8);
const counters = memory.data(32, 8);
const names = memory.data(32, 8);

/// Writes counter `i`: its ASCII name, as UTF-8 at names + 16 * i, and its value.
function counter(i: usize, name: string, value: u64): void {
  let at = names + (i << 4);
  for (let k = 0; k < name.length; k++) store<u8>(at + k, <u8>name.charCodeAt(k));
  let c = counters + (i << 4);
  store<u32>(c, <u32>at);
  store<u32>(c, <u32>name.length, 4);
  store<u64>(c, value, 8);
}

export function report(): usize {
  resetScratch();
  counter(0, "slabs-taken", slabsTaken);
  // `peak-` tells a tool that combines reports to keep the largest, not the sum.
  counter(1, "peak-slabs", peakSlabs);
  store<u32>(reportRet, <u32>counters);
  store<u32>(reportRet, 2, 4);
  return reportRet;
}

// ---------------------------------------------------------------------------------------
// allocbox:policy/observer@0.2.0: this policy is asked on every call and observes nothing.

/// `observes`' answer, option<observing>: tag u8 at 0 (0 = none), the record at 8 (its
/// option<u64> lease makes it 8-aligned), 32 bytes in all.
const observesRet = memory.data(32, 8);

export function observes(): usize {
  resetScratch();
  store<u8>(observesRet, 0);
  return observesRet;
}

/// Never called while `observes` answers none, but every export of the world must exist.
/// The `observation` variant arrives flattened: the case, then each case's fields joined
/// slot by slot (an i32 slot that another case fills with a u64 becomes an i64): events
/// are three byte lists in slots 1..6; totals four u64 in 1..4 and a list in 5..6;
/// survivors the events in 1..6, a list in 7..8, a count in 9 and four u64 in 10..13.
/// Its lists were placed in the scratch area, emptied here.
export function observe(
  which: u32, s1: u64, s2: u64, s3: u64, s4: u64, s5: u32, s6: u32, s7: u32, s8: u32,
  s9: u32, s10: u64, s11: u64, s12: u64, s13: u64,
): void {
  resetScratch();
}

/// Never called without a lease, and this policy grants none.
export function renew(size: u64): u64 {
  resetScratch();
  return 0;
}

// ---------------------------------------------------------------------------------------
// allocbox:policy/sharding@0.2.0

/// Every slab and table lives in this instance's own memory and counts nothing another
/// instance lends, so the host may start one instance per thread.
export function shardable(): bool {
  resetScratch();
  return true;
}
