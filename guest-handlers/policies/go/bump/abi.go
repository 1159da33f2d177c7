// The canonical-ABI plumbing of contract 0.2.0's `allocbox:policy/sharding-policy`
// world (wit/0.2.0/policy.wit), by hand: Go's //go:wasmimport and //go:wasmexport
// directives give the exact core names, and the few values that are not plain integers
// (the config list, `init`'s result, the lists of `malloc-many`, `free-many`, `report`
// and `observe`, `observes`' option) are laid out in this module's memory here.

package main

import "unsafe"

// The upstream: the next policy in the chain, or the host's memory.

//go:wasmimport allocbox:policy/allocator@0.2.0 malloc
func upMalloc(size uint64) uint64

//go:wasmimport allocbox:policy/allocator@0.2.0 calloc
func upCalloc(nelem, elsize uint64) uint64

//go:wasmimport allocbox:policy/allocator@0.2.0 realloc
func upRealloc(ptr, oldSize, newSize uint64) uint64

//go:wasmimport allocbox:policy/allocator@0.2.0 free
func upFree(ptr, size uint64)

// Checked access to bytes of blocks this policy holds and has not lent out. `fill`'s
// byte is a u8, which the canonical ABI passes as an i32.

//go:wasmimport allocbox:policy/bytes@0.2.0 fill
func bytesFill(at, n uint64, b uint32)

//go:wasmimport allocbox:policy/bytes@0.2.0 copy
func bytesCopy(dst, src, n uint64)

// The exports. Each is a thin wrapper: the policy itself is in bump.go.

//go:wasmexport allocbox:policy/allocator@0.2.0#malloc
func exportMalloc(size uint64) uint64 { return malloc(size) }

//go:wasmexport allocbox:policy/allocator@0.2.0#calloc
func exportCalloc(nelem, elsize uint64) uint64 { return calloc(nelem, elsize) }

//go:wasmexport allocbox:policy/allocator@0.2.0#realloc
func exportRealloc(ptr, oldSize, newSize uint64) uint64 { return realloc(ptr, oldSize, newSize) }

//go:wasmexport allocbox:policy/allocator@0.2.0#free
func exportFree(ptr, size uint64) { free(ptr, size) }

// ret is the return area of the calls whose result does not fit in one value; 8-aligned
// as the results need. The host reads it as soon as the call returns.
var ret [5]uint64

// manyOut holds the addresses of the last `malloc-many` answer, reused call to call so
// that a batch costs the Go heap nothing once it has grown.
var manyOut []uint64

// At most this many blocks per `malloc-many` call ("fewer" is allowed); bounds manyOut.
const maxMany = 1024

// `list<u64>` is returned as (pointer, length) in the return area.
//
//go:wasmexport allocbox:policy/allocator@0.2.0#malloc-many
func exportMallocMany(size uint64, count uint32) uint32 {
	manyOut = mallocMany(size, min(count, maxMany), manyOut[:0])
	var at uint32
	if len(manyOut) > 0 {
		at = addr(unsafe.Pointer(&manyOut[0]))
	}
	put32(0, at)
	put32(4, uint32(len(manyOut)))
	return addr(unsafe.Pointer(&ret))
}

// The host wrote the list with cabi_realloc; it is ours until the call returns.
//
//go:wasmexport allocbox:policy/allocator@0.2.0#free-many
func exportFreeMany(list, n uint32, size uint64) {
	ptrs := unsafe.Slice((*uint64)(pointer(list)), n)
	for _, p := range ptrs {
		free(p, size)
	}
	args.reset()
}

// `list<tuple<string, string>>` arrives as (pointer, length), 16 bytes an element: key
// (pointer, length), value (pointer, length). The `limits` record follows, flattened into
// its fields: batch (u32), memory and overhead (u64). `result<info, string>`: the case
// byte at 0, the payload from 8: info is name (pointer, length) at 8, version at 16,
// alignment at 24, batch at 32, diagnoses at 33; an error is its string at 8.
//
// The limits need nothing here: the policy never calls `malloc-many` or `free-many`
// upstream, Go's runtime (not this code) grows the memory, and the host enforces the
// overhead budget.
//
//go:wasmexport allocbox:policy/lifecycle@0.2.0#init
func exportInit(list, n, batchLimit uint32, memoryLimit, overheadLimit uint64) uint32 {
	pairs := make([][2]string, n)
	for i := range pairs {
		at := list + 16*uint32(i)
		pairs[i] = [2]string{str(get32(at), get32(at+4)), str(get32(at+8), get32(at+12))}
	}
	args.reset()
	ret = [5]uint64{}
	if msg := configure(pairs); msg != "" {
		answer = msg
		put8(0, 1)
	} else {
		answer = name
		put8(0, 0)
		put8(16, 1) // the handler contract version
		ret[3] = 16 // alignment: every block starts at a multiple of 16
		put8(32, b2u(batch))
		put8(33, 0) // diagnoses: it checks nothing of how the client uses its blocks
	}
	put32(8, addr(unsafe.Pointer(unsafe.StringData(answer))))
	put32(12, uint32(len(answer)))
	return addr(unsafe.Pointer(&ret))
}

// answer keeps init's string alive until the host has read it.
var answer string

//go:wasmexport allocbox:policy/lifecycle@0.2.0#trim
func exportTrim() { trim() }

