//! `sandbox-probe`: a test fixture that calls the WASI the host serves, directly, to
//! show what a policy sees through it. It serves like a pass-through; the config key
//! `probe` picks what it does besides (`arg` is the probe's number):
//!
//! - `every-wasi`: in `init`, call every WASI function a policy can reach and answer
//!   `init` with an `err` listing what each returned, one `name=answer` per line;
//! - `timer-count`: in `init`, subscribe to a timer of `arg` ms and count the polls of
//!   `ready` until it fires; the `err` says `loops=N elapsed-ns=T`;
//! - `sleep`: every `malloc` first sleeps `arg` seconds (a WASI timer and `block`);
//! - `poll-sleep`: every `malloc` first waits `arg` seconds with `poll` on a timer;
//! - `spin`: every `malloc` first spins until the monotonic clock moved `arg` ms;
//! - `print`: every `malloc` prints `arg` bytes (lines of `x`, then `probe printed`)
//!   and then panics with `probe panics`;
//! - `streams`: every `malloc` takes stdout handles without dropping them, forever;
//! - `poll-many`: every `malloc` polls a list of `arg` copies of one timer;
//! - `random-bytes`: every `malloc` asks for `arg` random bytes at once;
//! - `exit`: `malloc` calls `exit`;
//! - `copy-up`, `copy-down`, `fill`, `read`, `write`: every `malloc(size)` takes a
//!   block of `size` bytes upstream and then, until its call is stopped, copies it onto
//!   itself shifted one byte up (`copy-up`, the destination above the source) or down,
//!   fills it, or reads or writes `arg` MiB of it at a time;
//! - `resize-then-write`: `realloc` resizes the block upstream, then writes a word at
//!   the end of the new block before answering it (a policy that keeps a footer).

use std::fmt::Write as _;
use std::time::Duration;

use allocbox_policy::{Config, Info, Policy, bytes, export_policy, upstream};
use wasip2::clocks::{monotonic_clock, wall_clock};
use wasip2::io::poll;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Probe {
    None,
    Sleep,
    PollSleep,
    Spin,
    Print,
    Streams,
    PollMany,
    RandomBytes,
    Exit,
    CopyUp,
    CopyDown,
    Fill,
    Read,
    Write,
    ResizeThenWrite,
}

struct SandboxProbe {
    probe: Probe,
    arg: u64,
}

impl Policy for SandboxProbe {
    fn init(config: &mut Config) -> Result<Self, String> {
        let name = config.get_or("probe", "none".to_string())?;
        let arg = config.get_or("arg", 0u64)?;
        let probe = match name.as_str() {
            "none" => Probe::None,
            "every-wasi" => return Err(every_wasi()),
            "timer-count" => return Err(timer_count(arg)),
            "sleep" => Probe::Sleep,
            "poll-sleep" => Probe::PollSleep,
            "spin" => Probe::Spin,
            "print" => Probe::Print,
            "streams" => Probe::Streams,
            "poll-many" => Probe::PollMany,
            "random-bytes" => Probe::RandomBytes,
            "exit" => Probe::Exit,
            "copy-up" => Probe::CopyUp,
            "copy-down" => Probe::CopyDown,
            "fill" => Probe::Fill,
            "read" => Probe::Read,
            "write" => Probe::Write,
            "resize-then-write" => Probe::ResizeThenWrite,
            other => return Err(format!("unknown probe `{other}`")),
        };
        Ok(SandboxProbe { probe, arg })
    }

    fn info(&self) -> Info {
        Info::new().batch(false)
    }

    fn malloc(&self, size: u64) -> u64 {
        match self.probe {
            Probe::None | Probe::ResizeThenWrite => {}
            Probe::Sleep => monotonic_clock::subscribe_duration(secs(self.arg)).block(),
            Probe::PollSleep => {
                let timer = monotonic_clock::subscribe_duration(secs(self.arg));
                poll::poll(&[&timer]);
            }
            Probe::Spin => {
                let start = monotonic_clock::now();
                while monotonic_clock::now() - start < self.arg * 1_000_000 {}
            }
            Probe::Print => {
                let line = "x".repeat(79);
                for _ in 0..self.arg / 80 {
                    println!("{line}");
                }
                println!("probe printed");
                panic!("probe panics");
            }
            Probe::Streams => {
                let mut held = Vec::new();
                loop {
                    held.push(wasip2::cli::stdout::get_stdout());
                }
            }
            Probe::PollMany => {
                let timer = monotonic_clock::subscribe_duration(1);
                let list: Vec<&poll::Pollable> = (0..self.arg).map(|_| &timer).collect();
                poll::poll(&list);
            }
            Probe::RandomBytes => {
                std::hint::black_box(wasip2::random::random::get_random_bytes(self.arg));
            }
            Probe::Exit => wasip2::cli::exit::exit(Err(())),
            Probe::CopyUp | Probe::CopyDown | Probe::Fill | Probe::Read | Probe::Write => {
                self.bytes_forever(size)
            }
        }
        upstream::malloc(size)
    }

