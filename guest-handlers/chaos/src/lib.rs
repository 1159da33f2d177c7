//! `chaos`: a hostile policy for fuzzing the host. Every decision it makes — which
//! address to answer, which upstream and `bytes` calls to make first, when to trap, loop
//! or grow its memory — comes from a pseudo-random stream seeded by the config key
//! `seed`, so a stream that breaks the host replays exactly. `hostility` (per mille,
//! default 150) is the chance that a decision is hostile rather than honest; honest
//! decisions keep the policy alive long enough to reach deep states.
//!
//! It never checks what the host lets it do: the host must survive, and its client lose
//! nothing, whatever this policy tries. The host's tests drive it (`tests/all/chaos.rs`).

use std::cell::RefCell;
use std::hint::black_box;

use allocbox_policy::{Config, Info, Policy, bytes, export_policy, upstream};

/// Blocks remembered in each list; older ones are forgotten (bounds the guest's memory).
const REMEMBERED: usize = 64;

#[derive(Default)]
struct Chaos {
    state: u64,
    hostility: u64,
    /// Upstream blocks this policy holds (as far as it knows), `(addr, size)`.
    held: Vec<(u64, u64)>,
    /// Blocks it answered: `(answer, size, upstream block, upstream size)`.
    lent: Vec<(u64, u64, u64, u64)>,
    /// Upstream blocks it gave back.
    freed: Vec<(u64, u64)>,
    /// The block being resized by `realloc`, while it is.
    transit: Option<(u64, u64)>,
    /// Guest memory kept to grow towards the cap.
    hoard: Vec<Vec<u8>>,
}

fn remember<T>(list: &mut Vec<T>, item: T) {
    if list.len() >= REMEMBERED {
        list.remove(0);
    }
    list.push(item);
}

impl Chaos {
    /// splitmix64: small, fast, and every seed gives its own stream.
    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    fn hostile(&mut self) -> bool {
        self.below(1000) < self.hostility
    }

    fn pick<T: Copy>(&mut self, list: &[T]) -> Option<T> {
        if list.is_empty() {
            None
        } else {
            Some(list[self.below(list.len() as u64) as usize])
        }
    }

    /// A size to hand the host: right, slightly wrong, or absurd.
    fn size_near(&mut self, size: u64) -> u64 {
        match self.below(6) {
            0 => size.wrapping_add(1),
            1 => size.saturating_sub(1),
            2 => u64::MAX - self.below(4),
            3 => self.below(1 << 20),
            _ => size,
        }
    }

    /// An address to hand the host: one it knows about, near one, or wild.
    fn address(&mut self) -> u64 {
        let known = [
            self.pick(&self.held.clone()).map(|b| b.0),
            self.pick(&self.lent.clone()).map(|b| b.0),
            self.pick(&self.freed.clone()).map(|b| b.0),
            self.transit.map(|b| b.0),
        ];
        let base = known[self.below(4) as usize].unwrap_or(0);
        match self.below(7) {
            0 => self.next(),
            1 => u64::MAX - self.below(64),
            2 => 0,
            3 => base.wrapping_add(16 * self.below(8)),
            4 => base.wrapping_sub(16),
            _ => base,
        }
    }

    fn honest_malloc(&mut self, size: u64) -> u64 {
        let p = upstream::malloc(size);
        if p != 0 {
            remember(&mut self.held, (p, size));
            remember(&mut self.lent, (p, size, p, size));
        }
        p
    }

    /// Give back the upstream block under a lent answer, the honest way.
    fn honest_free(&mut self, ptr: u64) {
        if let Some(i) = self.lent.iter().position(|b| b.0 == ptr) {
            let (_, _, up, up_size) = self.lent.remove(i);
            self.held.retain(|b| b.0 != up);
            remember(&mut self.freed, (up, up_size));
            upstream::free(up, up_size);
        }
    }

