//! The WASI 0.2 a guest sees: an allow-list of interfaces, served so that nothing a guest
//! does through them reaches the real world, makes the host wait, or starts a thread.
//!
//! A policy's language runtime imports WASI even when the policy never uses it (Rust's
//! std imports clocks, streams and the CLI; componentize-py adds random, the file
//! system and sockets). The host serves exactly the interfaces in [`SERVED`]; a
//! component importing any other is refused at load, naming the import. What each
//! served interface answers:
//!
//! - **clocks**: virtual unless [`crate::Grants::clocks`]. Each instance has its own
//!   clock, which advances 1 ns per read (so it never stands still, and never reads 0)
//!   and jumps to a timer's deadline when a wait on the timer completes. Both clocks
//!   read it (the wall clock as nanoseconds since 1970).
//! - **timers and `wasi:io/poll`**: the host never waits. A timer is ready as soon as
//!   it is asked: with virtual clocks, time jumps to its deadline; with real clocks the
//!   wait returns at once even if the deadline has not come (a spurious wake-up, which
//!   WASI allows callers to see), and a guest that spins until it comes runs into its
//!   call's time limit. Every other pollable the host can hand out is ready at once
//!   too; a wait that could not complete at once traps rather than blocks.
//! - **random**: a per-instance stream from a fixed seed: the same bytes in every
//!   instance, so a policy stays deterministic and a check replays.
//! - **stdout / stderr**: kept in a buffer of the last [`crate::Limits::output`] bytes
//!   per instance, shown in errors and logged when the instance ends; writing never
//!   fails or blocks.
//! - **stdin** is empty; **environment** holds only [`crate::Grants::env`]; there are no
//!   arguments, no working directory and no terminal; **exit** traps.
//! - **file system**: no directory is open, so no descriptor can exist.
//! - **sockets**: creating a socket and looking up a name are refused (`access-denied`,
//!   `permanent-resolver-failure`) without touching the OS, so no socket can exist and
//!   the network handle is inert.
//!
//! Every resource a guest can create here lives in its store's resource table, whose
//! size is bounded ([`MAX_RESOURCES`]).

mod no_wait;

use no_wait::{NoWait, NoWaitView};

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parking_lot::Mutex;
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::cli::{WasiCli, WasiCliView};
use wasmtime_wasi::filesystem::{WasiFilesystem, WasiFilesystemView};
use wasmtime_wasi::p2::bindings::sync as wasi;
use wasmtime_wasi::p2::bindings::{cli, clocks, random, sockets};
use wasmtime_wasi::p2::{
    DynOutputStream, DynPollable, OutputStream, Pollable, SocketError, SocketResult, StreamResult,
};
use wasmtime_wasi::random::{WasiRandom, WasiRandomView};
use wasmtime_wasi::sockets::{WasiSockets, WasiSocketsCtxView, WasiSocketsView};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// The WASI interfaces a guest may import, without their version: any `0.2.x` import
/// of one of these is served. Everything a policy language's runtime imports (Rust's
/// std, componentize-py, componentize-js, wasi-libc; Go and other core modules get the
/// host's preview-1 stub instead, see `wasi_stub.wat`).
pub(crate) const SERVED: &[&str] = &[
    "wasi:io/error",
    "wasi:io/poll",
    "wasi:io/streams",
    "wasi:clocks/monotonic-clock",
    "wasi:clocks/wall-clock",
    "wasi:random/random",
    "wasi:random/insecure",
    "wasi:random/insecure-seed",
    "wasi:cli/environment",
    "wasi:cli/exit",
    "wasi:cli/stdin",
    "wasi:cli/stdout",
    "wasi:cli/stderr",
    "wasi:cli/terminal-input",
    "wasi:cli/terminal-output",
    "wasi:cli/terminal-stdin",
    "wasi:cli/terminal-stdout",
    "wasi:cli/terminal-stderr",
    "wasi:filesystem/types",
    "wasi:filesystem/preopens",
    "wasi:sockets/network",
    "wasi:sockets/instance-network",
    "wasi:sockets/tcp",
    "wasi:sockets/tcp-create-socket",
    "wasi:sockets/udp",
    "wasi:sockets/udp-create-socket",
    "wasi:sockets/ip-name-lookup",
];

/// The interface through which the host's WASI preview-1 stub (`wasi_stub.wat`, which
/// core-module policies get) passes on what the policy prints, and the stub's world.
pub(crate) const STUB_WIT: &str = "package allocbox:sandbox@0.1.0;
interface output { write: func(data: list<u8>); }
world stub { import output; }";