    fn free(&self, ptr: u64, size: u64) {
        upstream::free(ptr, size)
    }

    fn realloc(&self, ptr: u64, old_size: u64, new_size: u64) -> u64 {
        if self.probe != Probe::ResizeThenWrite || ptr == 0 {
            return upstream::realloc(ptr, old_size, new_size);
        }
        let moved = upstream::realloc(ptr, old_size, new_size);
        if moved != 0 && new_size >= 8 {
            bytes::write_u64(moved + new_size - 8, 0x5a5a_5a5a_5a5a_5a5a);
        }
        moved
    }
}

impl SandboxProbe {
    /// Work on the bytes of a fresh upstream block of `size` bytes until stopped.
    fn bytes_forever(&self, size: u64) -> ! {
        let block = upstream::malloc(size);
        assert_ne!(block, 0, "no upstream block of {size} bytes");
        let chunk = (self.arg << 20).min(size);
        loop {
            match self.probe {
                Probe::CopyUp => bytes::copy(block + 1, block, size - 1),
                Probe::CopyDown => bytes::copy(block, block + 1, size - 1),
                Probe::Fill => bytes::fill(block, size, 0x5a),
                Probe::Read => {
                    std::hint::black_box(bytes::read(block, chunk as u32));
                }
                Probe::Write => bytes::write(block, &vec![0x5a; chunk as usize]),
                _ => unreachable!("not a bytes probe"),
            }
        }
    }
}

fn secs(seconds: u64) -> u64 {
    Duration::from_secs(seconds).as_nanos() as u64
}

/// Poll a timer of `ms` until it is ready, counting the polls, and say how long the
/// monotonic clock says that took.
fn timer_count(ms: u64) -> String {
    let start = monotonic_clock::now();
    let timer = monotonic_clock::subscribe_duration(ms * 1_000_000);
    let mut loops = 0u64;
    while !timer.ready() {
        loops += 1;
    }
    let elapsed = monotonic_clock::now() - start;
    format!("loops={loops} elapsed-ns={elapsed}")
}

