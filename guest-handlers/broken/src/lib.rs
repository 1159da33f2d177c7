//! `broken`: one component that breaks the policy contract on purpose, in exactly one way
//! chosen by the config key `fault`, so that the host's tests can check it catches each
//! kind of violation. Without a fault (or with `fault=none`) it behaves like `system`.
//!
//! See [`Fault`] for what each value does. Faults that misplace blocks only do so for
//! blocks from `malloc`; `calloc` and `realloc` stay correct unless the fault names them.
//! With any fault set, `malloc-many` and `free-many` are loops over this policy's own
//! `malloc` and `free`, so a fault shows whichever way the host asks, and `batch` is
//! false (except for `trap-malloc-many` and `trap-free-many`, which need the host to
//! batch).
//!
//! `fault=probe-sandbox` is no fault: `init` refuses with a report of what the sandbox
//! lets a guest see, which the host's tests read.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::hint::black_box;

use allocbox_policy::{Config, Info, Policy, bytes, export_policy, upstream};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    None,
    /// The named export panics (a wasm trap).
    TrapMalloc,
    TrapCalloc,
    TrapRealloc,
    TrapFree,
    TrapInit,
    TrapTrim,
    TrapMallocMany,
    TrapFreeMany,
    /// `malloc(13)` never returns; other sizes behave.
    LoopMalloc,
    /// `malloc` allocates guest memory, 1 MiB at a time, until the guest runs out.
    GrowMemory,
    /// `malloc` returns an address 64 KiB past the (16-rounded) end of its upstream block.
    Outside,
    /// `malloc` of up to 4096 bytes always returns the start of one upstream block.
    Overlap,
    /// `malloc` returns upstream + 8 (from a block of size + 16), declaring alignment 16.
    Misaligned,
    /// `free` frees upstream with size + 1.
    WrongSizeFree,
    /// `free` frees upstream twice.
    DoubleFree,
    /// `free` frees upstream `ptr + 4096`, which it never got.
    ForeignFree,
    /// `calloc` is upstream `malloc` filled with 0xAB.
    CallocDirty,
    /// `realloc` copies only half of `min(old, new)` bytes.
    ReallocLoses,
    /// `realloc` moves the data, frees the old block, and answers outside its memory.
    ReallocOutside,
    /// `free` also gives back upstream another block it has lent and not had back.
    FreeOther,
    /// `malloc(size)` returns an upstream block of `size - 1` bytes (for size > 1).
    OffByOne,
    /// `free` of 64 bytes or more does nothing.
    Leak,
    /// `malloc` writes 8 bytes into the previous block from `malloc`, still lent out.
    Scribble,
    /// Blocks come from one 4 KiB upstream chunk, lent from its start. The first
    /// `malloc` writes a word at the chunk's middle (allowed) and lends the chunk's
    /// start; the second writes the middle word again (allowed), then the first word of
    /// the block it lent: the host's record of what it just allowed must not cover a
    /// lent block beside it.
    ScribbleBeside,
    /// As `scribble-beside`, but the second `malloc` writes into the lent block first:
    /// what the host allowed before the block was lent must not outlive the lending.
    ScribbleStale,
    /// Blocks of up to 64 bytes are carved one after another from one 4 KiB upstream
    /// chunk, 64 bytes apart. `free` writes a word into the block given back (its own
    /// again: allowed), then the first word of the block after it, still lent: what the
    /// host cleared when the client gave the block back must not reach its neighbour.
    ScribbleAfterFree,
    /// `realloc` that does not grow gives the old block back upstream and answers it
    /// again: a use after free the host must refuse.
    ReallocFreeAnswerOld,
    /// `realloc` resizes the old block upstream and answers the old address, whatever
    /// upstream answered: a use after free when the block moved.
    ReallocUpstreamAnswerOld,
    /// `malloc` first asks upstream for `u32::MAX` one-byte blocks in one `malloc-many`.
    MallocManyHuge,
    /// `malloc` takes another 64 MiB upstream and keeps it for ever.
    Hoard,
    /// Freed blocks go on a free list that `malloc` of the same size reuses; `trim`
    /// gives the listed blocks back upstream but leaves them on the list, so the next
    /// such `malloc` answers memory the policy no longer holds (a stale free list).
    StaleAfterTrim,
    /// Like `misaligned`, but only from the 301st `malloc` of an instance on: a bug
    /// that short sequences never reach.
    MisalignedAfter300,
    /// `malloc` of 17..=24 bytes takes a 16-byte block: rounding down at a class
    /// boundary.
    ClassRounding,
    /// Freed blocks go on a free list; `calloc` reuses one of the same size without
    /// zeroing it (fresh memory is zero, recycled memory is not).
    RecycledCallocDirty,
    /// `realloc` that shrinks stays in place, and the block's later `free` gives back
    /// the new size upstream, not the size of the upstream block.
    ShrinkWrongSize,
    /// From the 201st `free` of an instance on, `free` keeps the block: a leak that
    /// short sequences never reach.
    LeakAfter200,
    /// `free` of a block whose size is a multiple of 16 puts it on the free list twice,
    /// so two later mallocs of that size get the same block.
    DuplicateSlot,
    /// From the 201st `malloc` of an instance on, `malloc` answers the previous
    /// `malloc`'s block again.
    OverlapAfter200,
    /// `realloc` that grows by at most 16 bytes stays in place, as if the block had
    /// slack after it.
    GrowIntoSlack,
    /// `malloc(4096)` takes a 4095-byte block: an off-by-one at the page size.
    PageOffByOne,
    /// `init` answers a 200-byte name, an empty name, version 2, alignment 24, an `err`.
    BadName,
    EmptyName,
    BadVersion,
    BadAlignment,
    InitErr,
}

