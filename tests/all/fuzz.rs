//! The random client both host fuzzers drive their handlers with (`chaos`: a seeded
//! hostile policy; `smith`: generated policies), and the invariants they assert after
//! every operation:
//!
//! - the host does not panic, and no host error blames the (correct) client;
//! - every call returns (a call still running after its links' limits and half a minute
//!   is taken for a hang: a hang detector, not a speed test, since a busy machine may
//!   stall any call for a while);
//! - a client's bytes change only by the client: every live block keeps its pattern, and
//!   a block a realloc answers holds the old block's bytes;
//! - `Handler::audit` holds: every lent block lies in memory its link holds, and no client
//!   block lies in memory the host released;
//! - what the chain holds from the host (its blocks and regions, by the host's own
//!   accounting) stays within its budgets: the most its top policy ever lent, and for
//!   each link its overhead budget and the largest request's allowance;
//! - once the client has freed everything, a stopped chain holds nothing from the host.
//!
//! A quarter of the mallocs and frees run on another client thread, so blocks cross
//! thread caches both ways: taken on one thread, freed on another; another quarter of
//! the frees say no size, as Numba's runtime frees.

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use allocbox::{Error, Handler, LinkStats, Stats};

use super::support::*;

/// Past its links' limits and this, a call is taken for a hang.
const HANG: Duration = Duration::from_secs(30);

/// The overhead budget both fuzzers give each policy.
pub const OVERHEAD: u64 = 8 << 20;

/// More than the largest request the random client makes (1 MiB and a little) or a
/// magazine refill asks for: the allowance a request adds to a link's budget.
const LARGEST_DEMAND: u64 = 4 << 20;

/// The client's side: splitmix64, independent of the policy's stream.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn size(&mut self) -> usize {
        (match self.below(20) {
            0 => 0,
            1..=11 => 1 + self.below(256),
            12..=17 => 1 + self.below(8192),
            18 => 65536 + self.below(4) * 16,
            _ => 1 + self.below(1 << 20),
        }) as usize
    }
}

struct Live {
    ptr: NonNull<u8>,
    size: usize,
    byte: u8,
}

/// Drive `h` with `ops` random client operations, then free everything and trim,
/// checking every invariant on the way (see the module doc). Each call may take
/// `call_time` for each of `links` links. `Ok` names how the chain ended: `alive`, or
/// the kind of failure that stopped it; `Err` says which invariant broke and where.
pub fn drive(
    h: &Handler,
    rng: &mut Rng,
    ops: usize,
    call_time: Duration,
    links: u32,
) -> Result<String, String> {
    let bound = call_time * links + HANG;
    // A GPU program's memory is only allocated and freed (the host never zeroes or
    // copies it); the client still fills and checks its blocks, as the GPU's kernels
    // would, on the stand-in GPU's host memory.
    let on_host = h.placement() == allocbox::gpu::Placement::Host;
    let mut live: Vec<Live> = Vec::new();
    for step in 0..ops {
        let byte = (step % 250) as u8 + 1;
        let start = Instant::now();
        let what = match rng.below(10) {
            0..=3 => {
                let size = rng.size();
                let p = match rng.below(4) {
                    0 => from_address(elsewhere(|| to_address(h.malloc(size)))),
                    _ => h.malloc(size),
                };
                let p = answer(p, "malloc")?;
                adopt(&mut live, p, size.max(1), byte);
                "malloc"
            }
            4 if on_host => {
                let (n, e) = (1 + rng.below(8) as usize, rng.size().min(8192));
                let p = answer(h.calloc(n, e), "calloc")?;
                adopt(&mut live, p, (n * e).max(1), byte);
                "calloc"
            }
            5..=6 if on_host && !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                let size = rng.size();
                // On none or a failure the old block is still live and unchanged.
                if let Some(q) = answer(h.realloc(Some(live[i].ptr), size), "realloc")? {
                    let old = live.swap_remove(i);
                    if !holds(q, old.size.min(size.max(1)), old.byte) {
                        return Err(format!("step {step}: realloc lost the client's bytes"));
                    }
                    adopt(&mut live, Some(q), size.max(1), byte);
                }
                "realloc"
            }
            7 if rng.below(8) == 0 => {
                let _ = h.trim();
                "trim"
            }
            _ if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                let block = live.swap_remove(i);
                // A policy failing inside free is its own fault; the block is given up.
                let freed = match rng.below(4) {
                    0 => {
                        let addr = block.ptr.as_ptr() as usize;
                        elsewhere(|| h.free(NonNull::new(addr as *mut u8), block.size))
                    }
                    // A client that says no size (Numba's runtime): the ledger's.
                    1 => match h.free_unsized_to_magazine(block.ptr) {
                        true => Ok(()),
                        false => h.free_unsized(block.ptr).map(drop),
                    },
                    _ => h.free(Some(block.ptr), block.size),
                };
                if let Err(Error::Client(e)) = freed {
                    return Err(format!("free blamed the client: {e}"));
                }
                "free"
            }
            _ => "nothing",
        };
        let took = start.elapsed();
        if took > bound {
            return Err(format!(
                "step {step} ({what}) took {took:?}, bound {bound:?}"
            ));
        }
        check(h, &live, links).map_err(|e| format!("after step {step} ({what}): {e}"))?;
    }
    for block in live.drain(..) {
        if let Err(Error::Client(e)) = h.free(Some(block.ptr), block.size) {
            return Err(format!("final free blamed the client: {e}"));
        }
    }
    let _ = h.trim();
    h.audit().map_err(|e| e.to_string())?;
    if h.failure().is_some() && h.held_from_host().unwrap() != (0, 0) {
        return Err(format!(
            "a stopped chain still holds {:?} from the host after its client let go: {:#?}",
            h.held_from_host().unwrap(),
            h.link_stats().unwrap()
        ));
    }
    Ok(h.failure().map_or("alive".into(), |e| e.kind().into()))
}