/// Call every WASI function a policy can reach, one answer per line.
fn every_wasi() -> String {
    use wasip2::cli::{
        environment, stderr, stdin, stdout, terminal_stderr, terminal_stdin, terminal_stdout,
    };
    use wasip2::random::{insecure, insecure_seed, random};
    use wasip2::sockets::network::IpAddressFamily;
    use wasip2::sockets::{instance_network, ip_name_lookup, tcp_create_socket, udp_create_socket};

    let mut out = String::new();
    let mut say = |name: &str, answer: String| writeln!(out, "{name}={answer}").unwrap();

    // Clocks: virtual time, 1 ns a read, timers jump it.
    let t0 = monotonic_clock::now();
    let t1 = monotonic_clock::now();
    say("monotonic-clock.now", format!("step {}", t1 - t0));
    say(
        "monotonic-clock.resolution",
        monotonic_clock::resolution().to_string(),
    );
    let before = monotonic_clock::now();
    let timer = monotonic_clock::subscribe_duration(3_600_000_000_000);
    timer.block();
    say(
        "monotonic-clock.subscribe-duration+block",
        format!(
            "advanced {}s",
            (monotonic_clock::now() - before) / 1_000_000_000
        ),
    );
    let at = monotonic_clock::now() + 5_000_000_000;
    let instant = monotonic_clock::subscribe_instant(at);
    say("pollable.ready", instant.ready().to_string());
    say(
        "monotonic-clock.subscribe-instant+ready",
        (monotonic_clock::now() >= at).to_string(),
    );
    let a = monotonic_clock::subscribe_duration(10);
    let b = monotonic_clock::subscribe_duration(20);
    say("poll.poll", format!("{:?}", poll::poll(&[&a, &b])));
    let wall = wall_clock::now();
    say("wall-clock.now", format!("{}s", wall.seconds));
    let res = wall_clock::resolution();
    say(
        "wall-clock.resolution",
        format!("{}s {}ns", res.seconds, res.nanoseconds),
    );

    // Random: a fixed stream.
    say(
        "random.get-random-bytes",
        format!("{:?}", random::get_random_bytes(4)),
    );
    say(
        "random.get-random-u64",
        random::get_random_u64().to_string(),
    );
    say(
        "insecure.get-insecure-random-bytes",
        format!("{:?}", insecure::get_insecure_random_bytes(4)),
    );
    say(
        "insecure.get-insecure-random-u64",
        insecure::get_insecure_random_u64().to_string(),
    );
    say(
        "insecure-seed.insecure-seed",
        format!("{:?}", insecure_seed::insecure_seed()),
    );

    // The command line: nothing.
    say(
        "environment.get-environment",
        format!("{:?}", environment::get_environment()),
    );
    say(
        "environment.get-arguments",
        format!("{:?}", environment::get_arguments()),
    );
    say(
        "environment.initial-cwd",
        format!("{:?}", environment::initial_cwd()),
    );
    say(
        "terminal-stdin.get-terminal-stdin",
        terminal_stdin::get_terminal_stdin().is_some().to_string(),
    );
    say(
        "terminal-stdout.get-terminal-stdout",
        terminal_stdout::get_terminal_stdout().is_some().to_string(),
    );
    say(
        "terminal-stderr.get-terminal-stderr",
        terminal_stderr::get_terminal_stderr().is_some().to_string(),
    );

    // Streams: stdin is empty, output goes to the host's buffer.
    let input = stdin::get_stdin();
    say("input-stream.read", format!("{:?}", input.read(16)));
    say(
        "input-stream.blocking-read",
        format!("{:?}", input.blocking_read(16)),
    );
    say("input-stream.skip", format!("{:?}", input.skip(16)));
    say(
        "input-stream.blocking-skip",
        format!("{:?}", input.blocking_skip(16)),
    );
    say("input-stream.subscribe+block", {
        input.subscribe().block();
        "returned".into()
    });
    let output = stdout::get_stdout();
    say(
        "output-stream.check-write",
        format!("{:?}", output.check_write()),
    );
    say(
        "output-stream.write",
        format!("{:?}", output.write(b"probe: write\n")),
    );
    say(
        "output-stream.blocking-write-and-flush",
        format!(
            "{:?}",
            output.blocking_write_and_flush(b"probe: blocking\n")
        ),
    );
    say("output-stream.flush", format!("{:?}", output.flush()));
    say(
        "output-stream.blocking-flush",
        format!("{:?}", output.blocking_flush()),
    );
    say(
        "output-stream.write-zeroes",
        format!("{:?}", output.write_zeroes(1)),
    );
    say(
        "output-stream.blocking-write-zeroes-and-flush",
        format!("{:?}", output.blocking_write_zeroes_and_flush(1)),
    );
    say(
        "output-stream.splice",
        format!("{:?}", output.splice(&input, 16)),
    );
    say(
        "output-stream.blocking-splice",
        format!("{:?}", output.blocking_splice(&input, 16)),
    );
    say("output-stream.subscribe+block", {
        output.subscribe().block();
        "returned".into()
    });
    let err_stream = stderr::get_stderr();
    say(
        "stderr.blocking-write-and-flush",
        format!(
            "{:?}",
            err_stream.blocking_write_and_flush(b"probe: stderr\n")
        ),
    );

    // No file system.
    say(
        "preopens.get-directories",
        wasip2::filesystem::preopens::get_directories()
            .len()
            .to_string(),
    );

    // No network.
    let network = instance_network::instance_network();
    say(
        "tcp-create-socket.create-tcp-socket",
        format!(
            "{:?}",
            tcp_create_socket::create_tcp_socket(IpAddressFamily::Ipv4).err()
        ),
    );
    say(
        "udp-create-socket.create-udp-socket",
        format!(
            "{:?}",
            udp_create_socket::create_udp_socket(IpAddressFamily::Ipv6).err()
        ),
    );
    say(
        "ip-name-lookup.resolve-addresses",
        format!(
            "{:?}",
            ip_name_lookup::resolve_addresses(&network, "example.com").err()
        ),
    );
    out
}

export_policy!(SandboxProbe, name = "sandbox-probe");
