//! Recording a handler's calls as a trace: any handler wrapped so that a watcher sees
//! each call it served, and the watcher that writes the trace format.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use allocbox_ledger::platform::fork;

use super::{EventOp, Site, UNKNOWN_ID};
use crate::error::Error;
use crate::memhandler::{MemHandler, Stats};
use crate::nep49::SharedHandler;

/// What a [`Watched`] handler tells its watcher after each call it forwarded and that
/// did not fail: the operation, the block before and after (`None` for none), and the
/// size (a free's: what the client passed). A `realloc` answered "none" is not told.
pub trait Watcher: Send + Sync {
    fn served(&self, op: EventOp, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize);
}

impl<W: Watcher + ?Sized> Watcher for &W {
    fn served(&self, op: EventOp, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize) {
        (**self).served(op, old, new, size);
    }
}

/// `handler`, with `watcher` told about every call it serves: a trace being recorded
/// ([`Recorder`]) or an event hook ([`crate::WasmHook`]).
#[derive(Debug)]
pub struct Watched<H, W> {
    pub handler: H,
    pub watcher: W,
}

impl<H, W> MemHandler for Watched<H, W>
where
    H: std::ops::Deref<Target: MemHandler> + Send + Sync + fmt::Debug,
    W: Watcher + fmt::Debug,
{
    fn name(&self) -> &str {
        self.handler.name()
    }
    fn version(&self) -> u8 {
        self.handler.version()
    }
    fn alignment(&self) -> u64 {
        self.handler.alignment()
    }
    fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.handler.malloc(size)?;
        self.watcher.served(EventOp::Malloc, None, p, size);
        Ok(p)
    }
    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.handler.calloc(nelem, elsize)?;
        let size = nelem.saturating_mul(elsize);
        self.watcher.served(EventOp::Calloc, None, p, size);
        Ok(p)
    }
    fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.handler.realloc(ptr, new_size)?;
        if p.is_some() {
            self.watcher.served(EventOp::Realloc, ptr, p, new_size);
        }
        Ok(p)
    }
    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        self.handler.free(ptr, size)?;
        self.watcher.served(EventOp::Free, ptr, None, size);
        Ok(())
    }
    fn free_unsized(&self, ptr: NonNull<u8>) -> Result<usize, Error> {
        let size = self.handler.free_unsized(ptr)?;
        self.watcher.served(EventOp::Free, Some(ptr), None, size);
        Ok(size)
    }
    fn stats(&self) -> Result<Stats, Error> {
        self.handler.stats()
    }
    fn usable(&self) -> Result<(), Error> {
        self.handler.usable()
    }
}

/// A handler that writes every call it forwards to `handler` as a trace.
pub type Recorder = Watched<SharedHandler, TraceWriter>;

/// Where the client was when it asked for a block, asked of the embedder for each
/// allocation a [`Recorder`] writes with sites (the NumPy bridge: the innermost line of
/// the program's own Python code). Called outside the recorder's lock.
pub type SiteOf = Box<dyn Fn() -> Option<Site> + Send + Sync>;

/// What a [`Recorder`] writes beside each event.
#[derive(Default)]
pub struct RecordOptions {
    /// Nanoseconds since the recording started, as `t=N`.
    pub time: bool,
    /// The site of each allocation, as `s=N`, each site named once in a `#@site`
    /// record before its first event.
    pub sites: Option<SiteOf>,
}

/// The trace a [`Recorder`] writes.
pub struct TraceWriter {
    state: Arc<Mutex<RecorderState>>,
    /// Its part in every fork, while it lives.
    fork: Arc<ForkPart>,
    /// Unique among the recorders of the process (for [`THREAD_NUMBER`]).
    serial: u64,
    /// [`coarse_now`] when the recording started.
    started: Option<u64>,
    sites: Option<SiteOf>,
    /// The file written, for the file a forked child writes beside it.
    path: Option<std::path::PathBuf>,
}

struct RecorderState {
    out: Box<dyn Write + Send>,
    /// The id of each live block, by address: looked up on every event.
    ids: HashMap<usize, u64, foldhash::fast::RandomState>,
    line: Vec<u8>,
    next_id: u64,
    threads: HashMap<std::thread::ThreadId, u32>,
    error: Option<std::io::Error>,
    /// Ended by [`Recorder::finish`]: later calls are not written.
    ended: bool,
    /// The number each site was given in its `#@site` record, for the sites seen
    /// last (at most [`MAX_SITES_KEPT`]).
    site_numbers: HashMap<Site, u32>,
    /// `#@site` records written: a site's number is never used for another.
    sites_named: u32,
    /// [`fork::generation`] of the process this recording writes for.
    generation: u64,
}