/// Run `f` on a client thread of its own.
fn elsewhere<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    std::thread::scope(|s| s.spawn(f).join().expect("the other client thread panicked"))
}

/// Pointers are not `Send`: blocks cross threads as addresses.
fn to_address(r: Result<Option<NonNull<u8>>, Error>) -> Result<usize, Error> {
    r.map(|p| p.map_or(0, |p| p.as_ptr() as usize))
}

fn from_address(r: Result<usize, Error>) -> Result<Option<NonNull<u8>>, Error> {
    r.map(|a| NonNull::new(a as *mut u8))
}

/// A request's answer: a block, none, or a policy's failure (fine), never the client's.
fn answer(
    result: Result<Option<NonNull<u8>>, Error>,
    call: &str,
) -> Result<Option<NonNull<u8>>, String> {
    match result {
        Ok(p) => Ok(p),
        Err(Error::Client(e)) => Err(format!("{call} blamed the client: {e}")),
        Err(_) => Ok(None),
    }
}

fn adopt(live: &mut Vec<Live>, p: Option<NonNull<u8>>, size: usize, byte: u8) {
    if let Some(ptr) = p {
        fill(ptr, size, byte);
        live.push(Live { ptr, size, byte });
    }
}

fn check(h: &Handler, live: &[Live], links: u32) -> Result<(), String> {
    h.audit().map_err(|e| e.to_string())?;
    // Counters are read once a step: a healthy chain's delivers events and asks each
    // policy for its own (a guest call each); a stopped chain's calls no guest.
    let counters = match h.failure() {
        None => read_counters(h)?,
        Some(_) => None,
    };
    let top = match &counters {
        Some((_, links)) => links[0].clone(),
        None => h.link_stats().map_err(|e| e.to_string())?.remove(0),
    };
    within_budgets(h, &top, links)?;
    if let Some((stats, _)) = &counters {
        counters_add_up(stats, &top, live)?;
    }
    for b in live {
        if !holds(b.ptr, b.size, b.byte) {
            return Err(format!(
                "the client's block {:p} ({} bytes) changed under it",
                b.ptr, b.size
            ));
        }
    }
    Ok(())
}

/// The handler's counters and each policy's, or `None` when reading them stopped the
/// chain: reading delivers an observing policy's events and asks it for its own
/// counters, and a policy may fail there. Only the client may never be blamed.
fn read_counters(h: &Handler) -> Result<Option<(Stats, Vec<LinkStats>)>, String> {
    match h.stats().and_then(|stats| Ok((stats, h.link_stats()?))) {
        Err(Error::Client(e)) => Err(format!("reading counters blamed the client: {e}")),
        Err(_) => Ok(None),
        Ok(_) if h.failure().is_some() => Ok(None),
        Ok(read) => Ok(Some(read)),
    }
}

/// Every upstream request of a link is refused past what it lends, what the request asks
/// and its overhead budget, and a request's allowance ends with its answer: so what the
/// chain holds from the host never passes the most its top policy lent plus, per link,
/// the budget and the largest request.
fn within_budgets(h: &Handler, top: &LinkStats, links: u32) -> Result<(), String> {
    let (_, held) = h.held_from_host().map_err(|e| e.to_string())?;
    let bound = top.peak_bytes + u64::from(links) * (OVERHEAD + LARGEST_DEMAND);
    if held > bound {
        return Err(format!(
            "the chain holds {held} bytes from the host, past its budgets' {bound}"
        ));
    }
    Ok(())
}

/// While the chain is healthy, the counters agree with the client and with each other:
/// the client's blocks and bytes, and the top policy's lent blocks, which are the
/// client's and those waiting in the host's magazines.
fn counters_add_up(stats: &Stats, top: &LinkStats, live: &[Live]) -> Result<(), String> {
    let bytes: u64 = live.iter().map(|b| b.size as u64).sum();
    if (stats.live_blocks, stats.live_bytes) != (live.len() as u64, bytes) {
        return Err(format!(
            "stats count {} blocks, {} bytes live; the client holds {}, {bytes}",
            stats.live_blocks,
            stats.live_bytes,
            live.len()
        ));
    }
    if top.live_blocks != stats.live_blocks + stats.cached_blocks {
        return Err(format!(
            "`{}` has {} blocks lent, but the client holds {} and the magazines {}",
            top.name, top.live_blocks, stats.live_blocks, stats.cached_blocks
        ));
    }
    Ok(())
}
