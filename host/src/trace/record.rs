//! Recording a handler's calls as a trace: the watcher (`trace/watched.rs`) that writes
//! the binary trace form (`trace/binary.rs`).
//!
//! Each thread writes its calls into a chunk of its own, under a lock only finishing
//! (and a fork) ever contends for, numbering them from one shared counter; full chunks
//! go to a writer thread, which compresses them into the file.

use std::fmt;
use std::io::Write;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use allocbox_ledger::platform::fork;
use thread_local::ThreadLocal;

use super::binary::{self, Call, ChunkEncoder};
use super::watched::{Served, Watched, Watcher};
use super::{EventOp, Site};
use crate::nep49::SharedHandler;
use crate::output::{Output, OutputError, OutputFault};

/// A handler that writes every call it forwards to `handler` as a trace.
pub type Recorder = Watched<SharedHandler, TraceWriter>;

/// A GPU's handler whose every call is written as a trace, through
/// [`Watched::device_malloc`] and [`Watched::device_free`]: each event with its GPU, a
/// free with its stream.
pub type DeviceRecorder = Watched<Arc<crate::handler::DeviceHandler>, TraceWriter>;

/// Where the client was when it asked for a block, asked of the embedder for each
/// allocation a [`Recorder`] writes with sites (the NumPy bridge: the innermost line of
/// the program's own Python code). Called before anything of the recording is locked.
pub type SiteOf = Box<dyn Fn() -> Option<Site> + Send + Sync>;

/// What a [`Recorder`] writes beside each event.
#[derive(Default)]
pub struct RecordOptions {
    /// Nanoseconds since the recording started.
    pub time: bool,
    /// The site of each allocation, each site named once per thread.
    pub sites: Option<SiteOf>,
}

/// The trace a [`Recorder`] writes.
pub struct TraceWriter {
    shared: Arc<Shared>,
    /// Its part in every fork, while it lives.
    fork: Arc<ForkPart>,
    /// [`coarse_now`] when the recording started.
    started: Option<u64>,
    sites: Option<SiteOf>,
    /// The file written, for the file a forked child writes beside it.
    path: Option<std::path::PathBuf>,
}

/// What every thread recording into one trace shares.
struct Shared {
    /// The calls' order: one number a call (two for a realloc), from every thread.
    seq: AtomicU64,
    /// Thread numbers given out.
    threads: AtomicU32,
    /// [`binary::TIMES`], [`binary::SITES`].
    flags: u8,
    /// Set by [`Recorder::finish`]: later calls are not written.
    ended: AtomicBool,
    /// Each thread's chunk being written.
    chunks: ThreadLocal<ThreadChunk>,
    sink: Mutex<Sink>,
}

/// One thread's chunk being written. Its lock is taken by its thread on every call, and
/// by another only to finish the trace (holding the [`Sink`]'s lock, so never across a
/// fork).
struct ThreadChunk {
    /// [`fork::generation`] of the process the chunk writes for: a forked child never
    /// locks a chunk its parent's other threads had (one may have held it).
    generation: AtomicU64,
    writing: Mutex<Option<Writing>>,
}

struct Writing {
    /// The thread writing it ([`this_thread`]).
    thread: u64,
    encoder: ChunkEncoder,
    to_writer: Option<SyncSender<Message>>,
}

enum Message {
    Chunk(Vec<u8>),
    /// Write the end and finish the file.
    End,
}

/// Where chunks go.
struct Sink {
    /// The file, the header written, until the writer thread starts with it.
    out: Option<Box<dyn Write + Send>>,
    writer: Option<WriterThread>,
    error: Option<std::io::Error>,
    ended: bool,
    /// [`fork::generation`] of the process this recording writes for.
    generation: u64,
}

struct WriterThread {
    chunks: SyncSender<Message>,
    thread: std::thread::JoinHandle<std::io::Result<()>>,
}

/// Chunks waiting for the writer (4 MiB of 64 KiB ones): a thread that finds it full
/// waits, so that a writer slower than the program (a full pipe) holds the program back
/// rather than its memory without bound.
const CHUNKS_QUEUED: usize = 64;

/// A recording's part in a fork: the sink's lock is taken before the fork (within
/// [`FORK_PATIENCE`]) and let go after it, so that the child never finds it held by a
/// thread it does not have. (The standard library's lock: letting it go in the child
/// wakes no waiter through tables other threads may have held, as parking_lot's does.)
struct ForkPart {
    shared: Arc<Shared>,
    /// In a child forked while another thread kept the lock past the patience: the
    /// lock is that thread's forever, so the child records nothing.
    abandoned: AtomicBool,
}

