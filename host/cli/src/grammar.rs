//! The command line's one grammar (clap): every subcommand, `run` included, with the
//! options they share.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use allocbox::mapped::KindGrant;
use allocbox::{CompileBound, Limits};
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::arguments::{
    at_least_one, batch_limit, call_time_ms, check_seconds, client_threads, device_memory,
    guest_memory, kind_grant, max_ops, overhead, parse_compile_bound, parse_key_value,
};
use crate::{convert, new_policy};

#[derive(Parser)]
#[command(
    name = "allocbox",
    version,
    about = "Sandboxed, checkable NEP 49 allocation policies"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Allow a policy of this shape to be compiled, as NAME=N (repeatable): `functions`
    /// [default: 65536], `code-bytes` [32 MiB], `function-bytes` [2 MiB], `data-bytes`
    /// [32 MiB], `modules` [32], `text-bytes` (WAT) [16 MiB]. A policy past one is
    /// refused before it is compiled.
    #[arg(long = "compile-bound", global = true, value_parser = parse_compile_bound)]
    pub(crate) compile_bounds: Vec<(CompileBound, u64)>,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Fuzz the handler contract of policies: random malloc/calloc/realloc/free sequences
    /// with every check on; a failure is shrunk to a short replayable script. With no
    /// file, checks the built-in default policy.
    Check {
        /// Policies: shipped ones by name (`system`, `aligned`, `size-classes`, `arena`,
        /// `builtin`), components (.wasm) or WAT sources (.wat).
        policies: Vec<PathBuf>,
        /// Rounds of `--cases` sequences to run on each policy, each from a seed of its
        /// own drawn from `--seed` (every fourth round long-lived instances of thousands
        /// of operations): the same work, and the same verdict, on any machine.
        #[arg(long, default_value_t = allocbox_check::DEFAULT_ROUNDS, value_parser = at_least_one::<u32>)]
        rounds: u32,
        /// Random sequences per round.
        #[arg(long, default_value_t = 64, value_parser = at_least_one::<u32>)]
        cases: u32,
        /// Most seconds to spend on each policy: a cap that stops the rounds early (the
        /// report says so), so a slower machine may check less than a faster one.
        /// Default: no cap.
        #[arg(long, allow_negative_numbers = true, value_parser = check_seconds)]
        time: Option<f64>,
        /// Seed, for a run that repeats exactly.
        #[arg(long)]
        seed: Option<u64>,
        /// Most operations per sequence (per thread).
        #[arg(long, default_value_t = 128, value_parser = max_ops)]
        max_ops: usize,
        /// Client threads calling one handler at once.
        #[arg(long, default_value_t = 1, value_parser = client_threads)]
        threads: usize,
        /// One JSON report per line instead of text.
        #[arg(long)]
        json: bool,
        /// Where failing seeds and scripts are kept [default: `regressions` in the user's
        /// cache directory, `~/.cache/allocbox/regressions`]; the report names the file.
        #[arg(long, value_name = "DIR")]
        regressions: Option<PathBuf>,
        /// Configuration passed to every policy's `init`, as KEY=VALUE (repeatable).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        hook: HookArg,
        #[command(flatten)]
        limits: LimitArgs,
        #[command(flatten)]
        work: CallWorkArg,
    },
    /// Convert a trace between the binary form recordings write and the text form
    /// (`op id size thread` lines) people read and write by hand.
    TraceConvert {
        /// The trace to convert (either form).
        input: PathBuf,
        /// Where to write it; replaced only once written whole. Text is gzip-compressed
        /// when the name ends in `.gz`.
        output: PathBuf,
        /// The form to write [default: text when the output's name ends in `.txt` or
        /// `.txt.gz`, else the other form than the input's].
        #[arg(long, value_enum)]
        to: Option<convert::Form>,
    },
    /// Replay an allocation trace (binary, or `op id size thread` lines, plain or gzip) through a
    /// handler and report time per event, peak bytes, corrections and the first failing
    /// event. Exit 1 if an event fails, or if a policy still holds host memory once every
    /// block is freed and it is trimmed (a leak).
    ReplayTrace {
        trace: PathBuf,
        /// The chain, top first: a shipped policy's name (`size-classes`, ...), a policy
        /// file, `default` (NumPy's default handler, natively) or `builtin` (the built-in
        /// default policy). Default: `default`.
        #[arg(long = "policy", short = 'p')]
        policies: Vec<String>,
        /// Configuration for the `init` of the policy named before it, as KEY=VALUE
        /// (repeatable: `-p aligned -c alignment=128 -p size-classes -c bucket-depth=7`).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        hook: HookArg,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Replay an allocation trace through each handler, one event after another on one
    /// thread, and write one self-contained HTML page comparing them: live and held bytes
    /// over time, the peak and the test it fell in (the trace's comment lines), the
    /// phases with the most bytes and overhead, where the most each handler held went
    /// by size class, what the trace left live, held/live, time per event, request
    /// sizes, the first failing event. Prints a summary table (or JSON). Exit 1 if an event fails in any handler, or a
    /// policy leaks (the page is still written).
    Report {
        /// The trace: `op id size thread` lines, plain or gzip. Several (a program's and
        /// its child processes', as `allocbox run` writes them) make one page, a part
        /// per trace, each replayed on its own.
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// A handler (repeatable, at least one): `default` (NumPy's default handler,
        /// natively), a shipped policy's name (`size-classes`, ..., `builtin`), a policy
        /// file, or a chain of them written `top>next` (`-c LINK:KEY=VALUE` configures
        /// its link `LINK`), each on its own over the host's memory.
        #[arg(long = "policy", short = 'p', required = true)]
        policies: Vec<String>,
        /// Where the HTML page is written.
        #[arg(long, short = 'o')]
        output: PathBuf,
        /// Print the summary as JSON (an array, one object per handler).
        #[arg(long)]
        json: bool,
        /// Configuration for the `init` of the policy named before it, as KEY=VALUE
        /// (repeatable: `-p size-classes -c bucket-depth=7 -p arena`; `default` takes
        /// none).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        hook: HookArg,
        #[command(flatten)]
        limits: LimitArgs,
        /// A device policy (repeatable) that each GPU's events of the trace are replayed
        /// through, each on its own, on a stand-in GPU (no GPU is needed): a shipped
        /// policy's name or a policy file [default: gpu-pool].
        #[arg(long = "device-policy", value_name = "POLICY")]
        device_policies: Vec<String>,
        /// The memory of each stand-in GPU, as bytes or with a unit (`80GiB`): a device
        /// policy may map all of it, and caches within it (not within `--overhead`); one
        /// that needs more runs out, which fails the report [default: 80 GiB].
        #[arg(long, value_parser = device_memory)]
        device_memory: Option<u64>,
    },
    /// Run a script (one operation a line, as `check` prints it) through a policy with
    /// every check on.
    #[command(after_help = allocbox_check::SCRIPT_NOTATION)]
    Replay {
        /// The script: as `check` printed and saved it, or written by hand.
        script: PathBuf,
        /// A shipped policy's name or a policy file; with none, the built-in default
        /// policy.
        policy: Option<PathBuf>,
        /// Configuration passed to the policy's `init`, as KEY=VALUE (repeatable).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        limits: LimitArgs,
        #[command(flatten)]
        work: CallWorkArg,
    },
    /// Show what a policy is: name, version, alignment, world, imports, exports, size.
    /// With no file, the built-in default policy.
    Inspect {
        /// A shipped policy's name, a policy component (.wasm) or WAT source (.wat).
        policy: Option<PathBuf>,
        /// Configuration passed to the policy's `init`, as KEY=VALUE (repeatable).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
    },
    Run(RunArgs),
    /// Start a policy project in `./NAME` that builds with one command and passes `check`
    /// as it stands; its README.md says how to build, check and test it.
    New {
        /// The policy's name: a crate name (letters, digits, `-`, `_`; 1..=64 bytes).
        name: String,
        /// `rust` (a cargo project over the allocbox-policy SDK), `wat` (WebAssembly
        /// text, nothing to build), or `c`, `zig`, `assemblyscript` (`as`), `python`, `go`,
        /// `js` (`javascript`) (a `./build.sh` project with a `./setup.sh` that installs
        /// its toolchain).
        #[arg(long, value_parser = new_policy::parse_lang)]
        lang: new_policy::Lang,
        /// The project's directory, instead of `./NAME`; it must not exist or be empty.
        #[arg(long)]
        path: Option<PathBuf>,
    },
}