    /// Up to two things the host did not ask for, before answering.
    fn mischief(&mut self) {
        for _ in 0..self.below(3) {
            if !self.hostile() {
                continue;
            }
            match self.below(16) {
                0 => {
                    if let Some((p, s)) = self.pick(&self.held.clone()) {
                        let size = self.size_near(s);
                        upstream::free(p, size);
                    }
                }
                1 => {
                    let (p, s) = self.pick(&self.freed.clone()).unwrap_or((0, 16));
                    upstream::free(p, s);
                }
                2 => {
                    if let Some((p, s)) = self.transit {
                        let up = self.lent.iter().find(|b| b.0 == p).map(|b| (b.2, b.3));
                        let (up, up_size) = up.unwrap_or((p, s));
                        if self.below(2) == 0 {
                            upstream::free(up, up_size);
                        } else {
                            let new = self.below(8192) + 1;
                            upstream::realloc(up, up_size, new);
                        }
                    }
                }
                3 => {
                    if let Some((p, s)) = self.pick(&self.held.clone()) {
                        let new = self.size_near(s);
                        let q = upstream::realloc(p, s, new);
                        if q != 0 {
                            self.held.retain(|b| b.0 != p);
                            remember(&mut self.held, (q, new));
                        }
                    }
                }
                4 => {
                    let count = match self.below(4) {
                        0 => u32::MAX,
                        1 => 1 << 20,
                        2 => 5000,
                        _ => self.below(64) as u32,
                    };
                    let size = self.below(4096) + 1;
                    for p in upstream::malloc_many(size, count) {
                        remember(&mut self.held, (p, size));
                    }
                }
                5 => {
                    let ptrs: Vec<u64> = (0..self.below(6)).map(|_| self.address()).collect();
                    let size = self.below(4096) + 1;
                    upstream::free_many(&ptrs, size);
                }
                6 => {
                    let at = self.address();
                    let len = self.below(256) as u32;
                    black_box(bytes::read(at, len));
                }
                7 => {
                    let at = self.address();
                    let len = self.below(256) as usize;
                    bytes::write(at, &vec![0xC4; len]);
                }
                8 => {
                    let at = self.address();
                    let len = if self.below(8) == 0 {
                        u64::MAX
                    } else {
                        self.below(4096)
                    };
                    bytes::fill(at, len, 0xC4);
                }
                9 => {
                    let (dst, src) = (self.address(), self.address());
                    bytes::copy(dst, src, self.below(4096));
                }
                10 => {
                    let at = self.address();
                    black_box(bytes::read_u64(at));
                    bytes::write_u64(at, 0xC4C4_C4C4_C4C4_C4C4);
                }
                11 => {
                    // Take memory and keep it (within or past the overhead budget).
                    let size = 1 << self.below(28);
                    let p = upstream::malloc(size);
                    if p != 0 {
                        remember(&mut self.held, (p, size));
                    }
                }
                12 => {
                    black_box(upstream::calloc(u64::MAX / 2, 3));
                    black_box(bytes::read(self.address(), u32::MAX));
                }
                13 if self.below(40) == 0 => panic!("chaos: trapping on purpose"),
                14 if self.below(80) == 0 => {
                    let mut spins = 0u64;
                    loop {
                        spins = black_box(spins).wrapping_add(1);
                    }
                }
                15 if self.below(40) == 0 => loop {
                    self.hoard.push(black_box(vec![1u8; 1 << 20]));
                },
                _ => {}
            }
        }
    }

    /// A block of `size` bytes: honest, or one of the answers the host must refuse.
    fn answer(&mut self, size: u64) -> u64 {
        if !self.hostile() {
            return self.honest_malloc(size);
        }
        match self.below(8) {
            0 => self
                .pick(&self.held.clone())
                .map_or(0, |(p, s)| p + 16 * self.below(s / 16 + 2)),
            1 => self.pick(&self.lent.clone()).map_or(0, |b| b.0),
            2 => self.pick(&self.freed.clone()).map_or(0, |b| b.0),
            3 => self.transit.map_or(0, |b| b.0),
            4 => self.next() & !15,
            5 => (u64::MAX - self.below(1 << 12)) & !15,
            6 => 0,
            _ => self.honest_malloc(size).wrapping_add(8),
        }
    }

