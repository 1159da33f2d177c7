// policy_name: an allocbox allocation policy (NumPy NEP 49) in freestanding C, started by
// `allocbox new`. A pass-through that counts the blocks it has lent out: every call goes
// upstream (the next policy in the chain, or the host's memory) unchanged.
//
// It is a core module written by hand to the canonical ABI of the `policy` world in
// wit/policy.wit; allocbox makes it a component when it loads it. No libc, no WASI: the
// module imports only the world's functions.
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
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define NAME "policy_name"

// Imports: module = the interface, field = the WIT function name.
#define UP(name) \
    __attribute__((import_module("allocbox:policy/allocator@0.1.0"), import_name(name)))
// Exports: "allocbox:policy/<interface>@0.1.0#<function>".
#define EXPORT(iface, name) __attribute__((export_name("allocbox:policy/" iface "@0.1.0#" name)))

UP("malloc") uint64_t up_malloc(uint64_t size);
UP("calloc") uint64_t up_calloc(uint64_t nelem, uint64_t elsize);
UP("realloc") uint64_t up_realloc(uint64_t ptr, uint64_t old_size, uint64_t new_size);
UP("free") void up_free(uint64_t ptr, uint64_t size);

// Blocks lent to the client and not given back yet. The host calls a policy on one
// thread at a time: plain globals need no lock.
static uint64_t lent;

// Counts a block handed to the client (0 means the allocation failed).
static uint64_t lend(uint64_t ptr) {
    if (ptr) lent++;
    return ptr;
}

// `u64` is a core i64: `uint64_t`. `u32`, `u8`, `bool` and pointers are i32.
EXPORT("allocator", "malloc")
uint64_t policy_malloc(uint64_t size) { return lend(up_malloc(size)); }

EXPORT("allocator", "calloc")
uint64_t policy_calloc(uint64_t nelem, uint64_t elsize) { return lend(up_calloc(nelem, elsize)); }

EXPORT("allocator", "realloc")
uint64_t policy_realloc(uint64_t ptr, uint64_t old_size, uint64_t new_size) {
    uint64_t moved = up_realloc(ptr, old_size, new_size);
    // Only `realloc(0, ..)` lends a new block; otherwise the count is unchanged.
    return ptr ? moved : lend(moved);
}

EXPORT("allocator", "free")
void policy_free(uint64_t ptr, uint64_t size) {
    lent--;
    up_free(ptr, size);
}

// Arguments the host passes in (`free-many`'s list, `init`'s configuration) are placed
// with this: a bump allocator over the memory above the stack and data, rewound when
// the call that received them is done.
extern unsigned char __heap_base;
static uint64_t top;

static void release_arguments(void) { top = 0; }

__attribute__((export_name("cabi_realloc")))
void *cabi_realloc(void *old, uint32_t old_size, uint32_t align, uint32_t new_size) {
    if (!top) top = (uintptr_t)&__heap_base;
    uint64_t at = (top + align - 1) & ~(uint64_t)(align - 1);
    top = at + new_size;
    uint64_t have = (uint64_t)__builtin_wasm_memory_size(0) << 16;
    if (top > have && __builtin_wasm_memory_grow(0, (size_t)((top - have + 0xffff) >> 16)) == (size_t)-1)
        __builtin_trap();
    if (old_size) __builtin_memcpy((void *)(uintptr_t)at, old, old_size);
    return (void *)(uintptr_t)at;
}

// `list<u64>` result: a pointer to (list pointer, length). Up to 64 blocks a call:
// "fewer, possibly none" is allowed.
static uint64_t many[64];
static struct { uint64_t *ptr; uint32_t len; } many_answer;

EXPORT("allocator", "malloc-many")
void *policy_malloc_many(uint64_t size, uint32_t count) {
    uint32_t n = 0;
    while (n < count && n < sizeof many / sizeof many[0] && (many[n] = up_malloc(size)) != 0) n++;
    lent += n;
    many_answer.ptr = many;
    many_answer.len = n;
    return &many_answer;
}

// `list<u64>` argument: (pointer, length), placed by cabi_realloc.
EXPORT("allocator", "free-many")
void policy_free_many(const uint64_t *ptrs, uint32_t len, uint64_t size) {
    for (uint32_t i = 0; i < len; i++) up_free(ptrs[i], size);
    lent -= len;
    release_arguments();
}

// `result<info, string>`: the case at 0 (0 ok, 1 err), the payload from 8: info is the
// name (pointer, length) at 8, version at 16, alignment at 24, batch at 32; an error is
// its message (pointer, length) at 8. Strings must be UTF-8 and outlive the call.
static struct {
    uint8_t is_err;
    _Alignas(8) const char *text;
    uint32_t text_len;
    uint8_t version;
    _Alignas(8) uint64_t alignment;
    bool batch;
} answer;
_Static_assert(offsetof(__typeof__(answer), text) == 8, "name at 8");
_Static_assert(offsetof(__typeof__(answer), version) == 16, "version at 16");
_Static_assert(offsetof(__typeof__(answer), alignment) == 24, "alignment at 24");
_Static_assert(offsetof(__typeof__(answer), batch) == 32, "batch at 32");

// `config` is `list<tuple<string, string>>`: `len` 16-byte (key pointer, key length,
// value pointer, value length) records. This policy reads no settings.
EXPORT("lifecycle", "init")
void *policy_init(const void *config, uint32_t len) {
    (void)config;
    release_arguments();
    if (len) {
        static const char refusal[] = NAME " takes no configuration";
        answer = (__typeof__(answer)){.is_err = 1, .text = refusal, .text_len = sizeof refusal - 1};
    } else {
        // batch: the host may fetch blocks ahead with `malloc-many`.
        answer = (__typeof__(answer)){.text = NAME, .text_len = sizeof NAME - 1, .version = 1,
                                      .alignment = 16, .batch = true};
    }
    return &answer;
}

// Nothing cached, so nothing to give back.
EXPORT("lifecycle", "trim")
void policy_trim(void) {}
