//! `buddy`: a binary buddy allocator, written in Zig as a core module to the canonical ABI
//! of contract 0.2.0's `allocbox:policy/sharding-policy` world (wit/0.2.0/policy.wit;
//! allocbox makes it a component when it loads it). Its state is this instance's alone,
//! so it says it is shardable: the host may start one instance per thread.
//!
//! - Arenas of `arena-size` bytes (a power of two, default 1 MiB) come from upstream. Each
//!   is one block of the top order; a request is rounded up to a power of two no smaller
//!   than `min-block` (default 16) and a block of that order is split off, halving larger
//!   free blocks as needed. On free, a block merges with its buddy (the other half of the
//!   block it was split from) for as long as the buddy is free too.
//! - Requests larger than an arena go straight upstream. The sized-free rule means `free`
//!   and `realloc` always know the size, so the size alone says which way a block went
//!   and what order it is: nothing is recorded per lent block.
//! - An arena that becomes entirely free is kept only while at most `spare-arenas` are
//!   (default 1, so a program that keeps freeing and re-making one big array does not
//!   go upstream every time); `trim` gives back every entirely free arena.
//! - `realloc` within the buddy range stays in place when it can: a shrink gives back the
//!   upper halves, a grow takes free right-hand buddies.
//!
//! All the bookkeeping lives in this module's own memory (Zig's `wasm_allocator`): per
//! arena, one bitmap of free blocks per order plus a summary bitmap over its words (so a
//! free block is found by two count-trailing-zeros instead of a scan), and per order a
//! bitmap of the arenas that hold a free block of that order. The policy never reads or
//! writes the bytes of a block (only `calloc` zero-fills and `realloc` copies through
//! the host's checked `bytes` interface), so no client can corrupt its state.
//!
//! Alignment: the host's upstream blocks are 16-aligned and every buddy block starts at
//! an offset from its arena's base that is a multiple of its size, which is at least
//! `min-block` >= 16, so every block this policy returns is 16-aligned.
//!
//! Every inconsistency (a free of an address outside every arena, a double free the host
//! would have caught first) traps, as does a failed safety check in ReleaseSafe: the host
//! turns a trap into a caught failure of this policy instead of a lent-out overlap.

const std = @import("std");

/// Panics (failed safety checks in ReleaseSafe) become a bare `unreachable` trap: there is
/// nowhere to print to, and the host reports a trap with the call that caused it.
pub const panic = std.debug.no_panic;

/// The module's own heap: `memory.grow` pages, size-class free lists, nothing shared.
const gpa = std.heap.wasm_allocator;

// ---------------------------------------------------------------------------------------
// Imports: the upstream allocator and checked byte access, by their canonical-ABI names.
// A `u64` is an `i64` and a `u8` an `i32` in the core signature, as the ABI wants.

const upstream = struct {
    extern "allocbox:policy/allocator@0.2.0" fn malloc(size: u64) u64;
    extern "allocbox:policy/allocator@0.2.0" fn calloc(nelem: u64, elsize: u64) u64;
    extern "allocbox:policy/allocator@0.2.0" fn realloc(ptr: u64, old_size: u64, new_size: u64) u64;
    extern "allocbox:policy/allocator@0.2.0" fn free(ptr: u64, size: u64) void;
};

const bytes = struct {
    extern "allocbox:policy/bytes@0.2.0" fn fill(at: u64, len: u64, byte: u8) void;
    extern "allocbox:policy/bytes@0.2.0" fn copy(dst: u64, src: u64, len: u64) void;
};

// ---------------------------------------------------------------------------------------
// Configuration and the bitmap layout it implies.

/// The most orders above `min-block` an arena may span: the bookkeeping of one arena is
/// about 2^(top+1) bits, so 20 keeps it under 300 KiB.
const max_top = 20;
const max_orders = max_top + 1;
const min_arena: u64 = 4 << 10;
const max_arena: u64 = 1 << 30;
const max_spare: u64 = 1024;
/// `malloc-many` answers at most this many blocks per call ("fewer" is allowed).
const max_many: u32 = 1 << 16;

