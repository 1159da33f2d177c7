// policy_name: an allocbox allocation policy (NumPy NEP 49) in AssemblyScript, started by
// `allocbox new`. A pass-through that counts the blocks it has lent out: every call goes
// upstream (the next policy in the chain, or the host's memory) unchanged.
//
// It compiles to a core module in the canonical ABI of the `policy` world in
// wit/policy.wit; allocbox makes it a component when it loads it. AssemblyScript can
// only export identifiers, so build.sh renames the exports after compiling (rename.mjs:
// `malloc` -> `allocbox:policy/allocator@0.1.0#malloc`, ...).
//
// The rules the host enforces (it stops the policy at the first break):
// - every address you return lies inside a block you got from upstream and have not
//   freed, overlaps no other block you have lent out, and is aligned to the `alignment`
//   you promise in `init` (16 here: what upstream gives);
// - give blocks back upstream with exactly the size you got them with;
// - touch the bytes of blocks only through the `allocbox:policy/bytes@0.1.0` imports
//   (`fill`, `copy`, `read-u64`, ...), and only of blocks you hold and have not lent;
// - `trim` gives back everything you cache: `allocbox check` calls it last and counts
//   whatever is still held upstream as a leak.
//
// `--runtime stub` has no garbage collector: allocate nothing through the runtime (no
// `new`, no string concatenation); lay out your own memory (memory.data, __heap_base).

// The policy's name and its refusal, ASCII: copied out as UTF-8 bytes in `init`
// (AssemblyScript strings are UTF-16 in memory).
const NAME = "policy_name";
const REFUSAL = "policy_name takes no configuration";

// Imports: module = the interface, field = the WIT function name. `u64` is a core i64;
// `u32`, `u8`, `bool` and pointers (`usize`) are i32.
@external("allocbox:policy/allocator@0.1.0", "malloc")
declare function upMalloc(size: u64): u64;
@external("allocbox:policy/allocator@0.1.0", "calloc")
declare function upCalloc(nelem: u64, elsize: u64): u64;
@external("allocbox:policy/allocator@0.1.0", "realloc")
declare function upRealloc(ptr: u64, oldSize: u64, newSize: u64): u64;
@external("allocbox:policy/allocator@0.1.0", "free")
declare function upFree(ptr: u64, size: u64): void;

// Blocks lent to the client and not given back yet. The host calls a policy on one
// thread at a time: plain globals need no lock.
let lent: u64 = 0;

// Counts a block handed to the client (0 means the allocation failed).
function lend(ptr: u64): u64 {
  if (ptr != 0) lent++;
  return ptr;
}

export function malloc(size: u64): u64 {
  return lend(upMalloc(size));
}
export function calloc(nelem: u64, elsize: u64): u64 {
  return lend(upCalloc(nelem, elsize));
}
export function realloc(ptr: u64, oldSize: u64, newSize: u64): u64 {
  let moved = upRealloc(ptr, oldSize, newSize);
  // Only `realloc(0, ..)` lends a new block; otherwise the count is unchanged.
  return ptr == 0 ? lend(moved) : moved;
}
export function free(ptr: u64, size: u64): void {
  lent--;
  upFree(ptr, size);
}

// Return areas the host reads after the call: (list pointer, length) for `malloc-many`,
// `result<info, string>` for `init`.
const ret = memory.data(40, 8);
// Up to 64 blocks a `malloc-many` call: "fewer, possibly none" is allowed.
const MANY: u32 = 64;
const many = memory.data(64 * 8, 8);

export function malloc_many(size: u64, count: u32): usize {
  let n: u32 = 0;
  while (n < count && n < MANY) {
    let p = upMalloc(size);
    if (p == 0) break;
    store<u64>(many + (<usize>n << 3), p);
    n++;
  }
  lent += n;
  store<u32>(ret, <u32>many);
  store<u32>(ret, n, 4);
  return ret;
}

// A `list<u64>` argument: (pointer, length), placed by cabi_realloc.
export function free_many(list: usize, len: u32, size: u64): void {
  for (let i: u32 = 0; i < len; i++) upFree(load<u64>(list + (<usize>i << 3)), size);
  lent -= len;
  top = 0;
}

// Arguments the host passes in (`free-many`'s list, `init`'s configuration) are placed
// with this: a bump allocator over the memory above the data, rewound when the call that
// received them is done.
let top: usize = 0;
export function cabi_realloc(old: usize, oldSize: usize, align: usize, size: usize): usize {
  if (top == 0) top = __heap_base;
  let at = (top + align - 1) & ~(align - 1);
  top = at + size;
  let pages = <i32>((top + 0xffff) >>> 16) - memory.size();
  if (pages > 0 && memory.grow(pages) < 0) unreachable();
  if (oldSize) memory.copy(at, old, oldSize);
  return at;
}

// `result<info, string>`: the case at 0 (0 ok, 1 err), the payload from 8: info is the
// name (pointer, length) at 8, version at 16, alignment at 24, batch at 32; an error is
// its message (pointer, length) at 8. Strings must be UTF-8 and outlive the call.
const text = memory.data(128, 8);

function answer(tag: u8, s: string): void {
  for (let i = 0; i < s.length; i++) store<u8>(text + i, <u8>s.charCodeAt(i));
  store<u8>(ret, tag);
  store<u32>(ret, <u32>text, 8);
  store<u32>(ret, <u32>s.length, 12);
}

// `config` is `list<tuple<string, string>>`: `len` 16-byte (key pointer, key length,
// value pointer, value length) records. This policy reads no settings.
export function init(config: usize, len: u32): usize {
  top = 0;
  if (len != 0) {
    answer(1, REFUSAL);
    return ret;
  }
  answer(0, NAME);
  store<u8>(ret, 1, 16); // the handler contract version
  store<u64>(ret, 16, 24); // alignment
  store<u8>(ret, 1, 32); // batch: the host may fetch blocks ahead with `malloc-many`
  return ret;
}

// Nothing cached, so nothing to give back.
export function trim(): void {}
