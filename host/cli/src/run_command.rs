//! `allocbox run`'s command line, parsed by the one grammar (`grammar.rs`) as every
//! other subcommand's: the same errors, usage and `--help`. The program itself runs in
//! Python (the wheel's `allocbox.run`), which asks for its command line parsed here
//! ([`parse_run`]).

use std::ffi::OsString;
use std::path::PathBuf;

use crate::grammar::{self, Command};
use crate::trace_command::config_per_policy;

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
    /// `--no-sites`: a report without the program's lines.
    pub no_sites: bool,
    pub report: Option<PathBuf>,
    pub compare: Vec<String>,
    /// `--device-policy`, with its `--device-config`.
    pub device: Option<(String, Vec<(String, String)>)>,
    pub program: Program,
    /// The program's own arguments.
    pub args: Vec<OsString>,
}

/// Parse `allocbox run`'s arguments (what follows `run`). On help, or input the grammar
/// refuses, what clap (or the one line of a `-c` before any `-p`) says is printed and
/// the exit status returned: 0 for help, 2 otherwise, as for every subcommand.
pub fn parse_run(args: Vec<OsString>) -> Result<RunCommand, u8> {
    let argv = ["allocbox".into(), "run".into()].into_iter().chain(args);
    let (cli, matches) = grammar::parse(argv)?;
    // The program, the files its arguments name and the policies: no output of the run
    // (its recording, its report) may replace one.
    for input in cli.command.inputs() {
        allocbox::output::note_input(&input);
    }
    let Command::Run(run) = cli.command else {
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
        no_sites: run.no_sites,
        report: run.report,
        compare: run.compare.into_iter().filter(|c| !c.is_empty()).collect(),
        device: run.device_policy.map(|policy| (policy, run.device_config)),
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