var arena_size: u64 = 1 << 20;
/// log2(min-block).
var log_min: u6 = 4;
/// The order of a whole arena: log2(arena-size / min-block).
var top: u32 = 16;
var spare_arenas: u32 = 1;

/// Where, in an arena's `meta` words, the free bitmap of each order starts, and its
/// summary bitmap (one bit per bitmap word that is not zero) and that summary's length.
var bits_off: [max_orders]u32 = @splat(0);
var sum_off: [max_orders]u32 = @splat(0);
var sum_words: [max_orders]u32 = @splat(0);
var meta_words: u32 = 0;

fn computeLayout() void {
    var off: u32 = 0;
    var o: u32 = 0;
    while (o <= top) : (o += 1) {
        // Order o has 2^(top - o) blocks in an arena.
        const words = ((@as(u32, 1) << @intCast(top - o)) + 63) / 64;
        bits_off[o] = off;
        off += words;
        sum_words[o] = (words + 63) / 64;
    }
    o = 0;
    while (o <= top) : (o += 1) {
        sum_off[o] = off;
        off += sum_words[o];
    }
    meta_words = off;
}

// ---------------------------------------------------------------------------------------
// State. The host calls an instance on one thread at a time, so plain globals are enough,
// and no other instance sees them (which is what makes the policy shardable).

const Arena = struct {
    /// The upstream block's address; 0 marks a slot whose arena was given back.
    base: u64,
    /// Free blocks of each order in this arena.
    nfree: [max_orders]u32,
    /// The bitmaps described by `bits_off`/`sum_off`: a set bit is a free block.
    meta: []u64,
};

/// Arenas by slot; a slot's number indexes the `has` bitmaps, so slots never move.
var arenas: std.ArrayList(Arena) = .empty;
/// Slots given back and free to reuse (capacity kept >= arenas.len so pushing never fails).
var empty_slots: std.ArrayList(u32) = .empty;
/// `has[o]`: one bit per slot, set when that arena has a free block of order `o`.
var has: [max_orders]std.ArrayList(u64) = @splat(.empty);
/// Free blocks of each order over all arenas: lets `malloc` skip empty orders at once.
var total_free: [max_orders]u32 = @splat(0);

/// Arenas sorted by base address, to find the arena of a freed address by bisection.
const Entry = struct { base: u64, slot: u32 };
var by_address: std.ArrayList(Entry) = .empty;

/// What `lifecycle.report` answers: arenas got from upstream, and the most held at once.
var arenas_taken: u64 = 0;
var peak_arenas: u64 = 0;

inline fn bit(i: u32) u64 {
    return @as(u64, 1) << @as(u6, @truncate(i));
}

fn isFree(a: *const Arena, o: u32, idx: u32) bool {
    return a.meta[bits_off[o] + (idx >> 6)] & bit(idx) != 0;
}

fn markFree(a: *Arena, slot: u32, o: u32, idx: u32) void {
    a.meta[bits_off[o] + (idx >> 6)] |= bit(idx);
    a.meta[sum_off[o] + (idx >> 12)] |= bit(idx >> 6);
    if (a.nfree[o] == 0) has[o].items[slot >> 6] |= bit(slot);
    a.nfree[o] += 1;
    total_free[o] += 1;
}

fn unmarkFree(a: *Arena, slot: u32, o: u32, idx: u32) void {
    const word = &a.meta[bits_off[o] + (idx >> 6)];
    word.* &= ~bit(idx);
    if (word.* == 0) a.meta[sum_off[o] + (idx >> 12)] &= ~bit(idx >> 6);
    a.nfree[o] -= 1;
    if (a.nfree[o] == 0) has[o].items[slot >> 6] &= ~bit(slot);
    total_free[o] -= 1;
}

