//! `aligned`: NEP 49's example handler. Every block carries a header just before the
//! address the client sees, so that `free` can find the upstream block and check the
//! size the client passes back.
//!
//! Layout inside one upstream block of `size + alignment + HEADER` bytes:
//!
//! ```text
//! raw ... [ header word ] user (aligned) ... user + size ... end
//!         user - 8
//! ```
//!
//! `raw` is 16-aligned (the host's guarantee), so `user = align_up(raw + HEADER,
//! alignment)` is at most `raw + HEADER + alignment - 16` and `user + size` stays inside
//! the block. The header lies in the upstream block but outside the lent range, so the
//! policy may read and write it through `bytes`.
//!
//! The header is one word, because every `bytes` access is a call into the host: one
//! word per malloc and one per free, where three cost half as much again per call. It
//! packs what NEP 49's example keeps in its header, checked on every free:
//!
//! ```text
//! bits 63..13: size XOR MAGIC     (the size freed must be the size allocated, and a
//!                                  word that does not decode is not our header)
//! bits 12..0:  (user - raw) / 16  (where the upstream block starts)
//! ```

use allocbox_policy::{Config, Info, Policy, bytes, export_policy, upstream};

/// Bytes reserved before every user block; NEP 49's example uses 64 as well.
const HEADER: u64 = 64;
/// Where the header word sits, counted back from the user address.
const AT_WORD: u64 = 8;
/// Bits of the header word that hold `(user - raw) / 16`: up to
/// `(HEADER + MAX_ALIGNMENT - 16) / 16` = 4099.
const OFFSET_BITS: u32 = 13;
/// Sizes are below 2^51 (no memory holds more), so `size ^ MAGIC` fits above the offset.
const MAX_SIZE: u64 = (1 << (64 - OFFSET_BITS)) - 1;
/// Marks a header this policy wrote; a mismatch means `ptr` is not one of our blocks
/// or `size` is not the size it was allocated with.
const MAGIC: u64 = 0x4_A11C_B0C5_A119 & MAX_SIZE;
/// Sizes a real block can have (2^47 bytes is all a 64-bit host's user space holds):
/// a header that decodes to a larger size was not written by this policy.
const PLAUSIBLE_SIZE: u64 = 1 << 47;

const DEFAULT_ALIGNMENT: u64 = 64;
const MIN_ALIGNMENT: u64 = 16;
const MAX_ALIGNMENT: u64 = 65536;

struct Aligned {
    alignment: u64,
}

impl Aligned {
    /// What we ask upstream for to serve `size` bytes, or `None` for a size no header
    /// can describe (and no memory could hold).
    fn padded(&self, size: u64) -> Option<u64> {
        if size > MAX_SIZE {
            return None;
        }
        size.checked_add(self.alignment)?.checked_add(HEADER)
    }

    /// Turns a fresh upstream block into the user address and writes its header.
    fn place(&self, raw: u64, size: u64) -> u64 {
        let align = self.alignment;
        let user = (raw + HEADER + align - 1) & !(align - 1);
        let word = ((size ^ MAGIC) << OFFSET_BITS) | ((user - raw) / 16);
        bytes::write_u64(user - AT_WORD, word);
        user
    }

    fn release(&self, user: u64, size: u64, op: &str) {
        let raw = header(user, size, op);
        let total = self.padded(size).expect("size was padded when allocated");
        upstream::free(raw, total);
    }
}

/// Reads the header of `user` and checks it against the size the caller gave; returns the
/// upstream pointer. A mismatch is a bug in whoever called us, so we stop loudly.
fn header(user: u64, size: u64, op: &str) -> u64 {
    let word = bytes::read_u64(user - AT_WORD);
    let stored = (word >> OFFSET_BITS) ^ MAGIC;
    if stored >= PLAUSIBLE_SIZE {
        panic!("aligned: {op} of {user:#x}: no aligned header there (word {word:#x})");
    }
    if stored != size {
        panic!(
            "aligned: {op} of {user:#x} with size {size}, but it was allocated with size {stored}"
        );
    }
    user - (word & ((1 << OFFSET_BITS) - 1)) * 16
}

fn parse_alignment(value: &str) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(a) if a.is_power_of_two() && (MIN_ALIGNMENT..=MAX_ALIGNMENT).contains(&a) => Ok(a),
        _ => Err(format!(
            "want a power of two in {MIN_ALIGNMENT}..={MAX_ALIGNMENT}"
        )),
    }
}

impl Policy for Aligned {
    fn init(config: &mut Config) -> Result<Self, String> {
        let alignment = config
            .get_with("alignment", parse_alignment)?
            .unwrap_or(DEFAULT_ALIGNMENT);
        Ok(Aligned { alignment })
    }

    fn info(&self) -> Info {
        // The host may keep this policy's blocks in its magazines: a block's header lies
        // outside the lent range, so neither the client nor the host writes it while the
        // block waits there, and the size check runs when the block comes back (a free,
        // or a flush through `free_many`).
        Info::new()
            .alignment(self.alignment)
            .batch(true)
            .shardable(true)
    }

    fn malloc(&self, size: u64) -> u64 {
        let Some(total) = self.padded(size) else {
            return 0;
        };
        match upstream::malloc(total) {
            0 => 0,
            raw => self.place(raw, size),
        }
    }

    fn calloc(&self, nelem: u64, elsize: u64) -> u64 {
        let Some(size) = nelem.checked_mul(elsize) else {
            return 0;
        };
        let Some(total) = self.padded(size) else {
            return 0;
        };
        // The whole padded block comes back zeroed; the header lies outside the user range.
        match upstream::calloc(1, total) {
            0 => 0,
            raw => self.place(raw, size),
        }
    }

    fn realloc(&self, ptr: u64, old_size: u64, new_size: u64) -> u64 {
        if ptr == 0 {
            return self.malloc(new_size);
        }
        // Check the header before allocating, so a bad call fails without side effects.
        header(ptr, old_size, "realloc");
        let new = self.malloc(new_size);
        if new == 0 {
            return 0;
        }
        bytes::copy(new, ptr, old_size.min(new_size));
        self.release(ptr, old_size, "realloc");
        new
    }

    fn free(&self, ptr: u64, size: u64) {
        if ptr != 0 {
            self.release(ptr, size, "free");
        }
    }

    // `malloc_many` and `free_many` are never called (batch is false); the defaults
    // loop over `malloc` and `free` should a host call them anyway.

    // Nothing is cached: every free goes straight back upstream, so the default `trim`
    // (nothing) is right.
}

export_policy!(Aligned, name = "aligned");
