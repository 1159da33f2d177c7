"""`allocbox run`: an unmodified Python program under a policy, its exit status passed
on, a summary of what the policy saw at the end, and input that cannot be used refused
in one sentence before the program starts; and the pytest plugin's recording."""

import subprocess
import sys
import textwrap

import pytest

from conftest import guest


def allocbox_run(tmp_path, *args, program=None, name="program.py"):
    """Run `python -m allocbox run ARGS` in `tmp_path`, with `program` written to
    `name` there first."""
    if program is not None:
        (tmp_path / name).write_text(textwrap.dedent(program))
    return subprocess.run(
        [sys.executable, "-m", "allocbox", "run", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )


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
        (["-p", "guard", "--grant", "telepathy", "program.py"], "telepathy"),
        (["--frobnicate", "program.py"], "--frobnicate"),
        (["-p", "size-classes"], "name the program"),
    ],
)
def test_input_that_cannot_be_used_is_one_sentence_and_exit_2_before_the_program_starts(tmp_path, args, named):
    done = allocbox_run(tmp_path, *args, program="open('started', 'w').close()\n")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("allocbox run: ") and named in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "started").exists(), "the program never started"


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
    events = [line.split() for line in (tmp_path / "t.trace").read_text().splitlines() if not line.startswith("#")]
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
    trace = (tmp_path / "run.trace").read_text()
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
    trace = (tmp_path / "peak.trace").read_text()
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
    events = [line.split() for line in (tmp_path / "t.trace").read_text().splitlines() if not line.startswith("#")]
    freed = {event[1] for event in events if event[0] == "f"}
    live = [int(event[2]) for event in events if event[0] in "mc" and event[1] not in freed]
    assert live.count(8000) == 2, "interpreter shutdown frees them after the recording ended"
