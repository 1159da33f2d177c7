//! Every file a command writes (`trace-convert`'s output, `report`'s page, a check's
//! regressions, a recording) harms nothing that is there: a link planted beside it is not
//! followed, a folder's files are not removed, a FIFO or a device is not replaced, a
//! read-only file is not written, the input is not the output (through a link too), and
//! each refusal is one line that names the file and what to do.

use super::support::*;

fn one_line(out: &str) -> &str {
    assert_eq!(out.trim().lines().count(), 1, "{out}");
    out.trim()
}

fn mkfifo(path: &std::path::Path) {
    let name = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `name` is a NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o644) }, 0);
}

fn a_trace(dir: &std::path::Path) {
    std::fs::write(dir.join("t.trace"), "m 1 8\n# test_one\nf 1 8\n").unwrap();
}

/// Issue 64: a planted `out.txt.partial` symlink made `trace-convert` overwrite the
/// file the link names.
#[test]
fn trace_convert_follows_no_link_planted_beside_its_output() {
    let dir = tempdir("out-planted");
    a_trace(&dir);
    std::fs::write(dir.join("victim"), "precious").unwrap();
    for planted in ["out.bin.partial", ".out.bin.partial"] {
        std::os::unix::fs::symlink(dir.join("victim"), dir.join(planted)).unwrap();
    }
    let (code, out) = allocbox_cli(&["trace-convert", "t.trace", "out.bin"], &dir);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        std::fs::read_to_string(dir.join("victim")).unwrap(),
        "precious"
    );
    let back = allocbox::trace::read_trace(dir.join("out.bin")).unwrap();
    assert_eq!(back.len(), 2);
}

/// Issue 64: `allocbox trace-convert t.bin .` deleted the user's own `.partial`.
#[test]
fn trace_convert_to_a_folder_is_refused_and_removes_nothing_in_it() {
    let dir = tempdir("out-folder");
    a_trace(&dir);
    std::fs::write(dir.join(".partial"), "the user's").unwrap();
    let (code, out) = allocbox_cli(&["trace-convert", "t.trace", "."], &dir);
    assert_eq!(code, 2, "{out}");
    assert_eq!(
        one_line(&out),
        "allocbox: cannot write `.`: it is a folder; name a file (in it, or elsewhere)"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join(".partial")).unwrap(),
        "the user's"
    );
}

/// Issue 64: an output that was a device node was replaced by a regular file (as root,
/// on the real path, the machine's `/dev/null`). A FIFO stands in for a device.
#[test]
fn trace_convert_and_report_refuse_a_fifo_and_leave_it_one() {
    let dir = tempdir("out-fifo");
    a_trace(&dir);
    mkfifo(&dir.join("out.fifo"));
    for args in [
        &["trace-convert", "t.trace", "out.fifo"][..],
        &["report", "t.trace", "-p", "default", "-o", "out.fifo"],
    ] {
        let (code, out) = allocbox_cli(args, &dir);
        assert_eq!(code, 2, "{out}");
        assert_eq!(
            one_line(&out),
            "allocbox: cannot write `out.fifo`: it is a FIFO (a named pipe), not a regular \
             file; name a regular file"
        );
        let kind = std::fs::symlink_metadata(dir.join("out.fifo")).unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_fifo(&kind.file_type()));
    }
    let (code, out) = allocbox_cli(&["trace-convert", "t.trace", "/dev/null"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(one_line(&out).contains("it is a character device"), "{out}");
}

/// Issue 64: a read-only output was replaced without a word.
#[test]
fn trace_convert_and_report_refuse_a_read_only_output_as_cp_does() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempdir("out-read-only");
    a_trace(&dir);
    let kept = dir.join("kept");
    std::fs::write(&kept, "kept").unwrap();
    std::fs::set_permissions(&kept, std::fs::Permissions::from_mode(0o444)).unwrap();
    for args in [
        &["trace-convert", "t.trace", "kept"][..],
        &["report", "t.trace", "-p", "default", "-o", "kept"],
    ] {
        let (code, out) = allocbox_cli(args, &dir);
        assert_eq!(code, 2, "{out}");
        assert_eq!(
            one_line(&out),
            "allocbox: cannot write `kept`: it is read-only; make it writable (`chmod u+w`) \
             or name another file"
        );
        assert_eq!(std::fs::read_to_string(&kept).unwrap(), "kept");
    }
}

#[test]
fn report_refuses_a_page_that_is_one_of_its_traces_through_a_link() {
    let dir = tempdir("out-is-input");
    a_trace(&dir);
    std::os::unix::fs::symlink(dir.join("t.trace"), dir.join("alias.trace")).unwrap();
    let (code, out) = allocbox_cli(
        &["report", "alias.trace", "-p", "default", "-o", "t.trace"],
        &dir,
    );
    assert_eq!(code, 2, "{out}");
    assert_eq!(
        one_line(&out),
        "allocbox: cannot write `t.trace`: it is `alias.trace`, which this command reads; \
         name another file"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("t.trace")).unwrap(),
        "m 1 8\n# test_one\nf 1 8\n"
    );
    let (code, out) = allocbox_cli(&["trace-convert", "alias.trace", "t.trace"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(one_line(&out).contains("which this command reads"), "{out}");
}

#[test]
fn a_page_written_over_an_older_one_leaves_nothing_beside_it() {
    let dir = tempdir("out-page");
    a_trace(&dir);
    std::fs::write(dir.join("page.html"), "older").unwrap();
    let (code, out) = allocbox_cli(
        &["report", "t.trace", "-p", "default", "-o", "page.html"],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        std::fs::read_to_string(dir.join("page.html"))
            .unwrap()
            .contains("<html")
    );
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["page.html", "t.trace"]);
}

