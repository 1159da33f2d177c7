//! The sandbox's bounds, measured: how long each hostile policy takes to be stopped
//! against its call's time limit, and how much memory it makes the process take
//! against its budget. One row per attack; the tests prove each ends in the right typed
//! error, this says how close to the bound it ends.
//!
//! Run: `cargo bench -p allocbox-cli --bench sandbox` (it takes a minute and touches a few
//! GiB of memory: the largest attacks work on 4 GiB blocks).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use allocbox::{Error, Grants, Handler, HandlerBuilder, Limits, Runtime};
use allocbox_artifacts::hostile;

const LIMIT: Duration = Duration::from_secs(1);
const GIB: usize = 1 << 30;

fn limits() -> Limits {
    Limits {
        call_time: LIMIT,
        ..Limits::default()
    }
}

fn probe(probe: &str, arg: u64) -> Handler {
    let policy = Runtime::shared()
        .load_file(allocbox_artifacts::SANDBOX_PROBE.path())
        .unwrap();
    HandlerBuilder::new(Runtime::shared())
        .limits(limits())
        .link_with(&policy, &[("probe", probe), ("arg", &arg.to_string())])
        .build()
        .unwrap()
}

/// What ended a call, in a few words.
fn outcome(result: Result<Option<std::ptr::NonNull<u8>>, Error>) -> String {
    match result {
        Ok(Some(_)) => "served".into(),
        Ok(None) => "none".into(),
        Err(Error::Timeout { policy, .. }) => format!("timeout, `{policy}` named"),
        Err(Error::WorkLimit { bound, .. }) => format!("work limit: {}", bound.name()),
        Err(Error::MemoryLimit { .. }) => "memory limit".into(),
        Err(Error::Trap { message, .. }) => {
            format!("trap: {}", message.chars().take(40).collect::<String>())
        }
        Err(e) => e.to_string(),
    }
}

struct Table {
    rows: Vec<[String; 4]>,
}

impl Table {
    fn timed(&mut self, attack: &str, limit: &str, f: impl FnOnce() -> String) {
        let start = Instant::now();
        let outcome = f();
        let took = start.elapsed();
        self.rows.push([
            attack.into(),
            limit.into(),
            format!("{:.3} s", took.as_secs_f64()),
            outcome,
        ]);
        eprintln!("{attack}: {took:?}");
    }

    fn print(&self, headers: [&str; 4]) {
        let width = |i: usize| {
            self.rows
                .iter()
                .map(|r| r[i].len())
                .chain([headers[i].len()])
                .max()
                .unwrap()
        };
        let widths: Vec<usize> = (0..4).map(width).collect();
        let line = |cells: [&str; 4]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            println!("| {} |", padded.join(" | "));
        };
        line(headers);
        let dashes: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        println!("|-{}-|", dashes.join("-|-"));
        for row in &self.rows {
            line([&row[0], &row[1], &row[2], &row[3]]);
        }
        println!();
    }
}