const FAULTS: &[(&str, Fault)] = &[
    ("none", Fault::None),
    ("trap-malloc", Fault::TrapMalloc),
    ("trap-calloc", Fault::TrapCalloc),
    ("trap-realloc", Fault::TrapRealloc),
    ("trap-free", Fault::TrapFree),
    ("trap-init", Fault::TrapInit),
    ("trap-trim", Fault::TrapTrim),
    ("trap-malloc-many", Fault::TrapMallocMany),
    ("trap-free-many", Fault::TrapFreeMany),
    ("loop-malloc", Fault::LoopMalloc),
    ("grow-memory", Fault::GrowMemory),
    ("outside", Fault::Outside),
    ("overlap", Fault::Overlap),
    ("misaligned", Fault::Misaligned),
    ("wrong-size-free", Fault::WrongSizeFree),
    ("double-free", Fault::DoubleFree),
    ("foreign-free", Fault::ForeignFree),
    ("calloc-dirty", Fault::CallocDirty),
    ("realloc-loses", Fault::ReallocLoses),
    ("realloc-outside", Fault::ReallocOutside),
    ("free-other", Fault::FreeOther),
    ("off-by-one", Fault::OffByOne),
    ("leak", Fault::Leak),
    ("scribble", Fault::Scribble),
    ("scribble-beside", Fault::ScribbleBeside),
    ("scribble-stale", Fault::ScribbleStale),
    ("scribble-after-free", Fault::ScribbleAfterFree),
    ("realloc-free-answer-old", Fault::ReallocFreeAnswerOld),
    (
        "realloc-upstream-answer-old",
        Fault::ReallocUpstreamAnswerOld,
    ),
    ("malloc-many-huge", Fault::MallocManyHuge),
    ("hoard", Fault::Hoard),
    ("stale-after-trim", Fault::StaleAfterTrim),
    ("misaligned-after-300", Fault::MisalignedAfter300),
    ("class-rounding", Fault::ClassRounding),
    ("recycled-calloc-dirty", Fault::RecycledCallocDirty),
    ("shrink-wrong-size", Fault::ShrinkWrongSize),
    ("leak-after-200", Fault::LeakAfter200),
    ("duplicate-slot", Fault::DuplicateSlot),
    ("overlap-after-200", Fault::OverlapAfter200),
    ("grow-into-slack", Fault::GrowIntoSlack),
    ("page-off-by-one", Fault::PageOffByOne),
    ("bad-name", Fault::BadName),
    ("empty-name", Fault::EmptyName),
    ("bad-version", Fault::BadVersion),
    ("bad-alignment", Fault::BadAlignment),
    ("init-err", Fault::InitErr),
];