/// The stub's import: served to every guest, like WASI.
const STUB_OUTPUT: &str = "allocbox:sandbox/output@0.1.0";

/// The major version of WASI served: `0.2`.
const SERVED_VERSION: &str = "0.2.";

/// Is `import` (`wasi:io/poll@0.2.9`) a WASI interface this host serves? Imports
/// outside the `wasi:` namespace are not WASI and not judged here.
pub(crate) fn is_served(import: &str) -> bool {
    let (interface, version) = import.split_once('@').unwrap_or((import, ""));
    import == STUB_OUTPUT || SERVED.contains(&interface) && version.starts_with(SERVED_VERSION)
}

/// Most entries a guest's resource table may hold at once: streams, pollables, errors,
/// the network handle. A runtime holds a handful; a guest that creates them without
/// dropping them traps here instead of growing host memory.
pub(crate) const MAX_RESOURCES: usize = 256;

/// The seed of every instance's random stream.
const RANDOM_SEED: u64 = 0x616c_6c6f_6362_6f78;

/// What a guest store holds for WASI: the context wasmtime-wasi's interfaces read, the
/// resource table, this instance's clock and its output.
pub(crate) struct GuestWasi {
    ctx: WasiCtx,
    table: ResourceTable,
    clock: GuestClock,
    pub(crate) output: Output,
}

impl GuestWasi {
    /// The WASI of one instance: `env` as its environment, real clocks if `real_clocks`,
    /// the last `output` bytes of what it prints kept.
    pub(crate) fn new(env: &[(String, String)], real_clocks: bool, output: usize) -> Self {
        use rand::SeedableRng;
        let mut ctx = WasiCtx::builder();
        for (key, value) in env {
            ctx.env(key, value);
        }
        ctx.secure_random(rand::rngs::StdRng::seed_from_u64(RANDOM_SEED))
            .insecure_random(rand::rngs::StdRng::seed_from_u64(RANDOM_SEED ^ 1))
            .insecure_random_seed(u128::from(RANDOM_SEED));
        let mut table = ResourceTable::new();
        table.set_max_capacity(MAX_RESOURCES);
        GuestWasi {
            ctx: ctx.build(),
            table,
            clock: GuestClock::new(real_clocks),
            output: Output::new(output),
        }
    }
}

/// A store's data that serves WASI to its guest.
pub(crate) trait GuestView: WasiView + 'static {
    fn guest_wasi(&mut self) -> &mut GuestWasi;
}

/// Gives wasmtime-wasi its context and table from a [`GuestWasi`].
pub(crate) fn wasi_view(wasi: &mut GuestWasi) -> WasiCtxView<'_> {
    WasiCtxView {
        ctx: &mut wasi.ctx,
        table: &mut wasi.table,
    }
}

/// Fill `linker` with the served interfaces ([`SERVED`]).
pub(crate) fn add_to_linker<T: GuestView>(l: &mut Linker<T>) -> wasmtime::Result<()> {
    // wasi:io, with waits that never wait.
    wasi::io::error::add_to_linker::<T, Table>(l, |t| &mut t.guest_wasi().table)?;
    wasi::io::poll::add_to_linker::<T, NoWait>(l, |t| NoWaitView(&mut t.guest_wasi().table))?;
    wasi::io::streams::add_to_linker::<T, NoWait>(l, |t| NoWaitView(&mut t.guest_wasi().table))?;
    // Clocks and stdout/stderr: this module's own.
    clocks::monotonic_clock::add_to_linker::<T, Clocks>(l, |t| ClockView::of(t.guest_wasi()))?;
    clocks::wall_clock::add_to_linker::<T, Clocks>(l, |t| ClockView::of(t.guest_wasi()))?;
    cli::stdout::add_to_linker::<T, Outputs>(l, |t| OutputView::of(t.guest_wasi()))?;
    cli::stderr::add_to_linker::<T, Outputs>(l, |t| OutputView::of(t.guest_wasi()))?;
    // wasmtime-wasi's own, on a context that grants nothing but `env` and seeded random.
    random::random::add_to_linker::<T, WasiRandom>(l, T::random)?;
    random::insecure::add_to_linker::<T, WasiRandom>(l, T::random)?;
    random::insecure_seed::add_to_linker::<T, WasiRandom>(l, T::random)?;
    cli::exit::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::environment::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::stdin::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::terminal_input::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::terminal_output::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::terminal_stdin::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::terminal_stdout::add_to_linker::<T, WasiCli>(l, T::cli)?;
    cli::terminal_stderr::add_to_linker::<T, WasiCli>(l, T::cli)?;
    wasi::filesystem::types::add_to_linker::<T, WasiFilesystem>(l, T::filesystem)?;
    wasi::filesystem::preopens::add_to_linker::<T, WasiFilesystem>(l, T::filesystem)?;
    // Sockets: the types and methods are wasmtime-wasi's, but no socket can be made,
    // so none of their methods can be reached; the network handle is inert.
    sockets::network::add_to_linker::<T, WasiSockets>(l, &Default::default(), T::sockets)?;
    sockets::instance_network::add_to_linker::<T, WasiSockets>(l, T::sockets)?;
    wasi::sockets::tcp::add_to_linker::<T, WasiSockets>(l, T::sockets)?;
    wasi::sockets::udp::add_to_linker::<T, WasiSockets>(l, T::sockets)?;
    l.instance(STUB_OUTPUT)?.func_wrap(
        "write",
        |mut store: wasmtime::StoreContextMut<'_, T>, (data,): (Vec<u8>,)| {
            store.data_mut().guest_wasi().output.keep(&data);
            Ok(())
        },
    )?;
    sockets::tcp_create_socket::add_to_linker::<T, WasiSockets>(l, T::sockets)?;
    wasi::sockets::ip_name_lookup::add_to_linker::<T, WasiSockets>(l, T::sockets)?;
    wasi::sockets::udp_create_socket::add_to_linker::<T, NoUdp>(l, |t| NoUdpView(t.sockets()))?;
    Ok(())
}

