// policy_name: an allocbox allocation policy (NumPy NEP 49) in Go, started by
// `allocbox new`. A pass-through that counts the blocks it has lent out: every call goes
// upstream (the next policy in the chain, or the host's memory) unchanged.
//
// It is a core module written to the canonical ABI of the `policy` world in
// wit/policy.wit: //go:wasmimport and //go:wasmexport give the exact core names.
// allocbox makes it a component when it loads it, with its own stub for the WASI
// preview 1 functions the Go runtime imports (it grants nothing).
//
// The rules the host enforces (it stops the policy at the first break):
//   - every address you return lies inside a block you got from upstream and have not
//     freed, overlaps no other block you have lent out, and is aligned to the
//     `alignment` you promise in `init` (16 here: what upstream gives);
//   - give blocks back upstream with exactly the size you got them with;
//   - touch the bytes of blocks only through the `allocbox:policy/bytes@0.1.0` imports
//     (`fill`, `copy`, `read-u64`, ...), and only of blocks you hold and have not lent;
//   - `trim` gives back everything you cache: `allocbox check` calls it last and counts
//     whatever is still held upstream as a leak.
//
// A Go panic is a bare trap (its message goes to a stderr the stub drops).
package main

import "unsafe"

const name = "policy_name"

// Imports: module = the interface, field = the WIT function name. `u64` is `uint64`;
// `u32`, `u8` and `bool` are `uint32`.

//go:wasmimport allocbox:policy/allocator@0.1.0 malloc
func upMalloc(size uint64) uint64

//go:wasmimport allocbox:policy/allocator@0.1.0 calloc
func upCalloc(nelem, elsize uint64) uint64

//go:wasmimport allocbox:policy/allocator@0.1.0 realloc
func upRealloc(ptr, oldSize, newSize uint64) uint64

//go:wasmimport allocbox:policy/allocator@0.1.0 free
func upFree(ptr, size uint64)

// lent counts the blocks lent to the client and not given back yet. The host calls a
// policy on one thread at a time: plain globals need no lock.
var lent uint64

// lend counts a block handed to the client (0 means the allocation failed).
func lend(ptr uint64) uint64 {
	if ptr != 0 {
		lent++
	}
	return ptr
}

//go:wasmexport allocbox:policy/allocator@0.1.0#malloc
func malloc(size uint64) uint64 { return lend(upMalloc(size)) }

//go:wasmexport allocbox:policy/allocator@0.1.0#calloc
func calloc(nelem, elsize uint64) uint64 { return lend(upCalloc(nelem, elsize)) }

//go:wasmexport allocbox:policy/allocator@0.1.0#realloc
func realloc(ptr, oldSize, newSize uint64) uint64 {
	moved := upRealloc(ptr, oldSize, newSize)
	if ptr == 0 { // only `realloc(0, ..)` lends a new block
		return lend(moved)
	}
	return moved
}

//go:wasmexport allocbox:policy/allocator@0.1.0#free
func free(ptr, size uint64) {
	lent--
	upFree(ptr, size)
}

// ret is the return area of the calls whose result is not one value; the host reads it
// after the call returns, so it is a global (8-aligned, as the results need).
var ret [5]uint64

// many holds `malloc-many`'s answer: up to 64 blocks a call ("fewer, possibly none" is
// allowed).
var many [64]uint64

// A `list<u64>` result is (pointer, length) in the return area.
//
//go:wasmexport allocbox:policy/allocator@0.1.0#malloc-many
func mallocMany(size uint64, count uint32) uint32 {
	n := uint32(0)
	for n < count && n < uint32(len(many)) {
		if many[n] = upMalloc(size); many[n] == 0 {
			break
		}
		n++
	}
	lent += uint64(n)
	b := (*[40]byte)(unsafe.Pointer(&ret))
	*(*uint32)(unsafe.Pointer(&b[0])) = addr(unsafe.Pointer(&many))
	*(*uint32)(unsafe.Pointer(&b[4])) = n
	return addr(unsafe.Pointer(&ret))
}

// A `list<u64>` argument arrives as (pointer, length), placed by cabi_realloc.
//
//go:wasmexport allocbox:policy/allocator@0.1.0#free-many
func freeMany(list, n uint32, size uint64) {
	for _, p := range unsafe.Slice((*uint64)(unsafe.Pointer(uintptr(list))), n) {
		upFree(p, size)
	}
	lent -= uint64(n)
	keep = nil // done with the arguments
}

// `config` is `list<tuple<string, string>>`: (pointer, length) of 16-byte (key pointer,
// key length, value pointer, value length) records. This policy reads no settings.
// `result<info, string>`: the case at 0 (0 ok, 1 err), the payload from 8: info is the
// name (pointer, length) at 8, version at 16, alignment at 24, batch at 32; an error is
// its message (pointer, length) at 8.
//
//go:wasmexport allocbox:policy/lifecycle@0.1.0#init
func initPolicy(list, n uint32) uint32 {
	keep = nil // done with the arguments
	ret = [5]uint64{}
	b := (*[40]byte)(unsafe.Pointer(&ret))
	if n != 0 {
		b[0] = 1 // err(string)
		putString(b, name+" takes no configuration")
	} else {
		b[0] = 0 // ok(info)
		putString(b, name)
		b[16] = 1   // the handler contract version
		ret[3] = 16 // alignment
		b[32] = 1   // batch: the host may fetch blocks ahead with `malloc-many`
	}
	return addr(unsafe.Pointer(&ret))
}

// putString stores (pointer, length) at 8; a constant's bytes never move or die.
func putString(b *[40]byte, s string) {
	*(*uint32)(unsafe.Pointer(&b[8])) = addr(unsafe.Pointer(unsafe.StringData(s)))
	*(*uint32)(unsafe.Pointer(&b[12])) = uint32(len(s))
}

// Nothing cached, so nothing to give back.
//
//go:wasmexport allocbox:policy/lifecycle@0.1.0#trim
func trim() {}

// keep holds the arguments the host writes (config strings, free-many's list) until
// the export that receives them is done: reachable, so the collector keeps them (it
// never moves an object).
var keep [][]byte

//go:wasmexport cabi_realloc
func cabiRealloc(old, oldSize, align, size uint32) uint32 {
	buf := make([]byte, size+align)
	keep = append(keep, buf)
	p := (uintptr(unsafe.Pointer(&buf[0])) + uintptr(align) - 1) &^ (uintptr(align) - 1)
	if oldSize > 0 {
		copy(unsafe.Slice((*byte)(unsafe.Pointer(p)), oldSize),
			unsafe.Slice((*byte)(unsafe.Pointer(uintptr(old))), oldSize))
	}
	return uint32(p)
}

// addr is a pointer's address in this module's memory (wasm32: 32 bits).
func addr(p unsafe.Pointer) uint32 { return uint32(uintptr(p)) }

func main() {}
