"""`allocbox run`: an unmodified Python program under a policy, its exit status passed
on, a summary of what the policy saw at the end, and input that cannot be used refused
in one sentence before the program starts; and the pytest plugin's recording."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from conftest import allocbox_run, guest, trace_text


PROGRAM = """
    import sys, threading
    import numpy as np, allocbox
    a = np.arange(100_000)
    seen = []
    t = threading.Thread(target=lambda: seen.append(allocbox.handler_name(np.ones(10))))
    t.start(); t.join()
    print(allocbox.handler_name(a), seen[0], sys.argv[1:])
    sys.exit(3)
"""


def test_a_script_runs_under_the_policy_in_every_thread_and_its_exit_status_is_the_command_s(tmp_path):
    done = allocbox_run(tmp_path, "-p", "size-classes", "program.py", "x", "--y", program=PROGRAM)
    assert done.returncode == 3, done.stderr
    assert done.stdout.split("\n")[0] == "size-classes size-classes ['x', '--y']"
    assert "allocbox: `size-classes` placed" in done.stderr and "peak" in done.stderr, done.stderr


def test_a_module_runs_with_dash_m_as_python_runs_it(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(
        "import numpy as np, allocbox, sys\nprint(allocbox.handler_name(np.ones(5)), __name__, sys.argv[1:])\n"
    )
    done = allocbox_run(tmp_path, "-p", "arena", "-m", "pkg.job", "one")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "arena __main__ ['one']"


def test_each_config_goes_to_the_policy_named_before_it(tmp_path):
    done = allocbox_run(
        tmp_path,
        "-p", "aligned", "-c", "alignment=128", "-p", "size-classes", "-c", "bucket-depth=7",
        "program.py",
        program="import numpy as np, allocbox\na = np.ones(1000)\nprint(allocbox.handler_name(a), a.ctypes.data % 128)\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["aligned>size-classes", "0"]


@pytest.mark.parametrize(
    "args, named",
    [
        (["-p", "size-classes", "missing.py"], "missing.py"),
        (["-p", "size-classes", "-m", "no_such_module_here"], "no_such_module_here"),
        (["-p", "no-such-policy", "program.py"], "no-such-policy"),
        (["-p", "size-classes", "-c", "bukket-depth=7", "program.py"], "bukket-depth"),
        (["-p", "size-classes", "--record", "nodir/t.trace", "program.py"], "nodir"),
        (["-c", "bucket-depth=7", "-p", "size-classes", "program.py"], "-c bucket-depth=7"),
        (["--grant", "guarded", "program.py"], "--grant"),
        (["-p", "size-classes", "--no-sites", "program.py"], "--no-sites"),
        (["--device-policy", "size-classes", "program.py"], "maps no memory of its own"),
    ],
)
def test_input_that_cannot_be_used_is_one_sentence_and_exit_2_before_the_program_starts(tmp_path, args, named):
    done = allocbox_run(tmp_path, *args, program="open('started', 'w').close()\n")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("allocbox run: ") and named in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "started").exists(), "the program never started"


@pytest.mark.parametrize(
    "args, named",
    [
        (["-p", "guard", "--grant", "telepathy", "program.py"], "telepathy"),
        (["--frobnicate", "program.py"], "--frobnicate"),
        (["-p", "size-classes"], "<-m <MODULE>...|SCRIPT [ARGS]>"),
        (["-p"], "--policy <POLICY>"),
    ],
)
def test_a_command_line_the_grammar_refuses_is_its_usage_error_as_for_every_subcommand(tmp_path, args, named):
    # Issue 65: `run` was parsed by hand, with errors of its own; it is the command
    # line's one clap grammar now, its errors those of every subcommand: one line
    # (issue 72: clap's were four), naming the help that says how it is used.
    done = allocbox_run(tmp_path, *args, program="open('started', 'w').close()\n")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("allocbox run: ") and named in lines[0], done.stderr
    assert lines[0].endswith("`allocbox run --help` says how it is used"), done.stderr
    assert not (tmp_path / "started").exists(), "the program never started"


def test_run_help_is_the_command_line_s_own_and_allocbox_help_lists_run(tmp_path):
    done = allocbox_run(tmp_path, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Run a Python program, unmodified, under a policy chain")
    for option in ("--policy", "--config", "--grant", "--record", "--sites", "--report", "--compare", "-m <MODULE>"):
        assert option in done.stdout, option
    listed = subprocess.run([sys.executable, "-m", "allocbox", "--help"], capture_output=True, text=True)
    assert listed.returncode == 0 and "\n  run " in listed.stdout, listed.stdout


def test_the_command_a_run_suggests_for_its_trace_runs_as_printed(tmp_path):
    # Issue 61: the hint "read it with `allocbox report <trace>`" ended in exit 2
    # (`-p` and `-o` are required).
    done = allocbox_run(tmp_path, "--record", "t.trace", "program.py", program="import numpy as np\nnp.ones(10)\n")
    assert done.returncode == 0, done.stderr
    hint = [line for line in done.stderr.splitlines() if "read it with" in line]
    assert len(hint) == 1, done.stderr
    command = hint[0].split("`")[1].split()
    assert command[:2] == ["allocbox", "report"], command
    report = subprocess.run([sys.executable, "-m", "allocbox", *command[1:]], cwd=tmp_path, capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    assert (tmp_path / "report.html").exists()


def test_with_no_policy_it_records_numpy_s_default_and_the_recording_ends_with_the_program(tmp_path):
    done = allocbox_run(
        tmp_path,
        "--record", "t.trace", "program.py",
        program="""
            import numpy as np
            kept = [np.ones(1000) for _ in range(3)]   # leaked into a global
            np.arange(5000).sum()
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "allocbox: `default_allocator` placed" in done.stderr and "t.trace" in done.stderr
    events = [line.split() for line in trace_text(tmp_path / "t.trace").splitlines() if not line.startswith("#")]
    freed = {event[1] for event in events if event[0] == "f"}
    live = [event for event in events if event[0] in "mc" and event[1] not in freed]
    assert [int(event[2]) for event in live].count(8000) == 3, "the three kept arrays are what leaked"