/// A recording's part in a fork: its lock is taken before the fork (within
/// [`FORK_PATIENCE`]) and let go after it, so that the child never finds it held by a
/// thread it does not have. (The standard library's lock: letting it go in the child
/// wakes no waiter through tables other threads may have held, as parking_lot's does.)
struct ForkPart {
    state: Arc<Mutex<RecorderState>>,
    /// In a child forked while another thread kept the lock past the patience: the
    /// lock is that thread's forever, so the child records nothing.
    abandoned: AtomicBool,
}

/// How long a fork waits for a thread writing an event (to a full pipe, say).
const FORK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);

/// What a recording's [`ForkPart`] holds across the fork. The guard is declared first,
/// so it is dropped before the part that owns its lock.
struct ForkHeld {
    lock: Option<MutexGuard<'static, RecorderState>>,
    part: Arc<ForkPart>,
}

impl fork::Forkable for ForkPart {
    fn before_fork(self: Arc<Self>) -> Box<dyn fork::AfterFork> {
        let give_up = std::time::Instant::now() + FORK_PATIENCE;
        let lock = loop {
            match self.state.try_lock() {
                Ok(guard) => break Some(guard),
                Err(std::sync::TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < give_up => {
                    std::thread::yield_now();
                }
                Err(std::sync::TryLockError::WouldBlock) => break None,
            }
        };
        // SAFETY: the guard borrows the mutex inside `self.state`, an `Arc` that the
        // `ForkHeld` made here keeps alive; its `lock` field is dropped before its
        // `part` (declaration order), so the guard never outlives the mutex.
        let lock =
            lock.map(|guard| unsafe {
                std::mem::transmute::<
                    MutexGuard<'_, RecorderState>,
                    MutexGuard<'static, RecorderState>,
                >(guard)
            });
        Box::new(ForkHeld { lock, part: self })
    }
}

impl fork::AfterFork for ForkHeld {
    fn after_fork(self: Box<Self>, in_child: bool) {
        if in_child && self.lock.is_none() {
            self.part.abandoned.store(true, Ordering::Relaxed);
        }
        // Dropped here, the lock before its part: the child's first use of the
        // recording follows the fork (a file of its own).
    }
}

/// A `#@site` (or `#@via`) record: `#@KIND NUMBER LINE FUNCTION FILE`.
fn site_record(kind: &str, number: u32, site: &Site) -> String {
    format!(
        "#@{kind} {number} {} {} {}\n",
        site.line,
        super::site_name(&site.function),
        super::site_name(&site.file)
    )
}

/// The first line of every recording.
const HEADER: &str = "# op(m=malloc,c=calloc,r=realloc,f=free) ptr-id size thread; \
                      free(NULL)->id 0; unknown ptr->id 18446744073709551615\n";

/// The most sites a recording remembers having named (a program that makes code
/// objects without end, `exec` in a loop, names sites without end).
const MAX_SITES_KEPT: usize = 1 << 16;

impl fmt::Debug for RecordOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordOptions")
            .field("time", &self.time)
            .field("sites", &self.sites.is_some())
            .finish()
    }
}

impl fmt::Debug for TraceWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TraceWriter").finish_non_exhaustive()
    }
}

impl Recorder {
    /// Record the calls made to `inner` into `out`.
    pub fn new(inner: SharedHandler, out: impl Write + Send + 'static) -> Recorder {
        Recorder::with_options(inner, out, RecordOptions::default())
    }

    /// Record the calls made to `inner` into the file at `path`, created (or emptied)
    /// here: gzip-compressed when its name ends in `.gz`, as `read_trace` reads it.
    pub fn create(
        path: &std::path::Path,
        inner: SharedHandler,
        options: RecordOptions,
    ) -> std::io::Result<Recorder> {
        let mut recorder = Recorder::with_options(inner, trace_file(path)?, options);
        recorder.watcher.path = Some(path.to_owned());
        // A file that takes no bytes (a full disk) is refused now, not at the end.
        let mut st = recorder.watcher.lock();
        if let Some(error) = st.error.take() {
            return Err(error);
        }
        st.out.flush()?;
        drop(st);
        Ok(recorder)
    }