/// A check's regressions folder holding a link where the script goes: the script is
/// written as a file of its own, the link's target untouched.
#[test]
fn a_failing_check_writes_its_script_without_following_a_planted_link() {
    let dir = tempdir("out-regressions");
    let regressions = dir.join("regressions");
    std::fs::create_dir_all(&regressions).unwrap();
    std::fs::write(dir.join("victim"), "precious").unwrap();
    let script = regressions.join("broken.script");
    std::os::unix::fs::symlink(dir.join("victim"), &script).unwrap();
    let (code, out) = allocbox_cli(
        &[
            "check",
            allocbox_artifacts::BROKEN.path(),
            "-c",
            "fault=double-free",
            "--regressions",
            regressions.to_str().unwrap(),
        ],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    assert_eq!(
        std::fs::read_to_string(dir.join("victim")).unwrap(),
        "precious"
    );
    // The link is not written through, so the report names no script it did not write.
    assert!(!out.contains("broken.script"), "{out}");
}

/// A recording goes where it is told, and refuses what `trace-convert` refuses: it
/// never writes through a link or into a device.
#[test]
fn a_recording_refuses_a_link_a_fifo_and_a_folder_and_is_at_its_name_while_it_runs() {
    use allocbox::trace::{RecordOptions, Recorder};
    let dir = tempdir("out-recording");
    std::fs::write(dir.join("victim"), "precious").unwrap();
    std::os::unix::fs::symlink(dir.join("victim"), dir.join("link.trace")).unwrap();
    mkfifo(&dir.join("rec.fifo"));
    let handler = || -> allocbox::nep49::SharedHandler {
        std::sync::Arc::new(allocbox::NumpyDefault::default())
    };
    for (target, says) in [
        ("link.trace", "it is a symbolic link"),
        ("rec.fifo", "it is a FIFO"),
        (".", "it is a folder"),
    ] {
        let error = Recorder::create(&dir.join(target), handler(), RecordOptions::default())
            .map(drop)
            .unwrap_err();
        assert!(error.to_string().contains(says), "{target}: {error}");
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("victim")).unwrap(),
        "precious"
    );
    let path = dir.join("rec.trace");
    std::fs::write(&path, "an older recording").unwrap();
    let recorder = Recorder::create(&path, handler(), RecordOptions::default()).unwrap();
    assert!(
        std::fs::read(&path)
            .unwrap()
            .starts_with(&allocbox::trace::BINARY_MAGIC)
    );
    recorder.finish().unwrap();
    assert!(allocbox::trace::read_trace(&path).unwrap().is_empty());
}

/// Issue 72: whichever command writes, every file it reads, named as its output
/// directly or through a hard link, is refused in one line before any work and keeps
/// its bytes: a trace, a host policy, a device policy.
#[test]
fn every_input_of_every_writing_command_is_refused_as_its_output() {
    let dir = tempdir("out-every-input");
    a_trace(&dir);
    std::fs::copy(allocbox_artifacts::SYSTEM.path(), dir.join("pol.wasm")).unwrap();
    std::fs::copy(allocbox_artifacts::GPU_POOL.path(), dir.join("gpu.wasm")).unwrap();
    let commands: [(&[&str], &[&str]); 3] = [
        (
            &["report", "t.trace", "-p", "pol.wasm", "-o", "OUT"],
            &["t.trace", "pol.wasm"],
        ),
        (
            &[
                "report",
                "t.trace",
                "-p",
                "default",
                "--device-policy",
                "gpu.wasm",
                "-o",
                "OUT",
            ],
            &["t.trace", "gpu.wasm"],
        ),
        (&["trace-convert", "t.trace", "OUT"], &["t.trace"]),
    ];
    for (command, inputs) in commands {
        for input in inputs {
            let linked = format!("{input}.same");
            let _ = std::fs::remove_file(dir.join(&linked));
            std::fs::hard_link(dir.join(input), dir.join(&linked)).unwrap();
            for output in [*input, linked.as_str()] {
                let before = std::fs::read(dir.join(input)).unwrap();
                let args: Vec<&str> = command
                    .iter()
                    .map(|&a| if a == "OUT" { output } else { a })
                    .collect();
                let (code, out) = allocbox_cli(&args, &dir);
                assert_eq!(code, 2, "{args:?}: {out}");
                assert!(
                    one_line(&out).contains("which this command reads"),
                    "{args:?}: {out}"
                );
                assert_eq!(std::fs::read(dir.join(input)).unwrap(), before, "{args:?}");
            }
        }
    }
}

/// Issue 72: a FIFO with no writer held `report` for good, and a pipe was refused as
/// "Illegal seek (os error 29)": a trace that is no regular file is refused at once,
/// by what it is, naming it.
#[test]
fn a_trace_that_is_a_fifo_is_refused_at_once_by_what_it_is() {
    let dir = tempdir("in-fifo");
    mkfifo(&dir.join("t.fifo"));
    for args in [
        &["report", "t.fifo", "-p", "default", "-o", "page.html"][..],
        &["replay-trace", "t.fifo", "-p", "default"],
        &["trace-convert", "t.fifo", "out.txt"],
    ] {
        let (code, out) = allocbox_cli(args, &dir);
        assert_eq!(code, 2, "{args:?}: {out}");
        let line = one_line(&out);
        assert!(
            line.starts_with("allocbox: t.fifo: it is a FIFO or a pipe, not a file"),
            "{args:?}: {line}"
        );
    }
    assert!(!dir.join("page.html").exists() && !dir.join("out.txt").exists());
}