/// The lowest free block of order `o` in an arena whose `nfree[o]` is not 0.
fn firstFree(a: *const Arena, o: u32) u32 {
    var s: u32 = 0;
    while (s < sum_words[o]) : (s += 1) {
        const summary = a.meta[sum_off[o] + s];
        if (summary != 0) {
            const w = s * 64 + @ctz(summary);
            return w * 64 + @ctz(a.meta[bits_off[o] + w]);
        }
    }
    @trap(); // nfree said there was one: the bitmaps are corrupt
}

/// The lowest slot whose arena has a free block of order `o` (`total_free[o]` > 0).
fn firstSlot(o: u32) u32 {
    for (has[o].items, 0..) |word, w| {
        if (word != 0) return @as(u32, @intCast(w)) * 64 + @ctz(word);
    }
    @trap();
}

/// The order of a block of `size` bytes (`size` <= arena-size).
fn orderOf(size: u64) u32 {
    if (size <= @as(u64, 1) << log_min) return 0;
    return @as(u32, 64 - @clz(size - 1)) - log_min;
}

inline fn blockShift(o: u32) u6 {
    return @intCast(o + log_min);
}

/// Index of the first entry of `by_address` whose base is >= `addr`.
fn lowerBound(addr: u64) usize {
    var lo: usize = 0;
    var hi: usize = by_address.items.len;
    while (lo < hi) {
        const mid = lo + (hi - lo) / 2;
        if (by_address.items[mid].base < addr) lo = mid + 1 else hi = mid;
    }
    return lo;
}

/// The slot of the arena holding `ptr`; traps if none does (the host checks the
/// client's addresses, so this only fires on a bug here).
fn arenaOf(ptr: u64) u32 {
    const i = lowerBound(ptr +| 1); // first base > ptr
    if (i == 0) @trap();
    const e = by_address.items[i - 1];
    if (ptr - e.base >= arena_size) @trap();
    return e.slot;
}

/// Gets one more arena from upstream. Every allocation of bookkeeping is made before the
/// upstream call, so a failure leaves nothing half made and nothing held.
fn newArena() bool {
    const reuse = empty_slots.items.len > 0;
    const slot: u32 = if (reuse) empty_slots.items[empty_slots.items.len - 1] else @intCast(arenas.items.len);
    if (!reuse) {
        arenas.ensureUnusedCapacity(gpa, 1) catch return false;
        empty_slots.ensureTotalCapacity(gpa, arenas.items.len + 1) catch return false;
        if ((slot >> 6) >= has[0].items.len) {
            var o: u32 = 0;
            while (o <= top) : (o += 1) has[o].append(gpa, 0) catch return false;
        }
    }
    by_address.ensureUnusedCapacity(gpa, 1) catch return false;
    const meta = gpa.alloc(u64, meta_words) catch return false;
    const base = upstream.malloc(arena_size);
    if (base == 0) {
        gpa.free(meta);
        return false;
    }
    @memset(meta, 0);
    const arena: Arena = .{ .base = base, .nfree = @splat(0), .meta = meta };
    if (reuse) {
        _ = empty_slots.pop();
        arenas.items[slot] = arena;
    } else {
        arenas.appendAssumeCapacity(arena);
    }
    by_address.insertAssumeCapacity(lowerBound(base), .{ .base = base, .slot = slot });
    markFree(&arenas.items[slot], slot, top, 0);
    arenas_taken += 1;
    peak_arenas = @max(peak_arenas, by_address.items.len);
    return true;
}

/// Gives an entirely free arena back upstream and frees its bookkeeping.
fn releaseArena(slot: u32) void {
    const a = &arenas.items[slot];
    unmarkFree(a, slot, top, 0);
    upstream.free(a.base, arena_size);
    const i = lowerBound(a.base);
    _ = by_address.orderedRemove(i);
    gpa.free(a.meta);
    a.* = .{ .base = 0, .nfree = @splat(0), .meta = &.{} };
    empty_slots.appendAssumeCapacity(slot);
}