/// Not in [`FAULTS`]: it breaks no rule, and the list is what a bad `fault` is told.
const PROBE_SANDBOX: &str = "probe-sandbox";

/// The value of `fault`, or `None` for [`PROBE_SANDBOX`].
fn parse_fault(name: &str) -> Result<Option<Fault>, String> {
    if name == PROBE_SANDBOX {
        return Ok(None);
    }
    match FAULTS.iter().find(|(known, _)| *known == name) {
        Some(&(_, fault)) => Ok(Some(fault)),
        None => {
            let known: Vec<&str> = FAULTS.iter().map(|(known, _)| *known).collect();
            Err(format!("unknown fault; known: {}", known.join(", ")))
        }
    }
}

const OVERLAP_BLOCK: u64 = 4096;

/// Whatever state the faults need; each field serves the faults named.
struct Broken {
    fault: Fault,
    /// Blocks `malloc` returned moved off their upstream block: returned -> (upstream,
    /// size), so that `free` can still give back what it got, should the host ever let it.
    moved: RefCell<BTreeMap<u64, (u64, u64)>>,
    /// `overlap`: the one upstream block every small `malloc` returns.
    shared: Cell<u64>,
    /// `scribble`: the last block `malloc` returned, while it is still lent out.
    last: Cell<u64>,
    /// `free-other`: blocks returned and not yet freed, `(ptr, size)`, oldest first.
    lent: RefCell<Vec<(u64, u64)>>,
    /// `grow-memory`: keeps every hoarded buffer reachable.
    hoard: RefCell<Vec<Vec<u8>>>,
    /// `malloc` calls so far, for the faults that start after a count.
    mallocs: Cell<u64>,
    /// `free` calls so far, for `leak-after-200`.
    frees: Cell<u64>,
    /// The last block `malloc` answered, for `overlap-after-200`.
    previous: Cell<u64>,
    /// `stale-after-trim`'s free list: `(address, size)`.
    free_list: RefCell<Vec<(u64, u64)>>,
}

fn trap(what: &str) -> ! {
    panic!("broken: fault `trap-{what}`: trapping on purpose")
}

impl Broken {
    fn new(fault: Fault) -> Broken {
        Broken {
            fault,
            moved: RefCell::new(BTreeMap::new()),
            shared: Cell::new(0),
            last: Cell::new(0),
            lent: RefCell::new(Vec::new()),
            hoard: RefCell::new(Vec::new()),
            mallocs: Cell::new(0),
            frees: Cell::new(0),
            previous: Cell::new(0),
            free_list: RefCell::new(Vec::new()),
        }
    }

    /// A block of `size` bytes from the free list of the faults that keep one.
    fn listed(&self, size: u64) -> Option<u64> {
        let mut list = self.free_list.borrow_mut();
        let at = list.iter().position(|&(_, s)| s == size)?;
        Some(list.swap_remove(at).0)
    }

    fn moved(&self, ptr: u64, upstream_ptr: u64, upstream_size: u64) -> u64 {
        self.moved
            .borrow_mut()
            .insert(ptr, (upstream_ptr, upstream_size));
        ptr
    }

    /// Counts one more call in `counter` and says how many came before it.
    fn count(counter: &Cell<u64>) -> u64 {
        counter.replace(counter.get() + 1)
    }
}

