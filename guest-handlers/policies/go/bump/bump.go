// Package main is `bump`, an allocbox policy in Go: a bump arena that resets a chunk
// once every block in it has been freed.
//
// Blocks of at most chunk-size/4 bytes are cut, 16-aligned, from chunks of chunk-size
// bytes taken from the upstream, by moving a pointer forward: an allocation is an
// addition and a comparison. Each chunk counts its live blocks. Freeing the block that
// ends at the chunk's pointer moves the pointer back (so strictly nested allocate/free
// patterns, the common case for temporaries, reuse the same bytes); any other free only
// lowers the count. A chunk whose count reaches 0 is reset and kept for the next blocks,
// up to `idle-chunks` of them; `trim` gives back every chunk with no live block. Larger
// requests go to the upstream directly, so they can be given back one by one.
//
// The policy never reads or writes the blocks themselves except to zero a `calloc` block
// and to move the bytes of a block that `realloc` cannot resize in place: all its
// bookkeeping lives in Go's own heap, in this module's linear memory.
//
// The host calls an instance on one thread at a time, so the state below is plain
// globals; they are this instance's alone, so the policy says it is shardable (the host
// may start one instance per thread). The file is split by concern: abi.go holds the
// canonical-ABI plumbing (imports, exports, argument and result memory); this file the
// policy; config.go the `init` settings.
package main

// chunk is one block taken from the upstream, cut into blocks from its start.
type chunk struct {
	raw   uint64 // the address the upstream gave; given back with chunkSize
	start uint64 // raw rounded up to 16: the first block starts here
	end   uint64 // raw + chunkSize: no block reaches past it
	bump  uint64 // the next block starts here; lent blocks lie in [start, bump)
	live  uint32 // blocks lent from this chunk and not freed
	idle  bool   // on the idle list: no live block, and not the current chunk
}

var (
	// settings, from init
	chunkSize uint64 = 1 << 20
	direct    uint64 = (1 << 20) / 4 // requests above this go to the upstream as they are
	maxIdle          = -1            // empty chunks kept between trims; -1: all of them

	// chunks sorted by address, to find the chunk of a freed block by binary search
	chunks []*chunk
	// the chunk new blocks come from; nil before the first block and after a trim
	current *chunk
	// empty chunks, not current, kept for reuse (most recently emptied last)
	idle []*chunk

	// what `report` answers: chunks taken from the upstream, and the most held at once
	chunksTaken, peakChunks uint64
)

// round16 is size rounded up to the alignment; callers keep size far below 2^64.
func round16(size uint64) uint64 { return (size + 15) &^ 15 }