def test_a_policy_failure_prints_its_cause_first(tmp_path):
    done = allocbox_run(
        tmp_path,
        "-p", str(guest("broken")), "-c", "fault=misaligned", "program.py",
        program="""
            import numpy as np
            try:
                np.ones(100)
            except MemoryError:
                print("MemoryError")
        """,
    )
    assert done.returncode == 0 and done.stdout.strip() == "MemoryError", done.stderr
    first = done.stderr.strip().splitlines()[0]
    assert first.startswith("allocbox: policy `broken` was stopped:") and "align" in first, done.stderr


def test_ctrl_c_and_an_uncaught_exception_end_the_program_as_without_allocbox(tmp_path):
    for body, in [("raise KeyboardInterrupt",), ("raise ValueError('no')",)]:
        (tmp_path / "program.py").write_text(body + "\n")
        plain = subprocess.run([sys.executable, "program.py"], capture_output=True, text=True, cwd=tmp_path)
        done = allocbox_run(tmp_path, "-p", "system", "program.py")
        assert done.returncode == plain.returncode, (body, done.stderr)
        assert plain.stderr.strip().splitlines()[-1] in done.stderr
        assert "allocbox: `system` placed" in done.stderr


def test_the_pytest_plugin_records_a_run_and_its_threads_run_under_the_policy(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent(
            """
            import threading, numpy as np, allocbox

            def test_threads_use_the_policy():
                seen = []
                t = threading.Thread(target=lambda: seen.append(allocbox.handler_name(np.ones(3))))
                t.start(); t.join()
                assert seen == ["size-classes"]
                np.arange(123)
            """
        )
    )
    import os

    env = {**os.environ, "ALLOCBOX_POLICY": "size-classes"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "allocbox.pytest_plugin", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, "--allocbox-record", "run.trace", "test_sample.py"],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    trace = trace_text(tmp_path / "run.trace")
    assert any(line.startswith("m ") and line.split()[2] == "984" for line in trace.splitlines()), trace[:500]
    bad = subprocess.run(
        [*command, "--allocbox-record", "nodir/run.trace", "test_sample.py"],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )
    assert bad.returncode == 4 and "nodir" in bad.stderr, bad.stdout + bad.stderr


