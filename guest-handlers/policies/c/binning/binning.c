// `binning`: a binning allocator in freestanding C, after RAPIDS RMM's
// `binning_memory_resource`.
//
// Requests up to the largest bin are rounded up to the smallest bin that holds them. Each
// bin serves one block size from chunks it gets from upstream (`blocks-per-chunk` blocks
// each, as RMM's `fixed_size_memory_resource` does) and carves into equal blocks.
// Requests above the largest bin go straight upstream, untouched.
//
// Where the bookkeeping lives: in this module's own linear memory, never in the chunks.
// A chunk has a descriptor here with a bitmap of its free blocks, and every chunk is
// listed in one array sorted by address, which `free` searches to find a block's chunk
// (upstream addresses are opaque and only 16-aligned, so a block's chunk cannot be found
// by masking its address). Keeping free lists inside the chunks through the `bytes`
// import would cost a host call on every malloc and free; a bitmap here costs none, and
// the policy never touches a byte of a block except to zero (`calloc`) or move
// (`realloc`) it.
//
// A chunk whose blocks are all free is kept for reuse (up to `empty-chunks` per bin) and
// given back by `trim`; so after the client has freed everything, `trim` returns every
// byte this policy holds upstream.
//
// The module is a core module written to the canonical ABI of contract 0.2.0's
// `sharding-policy` world (wit/0.2.0/policy.wit): no libc, no WASI, it imports nothing
// but the world's functions. allocbox makes it a component when it loads it. The host
// calls an instance on one thread at a time, so plain globals are the state; they are
// this instance's alone, so the policy says it is shardable and the host may start one
// instance per thread.
//
// Configuration (`init`), every key optional:
//   bins=16,48,256,...   explicit bin sizes: ascending multiples of 16, at most 32 of them
//   min-bin=16           smallest bin, a power of two (with max-bin: every power between)
//   max-bin=8192         largest bin, a power of two; larger requests go upstream
//   blocks-per-chunk=128 blocks in each chunk a bin gets from upstream (RMM's default)
//   empty-chunks=N       entirely free chunks a bin keeps; one more goes back upstream at
//                        once. Default `unlimited` (RMM never gives chunks back).

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// ---------------------------------------------------------------------------------------
// Canonical-ABI imports and exports.
//
// Each WIT function is one core function. `u64` is i64, `u8`/`u32`/`bool` and pointers
// are i32 (wasm32). A `list<u64>` argument is (pointer, length); a `list<u64>` result of
// an import is written by the host to a return area whose pointer the caller passes last.
// A record argument is flattened into its fields, in order (`init`'s `limits`).

#define UPSTREAM(name) \
    __attribute__((import_module("allocbox:policy/allocator@0.2.0"), import_name(name)))
#define BYTES(name) __attribute__((import_module("allocbox:policy/bytes@0.2.0"), import_name(name)))
#define EXPORT(name) __attribute__((export_name(name)))

// A canonical-ABI `list<u64>`: pointer and length, 8 bytes in all.
struct list {
    uint64_t *ptr;
    uint32_t len;
};

UPSTREAM("malloc") extern uint64_t up_malloc(uint64_t size);
UPSTREAM("calloc") extern uint64_t up_calloc(uint64_t nelem, uint64_t elsize);
UPSTREAM("realloc") extern uint64_t up_realloc(uint64_t ptr, uint64_t old_size, uint64_t new_size);
UPSTREAM("free") extern void up_free(uint64_t ptr, uint64_t size);
// The host allocates the list in our memory with `cabi_realloc` and stores it in `*ret`.
UPSTREAM("malloc-many") extern void up_malloc_many(uint64_t size, uint32_t count, struct list *ret);
UPSTREAM("free-many") extern void up_free_many(const uint64_t *ptrs, uint32_t len, uint64_t size);
BYTES("fill") extern void bytes_fill(uint64_t at, uint64_t len, uint32_t byte);
BYTES("copy") extern void bytes_copy(uint64_t dst, uint64_t src, uint64_t len);

// A broken invariant (a block that is not ours, a double free) is a host bug or a memory
// error here: stop at once rather than hand out a block twice.
#define CHECK(cond) \
    do { \
        if (!(cond)) __builtin_trap(); \
    } while (0)

// ---------------------------------------------------------------------------------------
// The module's own heap: power-of-two size classes carved from `memory.grow`, each with
// a free list kept in the freed blocks. It serves chunk descriptors, the chunk index and
// the lists the canonical ABI passes in and out. Frees are sized (every caller knows the
// size), so blocks need no header. Memory is never given back to the engine (wasm cannot
// shrink a memory), but freed blocks are reused.

