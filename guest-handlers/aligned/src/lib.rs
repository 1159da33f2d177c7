//! `aligned`: NEP 49's example handler. Every block carries a 64-byte header just before
//! the address the client sees, holding the upstream pointer and the requested size, so
//! that `free` can find the upstream block and check the size the client passes back.
//!
//! Layout inside one upstream block of `size + alignment + HEADER` bytes:
//!
//! ```text
//! raw ... [ header: raw | size | MAGIC | unused ] user (aligned) ... user + size ... end
//! ```
//!
//! `raw` is 16-aligned (the host's guarantee), so `user = align_up(raw + HEADER,
//! alignment)` is at most `raw + HEADER + alignment - 16` and `user + size` stays inside
//! the block. The header lies in the upstream block but outside the lent range, so the
//! policy may read and write it through `bytes`.

wit_bindgen::generate!({ path: "../../wit", world: "policy" });

use std::cell::Cell;

use allocbox::policy::{allocator as upstream, bytes};
use exports::allocbox::policy::allocator::Guest as Allocator;
use exports::allocbox::policy::lifecycle::{Guest as Lifecycle, Info};

/// Bytes reserved before every user block; NEP 49's example uses 64 as well.
const HEADER: u64 = 64;
/// Header word offsets, counted back from the user address.
const AT_RAW: u64 = HEADER;
const AT_SIZE: u64 = HEADER - 8;
const AT_MAGIC: u64 = HEADER - 16;
/// Marks a header this policy wrote; a mismatch means `ptr` is not one of our blocks.
const MAGIC: u64 = 0xA11C_B0C5_A119_4ED0;

const DEFAULT_ALIGNMENT: u64 = 64;
const MIN_ALIGNMENT: u64 = 16;
const MAX_ALIGNMENT: u64 = 65536;

thread_local! {
    // Guests are single-threaded; a thread-local is just a static without `unsafe`.
    static ALIGNMENT: Cell<u64> = const { Cell::new(DEFAULT_ALIGNMENT) };
}

fn alignment() -> u64 {
    ALIGNMENT.with(Cell::get)
}

/// What we ask upstream for to serve `size` bytes, or `None` on overflow.
fn padded(size: u64) -> Option<u64> {
    size.checked_add(alignment())?.checked_add(HEADER)
}

/// Turns a fresh upstream block into the user address and writes its header.
fn place(raw: u64, size: u64) -> u64 {
    let align = alignment();
    let user = (raw + HEADER + align - 1) & !(align - 1);
    bytes::write_u64(user - AT_RAW, raw);
    bytes::write_u64(user - AT_SIZE, size);
    bytes::write_u64(user - AT_MAGIC, MAGIC);
    user
}

/// Reads the header of `user` and checks it against the size the caller gave; returns the
/// upstream pointer. A mismatch is a bug in whoever called us, so we stop loudly.
fn header(user: u64, size: u64, op: &str) -> u64 {
    let magic = bytes::read_u64(user - AT_MAGIC);
    if magic != MAGIC {
        panic!("aligned: {op} of {user:#x}: no aligned header there (magic {magic:#x})");
    }
    let stored = bytes::read_u64(user - AT_SIZE);
    if stored != size {
        panic!(
            "aligned: {op} of {user:#x} with size {size}, but it was allocated with size {stored}"
        );
    }
    bytes::read_u64(user - AT_RAW)
}

fn release(user: u64, size: u64, op: &str) {
    let raw = header(user, size, op);
    let total = padded(size).expect("size was padded when allocated");
    upstream::free(raw, total);
}

struct Aligned;

impl Allocator for Aligned {
    fn malloc(size: u64) -> u64 {
        let Some(total) = padded(size) else { return 0 };
        match upstream::malloc(total) {
            0 => 0,
            raw => place(raw, size),
        }
    }

    fn calloc(nelem: u64, elsize: u64) -> u64 {
        let Some(size) = nelem.checked_mul(elsize) else {
            return 0;
        };
        let Some(total) = padded(size) else { return 0 };
        // The whole padded block comes back zeroed; the header lies outside the user range.
        match upstream::calloc(1, total) {
            0 => 0,
            raw => place(raw, size),
        }
    }

    fn realloc(ptr: u64, old_size: u64, new_size: u64) -> u64 {
        if ptr == 0 {
            return Self::malloc(new_size);
        }
        // Check the header before allocating, so a bad call fails without side effects.
        header(ptr, old_size, "realloc");
        let new = Self::malloc(new_size);
        if new == 0 {
            return 0;
        }
        bytes::copy(new, ptr, old_size.min(new_size));
        release(ptr, old_size, "realloc");
        new
    }

    fn free(ptr: u64, size: u64) {
        if ptr != 0 {
            release(ptr, size, "free");
        }
    }

    fn malloc_many(size: u64, count: u32) -> Vec<u64> {
        (0..count)
            .map(|_| Self::malloc(size))
            .take_while(|&p| p != 0)
            .collect()
    }

    fn free_many(ptrs: Vec<u64>, size: u64) {
        for ptr in ptrs {
            Self::free(ptr, size);
        }
    }
}

fn parse_alignment(value: &str) -> Result<u64, String> {
    match value.trim().parse::<u64>() {
        Ok(a) if a.is_power_of_two() && (MIN_ALIGNMENT..=MAX_ALIGNMENT).contains(&a) => Ok(a),
        _ => Err(format!(
            "aligned: bad value `{value}` for `alignment`: \
             want a power of two in {MIN_ALIGNMENT}..={MAX_ALIGNMENT}"
        )),
    }
}

impl Lifecycle for Aligned {
    fn init(config: Vec<(String, String)>) -> Result<Info, String> {
        let mut align = None;
        for (key, value) in &config {
            match key.as_str() {
                "alignment" if align.is_some() => {
                    return Err("aligned: `alignment` given more than once".into());
                }
                "alignment" => align = Some(parse_alignment(value)?),
                _ => {
                    return Err(format!(
                        "aligned: unknown config key `{key}` (value `{value}`); known: alignment"
                    ));
                }
            }
        }
        let align = align.unwrap_or(DEFAULT_ALIGNMENT);
        ALIGNMENT.with(|a| a.set(align));
        Ok(Info {
            name: "aligned".into(),
            version: 1,
            alignment: align,
            // NEP 49's example exists to see every call; no host-side magazines.
            batch: false,
        })
    }

    // Nothing is cached: every free goes straight back upstream.
    fn trim() {}
}

export!(Aligned);