impl Policy for Broken {
    fn init(config: &mut Config) -> Result<Self, String> {
        let fault = match config.get_with("fault", parse_fault)? {
            None => Fault::None,
            Some(Some(fault)) => fault,
            Some(None) => return Err(config.refuse_verbatim(probe_sandbox())),
        };
        if fault == Fault::InitErr {
            return Err(config.refuse_verbatim("refusing: test fault"));
        }
        Ok(Broken::new(fault))
    }

    // The faults of `init`'s answer live here, after the SDK has refused unknown keys,
    // as they came after the configuration was checked before the SDK.
    fn info(&self) -> Info {
        let info = Info::new().batch(matches!(
            self.fault,
            Fault::None | Fault::TrapMallocMany | Fault::TrapFreeMany
        ));
        match self.fault {
            Fault::TrapInit => trap("init"),
            Fault::BadName => info.name("x".repeat(200).leak()),
            Fault::EmptyName => info.name(""),
            Fault::BadVersion => info.version(2),
            Fault::BadAlignment => info.alignment(24),
            _ => info,
        }
    }

    fn malloc(&self, size: u64) -> u64 {
        match self.fault {
            Fault::TrapMalloc => trap("malloc"),
            Fault::LoopMalloc if size == 13 => {
                // `black_box` is opaque to the optimiser, so the loop cannot be removed.
                let mut spins = 0u64;
                loop {
                    spins = black_box(spins).wrapping_add(1);
                }
            }
            Fault::GrowMemory => loop {
                let buffer = black_box(vec![1u8; 1 << 20]);
                self.hoard.borrow_mut().push(buffer);
            },
            Fault::Outside => match upstream::malloc(size) {
                0 => 0,
                p => self.moved(p + size.next_multiple_of(16) + (64 << 10), p, size),
            },
            Fault::Overlap if size <= OVERLAP_BLOCK => {
                if self.shared.get() == 0 {
                    self.shared.set(upstream::malloc(OVERLAP_BLOCK));
                }
                self.shared.get()
            }
            Fault::Misaligned => match size.checked_add(16).map(upstream::malloc) {
                None | Some(0) => 0,
                Some(p) => self.moved(p + 8, p, size + 16),
            },
            Fault::MisalignedAfter300 if Broken::count(&self.mallocs) >= 300 => {
                match size.checked_add(16).map(upstream::malloc) {
                    None | Some(0) => 0,
                    Some(p) => self.moved(p + 8, p, size + 16),
                }
            }
            Fault::OffByOne if size > 1 => match upstream::malloc(size - 1) {
                0 => 0,
                p => self.moved(p, p, size - 1),
            },
            Fault::FreeOther => {
                let ptr = upstream::malloc(size);
                if ptr != 0 {
                    self.lent.borrow_mut().push((ptr, size));
                }
                ptr
            }
            Fault::Scribble => {
                let ptr = upstream::malloc(size);
                if ptr != 0 {
                    let previous = self.last.replace(ptr);
                    if previous != 0 {
                        bytes::write_u64(previous, 0x5C21_BB1E_5C21_BB1E);
                    }
                }
                ptr
            }
            Fault::ScribbleBeside | Fault::ScribbleStale => {
                let chunk = match self.last.get() {
                    0 => upstream::malloc(4096),
                    chunk => chunk,
                };
                if chunk == 0 || size > 2048 {
                    return 0;
                }
                let middle = chunk + 2048;
                if self.last.replace(chunk) == 0 {
                    bytes::write_u64(middle, 1);
                    return chunk;
                }
                if self.fault == Fault::ScribbleBeside {
                    bytes::write_u64(middle, 2);
                }
                bytes::write_u64(chunk, 0x5C21_BB1E_5C21_BB1E);
                0
            }
            Fault::ScribbleAfterFree => {
                let chunk = match self.last.get() {
                    0 => upstream::malloc(4096),
                    chunk => chunk,
                };
                self.last.set(chunk);
                let carved = Broken::count(&self.mallocs);
                if chunk == 0 || size > 64 || carved >= 4096 / 64 {
                    return 0;
                }
                chunk + carved * 64
            }
            Fault::MallocManyHuge => {
                black_box(upstream::malloc_many(1, u32::MAX));
                upstream::malloc(size)
            }
            Fault::Hoard => {
                let hoarded = upstream::malloc(64 << 20);
                black_box(hoarded);
                upstream::malloc(size)
            }
            Fault::StaleAfterTrim | Fault::RecycledCallocDirty | Fault::DuplicateSlot => {
                self.listed(size).unwrap_or_else(|| upstream::malloc(size))
            }
            Fault::ClassRounding if (17..=24).contains(&size) => upstream::malloc(16),
            Fault::PageOffByOne if size == 4096 => upstream::malloc(4095),
            Fault::OverlapAfter200 => {
                let count = Broken::count(&self.mallocs);
                let previous = self.previous.get();
                if count >= 200 && previous != 0 {
                    return previous;
                }
                let ptr = upstream::malloc(size);
                self.previous.set(ptr);
                ptr
            }
            _ => upstream::malloc(size),
        }
    }

