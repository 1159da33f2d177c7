//! The host side of a policy's `bytes` import: reads, writes, fills and copies of the
//! memory it holds, each range checked (inside memory it owns, clear of every block it
//! lent) and long ones cut into chunks with the call's time checked between them.

use super::{LinkState, bindings};
use crate::error::{Bound, Call};

/// Bytes one step of a long `bytes` access touches before the call's time is checked
/// again: a few milliseconds of memory bandwidth.
const BYTES_CHUNK: u64 = 16 << 20;

/// Which end of a range a chunked loop starts from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    Ascending,
    /// For a copy whose destination lies above its overlapping source: a chunk copied
    /// from the end never overwrites source bytes still to be copied.
    Descending,
}

impl LinkState {
    /// Run `step(offset, len)` over `[0, total)` in chunks of at most [`BYTES_CHUNK`],
    /// checking the call's time before each, so that no host loop whose length a guest
    /// chose outlives the call's deadline by more than one chunk.
    fn in_chunks(
        &mut self,
        call: Call,
        total: u64,
        order: Order,
        mut step: impl FnMut(u64, u64),
    ) -> wasmtime::Result<()> {
        let mut done = 0;
        while done < total {
            let len = (total - done).min(BYTES_CHUNK);
            self.on_time_moving(call, len)?;
            let offset = match order {
                Order::Ascending => done,
                Order::Descending => total - done - len,
            };
            step(offset, len);
            done += len;
        }
        Ok(())
    }
}

impl bindings::allocbox::policy::bytes::Host for LinkState {
    fn read(&mut self, at: u64, len: u32) -> wasmtime::Result<Vec<u8>> {
        self.on_time(Call::BytesRead)?;
        let limit = self.read_limit;
        self.bounded(Call::BytesRead, Bound::ReadLength, len.into(), limit)?;
        self.check_bytes(Call::BytesRead, at, len.into(), true)?;
        let mut out = vec![0; len as usize];
        let into = out.as_mut_ptr() as u64;
        self.in_chunks(
            Call::BytesRead,
            len.into(),
            Order::Ascending,
            |offset, n| {
                // SAFETY: check_bytes proved `[at, at+len)` lies inside one live upstream
                // block (or the block in transit, which lies inside one), and every block in
                // a ledger lies inside host memory allocated by SystemMemory and not yet
                // released; `out` has `len` bytes; this chunk lies inside both.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (at + offset) as *const u8,
                        (into + offset) as *mut u8,
                        n as usize,
                    )
                };
            },
        )?;
        Ok(out)
    }

    fn write(&mut self, at: u64, data: Vec<u8>) -> wasmtime::Result<()> {
        self.on_time(Call::BytesWrite)?;
        self.check_bytes(Call::BytesWrite, at, data.len() as u64, false)?;
        self.zeroed.forget(at, data.len() as u64);
        let source = data.as_ptr() as u64;
        self.in_chunks(
            Call::BytesWrite,
            data.len() as u64,
            Order::Ascending,
            |offset, n| {
                // SAFETY: as in `read`; the range is also not lent out, so no client holds
                // it; `data` has the range's length.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (source + offset) as *const u8,
                        (at + offset) as *mut u8,
                        n as usize,
                    )
                };
            },
        )?;
        Ok(())
    }

    fn fill(&mut self, at: u64, len: u64, byte: u8) -> wasmtime::Result<()> {
        self.check_bytes(Call::BytesFill, at, len, false)?;
        self.zeroed.forget(at, len);
        self.in_chunks(Call::BytesFill, len, Order::Ascending, |offset, n| {
            // SAFETY: as in `write`; the chunk lies inside the checked range.
            unsafe { std::ptr::write_bytes((at + offset) as *mut u8, byte, n as usize) };
        })?;
        if byte == 0 {
            self.zeroed.add(at, len);
        }
        Ok(())
    }

    fn copy(&mut self, dst: u64, src: u64, len: u64) -> wasmtime::Result<()> {
        self.check_bytes(Call::BytesCopy, src, len, true)?;
        self.check_bytes(Call::BytesCopy, dst, len, false)?;
        self.zeroed.forget(dst, len);
        let order = match dst > src && dst < src + len {
            true => Order::Descending,
            false => Order::Ascending,
        };
        self.in_chunks(Call::BytesCopy, len, order, |offset, n| {
            // SAFETY: both ranges were checked as in `read`/`write` and the chunk lies
            // inside both; `copy` allows overlap inside one chunk, and chunks are taken
            // from the end exactly when the destination lies above an overlapping source,
            // so no chunk overwrites source bytes a later chunk still reads.
            unsafe {
                std::ptr::copy(
                    (src + offset) as *const u8,
                    (dst + offset) as *mut u8,
                    n as usize,
                )
            };
        })?;
        Ok(())
    }

    fn read_u64(&mut self, at: u64) -> wasmtime::Result<u64> {
        self.on_time(Call::BytesRead)?;
        self.check_bytes(Call::BytesRead, at, 8, true)?;
        // SAFETY: as in `read`; an unaligned read is used because headers may sit anywhere.
        Ok(u64::from_le(unsafe {
            std::ptr::read_unaligned(at as *const u64)
        }))
    }

    fn write_u64(&mut self, at: u64, value: u64) -> wasmtime::Result<()> {
        self.on_time(Call::BytesWrite)?;
        self.check_bytes(Call::BytesWrite, at, 8, false)?;
        self.zeroed.forget(at, 8);
        // SAFETY: as in `write`.
        unsafe { std::ptr::write_unaligned(at as *mut u64, value.to_le()) };
        Ok(())
    }
}