extern unsigned char __heap_base; // defined by wasm-ld: the end of data and stack
static uintptr_t heap_top;
static void *heap_free[31];

// The class of `size` bytes: 2^k with k >= 4, so every block is 16-aligned.
static unsigned heap_class(size_t size) {
    return size <= 16 ? 4 : 32 - (unsigned)__builtin_clz((unsigned)(size - 1));
}

static void *heap_alloc(size_t size) {
    if (size > (1u << 30)) return NULL;
    unsigned k = heap_class(size);
    void *p = heap_free[k];
    if (p) {
        heap_free[k] = *(void **)p;
        return p;
    }
    if (heap_top == 0) heap_top = ((uintptr_t)&__heap_base + 15) & ~(uintptr_t)15;
    uint64_t end = (uint64_t)heap_top + ((uint64_t)1 << k);
    uint64_t have = (uint64_t)__builtin_wasm_memory_size(0) << 16;
    if (end > have) {
        size_t pages = (size_t)((end - have + 0xffff) >> 16);
        // Past its cap a host may answer -1 (out of memory here); allocbox instead stops
        // the policy (`--guest-memory`, default 64 MiB).
        if (__builtin_wasm_memory_grow(0, pages) == (size_t)-1) return NULL;
    }
    p = (void *)heap_top;
    heap_top = (uintptr_t)end;
    return p;
}

static void heap_release(void *p, size_t size) {
    if (!p) return;
    unsigned k = heap_class(size);
    *(void **)p = heap_free[k];
    heap_free[k] = p;
}

// Releases what the host placed with `cabi_realloc` (an argument list, a string), now
// ours. Only blocks of this heap go back to it: for an empty list the canonical ABI may
// pass a pointer `cabi_realloc` never returned.
static void release_arg(const void *p, size_t size) {
    uintptr_t at = (uintptr_t)p;
    if (at >= (uintptr_t)&__heap_base && at < heap_top && at % 16 == 0) heap_release((void *)p, size);
}

// The canonical ABI's allocator: the host calls it to place `init`'s configuration,
// `free-many`'s list and the list an upstream `malloc-many` returns. Alignments it asks
// for are at most 8; every heap block is 16-aligned.
EXPORT("cabi_realloc")
void *cabi_realloc(void *old, size_t old_size, size_t align, size_t new_size) {
    (void)align;
    if (old && heap_class(old_size) == heap_class(new_size)) return old;
    void *p = heap_alloc(new_size);
    // Nothing to answer with: the host reports a trapped policy.
    CHECK(p);
    if (old) {
        __builtin_memcpy(p, old, old_size < new_size ? old_size : new_size);
        heap_release(old, old_size);
    }
    return p;
}

// ---------------------------------------------------------------------------------------
// Bins and chunks.

#define MAX_BINS 32
#define MAX_BIN_SIZE ((uint64_t)1 << 20)
#define MAX_BLOCKS_PER_CHUNK 4096
// Largest chunk one bin may ask upstream for (the checker's default overhead cap).
#define MAX_CHUNK_BYTES ((uint64_t)1 << 28)
#define UNLIMITED UINT32_MAX

struct chunk {
    uint64_t base;             // upstream address, got with the bin's `chunk_bytes`
    struct chunk *prev, *next; // the bin's list of chunks with a free block
    uint32_t nfree;            // free blocks; the chunk is listed iff nfree > 0
    uint32_t hint;             // every bitmap word below this one is 0 (no free block)
    uint8_t bin;
    bool dead; // given back by `trim`, about to leave the index
    uint64_t bits[];           // bit i set = block i free
};

struct bin {
    uint64_t size;        // block size, a multiple of 16
    uint64_t chunk_bytes; // size * blocks_per_chunk
    uint32_t words;       // bitmap words per chunk
    uint32_t nempty;      // chunks with every block free
    // Chunks with a free block: partly used ones first, so that wholly free chunks
    // (moved to the tail) stay free for `trim`.
    struct chunk *head, *tail;
};

static struct bin bins[MAX_BINS];
static uint32_t nbins;
// Before `init`, 0: every request goes upstream.
static uint64_t max_bin;
static uint32_t blocks_per_chunk;
static uint32_t empty_limit;
// lut[(size - 1) / 16] is the bin for `size`: sizes are multiples of 16, so each
// 16-byte step of request sizes maps to one bin. max_bin / 16 entries, made by `init`.
static uint8_t *lut;

// Every chunk, sorted by base address, to find the chunk of a freed block.
struct slot {
    uint64_t base;
    struct chunk *chunk;
};
static struct slot *slots;
static uint32_t nslots, slots_cap;

// What `lifecycle.report` answers: chunks got from upstream, and the most held at once.
static uint64_t chunks_taken, peak_chunks;