impl Command {
    /// Every file the command reads, as its arguments name it: noted before any work
    /// (`allocbox::output::note_input`), so that no output of any command replaces one,
    /// whichever order the command reads and writes in. A name that is no file (a
    /// shipped policy's, `builtin`) notes nothing. Under `run`, the program reads what
    /// its arguments name, so every argument naming a file is one (and the value of an
    /// argument `--OPTION=FILE`).
    pub(crate) fn inputs(&self) -> Vec<PathBuf> {
        let policy_names = |names: &[String]| -> Vec<PathBuf> {
            // A report's chain is `top>next`, each a name or a file.
            names
                .iter()
                .flat_map(|name| name.split('>'))
                .map(PathBuf::from)
                .collect()
        };
        match self {
            Command::Check { policies, hook, .. } => {
                policies.iter().cloned().chain(hook.path.clone()).collect()
            }
            Command::TraceConvert { input, .. } => vec![input.clone()],
            Command::ReplayTrace {
                trace,
                policies,
                hook,
                ..
            } => [trace.clone()]
                .into_iter()
                .chain(policy_names(policies))
                .chain(hook.path.clone())
                .collect(),
            Command::Report {
                traces,
                policies,
                hook,
                device_policies,
                ..
            } => traces
                .iter()
                .cloned()
                .chain(policy_names(policies))
                .chain(policy_names(device_policies))
                .chain(hook.path.clone())
                .collect(),
            Command::Replay { script, policy, .. } => {
                [script.clone()].into_iter().chain(policy.clone()).collect()
            }
            Command::Inspect { policy, .. } => policy.iter().cloned().collect(),
            Command::Run(run) => {
                let program = run.module.iter().flatten().skip(1).chain(&run.script);
                let named_by_arguments = program.flat_map(|word| {
                    let value: Option<PathBuf> = word
                        .to_str()
                        .and_then(|w| w.split_once('=').map(|(_, value)| PathBuf::from(value)));
                    [Some(PathBuf::from(word)), value].into_iter().flatten()
                });
                policy_names(&run.policies)
                    .into_iter()
                    .chain(policy_names(&run.compare))
                    .chain(run.device_policy.iter().map(PathBuf::from))
                    .chain(named_by_arguments)
                    .collect()
            }
            Command::New { .. } => Vec::new(),
        }
    }
}