// ---------------------------------------------------------------------------------------
// The buddy system proper.

/// A block of order `r`, or 0 when upstream has no arena to give.
fn buddyAlloc(r: u32) u64 {
    var o = r;
    // The smallest order with a free block anywhere: splitting it wastes least.
    while (o <= top and total_free[o] == 0) o += 1;
    if (o > top) {
        if (!newArena()) return 0;
        o = top;
    }
    const slot = firstSlot(o);
    const a = &arenas.items[slot];
    var idx = firstFree(a, o);
    unmarkFree(a, slot, o, idx);
    // Split down to order r, keeping the left half each time and freeing the right one.
    while (o > r) {
        o -= 1;
        idx *= 2;
        markFree(a, slot, o, idx + 1);
    }
    return a.base + (@as(u64, idx) << blockShift(o));
}

/// The arena slot and block index of the lent block at `ptr` of order `r`.
const Located = struct { slot: u32, idx: u32 };

fn locate(ptr: u64, r: u32) Located {
    const slot = arenaOf(ptr);
    const off = ptr - arenas.items[slot].base;
    // A block starts at a multiple of its size; anything else is not a block we lent.
    if (off & ((@as(u64, 1) << blockShift(r)) - 1) != 0) @trap();
    const idx: u32 = @intCast(off >> blockShift(r));
    if (isFree(&arenas.items[slot], r, idx)) @trap(); // already free
    return .{ .slot = slot, .idx = idx };
}

fn buddyFree(ptr: u64, r: u32) void {
    const at = locate(ptr, r);
    const a = &arenas.items[at.slot];
    var o = r;
    var idx = at.idx;
    // Merge upward while the buddy (idx ^ 1) is free as a whole block of the same order.
    while (o < top and isFree(a, o, idx ^ 1)) {
        unmarkFree(a, at.slot, o, idx ^ 1);
        idx >>= 1;
        o += 1;
    }
    markFree(a, at.slot, o, idx);
    if (o == top and total_free[top] > spare_arenas) releaseArena(at.slot);
}

/// Shrinks the block at `ptr` from order `from` to `to` in place: the upper halves are freed.
fn shrinkInPlace(ptr: u64, from: u32, to: u32) void {
    const at = locate(ptr, from);
    const a = &arenas.items[at.slot];
    var o = from;
    var idx = at.idx;
    while (o > to) {
        o -= 1;
        idx *= 2;
        // The freed half's buddy is the part still lent, so it cannot merge.
        markFree(a, at.slot, o, idx + 1);
    }
}

/// Grows the block at `ptr` from order `from` to `to` in place when it is the left half
/// at every level and each right-hand buddy is free; otherwise changes nothing.
fn growInPlace(ptr: u64, from: u32, to: u32) bool {
    if (to > top) return false;
    const at = locate(ptr, from);
    const a = &arenas.items[at.slot];
    var o = from;
    var idx = at.idx;
    while (o < to) : (o += 1) {
        if (idx & 1 != 0 or !isFree(a, o, idx + 1)) return false;
        idx >>= 1;
    }
    o = from;
    idx = at.idx;
    while (o < to) : (o += 1) {
        unmarkFree(a, at.slot, o, idx + 1);
        idx >>= 1;
    }
    return true;
}

// ---------------------------------------------------------------------------------------
// The exported allocator.

fn malloc(size: u64) callconv(.c) u64 {
    if (size > arena_size) return upstream.malloc(size);
    return buddyAlloc(orderOf(size));
}

fn calloc(nelem: u64, elsize: u64) callconv(.c) u64 {
    const product = @mulWithOverflow(nelem, elsize);
    if (product[1] != 0) return 0; // an overflowing product is 0, never a wrapped size
    const size = product[0];
    // Upstream's zeroed blocks may be fresh pages that cost nothing to clear.
    if (size > arena_size) return upstream.calloc(nelem, elsize);
    const ptr = buddyAlloc(orderOf(size));
    // A buddy block may hold an earlier owner's bytes: clear what the client will see.
    if (ptr != 0 and size != 0) bytes.fill(ptr, size, 0);
    return ptr;
}