/// The `allocbox` command's exit code, wall time and peak resident memory in MiB, run
/// from a small Python parent (a child forked from this process would count this
/// process's memory in its peak), without the compile cache.
fn command(args: &[&str], dir: &Path) -> (i32, f64, u64) {
    const MEASURE: &str = "import resource, subprocess, sys, time\n\
        t = time.time()\n\
        run = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n\
        took = time.time() - t\n\
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n\
        print(run.returncode, took, peak)\n";
    let out = Command::new("python3")
        .arg("-c")
        .arg(MEASURE)
        .arg(env!("CARGO_BIN_EXE_allocbox"))
        .args(args)
        .current_dir(dir)
        .env(allocbox::COMPILE_CACHE_ENV, "off")
        .output()
        .expect("python3 runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    let code = words.next().unwrap().parse().unwrap();
    let took = words.next().unwrap().parse().unwrap();
    let peak_kib: u64 = words.next().unwrap().parse().unwrap();
    (code, took, peak_kib >> 10)
}

fn main() {
    let mut time = Table { rows: Vec::new() };

    for (attack, name, arg) in [
        ("WASI: sleep 1 h in malloc (timer + block)", "sleep", 3600),
        (
            "WASI: wait 1 h in malloc (poll on a timer)",
            "poll-sleep",
            3600,
        ),
        ("WASI: spin until the clock moves 100 ms", "spin", 100),
        (
            "WASI: poll 15 M copies of one timer",
            "poll-many",
            15_000_000,
        ),
        (
            "WASI: 64 MiB of random bytes at once",
            "random-bytes",
            64 << 20,
        ),
        ("WASI: stdout handles, never dropped", "streams", 0),
        ("WASI: print 1 MiB, then panic", "print", 1 << 20),
    ] {
        let h = probe(name, arg);
        time.timed(attack, "1 s", || outcome(h.malloc(64)));
    }
    for (attack, name, arg) in [
        ("bytes.copy up, over a 4 GiB block, repeated", "copy-up", 0),
        (
            "bytes.copy down, over a 4 GiB block, repeated",
            "copy-down",
            0,
        ),
        ("bytes.fill of a 4 GiB block, repeated", "fill", 0),
        ("bytes.read of 64 MiB, repeated", "read", 64),
        ("bytes.write of 64 MiB, repeated", "write", 64),
    ] {
        let h = probe(name, arg);
        time.timed(attack, "1 s", || outcome(h.malloc(4 * GIB)));
    }
    for links in [2, 3] {
        let system = Runtime::shared()
            .load_file(allocbox_artifacts::SYSTEM.path())
            .unwrap();
        let broken = Runtime::shared()
            .load_file(allocbox_artifacts::BROKEN.path())
            .unwrap();
        let mut builder = HandlerBuilder::new(Runtime::shared()).limits(limits());
        for _ in 1..links {
            builder = builder.link(&system);
        }
        let h = builder
            .link_with(&broken, &[("fault", "loop-malloc")])
            .build()
            .unwrap();
        time.timed(&format!("the lowest of {links} links loops"), "1 s", || {
            outcome(h.malloc(13))
        });
    }
    {
        let h = HandlerBuilder::new(Runtime::shared())
            .limits(limits())
            .link(
                &Runtime::shared()
                    .load_file(allocbox_artifacts::SYSTEM.path())
                    .unwrap(),
            )
            .build()
            .unwrap();
        let p = h.malloc(2 * GIB).unwrap().unwrap();
        // SAFETY: `p` is a live block of 2 GiB lent by `h`.
        unsafe { p.as_ptr().write_bytes(7, 2 * GIB) };
        time.timed(
            "a client's resize of a 2 GiB block (host copies it)",
            "1 s, given back",
            || {
                let answer = h.realloc(Some(p), 4 * GIB);
                let text = outcome(answer.clone());
                if let Ok(Some(q)) = answer {
                    h.free(Some(q), 4 * GIB).unwrap();
                }
                text
            },
        );
    }
    {
        // One client call causes a magazine refill and the delivery of the event it
        // completes: 0.7 s in each is one call of 1.4 s unless both run under the call's
        // one deadline.
        let quota = Runtime::shared()
            .load_file(allocbox_artifacts::QUOTA.path())
            .unwrap();
        let h = HandlerBuilder::new(Runtime::shared())
            .limits(Limits {
                grants: Grants {
                    clocks: true,
                    ..Grants::default()
                },
                ..limits()
            })
            .link_with(
                &quota,
                &[("observe", "true"), ("batch", "1"), ("dawdle-ms", "700")],
            )
            .build()
            .unwrap();
        time.timed(
            "0.7 s in each guest call one malloc causes (refill, delivery)",
            "1 s",
            || {
                let served = outcome(h.malloc(64));
                match h.failure() {
                    Some(f) => format!(
                        "{served}, then {}: `{}` named",
                        f.kind(),
                        f.policy().unwrap_or("?")
                    ),
                    None => format!("{served}; nothing stopped"),
                }
            },
        );
    }
    time.print(["attack", "call limit", "until stopped", "outcome"]);

    let dir = std::env::temp_dir().join(format!("allocbox-sandbox-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
    write("one.script", "b0 = malloc 64\n");
    write("plain.wat", &hostile::one_byte_blocks(false));
    write("hoard.wat", &hostile::one_byte_blocks(true));
    write("hog.wat", &hostile::memory_and_table_hog());
    for (name, functions) in [("f65k.wasm", 65_520), ("f200k.wasm", 200_000)] {
        let binary = wat::parse_str(hostile::with_functions(functions)).unwrap();
        std::fs::write(dir.join(name), binary).unwrap();
    }
    let mut memory = Table { rows: Vec::new() };
    let mut run = |what: &str, budget: &str, args: &[&str]| {
        let (code, took, peak) = command(args, &dir);
        memory.rows.push([
            what.into(),
            budget.into(),
            format!("{peak} MiB"),
            format!("exit {code}, {took:.2} s"),
        ]);
    };
    run(
        "a plain policy, one malloc",
        "-",
        &["replay", "one.script", "plain.wat"],
    );
    run(
        "memories and 8 tables grown until refused",
        "128 MiB guest memory",
        &["replay", "one.script", "hog.wat"],
    );
    run(
        "1-byte upstream blocks hoarded until refused",
        "256 MiB overhead",
        &[
            "replay",
            "one.script",
            "hoard.wat",
            "--call-time-ms",
            "60000",
        ],
    );
    run(
        "load a policy of 65,530 functions",
        "65,536 functions",
        &["inspect", "f65k.wasm"],
    );
    run(
        "load a policy of 200,010 functions",
        "65,536 functions",
        &["inspect", "f200k.wasm"],
    );
    memory.print(["attack", "bound", "peak resident", "outcome"]);
    let _ = std::fs::remove_dir_all(&dir);
}