    /// Record the calls made to `inner` into `out`, each with what `options` asks.
    pub fn with_options(
        inner: SharedHandler,
        out: impl Write + Send + 'static,
        options: RecordOptions,
    ) -> Recorder {
        let mut out: Box<dyn Write + Send> = Box::new(out);
        let error = out.write_all(HEADER.as_bytes()).err();
        let state = Arc::new(Mutex::new(RecorderState {
            out,
            ids: HashMap::default(),
            line: Vec::new(),
            next_id: 1,
            threads: HashMap::new(),
            error,
            ended: false,
            site_numbers: HashMap::new(),
            sites_named: 0,
            generation: {
                fork::count_forks();
                fork::generation()
            },
        }));
        let fork = Arc::new(ForkPart {
            state: state.clone(),
            abandoned: AtomicBool::new(false),
        });
        fork::register(Arc::downgrade(&fork) as std::sync::Weak<dyn fork::Forkable>);
        Watched {
            handler: inner,
            watcher: TraceWriter {
                state,
                fork,
                serial: {
                    static SERIAL: std::sync::atomic::AtomicU64 =
                        std::sync::atomic::AtomicU64::new(1);
                    SERIAL.fetch_add(1, Ordering::Relaxed)
                },
                started: options.time.then(coarse_now),
                sites: options.sites,
                path: None,
            },
        }
    }

    /// The file written, for a recording made by [`Recorder::create`].
    pub fn file(&self) -> Option<&std::path::Path> {
        self.watcher.path.as_deref()
    }

    /// End the trace and flush it: calls after this one are served but not written, so
    /// the blocks live at this point are the ones the trace never frees (what leaked
    /// where the recording ends). The first write error, if any, is returned here, once.
    pub fn finish(&self) -> std::io::Result<()> {
        if self.watcher.fork.abandoned.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut state = self.watcher.lock();
        self.watcher.follow_fork(&mut state);
        if state.ended {
            return Ok(());
        }
        state.ended = true;
        let result = match state.error.take() {
            Some(e) => Err(e),
            None => state.out.flush(),
        };
        // Written out now (a gzip stream's end), whatever comes of the rest.
        let out = std::mem::replace(&mut state.out, Box::new(std::io::sink()));
        drop(out);
        result
    }
}

/// The file a recording writes at `path`: gzip-compressed when its name ends in `.gz`.
fn trace_file(path: &std::path::Path) -> std::io::Result<Box<dyn Write + Send>> {
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    Ok(match path.extension().is_some_and(|e| e == "gz") {
        true => Box::new(flate2::write::GzEncoder::new(
            file,
            flate2::Compression::fast(),
        )),
        false => Box::new(file),
    })
}

/// The file a forked child with process id `pid` records into beside its parent's
/// `path`: `trace.PID`, or `trace.PID.gz` for `trace.gz`.
pub fn child_path(path: &std::path::Path, pid: u32) -> std::path::PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let child = match name.strip_suffix(".gz") {
        Some(stem) => format!("{stem}.{pid}.gz"),
        None => format!("{name}.{pid}"),
    };
    path.with_file_name(child)
}

impl TraceWriter {
    /// The recording's state, locked (a writer that panicked left it whole: each event
    /// is written under the lock in one piece).
    fn lock(&self) -> MutexGuard<'_, RecorderState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// In a forked child, on its first use: what the parent had buffered is the
    /// parent's to write, so it is dropped unwritten, and the child records into a file
    /// of its own ([`child_path`]), from a fresh start (blocks it inherited are freed as
    /// unknown). A recording into a writer that is not a file ends in the child.
    fn follow_fork(&self, st: &mut RecorderState) {
        let now = fork::generation();
        if st.generation == now {
            return;
        }
        st.generation = now;
        // Not dropped: dropping writes out the parent's buffer (and a gzip trailer).
        std::mem::forget(std::mem::replace(&mut st.out, Box::new(std::io::sink())));
        // The threads keep their numbers: the forking thread remembers its own.
        st.ids.clear();
        st.site_numbers.clear();
        st.error = None;
        let Some(path) = self.path.as_deref().filter(|_| !st.ended) else {
            st.ended = true;
            return;
        };
        match trace_file(&child_path(path, std::process::id())) {
            Ok(mut out) => {
                st.error = out.write_all(HEADER.as_bytes()).err();
                st.out = out;
            }
            Err(error) => st.error = Some(error),
        }
    }
}