/// Interfaces served from the resource table alone.
struct Table;

impl HasData for Table {
    type Data<'a> = &'a mut ResourceTable;
}

// ---------------------------------------------------------------------------------------
// Clocks

/// One instance's clock: virtual (a counter of nanoseconds, shared with its timers), or
/// the real one.
struct GuestClock {
    virtual_now: Option<Arc<AtomicU64>>,
    started: std::time::Instant,
}

impl GuestClock {
    fn new(real: bool) -> Self {
        GuestClock {
            virtual_now: (!real).then(|| Arc::new(AtomicU64::new(0))),
            started: std::time::Instant::now(),
        }
    }

    /// Nanoseconds: a virtual clock advances 1 ns per read.
    fn read(&self) -> u64 {
        match &self.virtual_now {
            Some(now) => now.fetch_add(1, Ordering::Relaxed) + 1,
            None => u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX),
        }
    }

    /// A pollable that is ready at the monotonic instant `deadline`.
    fn timer(
        &self,
        table: &mut ResourceTable,
        deadline: u64,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        let timer = table.push(Timer {
            deadline,
            virtual_now: self.virtual_now.clone(),
        })?;
        wasmtime_wasi::p2::subscribe(table, timer)
    }
}

/// A monotonic-clock subscription. Ready as soon as it is asked: a virtual clock jumps
/// to its deadline then; with the real clock it wakes spuriously if the deadline has
/// not come (see the module doc).
struct Timer {
    deadline: u64,
    virtual_now: Option<Arc<AtomicU64>>,
}

#[wasmtime_wasi::async_trait]
impl Pollable for Timer {
    async fn ready(&mut self) {
        if let Some(now) = &self.virtual_now {
            now.fetch_max(self.deadline, Ordering::Relaxed);
        }
    }
}

struct Clocks;

impl HasData for Clocks {
    type Data<'a> = ClockView<'a>;
}

struct ClockView<'a> {
    clock: &'a GuestClock,
    table: &'a mut ResourceTable,
}

impl<'a> ClockView<'a> {
    fn of(wasi: &'a mut GuestWasi) -> Self {
        ClockView {
            clock: &wasi.clock,
            table: &mut wasi.table,
        }
    }
}

impl clocks::monotonic_clock::Host for ClockView<'_> {
    fn now(&mut self) -> wasmtime::Result<u64> {
        Ok(self.clock.read())
    }
    fn resolution(&mut self) -> wasmtime::Result<u64> {
        Ok(1)
    }
    fn subscribe_instant(&mut self, when: u64) -> wasmtime::Result<Resource<DynPollable>> {
        self.clock.timer(self.table, when)
    }
    fn subscribe_duration(&mut self, duration: u64) -> wasmtime::Result<Resource<DynPollable>> {
        let deadline = self.clock.read().saturating_add(duration);
        self.clock.timer(self.table, deadline)
    }
}