fn free(ptr: u64, size: u64) callconv(.c) void {
    if (ptr == 0) return;
    if (size > arena_size) return upstream.free(ptr, size);
    buddyFree(ptr, orderOf(size));
}

fn realloc(ptr: u64, old_size: u64, new_size: u64) callconv(.c) u64 {
    if (ptr == 0) return malloc(new_size);
    if (old_size > arena_size and new_size > arena_size)
        return upstream.realloc(ptr, old_size, new_size);
    if (old_size <= arena_size and new_size <= arena_size) {
        const from = orderOf(old_size);
        const to = orderOf(new_size);
        if (to == from) return ptr; // the block already fits
        if (to < from) {
            shrinkInPlace(ptr, from, to);
            return ptr;
        }
        if (growInPlace(ptr, from, to)) return ptr;
    }
    // Moving: between buddy blocks, or across the arena-size line.
    const new = malloc(new_size);
    if (new == 0) return 0; // the old block stays live and unchanged
    bytes.copy(new, ptr, @min(old_size, new_size));
    free(ptr, old_size);
    return new;
}

/// `malloc-many`'s answer: the list's (pointer, length), read by the host after the call.
var many_answer: [2]u32 align(8) = .{ 8, 0 };
/// The list itself, reused from call to call (there is no post-return to free it in).
var many_list: std.ArrayList(u64) = .empty;

fn mallocMany(size: u64, count: u32) callconv(.c) u32 {
    many_list.clearRetainingCapacity();
    const want = @min(count, max_many);
    // If the list cannot grow, answer fewer blocks: the contract allows it.
    many_list.ensureTotalCapacity(gpa, want) catch {};
    const n = @min(want, many_list.capacity);
    while (many_list.items.len < n) {
        const ptr = malloc(size);
        if (ptr == 0) break;
        many_list.appendAssumeCapacity(ptr);
    }
    const len: u32 = @intCast(many_list.items.len);
    // An empty list still needs an aligned in-bounds pointer; 8 is one.
    many_answer = .{ if (len == 0) 8 else @intCast(@intFromPtr(many_list.items.ptr)), len };
    return @intCast(@intFromPtr(&many_answer));
}

fn freeMany(list: [*]u64, len: u32, size: u64) callconv(.c) void {
    for (list[0..len]) |ptr| free(ptr, size);
    // The host put the list in our memory through cabi_realloc; it is ours to free.
    freeArg(@ptrCast(list), @as(usize, len) * 8, 8);
}

// ---------------------------------------------------------------------------------------
// cabi_realloc: how the host places `init`'s config and `free-many`'s list in our memory.

fn cabiRealloc(old: ?[*]u8, old_size: usize, alignment: usize, new_size: usize) callconv(.c) [*]u8 {
    // Zero bytes need no memory, only an aligned, non-null, in-bounds address.
    if (new_size == 0) return @ptrFromInt(alignment);
    const a = std.mem.Alignment.fromByteUnits(alignment);
    const new = gpa.rawAlloc(new_size, a, @returnAddress()) orelse @trap();
    if (old_size != 0) {
        @memcpy(new[0..@min(old_size, new_size)], old.?[0..@min(old_size, new_size)]);
        gpa.rawFree(old.?[0..old_size], a, @returnAddress());
    }
    return new;
}

/// Frees an argument the host allocated with `cabi_realloc(0, 0, alignment, len)`.
fn freeArg(ptr: [*]u8, len: usize, alignment: usize) void {
    if (len == 0) return;
    gpa.rawFree(ptr[0..len], std.mem.Alignment.fromByteUnits(alignment), @returnAddress());
}

// ---------------------------------------------------------------------------------------
// Lifecycle.

/// One element of `list<tuple<string, string>>`: two (pointer, length) pairs.
const Pair = extern struct { key: [*]u8, key_len: u32, value: [*]u8, value_len: u32 };