/// Nanoseconds on the monotonic clock, at the kernel's tick (a few ms): a report's
/// time axis needs no finer, and this clock is read in a few ns, where the precise one
/// costs more than the rest of writing an event.
fn coarse_now() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to fill; the clock exists on every
    // Linux since 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

thread_local! {
    /// The last recorder this thread wrote to (its serial) and its number there: most
    /// events find it here, not in the recorder's map.
    static THREAD_NUMBER: std::cell::Cell<(u64, u32)> = const { std::cell::Cell::new((0, 0)) };
}

impl TraceWriter {
    /// This thread's number in this recording, 1 for the first thread it saw.
    fn thread_number(&self, st: &mut RecorderState) -> u32 {
        let (serial, number) = THREAD_NUMBER.get();
        if serial == self.serial {
            return number;
        }
        let next = st.threads.len() as u32 + 1;
        let number = *st
            .threads
            .entry(std::thread::current().id())
            .or_insert(next);
        THREAD_NUMBER.set((self.serial, number));
        number
    }
}

impl Watcher for TraceWriter {
    fn served(&self, op: EventOp, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize) {
        let op = match op {
            EventOp::Malloc => 'm',
            EventOp::Calloc => 'c',
            EventOp::Realloc => 'r',
            EventOp::Free => 'f',
        };
        // Before the lock: finding the site may wait for the client's own locks (the
        // GIL), which another thread may hold while it waits for this lock.
        let site = match (&self.sites, op) {
            (Some(site_of), 'm' | 'c' | 'r') => site_of(),
            _ => None,
        };
        if self.fork.abandoned.load(Ordering::Relaxed) {
            return;
        }
        let mut guard = self.lock();
        // Under the lock, so that times never go back down the file.
        let time = self
            .started
            .map(|started| coarse_now().saturating_sub(started));
        let st = &mut *guard;
        self.follow_fork(st);
        if st.ended {
            return;
        }
        let thread = self.thread_number(st);
        let key = |p: NonNull<u8>| p.as_ptr() as usize;
        let id = match (op, old, new) {
            ('f', None, _) => 0,
            ('f', Some(p), _) => st.ids.remove(&key(p)).unwrap_or(UNKNOWN_ID),
            (_, Some(p), Some(q)) => {
                let id = st.ids.remove(&key(p)).unwrap_or(UNKNOWN_ID);
                st.ids.insert(key(q), id);
                id
            }
            (_, _, Some(q)) => {
                let id = st.next_id;
                st.next_id += 1;
                st.ids.insert(key(q), id);
                id
            }
            _ => return,
        };
        // One line buffer, reused, and integers written by `itoa`: an event is written
        // on every allocation of the program.
        let line = &mut st.line;
        line.clear();
        if st.site_numbers.len() >= MAX_SITES_KEPT {
            // Forgotten sites are named again, under new numbers, when next seen.
            st.site_numbers.clear();
        }
        let site = site.map(|site| match st.site_numbers.get(&site) {
            Some(&number) => number,
            None => {
                st.sites_named += 1;
                let number = st.sites_named;
                line.extend_from_slice(site_record("site", number, &site).as_bytes());
                if let Some(via) = &site.via {
                    line.extend_from_slice(site_record("via", number, via).as_bytes());
                }
                st.site_numbers.insert(site, number);
                number
            }
        });
        let mut number = itoa::Buffer::new();
        line.push(op as u8);
        for (prefix, value) in [
            (&b" "[..], id),
            (b" ", size as u64),
            (b" ", u64::from(thread)),
        ] {
            line.extend_from_slice(prefix);
            line.extend_from_slice(number.format(value).as_bytes());
        }
        if let Some(site) = site {
            line.extend_from_slice(b" s=");
            line.extend_from_slice(number.format(site).as_bytes());
        }
        if let Some(time) = time {
            line.extend_from_slice(b" t=");
            line.extend_from_slice(number.format(time).as_bytes());
        }
        line.push(b'\n');
        if st.error.is_none() {
            st.error = st.out.write_all(line).err();
        }
    }
}