    fn calloc(&self, nelem: u64, elsize: u64) -> u64 {
        match self.fault {
            Fault::TrapCalloc => trap("calloc"),
            Fault::RecycledCallocDirty => match nelem.checked_mul(elsize) {
                None => 0,
                Some(size) => self
                    .listed(size)
                    .unwrap_or_else(|| upstream::calloc(nelem, elsize)),
            },
            Fault::CallocDirty => {
                let Some(size) = nelem.checked_mul(elsize) else {
                    return 0;
                };
                let ptr = upstream::malloc(size);
                if ptr != 0 {
                    bytes::fill(ptr, size, 0xAB);
                }
                ptr
            }
            _ => upstream::calloc(nelem, elsize),
        }
    }

    fn realloc(&self, ptr: u64, old_size: u64, new_size: u64) -> u64 {
        match self.fault {
            Fault::TrapRealloc => trap("realloc"),
            Fault::ReallocLoses if ptr != 0 => {
                let new = upstream::malloc(new_size);
                if new != 0 {
                    bytes::copy(new, ptr, old_size.min(new_size) / 2);
                    upstream::free(ptr, old_size);
                }
                new
            }
            // Moves the data, gives the old block back, then answers with an address
            // past the new block: the host must still hold the client's old bytes.
            Fault::ReallocOutside if ptr != 0 => {
                let new = upstream::malloc(new_size);
                if new != 0 {
                    bytes::copy(new, ptr, old_size.min(new_size));
                    upstream::free(ptr, old_size);
                }
                new + new_size.next_multiple_of(16) + 65536
            }
            Fault::ReallocFreeAnswerOld if ptr != 0 && new_size <= old_size => {
                upstream::free(ptr, old_size);
                ptr
            }
            Fault::ShrinkWrongSize if ptr != 0 && new_size < old_size => ptr,
            Fault::GrowIntoSlack
                if ptr != 0 && new_size > old_size && new_size - old_size <= 16 =>
            {
                ptr
            }
            Fault::ReallocUpstreamAnswerOld if ptr != 0 => {
                upstream::realloc(ptr, old_size, new_size);
                ptr
            }
            Fault::Scribble => {
                let new = upstream::realloc(ptr, old_size, new_size);
                if new != 0 && ptr != 0 && self.last.get() == ptr {
                    self.last.set(new);
                }
                new
            }
            _ => upstream::realloc(ptr, old_size, new_size),
        }
    }