static size_t chunk_desc_bytes(const struct bin *b) {
    return sizeof(struct chunk) + (size_t)b->words * sizeof(uint64_t);
}

static struct bin *bin_for(uint64_t size) {
    return &bins[lut[size ? (size - 1) >> 4 : 0]];
}

// The first slot whose base is above `addr`.
static uint32_t slot_after(uint64_t addr) {
    uint32_t lo = 0, hi = nslots;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (slots[mid].base <= addr) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static bool slot_insert(struct chunk *c) {
    if (nslots == slots_cap) {
        uint32_t cap = slots_cap ? slots_cap * 2 : 64;
        struct slot *grown = heap_alloc((size_t)cap * sizeof *grown);
        if (!grown) return false;
        if (slots) __builtin_memcpy(grown, slots, (size_t)nslots * sizeof *slots);
        heap_release(slots, (size_t)slots_cap * sizeof *slots);
        slots = grown;
        slots_cap = cap;
    }
    uint32_t at = slot_after(c->base);
    __builtin_memmove(&slots[at + 1], &slots[at], (size_t)(nslots - at) * sizeof *slots);
    slots[at] = (struct slot){c->base, c};
    nslots++;
    return true;
}

static void slot_remove(struct chunk *c) {
    uint32_t at = slot_after(c->base);
    CHECK(at > 0 && slots[at - 1].chunk == c);
    at--;
    __builtin_memmove(&slots[at], &slots[at + 1], (size_t)(nslots - at - 1) * sizeof *slots);
    nslots--;
}

// The chunk holding `ptr`, which must be a block of bin `b`.
static struct chunk *chunk_of(const struct bin *b, uint64_t ptr) {
    uint32_t at = slot_after(ptr);
    CHECK(at > 0);
    struct chunk *c = slots[at - 1].chunk;
    CHECK(&bins[c->bin] == b && ptr - c->base < b->chunk_bytes);
    return c;
}

static void list_unlink(struct bin *b, struct chunk *c) {
    if (c->prev) c->prev->next = c->next;
    else b->head = c->next;
    if (c->next) c->next->prev = c->prev;
    else b->tail = c->prev;
    c->prev = c->next = NULL;
}

static void list_push_front(struct bin *b, struct chunk *c) {
    c->prev = NULL;
    c->next = b->head;
    if (b->head) b->head->prev = c;
    else b->tail = c;
    b->head = c;
}

static void list_push_back(struct bin *b, struct chunk *c) {
    c->next = NULL;
    c->prev = b->tail;
    if (b->tail) b->tail->next = c;
    else b->head = c;
    b->tail = c;
}

// A new chunk for `b`, every block free, at the head of its list; NULL when upstream
// (or this module's own memory) is out.
static struct chunk *chunk_new(struct bin *b) {
    uint64_t base = up_malloc(b->chunk_bytes);
    if (!base) return NULL;
    struct chunk *c = heap_alloc(chunk_desc_bytes(b));
    if (!c) {
        up_free(base, b->chunk_bytes);
        return NULL;
    }
    *c = (struct chunk){.base = base, .nfree = blocks_per_chunk, .bin = (uint8_t)(b - bins)};
    for (uint32_t w = 0; w < b->words; w++) c->bits[w] = ~(uint64_t)0;
    if (blocks_per_chunk % 64) c->bits[b->words - 1] = ((uint64_t)1 << (blocks_per_chunk % 64)) - 1;
    if (!slot_insert(c)) {
        heap_release(c, chunk_desc_bytes(b));
        up_free(base, b->chunk_bytes);
        return NULL;
    }
    list_push_front(b, c);
    b->nempty++;
    chunks_taken++;
    if (nslots > peak_chunks) peak_chunks = nslots;
    return c;
}

// Gives an entirely free chunk back upstream, with the size it was got with.
static void chunk_release(struct bin *b, struct chunk *c) {
    list_unlink(b, c);
    slot_remove(c);
    up_free(c->base, b->chunk_bytes);
    heap_release(c, chunk_desc_bytes(b));
}

// A block of `b`, the lowest free one of the first listed chunk; 0 when out of memory.
static uint64_t bin_alloc(struct bin *b) {
    struct chunk *c = b->head;
    if (!c && !(c = chunk_new(b))) return 0;
    if (c->nfree == blocks_per_chunk) b->nempty--;
    uint32_t w = c->hint;
    while (c->bits[w] == 0) w++; // nfree > 0: a set bit lies at or after the hint
    uint64_t word = c->bits[w];
    c->bits[w] = word & (word - 1);
    c->hint = w;
    if (--c->nfree == 0) list_unlink(b, c);
    return c->base + ((uint64_t)w * 64 + (uint64_t)__builtin_ctzll(word)) * b->size;
}

static void bin_free(struct bin *b, uint64_t ptr) {
    struct chunk *c = chunk_of(b, ptr);
    uint64_t off = ptr - c->base;
    uint64_t i = off / b->size;
    CHECK(off % b->size == 0);
    uint32_t w = (uint32_t)(i / 64);
    uint64_t bit = (uint64_t)1 << (i % 64);
    CHECK(!(c->bits[w] & bit)); // freed twice
    c->bits[w] |= bit;
    if (w < c->hint) c->hint = w;
    if (c->nfree++ == 0) list_push_front(b, c); // was full: it can serve again
    if (c->nfree == blocks_per_chunk) {
        if (b->nempty >= empty_limit) {
            chunk_release(b, c);
        } else {
            // Keep it for reuse, behind the partly used chunks.
            b->nempty++;
            list_unlink(b, c);
            list_push_back(b, c);
        }
    }
}

// ---------------------------------------------------------------------------------------
// The allocator interface.

EXPORT("allocbox:policy/allocator@0.2.0#malloc")
uint64_t binning_malloc(uint64_t size) {
    if (size > max_bin) return up_malloc(size);
    return bin_alloc(bin_for(size));
}

EXPORT("allocbox:policy/allocator@0.2.0#calloc")
uint64_t binning_calloc(uint64_t nelem, uint64_t elsize) {
    // An overflowing product is out of memory. Checked with 32-bit halves: clang turns
    // `nelem > UINT64_MAX / elsize` into a 128-bit multiply, which would need compiler-rt.
    uint64_t hi = (nelem >> 32) * (elsize & 0xffffffff) + (elsize >> 32) * (nelem & 0xffffffff);
    if (((nelem >> 32) && (elsize >> 32)) || (hi >> 32) ||
        (hi << 32) > UINT64_MAX - (nelem & 0xffffffff) * (elsize & 0xffffffff))
        return 0;
    uint64_t size = nelem * elsize;
    // Upstream zeroes large blocks itself, often for free (fresh pages).
    if (size > max_bin) return up_calloc(nelem, elsize);
    uint64_t ptr = bin_alloc(bin_for(size));
    // A recycled block still holds its previous owner's bytes.
    if (ptr && size) bytes_fill(ptr, size, 0);
    return ptr;
}

EXPORT("allocbox:policy/allocator@0.2.0#free")
void binning_free(uint64_t ptr, uint64_t size) {
    if (!ptr) return;
    if (size > max_bin) up_free(ptr, size);
    else bin_free(bin_for(size), ptr);
}

EXPORT("allocbox:policy/allocator@0.2.0#realloc")
uint64_t binning_realloc(uint64_t ptr, uint64_t old_size, uint64_t new_size) {
    if (!ptr) return binning_malloc(new_size);
    bool old_binned = old_size <= max_bin, new_binned = new_size <= max_bin;
    // Both outside the bins: upstream may resize in place.
    if (!old_binned && !new_binned) return up_realloc(ptr, old_size, new_size);
    // The same bin: the block already holds `new_size` bytes, and a later free with
    // `new_size` finds the same bin.
    if (old_binned && new_binned && bin_for(old_size) == bin_for(new_size)) return ptr;
    uint64_t moved = binning_malloc(new_size);
    if (!moved) return 0; // the old block stays live and unchanged
    bytes_copy(moved, ptr, old_size < new_size ? old_size : new_size);
    binning_free(ptr, old_size);
    return moved;
}

// The `malloc-many` answer (its return area) and how many addresses its list has room
// for, to release it in the post-return call.
static struct list many;
static uint32_t many_cap;
static uint64_t many_none[1]; // the list when there is no room for one

#define MAX_MANY 65536 // "fewer" is allowed; keeps count * 8 far from overflow
// Most blocks in one upstream `malloc-many`/`free-many`: 64 saves most of the calls, and
// `init` lowers it to the host's batch bound (`--batch-limit`) when that is smaller,
// since passing the bound stops the policy.
static uint32_t upstream_batch = 64;

EXPORT("allocbox:policy/allocator@0.2.0#malloc-many")
struct list *binning_malloc_many(uint64_t size, uint32_t count) {
    if (count > MAX_MANY) count = MAX_MANY;
    if (size > max_bin) {
        up_malloc_many(size, count < upstream_batch ? count : upstream_batch, &many);
        many_cap = many.len;
        return &many;
    }
    many = (struct list){heap_alloc((size_t)count * 8), 0};
    many_cap = count;
    if (!many.ptr) {
        many = (struct list){many_none, 0}; // not of the heap: never released
        return &many;
    }
    struct bin *b = bin_for(size);
    while (many.len < count) {
        uint64_t ptr = bin_alloc(b);
        if (!ptr) break;
        many.ptr[many.len++] = ptr;
    }
    return &many;
}

// Called by the host once it has read the `malloc-many` answer.
EXPORT("cabi_post_allocbox:policy/allocator@0.2.0#malloc-many")
void binning_malloc_many_post(struct list *ret) {
    release_arg(ret->ptr, (size_t)many_cap * 8);
    *ret = (struct list){0};
}

EXPORT("allocbox:policy/allocator@0.2.0#free-many")
void binning_free_many(uint64_t *ptrs, uint32_t len, uint64_t size) {
    if (size > max_bin) {
        for (uint32_t done = 0; done < len; done += upstream_batch)
            up_free_many(ptrs + done, len - done < upstream_batch ? len - done : upstream_batch, size);
    } else {
        struct bin *b = bin_for(size);
        for (uint32_t i = 0; i < len; i++)
            if (ptrs[i]) bin_free(b, ptrs[i]);
    }
    // The host placed the list with `cabi_realloc`; it is ours now.
    release_arg(ptrs, (size_t)len * 8);
}

// ---------------------------------------------------------------------------------------
// The lifecycle interface.

// Gives back every chunk whose blocks are all free, in `free-many`s of up to
// upstream_batch chunks.
EXPORT("allocbox:policy/lifecycle@0.2.0#trim")
void binning_trim(void) {
    struct chunk *dead = NULL; // released chunks, linked through `next`
    for (uint32_t i = 0; i < nbins; i++) {
        struct bin *b = &bins[i];
        if (b->nempty == 0) continue;
        uint64_t *bases = heap_alloc((size_t)b->nempty * 8);
        uint32_t n = 0;
        struct chunk *c = b->head;
        while (c) {
            struct chunk *next = c->next;
            if (c->nfree == blocks_per_chunk) {
                list_unlink(b, c);
                if (bases) {
                    bases[n++] = c->base;
                    c->dead = true;
                    c->next = dead;
                    dead = c;
                } else {
                    // No room for the list: one call per chunk instead.
                    slot_remove(c);
                    up_free(c->base, b->chunk_bytes);
                    heap_release(c, chunk_desc_bytes(b));
                }
            }
            c = next;
        }
        if (bases) {
            for (uint32_t done = 0; done < n; done += upstream_batch)
                up_free_many(bases + done, n - done < upstream_batch ? n - done : upstream_batch,
                             b->chunk_bytes);
            heap_release(bases, (size_t)b->nempty * 8);
        }
        b->nempty = 0;
    }
    // One pass over the index drops every released chunk.
    uint32_t kept = 0;
    for (uint32_t i = 0; i < nslots; i++)
        if (!slots[i].chunk->dead) slots[kept++] = slots[i];
    nslots = kept;
    while (dead) {
        struct chunk *next = dead->next;
        heap_release(dead, chunk_desc_bytes(&bins[dead->bin]));
        dead = next;
    }
}

// `init`'s answer, `result<info, string>` laid out by the canonical ABI: the tag, then
// the payload at offset 8 (info holds a u64, so it is 8-aligned). 0.2.0's `diagnoses`
// follows `batch` in the same 8-byte slot, so the answer stays 40 bytes.
static struct {
    uint8_t is_err;
    _Alignas(8) const char *text; // info.name, or the error message
    uint32_t text_len;
    uint8_t version;
    _Alignas(8) uint64_t alignment;
    bool batch;
    bool diagnoses;
} init_answer;
_Static_assert(offsetof(__typeof__(init_answer), text) == 8, "result payload at 8");
_Static_assert(offsetof(__typeof__(init_answer), version) == 16, "info.version at 16");
_Static_assert(offsetof(__typeof__(init_answer), alignment) == 24, "info.alignment at 24");
_Static_assert(offsetof(__typeof__(init_answer), batch) == 32, "info.batch at 32");
_Static_assert(offsetof(__typeof__(init_answer), diagnoses) == 33, "info.diagnoses at 33");
_Static_assert(sizeof init_answer == 40, "result<info, string> is 40 bytes");

struct str {
    const char *ptr;
    uint32_t len;
};
struct kv {
    struct str key, value;
};

static bool str_eq(struct str a, struct str b) {
    if (a.len != b.len) return false;
    for (uint32_t i = 0; i < a.len; i++)
        if (a.ptr[i] != b.ptr[i]) return false;
    return true;
}

static struct str str_trim(struct str s) {
    while (s.len && (s.ptr[0] == ' ' || s.ptr[0] == '\t')) s.ptr++, s.len--;
    while (s.len && (s.ptr[s.len - 1] == ' ' || s.ptr[s.len - 1] == '\t')) s.len--;
    return s;
}

// A whole decimal number, without sign or overflow.
static bool parse_u64(struct str s, uint64_t *out) {
    s = str_trim(s);
    if (s.len == 0) return false;
    uint64_t v = 0;
    for (uint32_t i = 0; i < s.len; i++) {
        unsigned d = (unsigned char)s.ptr[i] - '0';
        // Constant bounds: a 64-bit division by 10 here would need compiler-rt's
        // __multi3 (wasm has no 64-bit multiply-high), which this module does not link.
        if (d > 9 || v > UINT64_MAX / 10 || (v == UINT64_MAX / 10 && d > UINT64_MAX % 10))
            return false;
        v = v * 10 + d;
    }
    *out = v;
    return true;
}

static bool pow2(uint64_t v) { return v && !(v & (v - 1)); }

// The error message, built in place (no libc: no snprintf).
static char msg[512];
static uint32_t msg_len;

static void say_n(const char *s, uint32_t n) {
    uint32_t room = sizeof msg - msg_len;
    if (n > room) {
        // Cut on a character boundary: the host rejects a string that is not UTF-8.
        n = room;
        while (n && ((unsigned char)s[n] & 0xc0) == 0x80) n--;
    }
    __builtin_memcpy(msg + msg_len, s, n);
    msg_len += n;
}
static void say_str(struct str s) { say_n(s.ptr, s.len); }
// A string literal, its length known at compile time (no strlen to link).
#define LIT(lit) ((struct str){lit, sizeof(lit) - 1})
#define say(lit) say_str(LIT(lit))
// 32 bits suffice for the numbers `init` reports, and keep __multi3 out (see parse_u64).
static void say_u32(uint32_t v) {
    char digits[10];
    uint32_t n = 0;
    do digits[9 - n++] = (char)('0' + v % 10);
    while ((v /= 10) != 0);
    say_n(digits + 10 - n, n);
}
// "binning: bad value `VALUE` for `KEY`: " — the caller says why.
static void say_bad(struct kv kv) {
    say("binning: bad value `");
    say_str(kv.value);
    say("` for `");
    say_str(kv.key);
    say("`: ");
}

enum key { KEY_BINS, KEY_MIN_BIN, KEY_MAX_BIN, KEY_BLOCKS_PER_CHUNK, KEY_EMPTY_CHUNKS, NKEYS };
static const struct str key_names[NKEYS] = {
    LIT("bins"), LIT("min-bin"), LIT("max-bin"), LIT("blocks-per-chunk"), LIT("empty-chunks")};

// The settings `init` reads; applied only when all of them are valid.
struct settings {
    uint64_t sizes[MAX_BINS];
    uint32_t nsizes;
    uint64_t min_bin, max_bin, blocks_per_chunk;
    uint64_t empty_chunks; // UNLIMITED by default
    bool seen[NKEYS];      // to reject repeats, and `bins` mixed with min/max-bin
};

#define SIZE_RANGE "16..=1048576"

// `bins=16,48,256`: ascending multiples of 16.
static bool parse_bins(struct kv kv, struct settings *s) {
    struct str rest = kv.value;
    for (;;) {
        uint32_t n = 0;
        while (n < rest.len && rest.ptr[n] != ',') n++;
        struct str item = {rest.ptr, n};
        uint64_t v;
        struct str why = {0};
        if (!parse_u64(item, &v)) why = LIT(" is not a whole number");
        else if (v < 16 || v > MAX_BIN_SIZE) why = LIT(" is outside " SIZE_RANGE);
        else if (v % 16) why = LIT(" is not a multiple of 16 (the alignment)");
        else if (s->nsizes && v <= s->sizes[s->nsizes - 1]) why = LIT(" does not follow a smaller size");
        else if (s->nsizes == MAX_BINS) why = LIT(": more than 32 sizes");
        if (why.ptr) {
            say_bad(kv);
            say("`");
            say_str(str_trim(item));
            say("`");
            say_str(why);
            say("; want ascending multiples of 16 in " SIZE_RANGE ", comma-separated, at most 32");
            return false;
        }
        s->sizes[s->nsizes++] = v;
        if (n == rest.len) return true;
        rest.ptr += n + 1;
        rest.len -= n + 1;
    }
}

static bool parse_entry(struct kv kv, struct settings *s) {
    enum key key = 0;
    while (key < NKEYS && !str_eq(kv.key, key_names[key])) key++;
    if (key == NKEYS) {
        say("binning: unknown config key `");
        say_str(kv.key);
        say("` (value `");
        say_str(kv.value);
        say("`); known: bins, min-bin, max-bin, blocks-per-chunk, empty-chunks");
        return false;
    }
    if (s->seen[key]) {
        say("binning: `");
        say_str(kv.key);
        say("` given more than once");
        return false;
    }
    s->seen[key] = true;

    uint64_t v = 0;
    bool number = parse_u64(kv.value, &v);
    switch (key) {
    case KEY_BINS:
        return parse_bins(kv, s);
    case KEY_MIN_BIN:
    case KEY_MAX_BIN:
        if (!number || v < 16 || v > MAX_BIN_SIZE || !pow2(v)) {
            say_bad(kv);
            say("want a power of two in " SIZE_RANGE);
            return false;
        }
        *(key == KEY_MIN_BIN ? &s->min_bin : &s->max_bin) = v;
        return true;
    case KEY_BLOCKS_PER_CHUNK:
        if (!number || v < 1 || v > MAX_BLOCKS_PER_CHUNK) {
            say_bad(kv);
            say("want a whole number in 1..=4096");
            return false;
        }
        s->blocks_per_chunk = v;
        return true;
    default: // KEY_EMPTY_CHUNKS
        if (str_eq(str_trim(kv.value), LIT("unlimited"))) return true;
        if (!number || v >= UNLIMITED) {
            say_bad(kv);
            say("want a whole number of chunks below 4294967295, or `unlimited`");
            return false;
        }
        s->empty_chunks = v;
        return true;
    }
}

static bool configure(const struct kv *config, uint32_t len) {
    struct settings s = {
        .min_bin = 16, .max_bin = 8192, .blocks_per_chunk = 128, .empty_chunks = UNLIMITED};
    for (uint32_t i = 0; i < len; i++)
        if (!parse_entry(config[i], &s)) return false;
    if (s.seen[KEY_BINS] && (s.seen[KEY_MIN_BIN] || s.seen[KEY_MAX_BIN])) {
        say("binning: `bins` and `min-bin`/`max-bin` both given: use one or the other");
        return false;
    }
    if (!s.seen[KEY_BINS]) {
        if (s.min_bin > s.max_bin) {
            say("binning: `min-bin` (");
            say_u32((uint32_t)s.min_bin);
            say(") is larger than `max-bin` (");
            say_u32((uint32_t)s.max_bin);
            say(")");
            return false;
        }
        for (uint64_t size = s.min_bin; size <= s.max_bin; size *= 2) s.sizes[s.nsizes++] = size;
    }
    uint64_t largest = s.sizes[s.nsizes - 1];
    if (largest * s.blocks_per_chunk > MAX_CHUNK_BYTES) {
        say("binning: the largest bin (");
        say_u32((uint32_t)largest);
        say(" bytes) times `blocks-per-chunk` (");
        say_u32((uint32_t)s.blocks_per_chunk);
        say(") is a chunk over 268435456 bytes; lower one of them");
        return false;
    }

    lut = heap_alloc((size_t)(largest / 16));
    if (!lut) {
        say("binning: out of memory for the size table");
        return false;
    }

    // Every setting is valid: apply them.
    nbins = s.nsizes;
    blocks_per_chunk = (uint32_t)s.blocks_per_chunk;
    empty_limit = (uint32_t)s.empty_chunks;
    for (uint32_t i = 0; i < nbins; i++)
        bins[i] = (struct bin){.size = s.sizes[i],
                               .chunk_bytes = s.sizes[i] * s.blocks_per_chunk,
                               .words = (blocks_per_chunk + 63) / 64};
    uint32_t bin = 0;
    for (uint64_t step = 0; step < largest / 16; step++) {
        while (bins[bin].size < (step + 1) * 16) bin++;
        lut[step] = (uint8_t)bin;
    }
    max_bin = largest;
    return true;
}

// `limits` is a record, so the canonical ABI passes its fields one by one after the
// configuration list: `batch` (u32), `memory` and `overhead` (u64).
EXPORT("allocbox:policy/lifecycle@0.2.0#init")
void *binning_init(struct kv *config, uint32_t len, uint32_t batch_limit, uint64_t memory_limit,
                   uint64_t overhead_limit) {
    // Past `memory_limit` this module's `memory.grow` answers -1, which `heap_alloc`
    // already takes as out of memory; the overhead budget is the host's to enforce.
    (void)memory_limit;
    (void)overhead_limit;
    bool ok = max_bin == 0 && configure(config, len);
    if (ok) {
        // Never 0: the loops that split a batch would not advance.
        if (batch_limit < upstream_batch) upstream_batch = batch_limit ? batch_limit : 1;
        static const char name[] = "binning";
        init_answer.is_err = 0;
        init_answer.text = name;
        init_answer.text_len = sizeof name - 1;
        init_answer.version = 1;
        // Upstream blocks are 16-aligned and every bin size is a multiple of 16.
        init_answer.alignment = 16;
        // Blocks are interchangeable within a size, so the host may fetch them ahead
        // with `malloc-many` and return them later with `free-many`.
        init_answer.batch = true;
        // It checks nothing of how the client uses its blocks.
        init_answer.diagnoses = false;
    } else {
        if (msg_len == 0) say("binning: `init` called twice");
        init_answer.is_err = 1;
        init_answer.text = msg;
        init_answer.text_len = msg_len;
    }
    // The configuration was placed with `cabi_realloc`: it is ours to release.
    for (uint32_t i = 0; i < len; i++) {
        release_arg(config[i].key.ptr, config[i].key.len);
        release_arg(config[i].value.ptr, config[i].value.len);
    }
    release_arg(config, (size_t)len * sizeof *config);
    return &init_answer;
}

// `report`'s answer, `list<tuple<string, u64>>`: a return area of (pointer, length), the
// list's elements 16 bytes each (the string's pointer and length, then the u64 at 8).
struct counter {
    const char *name;
    uint32_t name_len;
    uint64_t value;
};
_Static_assert(sizeof(struct counter) == 16 && _Alignof(struct counter) == 8, "tuple<string, u64>");
static struct counter counters[2];
static struct {
    struct counter *ptr;
    uint32_t len;
} report_answer;

#define COUNTER(lit, v) ((struct counter){lit, sizeof(lit) - 1, (v)})

EXPORT("allocbox:policy/lifecycle@0.2.0#report")
void *binning_report(void) {
    counters[0] = COUNTER("chunks-taken", chunks_taken);
    // `peak-` tells a tool that combines reports to keep the largest, not the sum.
    counters[1] = COUNTER("peak-chunks", peak_chunks);
    report_answer.ptr = counters;
    report_answer.len = 2;
    return &report_answer;
}

// ---------------------------------------------------------------------------------------
// The observer interface: this policy is asked on every call and observes nothing.

// `observes`' answer, `option<observing>`: the tag at 0, the record at 8 (its
// `option<u64>` lease makes it 8-aligned), 32 bytes in all. Tag 0 is none.
static _Alignas(8) uint8_t observes_answer[32];

EXPORT("allocbox:policy/observer@0.2.0#observes")
void *binning_observes(void) {
    observes_answer[0] = 0;
    return observes_answer;
}

// Never called while `observes` answers none, but every export of the world must exist.
// Its `observation` variant arrives flattened: the case, then each case's fields joined
// slot by slot (an i32 slot that another case fills with a u64 becomes an i64):
//   events    (ops, addrs, sizes): three lists of bytes, (pointer, length) each, in 1..6
//   totals    four u64 sums in 1..4, `lent-by-bits` (a list of u64) in 5..6
//   survivors events in 1..6, `places` (bytes) in 7..8, `count` in 9, four u64 in 10..13
// The lists were placed with `cabi_realloc` and are ours: released, so that a host that
// did call it would leak nothing here.
EXPORT("allocbox:policy/observer@0.2.0#observe")
void binning_observe(uint32_t which, uint64_t s1, uint64_t s2, uint64_t s3, uint64_t s4,
                     uint32_t s5, uint32_t s6, uint32_t s7, uint32_t s8, uint32_t s9,
                     uint64_t s10, uint64_t s11, uint64_t s12, uint64_t s13) {
    (void)s9, (void)s10, (void)s11, (void)s12, (void)s13;
    if (which == 1) {
        release_arg((const void *)(uintptr_t)s5, (size_t)s6 * 8);
        return;
    }
    // events, or the events of survivors: byte lists in slots 1..6.
    release_arg((const void *)(uintptr_t)s1, (size_t)s2);
    release_arg((const void *)(uintptr_t)s3, (size_t)s4);
    release_arg((const void *)(uintptr_t)s5, s6);
    if (which == 2) release_arg((const void *)(uintptr_t)s7, s8);
}

// Never called: the host asks `renew` only of a policy that granted a lease.
EXPORT("allocbox:policy/observer@0.2.0#renew")
uint64_t binning_renew(uint64_t size) {
    (void)size;
    return 0;
}

// ---------------------------------------------------------------------------------------
// The sharding interface.

// Every chunk, bin and index lives in this instance's own memory and counts nothing
// another instance lends, so the host may start one instance per thread.
EXPORT("allocbox:policy/sharding@0.2.0#shardable")
uint32_t binning_shardable(void) { return 1; }