/// `--hook`, the same for every command that replays events.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct HookArg {
    /// An event hook told about every block each policy or handler lends, resizes and
    /// frees (one instance each; in `check`, shrinking included), its report printed
    /// after their results: a shipped hook's name (`sizes`, `counting`) or a hook
    /// component (.wasm, .wat).
    #[arg(long = "hook", value_name = "HOOK")]
    pub(crate) path: Option<PathBuf>,
}

/// The bounds on every policy instance ([`Limits`]); each defaults to the library's.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct LimitArgs {
    /// Longest one call into a policy may run, time in its imports included, in ms
    /// [default: 1000; for check and replay a safety net of 10000 beside --call-work].
    #[arg(long, value_parser = call_time_ms)]
    call_time_ms: Option<u64>,
    /// Most bytes of its own memory a policy may grow to, as bytes or with a unit
    /// (`64MiB`, `1GiB`) [default: 128 MiB].
    #[arg(long, value_parser = guest_memory)]
    guest_memory: Option<u64>,
    /// Most blocks one malloc-many or free-many may ask of the host [default: 4096].
    #[arg(long, value_parser = batch_limit)]
    batch_limit: Option<u32>,
    /// Most bytes a policy may hold from upstream beyond what its client holds and asks
    /// for, as bytes or with a unit; past it, upstream requests are answered
    /// out-of-memory [default: 256 MiB].
    #[arg(long, value_parser = overhead)]
    overhead: Option<u64>,
    #[arg(long = "grant", value_name = "KINDS", value_delimiter = ',', value_parser = kind_grant, help = grant_help())]
    grants: Vec<KindGrant>,
}

impl LimitArgs {
    pub(crate) fn limits(&self, call_time: Duration) -> Limits {
        let defaults = Limits::default();
        Limits {
            call_time: self.call_time_ms.map_or(call_time, Duration::from_millis),
            memory: self.guest_memory.unwrap_or(defaults.memory),
            batch: self.batch_limit.unwrap_or(defaults.batch),
            overhead: self.overhead.unwrap_or(defaults.overhead),
            grants: allocbox::Grants {
                memory: self.grants.iter().fold(Default::default(), |mut all, &g| {
                    all.grant(g);
                    all
                }),
                ..defaults.grants
            },
            ..defaults
        }
    }
}