/// `result<info, string>`: the tag at 0, the payload at 8 (info holds a u64, so the
/// payload is 8-aligned). For `ok`, info = {name at 8, version at 16, alignment at 24,
/// batch at 32, diagnoses at 33}; for `err`, the string at 8. 0.2.0's `diagnoses` shares
/// `batch`'s 8-byte slot, so the answer is 40 bytes as in 0.1.0.
const InitAnswer = extern struct {
    tag: u8,
    str: u32 align(8),
    str_len: u32,
    version: u8,
    alignment: u64,
    batch: u8,
    diagnoses: u8,
};
comptime {
    std.debug.assert(@offsetOf(InitAnswer, "str") == 8);
    std.debug.assert(@offsetOf(InitAnswer, "version") == 16);
    std.debug.assert(@offsetOf(InitAnswer, "alignment") == 24);
    std.debug.assert(@offsetOf(InitAnswer, "batch") == 32);
    std.debug.assert(@offsetOf(InitAnswer, "diagnoses") == 33);
    std.debug.assert(@sizeOf(InitAnswer) == 40);
}
var init_answer: InitAnswer = undefined;
const name = "buddy";

/// The error message, built here so the key and value the host sent can be freed.
var message: [512]u8 = undefined;
var message_len: usize = 0;

fn say(parts: []const []const u8) void {
    message_len = 0;
    for (parts) |part| {
        const n = @min(part.len, message.len - message_len);
        @memcpy(message[message_len..][0..n], part[0..n]);
        message_len += n;
    }
}

/// An unsigned integer with an optional binary suffix: `65536`, `64K`, `64KiB`, `1M`,
/// `1MiB`, `1G` (any case). Null when it is anything else or overflows.
fn parseSize(text: []const u8) ?u64 {
    var i: usize = 0;
    var n: u64 = 0;
    while (i < text.len and text[i] >= '0' and text[i] <= '9') : (i += 1) {
        const times = @mulWithOverflow(n, 10);
        const plus = @addWithOverflow(times[0], text[i] - '0');
        if (times[1] != 0 or plus[1] != 0) return null;
        n = plus[0];
    }
    if (i == 0) return null;
    const suffix = text[i..];
    const shift: u6 = if (suffix.len == 0) 0 else switch (suffix[0] | 0x20) {
        'k' => 10,
        'm' => 20,
        'g' => 30,
        else => return null,
    };
    if (suffix.len > 1 and !std.ascii.eqlIgnoreCase(suffix[1..], "ib")) return null;
    if (n > (@as(u64, std.math.maxInt(u64)) >> shift)) return null;
    return n << shift;
}

fn isPowerOfTwo(n: u64) bool {
    return n != 0 and n & (n - 1) == 0;
}

/// A configuration value as given: its text (for error messages) and its number.
const Setting = struct { text: []const u8 = "", value: ?u64 = null };