/// How long a fork waits for a thread finishing the recording.
const FORK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(1);

/// What a recording's [`ForkPart`] holds across the fork: the sink's lock, when its
/// holder let it go within the patience.
struct ForkHeld(fork::HeldLock<ForkPart, Sink>);

impl fork::Forkable for ForkPart {
    fn before_fork(self: Arc<Self>) -> Box<dyn fork::AfterFork> {
        let give_up = std::time::Instant::now() + FORK_PATIENCE;
        Box::new(ForkHeld(fork::HeldLock::take(
            self,
            |part| &part.shared.sink,
            give_up,
        )))
    }
}

impl fork::AfterFork for ForkHeld {
    fn after_fork(self: Box<Self>, in_child: bool) {
        if in_child && !self.0.taken() {
            self.0.owner().abandoned.store(true, Ordering::Relaxed);
        }
        // Dropped here, the lock before its part: the child's first use of the
        // recording follows the fork (a file of its own).
    }
}

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

/// A recording of any handler: a NEP 49 one ([`Recorder`]) or a GPU's ([`DeviceRecorder`]).
impl<H> Watched<H, TraceWriter> {
    /// Record the calls made to `inner` into `out`.
    pub fn new(inner: H, out: impl Write + Send + 'static) -> Self {
        Self::with_options(inner, out, RecordOptions::default())
    }

    /// Record the calls made to `inner` into the file at `path`, put in place of
    /// what was there here ([`crate::output`]: never through a link, never over a
    /// folder, a device or a read-only file).
    pub fn create(
        path: &std::path::Path,
        inner: H,
        options: RecordOptions,
    ) -> Result<Self, OutputError> {
        let mut recorder = Self::with_options(inner, trace_file(path)?, options);
        recorder.watcher.path = Some(path.to_owned());
        // A file that takes no bytes (a full disk) is refused now, not at the end.
        let mut sink = recorder.watcher.sink();
        let failed = |error| OutputError {
            path: path.to_owned(),
            fault: OutputFault::Io(error),
        };
        if let Some(error) = sink.error.take() {
            return Err(failed(error));
        }
        if let Some(out) = &mut sink.out {
            out.flush().map_err(failed)?;
        }
        drop(sink);
        Ok(recorder)
    }