    fn free(&self, ptr: u64, size: u64) {
        let moved = self.moved.borrow_mut().remove(&ptr);
        if let Some((up, up_size)) = moved {
            return upstream::free(up, up_size);
        }
        match self.fault {
            Fault::TrapFree => trap("free"),
            Fault::WrongSizeFree => upstream::free(ptr, size + 1),
            Fault::DoubleFree => {
                upstream::free(ptr, size);
                upstream::free(ptr, size);
            }
            Fault::ForeignFree => upstream::free(ptr + 4096, size),
            Fault::ScribbleAfterFree => {
                bytes::write_u64(ptr, 0);
                bytes::write_u64(ptr + 64, 0x5C21_BB1E_5C21_BB1E);
            }
            Fault::Leak if size >= 64 => {}
            Fault::StaleAfterTrim | Fault::RecycledCallocDirty => {
                self.free_list.borrow_mut().push((ptr, size));
            }
            Fault::DuplicateSlot => {
                let mut list = self.free_list.borrow_mut();
                list.push((ptr, size));
                if size.is_multiple_of(16) {
                    list.push((ptr, size));
                }
            }
            Fault::LeakAfter200 if Broken::count(&self.frees) >= 200 => {}
            Fault::FreeOther => {
                let other = {
                    let mut lent = self.lent.borrow_mut();
                    lent.retain(|&(p, _)| p != ptr);
                    lent.first().copied()
                };
                upstream::free(ptr, size);
                // Gives back memory the client still holds: the host must refuse.
                if let Some((p, s)) = other {
                    upstream::free(p, s);
                }
            }
            // The shared block stays with us until `trim`.
            Fault::Overlap if ptr == self.shared.get() => {}
            Fault::Scribble => {
                if self.last.get() == ptr {
                    self.last.set(0);
                }
                upstream::free(ptr, size);
            }
            _ => upstream::free(ptr, size),
        }
    }

    fn malloc_many(&self, size: u64, count: u32) -> Vec<u64> {
        match self.fault {
            Fault::TrapMallocMany => trap("malloc-many"),
            Fault::None | Fault::TrapFreeMany => upstream::malloc_many(size, count),
            _ => (0..count)
                .map(|_| self.malloc(size))
                .take_while(|&p| p != 0)
                .collect(),
        }
    }

    fn free_many(&self, ptrs: Vec<u64>, size: u64) {
        match self.fault {
            Fault::TrapFreeMany => trap("free-many"),
            Fault::None | Fault::TrapMallocMany => upstream::free_many(&ptrs, size),
            _ => ptrs.into_iter().for_each(|p| self.free(p, size)),
        }
    }

    fn trim(&self) {
        match self.fault {
            Fault::TrapTrim => trap("trim"),
            Fault::StaleAfterTrim => {
                // The bug: the blocks go back upstream and stay on the list.
                for (ptr, size) in self.free_list.borrow().clone() {
                    upstream::free(ptr, size);
                }
            }
            Fault::RecycledCallocDirty | Fault::DuplicateSlot => {
                for (ptr, size) in self.free_list.take() {
                    upstream::free(ptr, size);
                }
            }
            Fault::Overlap => {
                let shared = self.shared.replace(0);
                if shared != 0 {
                    upstream::free(shared, OVERLAP_BLOCK);
                }
            }
            _ => {}
        }
    }
}

/// What the sandbox lets a guest see, as the text of a refused `init` (the host's tests
/// read it): the environment, and whether the clocks move.
fn probe_sandbox() -> String {
    let env: Vec<String> = std::env::vars().map(|(k, v)| format!("{k}={v}")).collect();
    let start = std::time::Instant::now();
    let mut spin = 0u64;
    while start.elapsed().is_zero() && spin < 1000 {
        spin = black_box(spin + 1);
    }
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "probe: env=[{}] monotonic={} wall={wall}",
        env.join(","),
        if start.elapsed().is_zero() {
            "frozen"
        } else {
            "moving"
        }
    )
}

export_policy!(Broken, name = "broken");