/// Reads the configuration into the globals; false (with `message` set) on a bad one.
fn configure(pairs: []const Pair) bool {
    var arena: Setting = .{};
    var min: Setting = .{};
    var spare: Setting = .{};
    for (pairs) |p| {
        const key = p.key[0..p.key_len];
        const value = p.value[0..p.value_len];
        const setting = if (std.mem.eql(u8, key, "arena-size"))
            &arena
        else if (std.mem.eql(u8, key, "min-block"))
            &min
        else if (std.mem.eql(u8, key, "spare-arenas"))
            &spare
        else {
            say(&.{ "buddy: unknown config key `", key, "` (value `", value, "`); known: arena-size, min-block, spare-arenas" });
            return false;
        };
        if (setting.value != null) {
            say(&.{ "buddy: `", key, "` given more than once" });
            return false;
        }
        setting.* = .{
            .text = value,
            .value = parseSize(std.mem.trim(u8, value, " ")) orelse {
                say(&.{ "buddy: bad value `", value, "` for `", key, "`: want an unsigned integer, optionally with a K, M or G suffix" });
                return false;
            },
        };
    }
    const a = arena.value orelse (1 << 20);
    if (!isPowerOfTwo(a) or a < min_arena or a > max_arena) {
        say(&.{ "buddy: bad value `", arena.text, "` for `arena-size`: want a power of two from 4K to 1G" });
        return false;
    }
    // Without `min-block`, the smallest block that keeps the bitmaps within max_top orders.
    const m = min.value orelse @max(16, a >> max_top);
    if (!isPowerOfTwo(m) or m < 16 or m > a) {
        say(&.{ "buddy: bad value `", min.text, "` for `min-block`: want a power of two from 16 (the alignment promised) to arena-size" });
        return false;
    }
    if (a / m > (1 << max_top)) {
        say(&.{ "buddy: bad value `", min.text, "` for `min-block`: too small for arena-size `", arena.text, "`: arena-size / min-block must be at most 2^20 (1M), or each arena's bitmaps grow past 256 KiB" });
        return false;
    }
    const s = spare.value orelse 1;
    if (s > max_spare) {
        say(&.{ "buddy: bad value `", spare.text, "` for `spare-arenas`: want an integer from 0 to 1024" });
        return false;
    }
    arena_size = a;
    log_min = @intCast(@ctz(m));
    top = @ctz(a) - @ctz(m);
    spare_arenas = @intCast(s);
    computeLayout();
    return true;
}

/// `limits` is a record, so the canonical ABI passes its fields one by one after the
/// configuration list. None needs acting on here: this policy never calls `malloc-many`
/// or `free-many` upstream, a `memory.grow` past `memory` fails the allocation that asked
/// (and `gpa` answers out of memory), and the host enforces the overhead budget.
fn init(list: [*]Pair, len: u32, batch_limit: u32, memory_limit: u64, overhead_limit: u64) callconv(.c) u32 {
    _ = .{ batch_limit, memory_limit, overhead_limit };
    const pairs = list[0..len];
    const ok = configure(pairs);
    if (ok) {
        init_answer = .{
            .tag = 0,
            .str = @intCast(@intFromPtr(name.ptr)),
            .str_len = name.len,
            .version = 1,
            .alignment = 16,
            // Blocks are independent and every free carries its size, so the host may
            // fetch ahead with malloc-many and return frees late with free-many.
            .batch = 1,
            // It checks nothing of how the client uses its blocks.
            .diagnoses = 0,
        };
    } else {
        init_answer = .{
            .tag = 1,
            .str = @intCast(@intFromPtr(&message)),
            .str_len = @intCast(message_len),
            .version = 0,
            .alignment = 0,
            .batch = 0,
            .diagnoses = 0,
        };
    }
    // The strings and the list were allocated here by cabi_realloc: free them.
    for (pairs) |p| {
        freeArg(p.key, p.key_len, 1);
        freeArg(p.value, p.value_len, 1);
    }
    freeArg(@ptrCast(list), @as(usize, len) * @sizeOf(Pair), 4);
    return @intCast(@intFromPtr(&init_answer));
}

fn trim() callconv(.c) void {
    for (arenas.items, 0..) |a, slot| {
        if (a.base != 0 and a.nfree[top] != 0) releaseArena(@intCast(slot));
    }
}

/// One element of `list<tuple<string, u64>>`: the name's (pointer, length), the u64 at 8.
const Counter = extern struct { name: u32, name_len: u32, value: u64 };
comptime {
    std.debug.assert(@sizeOf(Counter) == 16 and @alignOf(Counter) == 8);
}
var counters: [2]Counter = undefined;
/// `report`'s answer: the list's (pointer, length).
var report_answer: [2]u32 align(8) = .{ 8, 0 };

fn counter(comptime counter_name: []const u8, value: u64) Counter {
    return .{ .name = @intCast(@intFromPtr(counter_name.ptr)), .name_len = counter_name.len, .value = value };
}