    /// Record the calls made to `inner` into `out`, each with what `options` asks.
    pub fn with_options(
        inner: H,
        out: impl Write + Send + 'static,
        options: RecordOptions,
    ) -> Self {
        let flags = if options.time { binary::TIMES } else { 0 }
            | if options.sites.is_some() {
                binary::SITES
            } else {
                0
            };
        let mut out: Box<dyn Write + Send> = Box::new(out);
        let error = out.write_all(&binary::header(flags)).err();
        let shared = Arc::new(Shared {
            seq: AtomicU64::new(1),
            threads: AtomicU32::new(0),
            flags,
            ended: AtomicBool::new(false),
            chunks: ThreadLocal::new(),
            sink: Mutex::new(Sink {
                out: Some(out),
                writer: None,
                error,
                ended: false,
                generation: {
                    fork::count_forks();
                    fork::generation()
                },
            }),
        });
        let fork = Arc::new(ForkPart {
            shared: shared.clone(),
            abandoned: AtomicBool::new(false),
        });
        fork::register(Arc::downgrade(&fork) as std::sync::Weak<dyn fork::Forkable>);
        Watched {
            handler: inner,
            watcher: TraceWriter {
                shared,
                fork,
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

    /// End the trace and write it out: calls after this one are served but not
    /// written, so the blocks live at this point are the ones the trace never frees
    /// (what leaked where the recording ends). The first write error, if any, is
    /// returned here, once.
    pub fn finish(&self) -> std::io::Result<()> {
        self.watcher.finish()
    }
}

/// The file a recording writes at `path`, in place at once (a program killed part way
/// leaves its trace up to there).
fn trace_file(path: &std::path::Path) -> Result<Box<dyn Write + Send>, OutputError> {
    let file = Output::create(path)?.stream()?;
    Ok(Box::new(std::io::BufWriter::new(file)))
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

/// The writer thread: every chunk into the compressed stream, in the order they come,
/// then the end.
fn write_chunks(out: Box<dyn Write + Send>, chunks: Receiver<Message>) -> std::io::Result<()> {
    let mut stream = binary::compressor(out)?;
    // A recording dropped without being finished ends when its senders are gone.
    for message in chunks {
        match message {
            Message::Chunk(chunk) => stream.write_all(&chunk)?,
            Message::End => break,
        }
    }
    stream.write_all(&binary::END)?;
    stream.finish()?.flush()
}

impl TraceWriter {
    /// The sink, locked, for this process (a writer that panicked left it whole).
    fn sink(&self) -> MutexGuard<'_, Sink> {
        let mut sink = self
            .shared
            .sink
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.follow_fork(&mut sink);
        sink
    }

    /// In a forked child, on its first use: the parent's writer thread is not here and
    /// its file is the parent's to write, so the child records into a file of its own
    /// ([`child_path`]), from a fresh start (blocks it inherited are freed as unknown).
    /// A recording into a writer that is not a file ends in the child.
    fn follow_fork(&self, sink: &mut Sink) {
        let now = fork::generation();
        if sink.generation == now {
            return;
        }
        sink.generation = now;
        // Not dropped: the channel's and the file's state may be mid-change by a
        // thread the child does not have, and dropping would write the parent's bytes.
        std::mem::forget(sink.out.take());
        std::mem::forget(sink.writer.take());
        sink.error = None;
        let Some(path) = self.path.as_deref().filter(|_| !sink.ended) else {
            sink.ended = true;
            return;
        };
        match trace_file(&child_path(path, std::process::id())) {
            Ok(mut out) => {
                sink.error = out.write_all(&binary::header(self.shared.flags)).err();
                sink.out = Some(out);
            }
            Err(error) => sink.error = Some(std::io::Error::other(error.to_string())),
        }
    }

    /// A way to the writer thread, started here for the first chunk of this process.
    fn to_writer(&self, sink: &mut Sink) -> Option<SyncSender<Message>> {
        if sink.ended {
            return None;
        }
        if sink.writer.is_none() {
            let out = sink.out.take()?;
            let (chunks, received) = sync_channel(CHUNKS_QUEUED);
            match std::thread::Builder::new()
                .name("allocbox-trace".into())
                .spawn(move || write_chunks(out, received))
            {
                Ok(thread) => sink.writer = Some(WriterThread { chunks, thread }),
                Err(error) => {
                    sink.error.get_or_insert(error);
                    return None;
                }
            }
        }
        sink.writer.as_ref().map(|w| w.chunks.clone())
    }

    /// The file written, for a recording made by [`Recorder::create`].
    pub fn file(&self) -> Option<&std::path::Path> {
        self.path.as_deref()
    }

    /// End the trace and write it out: see [`Recorder::finish`].
    pub fn finish(&self) -> std::io::Result<()> {
        if self.fork.abandoned.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut sink = self.sink();
        if sink.ended {
            return Ok(());
        }
        self.shared.ended.store(true, Ordering::Relaxed);
        // Every thread's last chunk, while the sink's lock keeps forks out.
        let generation = sink.generation;
        let mut last = Vec::new();
        for chunk in self.shared.chunks.iter() {
            if chunk.generation.load(Ordering::Relaxed) != generation {
                continue;
            }
            let mut writing = chunk.writing.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(writing) = writing.as_mut() {
                last.extend(writing.encoder.take());
                writing.to_writer = None;
            }
        }
        let to_writer = match last.is_empty() {
            true => None,
            false => self.to_writer(&mut sink),
        };
        for chunk in last {
            if let Some(to_writer) = &to_writer {
                let _ = to_writer.send(Message::Chunk(chunk));
            }
        }
        sink.ended = true;
        let mut result = match sink.writer.take() {
            Some(writer) => {
                let _ = writer.chunks.send(Message::End);
                drop(writer.chunks);
                writer.thread.join().unwrap_or_else(|_| {
                    Err(std::io::Error::other("the trace's writer thread panicked"))
                })
            }
            // Nothing was recorded: the header alone, and the end.
            None => match sink.out.take() {
                Some(out) => (|| {
                    let mut stream = binary::compressor(out)?;
                    stream.write_all(&binary::END)?;
                    stream.finish()?.flush()
                })(),
                None => Ok(()),
            },
        };
        if let Some(error) = sink.error.take() {
            result = Err(error);
        }
        result
    }
}

impl Drop for TraceWriter {
    /// A recording dropped unfinished is finished: its file is a whole trace.
    fn drop(&mut self) {
        let _ = self.finish();
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

impl Watcher for TraceWriter {
    fn before(&self) -> u64 {
        self.shared.seq.fetch_add(1, Ordering::Relaxed)
    }

    fn served(&self, call: Served) {
        let Served {
            op,
            old,
            new,
            size,
            before,
            device,
            stream,
        } = call;
        if self.shared.ended.load(Ordering::Relaxed) || self.fork.abandoned.load(Ordering::Relaxed)
        {
            return;
        }
        // Before any lock: finding the site may wait for the client's own locks (the
        // GIL), which another thread may hold while it waits for this recording.
        let site = match (&self.sites, op) {
            (Some(site_of), EventOp::Malloc | EventOp::Calloc | EventOp::Realloc) => site_of(),
            _ => None,
        };
        let chunk = self.shared.chunks.get_or(|| ThreadChunk {
            generation: AtomicU64::new(0),
            writing: Mutex::new(None),
        });
        let this = this_thread();
        let generation = fork::generation();
        let mut writing = chunk.writing.lock().unwrap_or_else(PoisonError::into_inner);
        if chunk.generation.load(Ordering::Relaxed) != generation
            || writing.as_ref().is_none_or(|w| w.thread != this)
        {
            // Not under this lock: finishing takes the sink's lock, then this one.
            let old = writing.take();
            drop(writing);
            let forked = chunk.generation.load(Ordering::Relaxed) != generation;
            let Some((started, generation)) = self.start_chunk(old, forked, this) else {
                return;
            };
            writing = chunk.writing.lock().unwrap_or_else(PoisonError::into_inner);
            chunk.generation.store(generation, Ordering::Relaxed);
            *writing = Some(started);
        }
        let Some(writing) = writing.as_mut() else {
            return;
        };
        let seq = match op {
            EventOp::Free | EventOp::Realloc => before,
            EventOp::Malloc | EventOp::Calloc => self.shared.seq.fetch_add(1, Ordering::Relaxed),
        };
        let done = match op {
            EventOp::Realloc => self.shared.seq.fetch_add(1, Ordering::Relaxed),
            _ => seq,
        };
        let address = |p: Option<NonNull<u8>>| p.map_or(0, |p| p.as_ptr() as u64);
        writing.encoder.call(Call {
            op,
            seq,
            done,
            old: address(old),
            new: address(new),
            size: size as u64,
            time: self
                .started
                .map_or(0, |started| coarse_now().saturating_sub(started)),
            site,
            device,
            stream,
        });
        if writing.encoder.full()
            && let (Some(to_writer), Some(chunk)) = (&writing.to_writer, writing.encoder.take())
        {
            // The writer gone (it failed, and said why where the trace is finished):
            // the chunk is dropped.
            let _ = to_writer.send(Message::Chunk(chunk));
        }
    }
}

impl TraceWriter {
    /// This thread's chunk, set up for this process: at a thread's first call, at the
    /// first call of a thread that took an ended thread's place (`old` is handed over
    /// first), or at a forked child's first (`old` is the parent's to write:
    /// forgotten). With the process's generation; `None` when the recording has ended
    /// here.
    fn start_chunk(&self, old: Option<Writing>, forked: bool, this: u64) -> Option<(Writing, u64)> {
        let mut kept = None;
        if let Some(Writing {
            thread,
            mut encoder,
            to_writer,
        }) = old
        {
            if forked {
                std::mem::forget(to_writer);
                encoder.forget();
                // The forking thread keeps its number.
                kept = (thread == this).then_some(encoder);
            } else if let Some((chunk, to_writer)) = encoder.take().zip(to_writer) {
                let _ = to_writer.send(Message::Chunk(chunk));
            }
        }
        let mut sink = self.sink();
        let to_writer = self.to_writer(&mut sink)?;
        let generation = sink.generation;
        drop(sink);
        let encoder = kept.unwrap_or_else(|| {
            let number = self.shared.threads.fetch_add(1, Ordering::Relaxed) + 1;
            ChunkEncoder::new(number, self.shared.flags)
        });
        let writing = Writing {
            thread: this,
            encoder,
            to_writer: Some(to_writer),
        };
        Some((writing, generation))
    }
}

/// A number for this thread, unique in the process: `ThreadLocal` hands the place of a
/// thread that ended to the next thread to start, which must not write as the other.
fn this_thread() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static THIS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }
    THIS.with(|this| match this.get() {
        0 => {
            this.set(NEXT.fetch_add(1, Ordering::Relaxed));
            this.get()
        }
        number => number,
    })
}