// find is the chunk holding addr, or nil for a block that came from the upstream
// directly. Blocks are classified by address rather than by size so that a block keeps
// its home whatever realloc does to its size.
func find(addr uint64) *chunk {
	lo, hi := 0, len(chunks)
	for lo < hi { // the first chunk that starts after addr
		mid := int(uint(lo+hi) >> 1)
		if chunks[mid].raw <= addr {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	if lo == 0 {
		return nil
	}
	if c := chunks[lo-1]; addr < c.end {
		return c
	}
	return nil
}

// newChunk takes a chunk from the idle list, or else from the upstream; nil when the
// upstream has no memory left.
func newChunk() *chunk {
	if n := len(idle); n > 0 {
		c := idle[n-1]
		idle[n-1] = nil
		idle = idle[:n-1]
		c.idle = false
		return c
	}
	raw := upMalloc(chunkSize)
	if raw == 0 {
		return nil
	}
	start := round16(raw)
	c := &chunk{raw: raw, start: start, end: raw + chunkSize, bump: start}
	// insert, keeping the order by address
	i := len(chunks)
	chunks = append(chunks, nil)
	for i > 0 && chunks[i-1].raw > raw {
		chunks[i] = chunks[i-1]
		i--
	}
	chunks[i] = c
	chunksTaken++
	peakChunks = max(peakChunks, uint64(len(chunks)))
	return c
}

// release gives a chunk with no live block back to the upstream.
func release(c *chunk) {
	upFree(c.raw, chunkSize)
	for i, other := range chunks {
		if other == c {
			copy(chunks[i:], chunks[i+1:])
			chunks[len(chunks)-1] = nil
			chunks = chunks[:len(chunks)-1]
			break
		}
	}
}

// emptied resets a chunk whose last live block was freed: its pointer goes back to the
// start, and a chunk other than the current one goes on the idle list (or back
// upstream, past `idle-chunks`).
func emptied(c *chunk) {
	c.bump = c.start
	if c == current {
		return
	}
	if maxIdle >= 0 && len(idle) >= maxIdle {
		release(c)
		return
	}
	c.idle = true
	idle = append(idle, c)
}

func malloc(size uint64) uint64 {
	size = max(size, 1) // the host never asks for 0 bytes; calloc(0, n) could
	if size > direct {
		return upMalloc(size)
	}
	n := round16(size)
	c := current
	if c == nil || c.end-c.bump < n {
		// The current chunk is full. It keeps its live blocks and becomes current again
		// only through the idle list, once they are all freed. n <= chunkSize/4 always
		// fits in a fresh chunk.
		c = newChunk()
		if c == nil {
			// Not a whole chunk left upstream: the block itself may still fit there.
			return upMalloc(size)
		}
		current = c
	}
	p := c.bump
	c.bump += n
	c.live++
	return p
}

func free(ptr, size uint64) {
	c := find(ptr)
	if c == nil {
		upFree(ptr, size)
		return
	}
	c.live--
	if c.live == 0 {
		emptied(c)
		return
	}
	if ptr+round16(size) == c.bump {
		// The most recent block still in place: give its bytes back to the pointer.
		c.bump = ptr
	}
}

func calloc(nelem, elsize uint64) uint64 {
	total := nelem * elsize
	if nelem != 0 && total/nelem != elsize {
		return 0 // the product overflows: no block, never a wrapped size
	}
	if total > direct {
		return upCalloc(nelem, elsize)
	}
	p := malloc(total)
	if p != 0 {
		// A chunk's bytes may hold a freed block's data, and malloc's fallback to the
		// upstream's malloc does not zero either.
		bytesFill(p, max(total, 1), 0)
	}
	return p
}

func realloc(ptr, oldSize, newSize uint64) uint64 {
	if ptr == 0 {
		return malloc(newSize)
	}
	c := find(ptr)
	if c == nil {
		// A block from the upstream stays with the upstream, whatever its new size.
		return upRealloc(ptr, oldSize, newSize)
	}
	room := c.end - ptr
	if ptr+round16(oldSize) == c.bump && newSize <= room && round16(newSize) <= room {
		// The most recent block of its chunk: grow or shrink it where it is.
		c.bump = ptr + round16(max(newSize, 1))
		return ptr
	}
	if newSize <= round16(oldSize) { // not round16(newSize): that wraps near 2^64
		// Shrinking within its own bytes; the tail is lost until the chunk resets.
		return ptr
	}
	moved := malloc(newSize)
	if moved == 0 {
		return 0 // the old block stays live and unchanged
	}
	bytesCopy(moved, ptr, min(oldSize, newSize))
	free(ptr, oldSize)
	return moved
}

// trim gives back every chunk with no live block; chunks with live blocks stay.
func trim() {
	kept := chunks[:0]
	for _, c := range chunks {
		if c.live == 0 {
			upFree(c.raw, chunkSize)
			if c == current {
				current = nil
			}
		} else {
			kept = append(kept, c)
		}
	}
	clear(chunks[len(kept):])
	chunks = kept
	clear(idle)
	idle = idle[:0]
}

// mallocMany serves up to count blocks, each as malloc would; fewer when memory runs out.
func mallocMany(size uint64, count uint32, out []uint64) []uint64 {
	for i := uint32(0); i < count; i++ {
		p := malloc(size)
		if p == 0 {
			break
		}
		out = append(out, p)
	}
	return out
}

func main() {}