def test_a_run_recorded_with_sites_names_the_peak_s_function_and_the_leaking_line_in_the_report(tmp_path):
    from conftest import ROOT

    example = ROOT / "examples" / "python" / "peak.py"
    done = allocbox_run(tmp_path, "-p", "size-classes", "--record", "peak.trace", "--sites", str(example))
    assert done.returncode == 0, done.stderr
    trace = trace_text(tmp_path / "peak.trace")
    assert "#@site " in trace and " t=" in trace and " s=" in trace
    report = subprocess.run(
        [sys.executable, "-m", "allocbox", "report", "peak.trace", "-p", "default", "-p", "size-classes", "-o", "peak.html"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert report.returncode == 0, report.stdout + report.stderr
    page = (tmp_path / "peak.html").read_text()
    lines = example.read_text().splitlines()
    cube = next(i for i, line in enumerate(lines, 1) if "cube = np.ones" in line)
    kept = next(i for i, line in enumerate(lines, 1) if "SEEN.append" in line)
    at_peak = page.split('<table class="lines at-peak">', 1)[1].split("</table>", 1)[0]
    first_row = at_peak.split("<tbody>", 1)[1].split("</tr>", 1)[0]
    assert "build_cube" in first_row, first_row
    assert f"{example}:{cube}" in at_peak, at_peak[:2000]
    never_freed = page.split('<table class="lines never-freed">', 1)[1].split("</table>", 1)[0]
    row = next(r for r in never_freed.split("<tr>") if f"{example}:{kept}" in r)
    assert "remember" in row and "<td>3</td>" in row, row
    assert "seconds since the recording started" in page, "the x axis is time"


def test_a_program_under_folders_named_allocbox_and_numpy_has_its_own_lines(tmp_path):
    # Issue 74: the rule that sets aside NumPy's and allocbox's frames matched the text
    # `/allocbox/` and `/numpy/` in a path, so a program under such a folder (a clone of
    # this repository by git's default name) got no line at all.
    folder = tmp_path / "allocbox" / "numpy"
    folder.mkdir(parents=True)
    (folder / "job.py").write_text("import numpy as np\nkept = np.ones(100_000)\n")
    done = allocbox_run(tmp_path, "-p", "size-classes", "--record", "job.trace", "--sites", str(folder / "job.py"))
    assert done.returncode == 0, done.stderr
    sites = [line for line in trace_text(tmp_path / "job.trace").splitlines() if line.startswith("#@site ")]
    assert any(line.endswith(str(folder / "job.py")) and " 2 " in line for line in sites), sites


def test_a_report_names_the_program_s_lines_unless_told_not_to(tmp_path):
    # Issue 61: `--report` without `--sites` made a page with no tables by line and no
    # hint; a report now records the lines unless `--no-sites`.
    program = "import numpy as np\nkeep = [np.ones(100_000) for _ in range(5)]\n"
    done = allocbox_run(tmp_path, "-p", "size-classes", "--report", "lines.html", "job.py", program=program, name="job.py")
    assert done.returncode == 0, done.stderr
    assert "job.py:2" in (tmp_path / "lines.html").read_text(), "the line that made the arrays"
    done = allocbox_run(
        tmp_path, "-p", "size-classes", "--report", "bare.html", "--no-sites", "job.py", program=program, name="job.py"
    )
    assert done.returncode == 0, done.stderr
    assert "job.py:2" not in (tmp_path / "bare.html").read_text()


def test_a_policy_that_asks_for_memory_it_was_not_granted_is_told_how_to_grant_it(tmp_path):
    # Issue 61: `-p guard` without `--grant guarded` checked canaries only, and said so
    # nowhere but a counter.
    done = allocbox_run(tmp_path, "-p", "guard", "program.py", program="import numpy as np\na = np.ones(1000)\n")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "not granted" in line]
    assert len(said) == 1 and "`guard` asked for guarded memory" in said[0], done.stderr
    assert "add `--grant guarded`" in said[0], done.stderr
    done = allocbox_run(
        tmp_path, "-p", "guard", "--grant", "guarded", "program.py", program="import numpy as np\na = np.ones(1000)\n"
    )
    assert "not granted" not in done.stderr, done.stderr


def test_a_report_compares_the_program_s_policy_and_others_with_numpy_s_default(tmp_path):
    done = allocbox_run(
        tmp_path,
        "-p", "size-classes", "-c", "bucket-depth=7", "--report", "job.html", "--compare", "arena,system",
        "program.py",
        program="import numpy as np\nkeep = [np.ones(100_000) for _ in range(5)]\nprint('done')\n",
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
    page = (tmp_path / "job.html").read_text()
    for name in ("size-classes", "arena", "system"):
        assert f"on this trace, `{name}` would have held" in done.stderr, done.stderr
        assert f"on this trace, `{name}` would have held" in page
    assert "report written to job.html" in done.stderr


@pytest.mark.parametrize(
    "args, named",
    [
        (["-p", "size-classes", "--compare", "arena", "program.py"], "--compare"),
        (["-p", "size-classes", "--report", "nodir/r.html", "program.py"], "nodir"),
        (["-p", "size-classes", "--report", "r.html", "--compare", "arenaa", "program.py"], "arenaa"),
    ],
)
def test_a_report_that_cannot_be_made_is_refused_before_the_program_starts(tmp_path, args, named):
    done = allocbox_run(tmp_path, *args, program="open('started', 'w').close()\n")
    assert done.returncode == 2 and named in done.stderr, done.stderr
    assert not (tmp_path / "started").exists()


@pytest.mark.parametrize(
    "args, kept",
    [
        (["-p", "size-classes", "--record", "program.py", "program.py"], "program.py"),
        (["-p", "size-classes", "--report", "program.py", "program.py"], "program.py"),
        (["-p", "pol.wasm", "--record", "pol.wasm", "program.py"], "pol.wasm"),
        (["--device-policy", "pol.wasm", "--record", "pol.wasm", "program.py"], "pol.wasm"),
        (["-p", "size-classes", "--record", "data.csv", "program.py", "--in=data.csv"], "data.csv"),
        (["-p", "size-classes", "--report", "same.csv", "program.py", "data.csv"], "data.csv"),
    ],
)
def test_a_file_the_run_reads_is_refused_as_its_output_before_the_program_starts(tmp_path, args, kept):
    # Issue 72: `--record job.py job.py` replaced the script with a trace, `--report
    # b.py b.py` with a page, and a policy named as its own recording was replaced.
    import shutil

    shutil.copy(guest("gpu-pool"), tmp_path / "pol.wasm")
    (tmp_path / "data.csv").write_text("the user's data\n")
    os.link(tmp_path / "data.csv", tmp_path / "same.csv")
    program = "open('started', 'w').close()\n"
    (tmp_path / "program.py").write_text(program)
    before = (tmp_path / kept).read_bytes()
    done = allocbox_run(tmp_path, *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "which this command reads" in lines[0], done.stderr
    assert not (tmp_path / "started").exists(), "the program never started"
    assert (tmp_path / kept).read_bytes() == before


def test_a_recording_nobody_ended_ends_at_the_program_s_last_line_so_globals_show_as_leaked(tmp_path):
    (tmp_path / "program.py").write_text(
        textwrap.dedent(
            """
            import numpy as np, allocbox
            policy = allocbox.load("system", record="t.trace")
            allocbox.set_handler(policy)
            kept = [np.ones(1000) for _ in range(2)]   # a module global, never freed
            """
        )
    )
    done = subprocess.run([sys.executable, "program.py"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    events = [line.split() for line in trace_text(tmp_path / "t.trace").splitlines() if not line.startswith("#")]
    freed = {event[1] for event in events if event[0] == "f"}
    live = [int(event[2]) for event in events if event[0] in "mc" and event[1] not in freed]
    assert live.count(8000) == 2, "interpreter shutdown frees them after the recording ended"


def _python_and_run(tmp_path, program, *args, run_args=("-p", "system"), stdin=None, module=None):
    """`python prog.py ARGS` and `allocbox run prog.py ARGS` (or `-m MODULE`) in
    `tmp_path`: each one's (exit status, stdout, stderr), allocbox's own lines taken out
    of its stderr and object addresses made alike."""
    import re

    if program is not None:
        (tmp_path / "program.py").write_text(textwrap.dedent(program))
    target = ["-m", module] if module else ["program.py"]

    def ran(command):
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, input=stdin, timeout=600)
        stderr = "".join(line for line in done.stderr.splitlines(True) if not line.startswith("allocbox: "))
        alike = lambda text: re.sub(r"0x[0-9a-f]+", "0x?", text)  # noqa: E731
        return done.returncode, alike(done.stdout), alike(stderr)

    plain = ran([sys.executable, *target, *args])
    under = ran([sys.executable, "-m", "allocbox", "run", *run_args, *target, *args])
    return plain, under


FIDELITY = {
    "name_error_with_its_hint": """
        def f():
            return lenn("x")
        f()
    """,
    "system_exit_3": "import sys\nprint('out')\nsys.exit(3)\n",
    "system_exit_with_a_message": "import sys\nsys.exit('bye')\n",
    "its_own_excepthook": """
        import sys
        def hook(kind, value, tb):
            print("hook saw", kind.__name__, file=sys.stderr)
            sys.exit(9)
        sys.excepthook = hook
        raise ValueError("x")
    """,
    "an_excepthook_that_fails": """
        import sys
        def hook(kind, value, tb):
            raise RuntimeError("hook broke")
        sys.excepthook = hook
        raise ValueError("x")
    """,
    "closing_stdout": "import sys\nprint('hi')\nsys.stdout.close()\n",
    "closing_stderr": "import sys\nprint('hi')\nsys.stderr.close()\n",
    "exiting_in_atexit": """
        import atexit, sys
        def f():
            print("in atexit")
            sys.exit(5)
        atexit.register(f)
        print("main done")
    """,
    "a_syntax_error": "def (\n",
    "a_keyboard_interrupt": "raise KeyboardInterrupt\n",
    "its_file_and_name": "import sys\nprint(__file__, __name__, sys.argv, sys.path[0] == __file__.rsplit('/', 1)[0])\n",
    "a_pickled_class_of_main": """
        import pickle
        class Point:
            pass
        print(type(pickle.loads(pickle.dumps(Point()))).__qualname__)
    """,
}


@pytest.mark.parametrize("name", sorted(FIDELITY))
def test_a_program_sees_under_run_what_it_sees_under_python(tmp_path, name):
    # Issue 52: the program's sys.excepthook, closed standard streams, atexit exits and
    # its traceback (issue 49: no frames of allocbox or runpy, the same path form and
    # hints) are as under plain python, on stdout, stderr and exit status.
    plain, under = _python_and_run(tmp_path, FIDELITY[name], "one", "--two")
    assert under == plain


def test_a_module_reading_standard_input_runs_with_dash_m_as_under_python(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "reader.py").write_text(
        "import sys\nprint(len(sys.stdin.read()), __name__)\nraise SystemExit(len(sys.argv))\n"
    )
    plain, under = _python_and_run(tmp_path, None, "a", stdin="hello\n" * 100, module="pkg.reader")
    assert plain[0] == 2 and plain[1] == "600 __main__\n"
    assert under == plain


def test_a_script_after_dash_dash_runs_even_with_a_dash_in_its_name(tmp_path):
    (tmp_path / "-odd.py").write_text("import sys\nprint(sys.argv[1:])\n")
    done = allocbox_run(tmp_path, "-p", "system", "--", "-odd.py", "x")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['x']\n"


def test_paths_given_to_run_are_resolved_before_a_program_changes_directory(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    done = allocbox_run(
        tmp_path,
        "--record", "t.trace", "--report", "page.html", "program.py",
        program="import os, numpy as np\nos.chdir('elsewhere')\na = np.ones(1000)\n",
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "t.trace").exists() and (tmp_path / "page.html").exists(), done.stderr
    assert not any((tmp_path / "elsewhere").iterdir())


def test_a_recording_with_sites_in_files_of_any_name_is_read_back_by_report(tmp_path):
    # Found in issue 52: code whose file name was empty, blank, or held a tab or a
    # newline made a trace that `report` refused.
    done = allocbox_run(
        tmp_path,
        "--record", "t.trace", "--sites", "program.py",
        program="""
            import numpy as np
            for name in ["", " ", "a\\tb", "x\\ny", "100% sure"]:
                exec(compile("import numpy as np\\nkept = np.ones(1000)\\n", name, "exec"), {})
        """,
    )
    assert done.returncode == 0, done.stderr
    report = subprocess.run(
        [sys.executable, "-m", "allocbox", "report", "t.trace", "-p", "default", "-o", "page.html"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert report.returncode == 0, report.stdout + report.stderr


def test_sites_keep_a_bounded_number_of_code_objects_alive(tmp_path):
    # Found in issue 52: --sites over 200,000 code objects held +135 MiB, every code
    # object it had looked at kept alive.
    done = allocbox_run(
        tmp_path,
        "--record", "t.trace.gz", "--sites", "program.py",
        program="""
            import resource
            import numpy as np
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            for i in range(120_000):
                exec(compile(f"np.ones(1)  # {i}", "generated", "exec"), {"np": np})
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
            print(grown)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 48 << 10, f"{done.stdout.strip()} KiB grown"


def test_numba_imported_after_the_policy_is_set_has_its_arrays_placed_and_recorded(tmp_path):
    # Found in issue 49: under `run`, a program that imports Numba (after the policy is
    # set, as every program under `run` does) had its @njit arrays left out, and the
    # report showed Numba's import-time lines as the peak.
    done = allocbox_run(
        tmp_path,
        "-p", "size-classes", "--record", "t.trace", "--sites", "--report", "page.html", "program.py",
        program="""
            import numba, numpy as np, allocbox

            @numba.njit
            def grids(n):
                return [np.ones((n, n)) for _ in range(5)]

            kept = grids(300)
            print(allocbox.handler_name(kept[0]))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "size-classes", done.stdout + done.stderr
    events = [line.split() for line in trace_text(tmp_path / "t.trace").splitlines() if line[:1] in "mc"]
    assert sum(1 for e in events if int(e[2]) >= 300 * 300 * 8) >= 5, "the five grids are in the trace"
    assert "MiB)" in done.stderr.split(" placed ")[1].split(";")[0], done.stderr
    page = (tmp_path / "page.html").read_text()
    at_peak = page.split('<table class="lines at-peak">', 1)[1].split("</table>", 1)[0]
    first_row = at_peak.split("<tbody>", 1)[1].split("</tr>", 1)[0]
    assert f"{tmp_path / 'program.py'}:8<" in first_row, first_row


def test_a_recording_of_numba_s_parallel_workers_replays_with_each_block_made_before_it_is_freed(tmp_path):
    # Issue 49's binary traces: each thread writes chunks of its own, numbered from one
    # counter, a free's number taken before its block can be handed to another thread.
    # Four workers (on however few cores) making and dropping arrays at once: the trace
    # puts every call back in order, so no free precedes its block's malloc.
    done = allocbox_run(
        tmp_path,
        "-p", "size-classes", "--record", "t.trace", "program.py",
        program="""
            import os
            os.environ["NUMBA_NUM_THREADS"] = "4"
            import numba, numpy as np

            @numba.njit(parallel=True)
            def churn(n):
                total = 0.0
                for i in numba.prange(n):
                    a = np.ones(8 + i % 3)  # a size of its own: not hoisted out of the loop
                    total += a.sum()
                return total

            for _ in range(5):
                churn(20_000)
        """,
    )
    assert done.returncode == 0, done.stderr
    replayed = subprocess.run(
        [sys.executable, "-m", "allocbox", "replay-trace", "t.trace", "-p", "size-classes"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    said = dict(line.split(None, 1) for line in replayed.stdout.splitlines() if line.strip())
    assert said["quirks"].startswith("0 ids not allocated in the trace"), replayed.stdout
    assert "replayed on 1 thread)" not in said["trace"], replayed.stdout
    assert int(said["calls"].split()[0]) >= 100_000, replayed.stdout


def test_a_peak_made_inside_a_library_call_is_the_program_s_line_via_the_library_s(tmp_path):
    # Found in issue 49: a peak made inside SciPy's `cdist` was credited to SciPy's line,
    # not the program's `D = cdist(P, P)`. The library here is a package installed in the
    # user's site-packages (PYTHONUSERBASE), which makes its arrays as `cdist` does.
    import os

    userbase = tmp_path / "userbase"
    env = dict(os.environ, PYTHONUSERBASE=str(userbase))
    packages = subprocess.run(
        [sys.executable, "-c", "import site; print(site.getusersitepackages())"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout.strip()
    os.makedirs(packages)
    with open(os.path.join(packages, "distances.py"), "w") as f:
        f.write(
            "import numpy as np\n"
            "def cdist(a, b):\n"
            "    return np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))\n"
        )
    (tmp_path / "program.py").write_text(
        "import site, sys\n"
        "sys.path.append(site.getusersitepackages())\n"
        "import numpy as np, distances\n"
        "P = np.random.rand(1500, 2)\n"
        "D = distances.cdist(P, P)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "allocbox", "run", "--record", "t.trace", "--sites", "--report", "page.html", "program.py"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "page.html").read_text()
    at_peak = page.split('<table class="lines at-peak">', 1)[1].split("</table>", 1)[0]
    first_row = at_peak.split("<tbody>", 1)[1].split("</tr>", 1)[0]
    program = tmp_path / "program.py"
    assert f"{program}:5 → {packages}/distances.py:3" in first_row, first_row
    assert "&lt;module&gt; → cdist" in first_row, first_row


@pytest.mark.parametrize("option", ["--record", "--report"])
def test_an_output_that_is_a_link_a_fifo_or_read_only_is_refused_before_the_program_runs(tmp_path, option):
    # Issue 64: every file allocbox writes is judged by the one writer, before any work.
    (tmp_path / "victim").write_text("precious")
    (tmp_path / "link").symlink_to(tmp_path / "victim")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "kept").write_text("kept")
    (tmp_path / "kept").chmod(0o444)
    for target, says in [
        ("link", "it is a symbolic link"),
        ("fifo", "it is a FIFO"),
        ("kept", "it is read-only"),
        ("no/such/t", "does not exist"),
    ]:
        done = allocbox_run(tmp_path, option, target, "program.py", program="print('ran')\n")
        assert done.returncode == 2, done.stderr
        assert "ran" not in done.stdout, "the program never started"
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert f"{option}: cannot write `" in lines[0] and f"{target}`: " in lines[0] and says in lines[0], lines
    assert (tmp_path / "victim").read_text() == "precious"
    assert (tmp_path / "kept").read_text() == "kept"




def _run_with_gpu(tmp_path, *args, program, gpu="stand-in"):
    (tmp_path / "cupy.py").write_text((pathlib.Path(__file__).parent / "stand_in_cupy.py").read_text())
    (tmp_path / "job.py").write_text(textwrap.dedent(program))
    env = dict(os.environ)
    env.pop("ALLOCBOX_GPU", None)
    if gpu:
        env["ALLOCBOX_GPU"] = gpu
    return subprocess.run(
        [sys.executable, "-m", "allocbox", "run", *args, "job.py"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )


def test_a_device_policy_places_an_unedited_gpu_program_s_memory_and_records_it(tmp_path):
    # Issue 62: a GPU program had to be edited to use a device policy; its device
    # memory was in no trace.
    program = """
        import numpy as np, cupy
        host = np.ones(1000)
        block = cupy.cuda.alloc(4096)
        print(block.ptr % 256 == 0, block.mem.device_id)
        del block
    """
    done = _run_with_gpu(
        tmp_path,
        *("-p", "size-classes", "--device-policy", "gpu-pool", "--record", "t.trace", "--sites"),
        *("--report", "r.html"),
        program=program,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True 0", done.stdout + done.stderr
    assert "device policy `gpu-pool` placed 1 blocks of GPU 0 (4.0 KiB)" in done.stderr, done.stderr
    events = [line for line in trace_text(tmp_path / "t.trace").splitlines() if not line.startswith("#")]
    gpu = [line for line in events if " d=0" in line]
    assert [line.split()[:3:2] for line in gpu] == [["m", "4096"], ["f", "4096"]], events
    assert any(" d=" not in line and line.startswith(("m ", "c ")) for line in events), "the host's arrays too"
    assert " s=" in gpu[0], "the program's line behind the GPU block"
    page = (tmp_path / "r.html").read_text()
    gpu_part = page[page.index("t.trace, GPU 0</h1>"):]
    # The stand-in CuPy lies beside the program, so its line is the program's own.
    assert "cupy.py:" in gpu_part, "the GPU part's tables name the line that made the block"


def test_a_gpu_program_that_sets_its_own_allocator_keeps_it_and_is_told(tmp_path):
    program = """
        import cupy
        cupy.cuda.set_allocator(lambda size: "its own")
        print(cupy.cuda.alloc(64))
    """
    done = _run_with_gpu(tmp_path, "--device-policy", "gpu-pool", program=program)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "its own"
    assert "the program sets CuPy's allocator itself: it keeps its own" in done.stderr, done.stderr


def test_without_a_gpu_a_device_policy_says_so_and_the_program_runs_with_its_libraries_own(tmp_path):
    import allocbox.cuda

    try:
        allocbox.cuda.load().device_memory()
        pytest.skip("this machine has a GPU")
    except allocbox.AllocboxError:
        pass
    done = _run_with_gpu(tmp_path, "--device-policy", "gpu-pool", program="import cupy\nprint('ran')\n", gpu=None)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran"
    lines = [line for line in done.stderr.splitlines() if "no GPU for device policy `gpu-pool`" in line]
    assert len(lines) == 1 and "keep their own allocators" in lines[0], done.stderr


def test_a_child_process_places_its_gpu_memory_by_the_device_policy_too(tmp_path):
    program = """
        import subprocess, sys
        child = "import numpy, cupy; block = cupy.cuda.alloc(512); del block"
        subprocess.run([sys.executable, "-c", child], check=True)
    """
    done = _run_with_gpu(tmp_path, "--device-policy", "gpu-pool", "--record", "t.trace", program=program)
    assert done.returncode == 0, done.stderr
    children = sorted(tmp_path.glob("t.trace.*"))
    assert len(children) == 1, done.stderr
    events = [line for line in trace_text(children[0]).splitlines() if not line.startswith("#")]
    assert [line.split()[:3:2] for line in events if " d=0" in line] == [["m", "512"], ["f", "512"]], events


def test_an_array_made_in_code_generated_at_run_time_is_named_by_the_program_s_line_that_ran_it(tmp_path):
    # Issue 61: `<string>:1` rows (a dataclass's generated `__init__`, an `exec`) were
    # counted as the program's own lines.
    program = 'import numpy as np\nexec("def make():\\n    return np.ones(100_000)\\n", globals())\nkeep = make()\n'
    done = allocbox_run(tmp_path, "--record", "t.trace", "--sites", "job.py", program=program, name="job.py")
    assert done.returncode == 0, done.stderr
    sites = [line for line in trace_text(tmp_path / "t.trace").splitlines() if line.startswith("#@")]
    assert any(line.startswith("#@site ") and line.endswith("job.py") and " 3 " in line for line in sites), sites
    assert not any(line.startswith("#@site ") and "<string>" in line for line in sites), sites


def test_a_chain_given_to_run_is_replayed_in_the_report_as_the_chain_it_was(tmp_path):
    # Issue 61: `-p aligned -c alignment=128 -p size-classes --report` made a page with
    # only `default` in it, and said nothing of the chain.
    done = allocbox_run(
        tmp_path,
        *("-p", "aligned", "-c", "alignment=128", "-p", "size-classes", "-c", "bucket-depth=7"),
        *("--report", "chain.html", "program.py"),
        program="import numpy as np\nkeep = [np.ones(n) for n in range(1, 300)]\n",
    )
    assert done.returncode == 0, done.stderr
    assert "aligned>size-classes" in done.stderr, done.stderr
    assert "`aligned&gt;size-classes` would have held" in (tmp_path / "chain.html").read_text()