// counter is one element of `list<tuple<string, u64>>`: the name's (pointer, length),
// then the value at 8.
type counter struct {
	name, nameLen uint32
	value         uint64
}

var counters [2]counter

// `report` answers its list as (pointer, length) in the return area. The names are
// string constants, which stay where they are for the module's life.
//
//go:wasmexport allocbox:policy/lifecycle@0.2.0#report
func exportReport() uint32 {
	named := func(name string, value uint64) counter {
		return counter{addr(unsafe.Pointer(unsafe.StringData(name))), uint32(len(name)), value}
	}
	// `peak-` tells a tool that combines reports to keep the largest, not the sum.
	counters = [2]counter{named("chunks-taken", chunksTaken), named("peak-chunks", peakChunks)}
	put32(0, addr(unsafe.Pointer(&counters)))
	put32(4, uint32(len(counters)))
	return addr(unsafe.Pointer(&ret))
}

// `option<observing>` is returned in the return area: the case byte at 0 (0: none), the
// record from 8 (its `option<u64>` lease makes it 8-aligned), 32 bytes in all. None:
// this policy is asked on every call.
//
//go:wasmexport allocbox:policy/observer@0.2.0#observes
func exportObserves() uint32 {
	ret = [5]uint64{}
	return addr(unsafe.Pointer(&ret))
}

// Never called while `observes` answers none, but every export of the world must exist.
// The `observation` variant arrives flattened: the case, then each case's fields joined
// slot by slot (an i32 slot that another case fills with a u64 becomes an i64): events
// are three byte lists in slots 1..6; totals four u64 in 1..4 and a list in 5..6;
// survivors the events in 1..6, a list in 7..8, a count in 9 and four u64 in 10..13.
// Whatever lists it got live in the argument arena, rewound here.
//
//go:wasmexport allocbox:policy/observer@0.2.0#observe
func exportObserve(which uint32, s1, s2, s3, s4 uint64, s5, s6, s7, s8, s9 uint32, s10, s11, s12, s13 uint64) {
	args.reset()
}

// Never called without a lease, and this policy grants none.
//
//go:wasmexport allocbox:policy/observer@0.2.0#renew
func exportRenew(size uint64) uint64 { return 0 }

// Every chunk lives in this instance's Go heap and counts nothing another instance
// lends, so the host may start one instance per thread: 1 is true.
//
//go:wasmexport allocbox:policy/sharding@0.2.0#shardable
func exportShardable() uint32 { return 1 }

// cabi_realloc gives the host memory for the arguments it passes in (the config strings
// and list, `free-many`'s list). They live in a Go byte slice kept reachable by args
// until the call that received them is done with them. Go's collector never moves an
// object, so the addresses stay valid while it is reachable.
//
//go:wasmexport cabi_realloc
func cabiRealloc(old, oldSize, align, newSize uint32) uint32 {
	at := args.alloc(newSize, align)
	if oldSize > 0 {
		copy(unsafe.Slice((*byte)(pointer(at)), oldSize), unsafe.Slice((*byte)(pointer(old)), oldSize))
	}
	return at
}

// argArena is a bump area for arguments: a call's arguments are few and short-lived,
// so they come from one buffer that is rewound after the call, with extra buffers only
// when one call passes more than the buffer holds.
type argArena struct {
	buf   []byte   // the current buffer
	used  uint32   // bytes of buf handed out
	extra [][]byte // older buffers still holding this call's arguments
}

var args argArena

func (a *argArena) alloc(size, align uint32) uint32 {
	align = max(align, 1)
	if len(a.buf) > 0 {
		base := addr(unsafe.Pointer(&a.buf[0]))
		at := (base + a.used + align - 1) &^ (align - 1)
		if at+size <= base+uint32(len(a.buf)) {
			a.used = at + size - base
			return at
		}
		a.extra = append(a.extra, a.buf)
	}
	a.buf = make([]byte, max(2*len(a.buf), int(size+align), 4096))
	a.used = 0
	return a.alloc(size, align)
}

// reset drops this call's arguments, keeping the largest buffer for the next call.
func (a *argArena) reset() {
	clear(a.extra)
	a.extra = a.extra[:0]
	a.used = 0
}

// Linear-memory helpers: Go pointers are 32-bit addresses of this module's memory.

func addr(p unsafe.Pointer) uint32 { return uint32(uintptr(p)) }

func pointer(at uint32) unsafe.Pointer {
	// `go vet` calls this a possible misuse; it is how an address the host passes (or
	// one we passed it) becomes a pointer again, and the memory is never moved.
	return unsafe.Pointer(uintptr(at))
}

func get32(at uint32) uint32 { return *(*uint32)(pointer(at)) }

// str copies a string argument out of the argument buffer, which is about to be reused.
func str(at, n uint32) string {
	return string(unsafe.Slice((*byte)(pointer(at)), n))
}

func put8(off uintptr, v uint8) {
	*(*uint8)(unsafe.Add(unsafe.Pointer(&ret), off)) = v
}

func put32(off uintptr, v uint32) {
	*(*uint32)(unsafe.Add(unsafe.Pointer(&ret), off)) = v
}

func b2u(b bool) uint8 {
	if b {
		return 1
	}
	return 0
}