/// `--call-work`: the counted limit of checking runs (`check`, `replay`).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct CallWorkArg {
    /// Most work one call into a policy may do in `check` and `replay`, counted rather
    /// than timed so that the verdict is the same on a busy machine: about a unit per
    /// wasm instruction of the policy's, the host's work in its imports counted apart
    /// by what it moves (a unit per 8 bytes) [default: 200000000]. `--call-time-ms` is
    /// then only a safety net against a machine too slow to finish the work.
    #[arg(long, value_name = "UNITS", value_parser = at_least_one::<u64>)]
    pub(crate) call_work: Option<u64>,
}

impl CallWorkArg {
    /// `limits` with the counted limit given.
    pub(crate) fn apply(&self, limits: Limits) -> Limits {
        Limits {
            call_work: self.call_work.unwrap_or(limits.call_work),
            ..limits
        }
    }
}

/// The wall clock's limit on a call in checking runs: a safety net far above the
/// counted limit (`--call-work`), which decides; past it the check says the machine was
/// too slow, never that the policy broke a rule.
pub(crate) const CHECK_CALL_TIME: Duration = allocbox_check::CHECK_CALL_TIME;
/// The device policy `report` replays a trace's GPU memory through unless told.
pub(crate) const DEFAULT_DEVICE_POLICY: &str = "gpu-pool";
/// A stand-in GPU's memory unless told: an 80 GB data-centre GPU's.
pub(crate) const DEFAULT_DEVICE_MEMORY: u64 = 80 << 30;

/// Run a Python program, unmodified, under a policy chain: NumPy's handler for the
/// program and every thread it starts, and the arrays Numba's compiled code makes.
///
/// Each `-p` adds a policy to the chain, top first (a shipped policy's name, `builtin`,
/// or a path); each `-c KEY=VALUE` configures the `-p` before it. With no `-p`, the
/// program runs under NumPy's default handler (allocbox's native copy of it, so that
/// `--record` can record it). The program's exit status is the command's; at the end a
/// few lines on standard error say what the policy saw. Input that cannot be used is one
/// sentence and exit status 2, before the program starts. Otherwise the program sees
/// what `python SCRIPT` or `python -m MODULE` gives it: its own `__main__`, `sys.argv`,
/// standard streams, traceback and exit status (`--` ends the options before a script's
/// name). Every Python process the program starts (forked, spawned by
/// `multiprocessing`, or a `subprocess` running this environment's Python) runs under
/// the same policy and records into a trace of its own beside the program's
/// (`TRACE.PID`). Needs the Python package (the wheel's `allocbox` command, or `python
/// -m allocbox run`).
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("program").required(true).args(["module", "script"])))]
pub(crate) struct RunArgs {
    /// A policy of the chain, top first (repeatable): a shipped policy's name
    /// (`size-classes`, ...), `builtin`, or a policy file.
    #[arg(long = "policy", short = 'p', value_name = "POLICY")]
    pub(crate) policies: Vec<String>,
    /// Configuration for the `init` of the policy named before it, as KEY=VALUE
    /// (repeatable: `-p size-classes -c bucket-depth=7`).
    #[arg(long = "config", short = 'c', value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub(crate) config: Vec<(String, String)>,
    #[arg(long = "grant", value_name = "KINDS", value_delimiter = ',', value_parser = kind_grant, help = grant_help())]
    pub(crate) grants: Vec<KindGrant>,
    /// Write every allocation as a binary trace for `allocbox report`, with its time
    /// (whatever the file's name: `trace-convert` writes text); the recording ends with
    /// the program's last line, so what is live then is what leaked.
    #[arg(long, value_name = "FILE")]
    pub(crate) record: Option<PathBuf>,
    /// With `--record`: the line of the program's own code behind each allocation, for
    /// the report's tables by line (with `--report` they are recorded unless
    /// `--no-sites`).
    #[arg(long)]
    pub(crate) sites: bool,
    /// With `--report`: record no lines of the program's code (a recording a little
    /// cheaper; the page then has no tables by line).
    #[arg(long, conflicts_with = "sites")]
    pub(crate) no_sites: bool,
    /// Then replay the recording (a temporary one without `--record`) through NumPy's
    /// default, the policy, and each `--compare` policy, into this HTML page.
    #[arg(long, value_name = "PAGE.html")]
    pub(crate) report: Option<PathBuf>,
    /// With `--report`: more policies to compare on the program, comma-separated.
    #[arg(long, value_name = "POLICY,...", value_delimiter = ',')]
    pub(crate) compare: Vec<String>,
    /// A device policy (a shipped policy's name, `gpu-pool`, or a file) that places the
    /// GPU memory of PyTorch, CuPy and Numba's CUDA target, installed as each is
    /// imported, before it starts CUDA: the program runs unedited. A program that sets
    /// its own allocator keeps it, and a line says so; without a CUDA driver a line says
    /// so and the libraries keep their own allocators. With `--record`, its blocks are
    /// in the trace, each with its GPU.
    #[arg(long, value_name = "POLICY")]
    pub(crate) device_policy: Option<String>,
    /// Configuration for the `init` of `--device-policy`, as KEY=VALUE (repeatable).
    #[arg(long = "device-config", value_name = "KEY=VALUE", value_parser = parse_key_value, requires = "device_policy")]
    pub(crate) device_config: Vec<(String, String)>,
    /// Run the module MODULE as `python -m` does; what follows it is its arguments.
    #[arg(short = 'm', value_name = "MODULE", num_args = 1.., allow_hyphen_values = true)]
    pub(crate) module: Option<Vec<OsString>>,
    /// The script to run, and its arguments.
    #[arg(trailing_var_arg = true, value_name = "SCRIPT [ARGS]")]
    pub(crate) script: Vec<OsString>,
}

