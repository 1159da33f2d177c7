//! policy_name: an allocbox allocation policy (NumPy NEP 49) in Zig, started by
//! `allocbox new`. A pass-through that counts the blocks it has lent out: every call
//! goes upstream (the next policy in the chain, or the host's memory) unchanged.
//!
//! It is a core module written to the canonical ABI of the `policy` world in
//! wit/policy.wit (allocbox makes it a component when it loads it); no WASI.
//!
//! The rules the host enforces (it stops the policy at the first break):
//! - every address you return lies inside a block you got from upstream and have not
//!   freed, overlaps no other block you have lent out, and is aligned to the
//!   `alignment` you promise in `init` (16 here: what upstream gives);
//! - give blocks back upstream with exactly the size you got them with;
//! - touch the bytes of blocks only through the `allocbox:policy/bytes@0.1.0` imports
//!   (`fill`, `copy`, `read-u64`, ...), and only of blocks you hold and have not lent;
//! - `trim` gives back everything you cache: `allocbox check` calls it last and counts
//!   whatever is still held upstream as a leak.

const std = @import("std");
pub const panic = std.debug.no_panic; // a panic is a trap, which the host reports
const gpa = std.heap.wasm_allocator;

const name = "policy_name";
const refusal = name ++ " takes no configuration";

// Imports: module = the interface, field = the WIT function name. A WIT `u64` is a Zig
// `u64` (core i64); `u8`, `u32` and pointers are i32.
const up = struct {
    extern "allocbox:policy/allocator@0.1.0" fn malloc(size: u64) u64;
    extern "allocbox:policy/allocator@0.1.0" fn calloc(nelem: u64, elsize: u64) u64;
    extern "allocbox:policy/allocator@0.1.0" fn realloc(ptr: u64, old_size: u64, new_size: u64) u64;
    extern "allocbox:policy/allocator@0.1.0" fn free(ptr: u64, size: u64) void;
};

/// Blocks lent to the client and not given back yet. The host calls a policy on one
/// thread at a time: plain globals need no lock.
var lent: u64 = 0;

/// Counts a block handed to the client (0 means the allocation failed).
fn lend(ptr: u64) u64 {
    if (ptr != 0) lent += 1;
    return ptr;
}

fn malloc(size: u64) callconv(.c) u64 {
    return lend(up.malloc(size));
}
fn calloc(nelem: u64, elsize: u64) callconv(.c) u64 {
    return lend(up.calloc(nelem, elsize));
}
fn realloc(ptr: u64, old_size: u64, new_size: u64) callconv(.c) u64 {
    const moved = up.realloc(ptr, old_size, new_size);
    // Only `realloc(0, ..)` lends a new block; otherwise the count is unchanged.
    return if (ptr == 0) lend(moved) else moved;
}
fn free(ptr: u64, size: u64) callconv(.c) void {
    lent -= 1;
    up.free(ptr, size);
}

// A `list<u64>` result is a pointer to (list pointer, length), kept in static memory.
// Up to 64 blocks a call: "fewer, possibly none" is allowed.
var many: [2]u32 align(8) = .{ 8, 0 };
var many_buf: [64]u64 = undefined;
fn mallocMany(size: u64, count: u32) callconv(.c) u32 {
    var n: u32 = 0;
    while (n < @min(count, many_buf.len)) : (n += 1) {
        many_buf[n] = up.malloc(size);
        if (many_buf[n] == 0) break;
    }
    lent += n;
    many = .{ @intCast(@intFromPtr(&many_buf)), n };
    return @intCast(@intFromPtr(&many));
}

// A `list<u64>` argument arrives as (pointer, length) in this module's memory, placed
// by cabi_realloc: it is ours to free, with the alignment it was allocated with (8).
fn freeMany(list: [*]u64, len: u32, size: u64) callconv(.c) void {
    for (list[0..len]) |p| up.free(p, size);
    lent -= len;
    if (len != 0) gpa.free(list[0..len]);
}

// `result<info, string>`: the case at 0 (0 ok, 1 err), the payload from 8: info is the
// name (pointer, length) at 8, version at 16, alignment at 24, batch at 32; an error is
// its message (pointer, length) at 8. Strings must be UTF-8 and outlive the call.
const Answer = extern struct { tag: u8, str: u32 align(8), len: u32, version: u8, alignment: u64, batch: u8 };
var answer: Answer = undefined;

// `config` is `list<tuple<string, string>>`: (pointer, length) of 16-byte (key pointer,
// key length, value pointer, value length) records. This policy reads no settings; init
// runs once, so its arguments are not freed.
fn init(_: [*]u8, len: u32) callconv(.c) u32 {
    answer = if (len == 0)
        // batch: the host may fetch blocks ahead with `malloc-many`.
        .{ .tag = 0, .str = @intCast(@intFromPtr(name)), .len = name.len, .version = 1, .alignment = 16, .batch = 1 }
    else
        .{ .tag = 1, .str = @intCast(@intFromPtr(refusal)), .len = refusal.len, .version = 0, .alignment = 0, .batch = 0 };
    return @intCast(@intFromPtr(&answer));
}

// Nothing cached, so nothing to give back.
fn trim() callconv(.c) void {}

// The host places the arguments it passes in (lists, strings) with this.
fn cabiRealloc(old: ?[*]u8, old_size: usize, alignment: usize, new_size: usize) callconv(.c) [*]u8 {
    // Zig allocators take no 0-byte requests: any aligned, in-bounds address will do.
    if (new_size == 0) return @ptrFromInt(alignment);
    const new = gpa.rawAlloc(new_size, std.mem.Alignment.fromByteUnits(alignment), 0) orelse @trap();
    if (old_size != 0) @memcpy(new[0..old_size], old.?[0..old_size]); // the host only grows
    return new;
}

comptime {
    const A = "allocbox:policy/allocator@0.1.0#";
    const L = "allocbox:policy/lifecycle@0.1.0#";
    @export(&malloc, .{ .name = A ++ "malloc" });
    @export(&calloc, .{ .name = A ++ "calloc" });
    @export(&realloc, .{ .name = A ++ "realloc" });
    @export(&free, .{ .name = A ++ "free" });
    @export(&mallocMany, .{ .name = A ++ "malloc-many" });
    @export(&freeMany, .{ .name = A ++ "free-many" });
    @export(&init, .{ .name = L ++ "init" });
    @export(&trim, .{ .name = L ++ "trim" });
    @export(&cabiRealloc, .{ .name = "cabi_realloc" });
}