impl clocks::wall_clock::Host for ClockView<'_> {
    fn now(&mut self) -> wasmtime::Result<clocks::wall_clock::Datetime> {
        let nanos = match self.clock.virtual_now {
            Some(_) => self.clock.read(),
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        };
        Ok(clocks::wall_clock::Datetime {
            seconds: nanos / 1_000_000_000,
            nanoseconds: (nanos % 1_000_000_000) as u32,
        })
    }
    fn resolution(&mut self) -> wasmtime::Result<clocks::wall_clock::Datetime> {
        Ok(clocks::wall_clock::Datetime {
            seconds: 0,
            nanoseconds: 1,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Output

/// What a guest printed, stdout and stderr together: the last `capacity` bytes. Writing
/// never fails and never waits; older bytes are dropped.
#[derive(Clone)]
pub(crate) struct Output {
    kept: Arc<Mutex<VecDeque<u8>>>,
    capacity: usize,
}

impl Output {
    fn new(capacity: usize) -> Self {
        Output {
            kept: Arc::new(Mutex::new(VecDeque::new())),
            capacity,
        }
    }

    /// The bytes kept, oldest first.
    pub(crate) fn contents(&self) -> Vec<u8> {
        self.kept.lock().iter().copied().collect()
    }

    fn keep(&self, bytes: &[u8]) {
        let tail = &bytes[bytes.len().saturating_sub(self.capacity)..];
        let mut kept = self.kept.lock();
        let overflow = (kept.len() + tail.len()).saturating_sub(self.capacity);
        let drop = overflow.min(kept.len());
        kept.drain(..drop);
        kept.extend(tail);
    }
}

/// The most bytes one `write` may take (what `check-write` permits): a stream's usual
/// permit. `write-zeroes` allocates this much at most.
const WRITE_PERMIT: usize = 64 << 10;

#[wasmtime_wasi::async_trait]
impl Pollable for Output {
    async fn ready(&mut self) {}
}

impl OutputStream for Output {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.keep(&bytes);
        Ok(())
    }
    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }
    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(WRITE_PERMIT)
    }
}

struct Outputs;

impl HasData for Outputs {
    type Data<'a> = OutputView<'a>;
}

struct OutputView<'a> {
    output: &'a Output,
    table: &'a mut ResourceTable,
}

impl<'a> OutputView<'a> {
    fn of(wasi: &'a mut GuestWasi) -> Self {
        OutputView {
            output: &wasi.output,
            table: &mut wasi.table,
        }
    }

    fn stream(&mut self) -> wasmtime::Result<Resource<DynOutputStream>> {
        let stream: DynOutputStream = Box::new(self.output.clone());
        Ok(self.table.push(stream)?)
    }
}

impl cli::stdout::Host for OutputView<'_> {
    fn get_stdout(&mut self) -> wasmtime::Result<Resource<DynOutputStream>> {
        self.stream()
    }
}

impl cli::stderr::Host for OutputView<'_> {
    fn get_stderr(&mut self) -> wasmtime::Result<Resource<DynOutputStream>> {
        self.stream()
    }
}

// ---------------------------------------------------------------------------------------
// Sockets: nothing can be created

/// `wasi:sockets/udp-create-socket`, refused here: wasmtime-wasi's sync binding would
/// start its multi-threaded tokio runtime in the host before refusing. (Its TCP socket
/// creation and name lookup refuse at once, on this context that allows neither.)
struct NoUdp;

impl HasData for NoUdp {
    type Data<'a> = NoUdpView<'a>;
}

struct NoUdpView<'a>(WasiSocketsCtxView<'a>);

impl sockets::network::Host for NoUdpView<'_> {
    fn convert_error_code(&mut self, error: SocketError) -> wasmtime::Result<ErrorCode> {
        sockets::network::Host::convert_error_code(&mut self.0, error)
    }
    fn network_error_code(
        &mut self,
        err: Resource<wasmtime_wasi::p2::IoError>,
    ) -> wasmtime::Result<Option<ErrorCode>> {
        sockets::network::Host::network_error_code(&mut self.0, err)
    }
}

impl sockets::network::HostNetwork for NoUdpView<'_> {
    fn drop(&mut self, network: Resource<sockets::network::Network>) -> wasmtime::Result<()> {
        sockets::network::HostNetwork::drop(&mut self.0, network)
    }
}

impl wasi::sockets::udp_create_socket::Host for NoUdpView<'_> {
    fn create_udp_socket(
        &mut self,
        _family: sockets::network::IpAddressFamily,
    ) -> SocketResult<Resource<wasmtime_wasi::p2::UdpSocket>> {
        Err(ErrorCode::AccessDenied.into())
    }
}

type ErrorCode = sockets::network::ErrorCode;

impl std::fmt::Debug for GuestWasi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestWasi").finish_non_exhaustive()
    }
}