    fn realloc(&mut self, ptr: u64, old: u64, new: u64) -> u64 {
        if ptr == 0 {
            return self.answer(new);
        }
        let up = self.lent.iter().find(|b| b.0 == ptr).map(|b| (b.2, b.3));
        let (up, up_size) = up.unwrap_or((ptr, old));
        if self.hostile() {
            match self.below(4) {
                0 => {
                    upstream::free(up, up_size);
                    return ptr;
                }
                1 => {
                    upstream::realloc(up, up_size, new);
                    return ptr;
                }
                2 => {
                    let q = upstream::realloc(up, up_size, new);
                    return if self.below(2) == 0 { q } else { up };
                }
                _ => return self.answer(new),
            }
        }
        let q = upstream::malloc(new);
        if q == 0 {
            return 0;
        }
        bytes::copy(q, ptr, old.min(new));
        self.honest_free(ptr);
        remember(&mut self.held, (q, new));
        remember(&mut self.lent, (q, new, q, new));
        q
    }
}

/// The policy: the stream and what it remembers behind a `RefCell`, since the SDK lends
/// it as `&self`. Upstream cannot call back into us, so holding the borrow across its
/// calls is fine; `free_many` calls `free` only with no borrow held.
struct ChaosPolicy {
    chaos: RefCell<Chaos>,
    /// Drawn from the stream in `init`, so a seed replays the host's choice too.
    batch: bool,
}

impl ChaosPolicy {
    fn with<R>(&self, f: impl FnOnce(&mut Chaos) -> R) -> R {
        f(&mut self.chaos.borrow_mut())
    }
}

impl Policy for ChaosPolicy {
    fn init(config: &mut Config) -> Result<Self, String> {
        let seed = config.get_or("seed", 0u64)?;
        let hostility = config.get_or("hostility", 150u64)?;
        if hostility > 1000 {
            return Err(format!("`hostility` is per mille, got {hostility}"));
        }
        let mut chaos = Chaos {
            state: seed,
            hostility,
            ..Chaos::default()
        };
        let batch = chaos.below(2) == 0;
        Ok(ChaosPolicy {
            chaos: RefCell::new(chaos),
            batch,
        })
    }

    fn info(&self) -> Info {
        Info::new().batch(self.batch)
    }

    fn malloc(&self, size: u64) -> u64 {
        self.with(|c| {
            c.mischief();
            c.answer(size)
        })
    }

    fn calloc(&self, nelem: u64, elsize: u64) -> u64 {
        self.with(|c| {
            c.mischief();
            if c.hostile() {
                // Not zeroed, or an overflowing product wrapped.
                return c.answer(nelem.wrapping_mul(elsize));
            }
            let p = upstream::calloc(nelem, elsize);
            if p != 0 {
                let size = nelem * elsize;
                remember(&mut c.held, (p, size));
                remember(&mut c.lent, (p, size, p, size));
            }
            p
        })
    }

    fn realloc(&self, ptr: u64, old_size: u64, new_size: u64) -> u64 {
        self.with(|c| {
            c.transit = (ptr != 0).then_some((ptr, old_size));
            c.mischief();
            let q = c.realloc(ptr, old_size, new_size);
            c.transit = None;
            q
        })
    }

    fn free(&self, ptr: u64, size: u64) {
        self.with(|c| {
            c.mischief();
            if c.hostile() && c.below(2) == 0 {
                // Keep it, or give back something else as well.
                if let Some((p, s)) = c.pick(&c.held.clone()) {
                    upstream::free(p, s);
                }
                return;
            }
            if c.lent.iter().any(|b| b.0 == ptr) {
                c.honest_free(ptr);
            } else {
                upstream::free(ptr, size);
            }
        })
    }

    fn malloc_many(&self, size: u64, count: u32) -> Vec<u64> {
        self.with(|c| {
            c.mischief();
            let extra = u64::from(c.hostile());
            let mut blocks: Vec<u64> = (0..u64::from(count) + extra)
                .map(|_| c.answer(size))
                .take_while(|&p| p != 0)
                .collect();
            if c.hostile() && !blocks.is_empty() {
                let again = blocks[0];
                blocks.push(again);
            }
            blocks
        })
    }

    // `free_many` is the default: `free` for each block, each with its own mischief.

    fn trim(&self) {
        self.with(|c| {
            c.mischief();
            let lent: Vec<u64> = c.lent.iter().map(|b| b.2).collect();
            let held = c.held.clone();
            let idle: Vec<(u64, u64)> = held
                .into_iter()
                .filter(|b| c.hostile() || !lent.contains(&b.0))
                .collect();
            for (p, s) in idle {
                c.held.retain(|b| b.0 != p);
                upstream::free(p, s);
            }
        })
    }
}

export_policy!(ChaosPolicy, name = "chaos");