/// `--grant`'s help, its kinds named from the one list of them.
fn grant_help() -> String {
    format!(
        "Kinds of memory the policies may ask the host to map for them, comma-separated: {} \
         [default: none]",
        allocbox::mapped::kind_list()
    )
}

/// Parse a command line (the program's name first) by the grammar: the command and
/// its matches (which say where each option stood), or, after printing clap's help or
/// error, the exit status to end with: 0 for help and version, 2 for a usage error. A
/// usage error is one line (clap's message and its tip, the user's own text escaped),
/// naming the `--help` that says how the command is used.
pub(crate) fn parse<I, T>(args: I) -> Result<(Cli, ArgMatches), u8>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    parse_or_say(args).map_err(|stop| match stop {
        Stop::Help(e) => {
            // Help and version are printed to stdout and succeed.
            let _ = e.print();
            u8::try_from(e.exit_code()).unwrap_or(0)
        }
        Stop::Usage(line) => {
            eprintln!("{line}");
            2
        }
    })
}

/// Why a command line parsed to no command.
#[derive(Debug)]
pub(crate) enum Stop {
    /// Help or the version was asked for: clap's, to print.
    Help(clap::Error),
    /// A usage error, in one line.
    Usage(String),
}

/// [`parse`], printing nothing.
pub(crate) fn parse_or_say<I, T>(args: I) -> Result<(Cli, ArgMatches), Stop>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let parsed = Cli::command()
        .try_get_matches_from(&args)
        .and_then(|matches| Cli::from_arg_matches(&matches).map(|cli| (cli, matches)));
    parsed.map_err(|e| match e.use_stderr() {
        false => Stop::Help(e),
        true => Stop::Usage(usage_error_line(&e, &args)),
    })
}

/// A usage error in one line: `allocbox SUB: MESSAGE; tip: ...; `allocbox SUB --help`
/// says how it is used`, every control character and bidirectional override the user
/// typed shown escaped.
fn usage_error_line(e: &clap::Error, args: &[OsString]) -> String {
    let rendered = e.render().to_string();
    let said: Vec<&str> = rendered
        .lines()
        .map(str::trim)
        .take_while(|line| !line.starts_with("Usage:"))
        .filter(|line| !line.is_empty() && !line.starts_with("For more information"))
        .map(|line| line.strip_prefix("error: ").unwrap_or(line))
        .collect();
    let command = Cli::command();
    let sub = args
        .iter()
        .skip(1)
        .filter_map(|a| a.to_str())
        .find(|a| command.find_subcommand(a).is_some());
    let named = sub.map_or("allocbox".to_string(), |sub| format!("allocbox {sub}"));
    // A line that ends in `:` leads into the next (the arguments not provided).
    let mut message = String::new();
    for line in said {
        if !message.is_empty() {
            message += if message.ends_with(':') { " " } else { "; " };
        }
        message += line;
    }
    let text = format!("{named}: {message}; `{named} --help` says how it is used");
    allocbox::untrusted::escape(&text)
}