fn report() callconv(.c) u32 {
    // `peak-` tells a tool that combines reports to keep the largest, not the sum.
    counters = .{ counter("arenas-taken", arenas_taken), counter("peak-arenas", peak_arenas) };
    report_answer = .{ @intCast(@intFromPtr(&counters)), counters.len };
    return @intCast(@intFromPtr(&report_answer));
}

// ---------------------------------------------------------------------------------------
// Observer: this policy is asked on every call and observes nothing.

/// `observes`' answer, `option<observing>`: the tag at 0 (0 = none), the record at 8 (its
/// `option<u64>` lease makes it 8-aligned), 32 bytes in all.
var observes_answer: [32]u8 align(8) = @splat(0);

fn observes() callconv(.c) u32 {
    observes_answer[0] = 0;
    return @intCast(@intFromPtr(&observes_answer));
}

/// Never called while `observes` answers none, but every export of the world must exist.
/// The `observation` variant arrives flattened: the case, then each case's fields joined
/// slot by slot (an i32 slot that another case fills with a u64 becomes an i64):
///   events     three lists of bytes, (pointer, length) each, in slots 1..6
///   totals     four u64 sums in 1..4, `lent-by-bits` (a list of u64) in 5..6
///   survivors  events in 1..6, `places` (bytes) in 7..8, `count` in 9, four u64 in 10..13
/// The lists were placed with `cabi_realloc` and are ours: freed, so that nothing leaks
/// should a host call it.
fn observe(case: u32, s1: u64, s2: u64, s3: u64, s4: u64, s5: u32, s6: u32, s7: u32, s8: u32, s9: u32, s10: u64, s11: u64, s12: u64, s13: u64) callconv(.c) void {
    _ = .{ s9, s10, s11, s12, s13 };
    if (case == 1) return freeList(s5, s6, 8);
    freeList(@truncate(s1), @truncate(s2), 1);
    freeList(@truncate(s3), @truncate(s4), 1);
    freeList(s5, s6, 1);
    if (case == 2) freeList(s7, s8, 1);
}

/// Frees a list argument of `len` elements of `size` bytes (aligned to their size). An
/// empty one holds nothing, and its address is not made a pointer: `@ptrFromInt` traps
/// on 0.
fn freeList(at: u32, len: u32, size: usize) void {
    if (len == 0) return;
    freeArg(@ptrFromInt(at), @as(usize, len) * size, size);
}

/// Never called without a lease, and this policy grants none.
fn renew(size: u64) callconv(.c) u64 {
    _ = size;
    return 0;
}

/// Every arena and bitmap lives in this instance's own memory and counts nothing another
/// instance lends, so the host may start one instance per thread.
fn shardable() callconv(.c) u32 {
    return 1;
}

comptime {
    const allocator = "allocbox:policy/allocator@0.2.0#";
    const lifecycle = "allocbox:policy/lifecycle@0.2.0#";
    const observer = "allocbox:policy/observer@0.2.0#";
    @export(&malloc, .{ .name = allocator ++ "malloc" });
    @export(&calloc, .{ .name = allocator ++ "calloc" });
    @export(&realloc, .{ .name = allocator ++ "realloc" });
    @export(&free, .{ .name = allocator ++ "free" });
    @export(&mallocMany, .{ .name = allocator ++ "malloc-many" });
    @export(&freeMany, .{ .name = allocator ++ "free-many" });
    @export(&init, .{ .name = lifecycle ++ "init" });
    @export(&trim, .{ .name = lifecycle ++ "trim" });
    @export(&report, .{ .name = lifecycle ++ "report" });
    @export(&observes, .{ .name = observer ++ "observes" });
    @export(&observe, .{ .name = observer ++ "observe" });
    @export(&renew, .{ .name = observer ++ "renew" });
    @export(&shardable, .{ .name = "allocbox:policy/sharding@0.2.0#shardable" });
    @export(&cabiRealloc, .{ .name = "cabi_realloc" });
}
