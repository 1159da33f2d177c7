//! `allocbox run`'s command line, in the same clap grammar as every other subcommand:
//! the same errors, usage and `--help`. The program itself runs in Python (the wheel's
//! `allocbox.run`), which asks for its command line parsed here ([`parse_run`]).

use std::ffi::OsString;
use std::path::PathBuf;

use allocbox::mapped::KindGrant;
use clap::{Args, CommandFactory, FromArgMatches};

use crate::arguments::{kind_grant, parse_key_value};
use crate::trace_command::config_per_policy;

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
    policies: Vec<String>,
    /// Configuration for the `init` of the policy named before it, as KEY=VALUE
    /// (repeatable: `-p size-classes -c bucket-depth=7`).
    #[arg(long = "config", short = 'c', value_name = "KEY=VALUE", value_parser = parse_key_value)]
    config: Vec<(String, String)>,
    /// Kinds of memory the policies may ask the host to map for them, comma-separated:
    /// numa, huge-pages, locked, guarded, pinned, device.
    #[arg(long = "grant", value_name = "KINDS", value_delimiter = ',', value_parser = kind_grant)]
    grants: Vec<KindGrant>,
    /// Write every allocation as a binary trace for `allocbox report`, with its time
    /// (whatever the file's name: `trace-convert` writes text); the recording ends with
    /// the program's last line, so what is live then is what leaked.
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
    /// With `--record`: the line of the program's own code behind each allocation, for
    /// the report's tables by line.
    #[arg(long)]
    sites: bool,
    /// Then replay the recording (a temporary one without `--record`) through NumPy's
    /// default, the policy, and each `--compare` policy, into this HTML page.
    #[arg(long, value_name = "PAGE.html")]
    report: Option<PathBuf>,
    /// With `--report`: more policies to compare on the program, comma-separated.
    #[arg(long, value_name = "POLICY,...", value_delimiter = ',')]
    compare: Vec<String>,
    /// Run the module MODULE as `python -m` does; what follows it is its arguments.
    #[arg(short = 'm', value_name = "MODULE", num_args = 1.., allow_hyphen_values = true)]
    module: Option<Vec<OsString>>,
    /// The script to run, and its arguments.
    #[arg(trailing_var_arg = true, value_name = "SCRIPT [ARGS]")]
    script: Vec<OsString>,
}

/// The program `allocbox run` runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Program {
    Script(PathBuf),
    Module(OsString),
}

/// `allocbox run`'s command line, parsed: what Python's `allocbox.run` needs.
#[derive(Debug)]
pub struct RunCommand {
    /// The chain, top first: each policy with its configuration.
    pub chain: Vec<(String, Vec<(String, String)>)>,
    /// The kinds granted, by name.
    pub grants: Vec<&'static str>,
    pub record: Option<PathBuf>,
    pub sites: bool,
    pub report: Option<PathBuf>,
    pub compare: Vec<String>,
    pub program: Program,
    /// The program's own arguments.
    pub args: Vec<OsString>,
}

/// Parse `allocbox run`'s arguments (what follows `run`). On help, or input the grammar
/// refuses, what clap (or the one line of a `-c` before any `-p`) says is printed and
/// the exit status returned: 0 for help, 2 otherwise, as for every subcommand.
pub fn parse_run(args: Vec<OsString>) -> Result<RunCommand, u8> {
    let argv = ["allocbox".into(), "run".into()].into_iter().chain(args);
    let parsed = crate::Cli::command()
        .try_get_matches_from(argv)
        .and_then(|matches| crate::Cli::from_arg_matches(&matches).map(|cli| (cli, matches)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            let _ = e.print();
            return Err(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let crate::Command::Run(run) = cli.command else {
        unreachable!("parsed as `run`");
    };
    let (_, sub) = matches.subcommand().expect("a subcommand is required");
    let configs = match config_per_policy(sub, run.config) {
        Ok(configs) => configs,
        Err(e) => {
            eprintln!("allocbox run: {e}");
            return Err(2);
        }
    };
    let (program, args) = match (run.module, run.script) {
        (Some(module), _) => {
            let mut words = module.into_iter();
            let name = words.next().expect("-m takes at least one value");
            (Program::Module(name), words.collect())
        }
        (None, script) => {
            let mut words = script.into_iter();
            let path = words.next().expect("a script or -m is required");
            (Program::Script(path.into()), words.collect())
        }
    };
    Ok(RunCommand {
        chain: run.policies.into_iter().zip(configs).collect(),
        grants: run.grants.iter().map(|g| g.name()).collect(),
        record: run.record,
        sites: run.sites,
        report: run.report,
        compare: run.compare.into_iter().filter(|c| !c.is_empty()).collect(),
        program,
        args,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(args: &[&str]) -> RunCommand {
        parse_run(args.iter().map(OsString::from).collect()).expect("parses")
    }

    #[test]
    fn each_config_goes_to_the_policy_before_it_and_the_script_keeps_its_own_options() {
        let run = parsed(&[
            "-p",
            "aligned",
            "-c",
            "alignment=128",
            "-p",
            "size-classes",
            "--grant",
            "guarded,numa",
            "prog.py",
            "--flag",
            "-p",
            "3",
        ]);
        assert_eq!(
            run.chain,
            [
                ("aligned".into(), vec![("alignment".into(), "128".into())]),
                ("size-classes".into(), vec![]),
            ]
        );
        assert_eq!(run.grants, ["guarded", "numa"]);
        assert_eq!(run.program, Program::Script("prog.py".into()));
        assert_eq!(run.args, ["--flag", "-p", "3"]);
    }

    #[test]
    fn what_follows_a_module_is_its_arguments_and_a_dashed_script_follows_double_dash() {
        let run = parsed(&["--sites", "-m", "pkg.tool", "-m", "x", "--record", "t"]);
        assert_eq!(run.program, Program::Module("pkg.tool".into()));
        assert_eq!(run.args, ["-m", "x", "--record", "t"]);
        assert!(run.sites && run.record.is_none());
        let run = parsed(&["--", "-weird.py", "-p"]);
        assert_eq!(run.program, Program::Script("-weird.py".into()));
        assert_eq!(run.args, ["-p"]);
    }

    #[test]
    fn a_bad_option_no_program_or_a_config_before_any_policy_is_exit_2() {
        for args in [
            &["--frobnicate", "prog.py"][..],
            &["-p", "size-classes"],
            &["--grant", "telepathy", "prog.py"],
            &["-c", "bucket-depth=7", "-p", "size-classes", "prog.py"],
            &["-c", "no-equals", "-p", "x", "prog.py"],
        ] {
            let args = args.iter().map(OsString::from).collect();
            assert_eq!(parse_run(args).map(drop), Err(2));
        }
        assert_eq!(parse_run(vec!["--help".into()]).map(drop), Err(0));
    }
}
