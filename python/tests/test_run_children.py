"""`allocbox run`'s children: forked ones inherit the policy, ones that start an
interpreter of their own take it up from what `run` hands down, each records into a
trace of its own beside the program's, none prints a summary, and `--report` reads
them all."""

import subprocess
import sys

import pytest

from conftest import allocbox_run, guest, trace_text


def test_a_forked_child_prints_no_summary_and_records_into_a_file_of_its_own(tmp_path):
    done = allocbox_run(
        tmp_path,
        "-p", "system", "--record", "t.trace.gz", "program.py",
        program="""
            import os, numpy as np
            a = np.ones(1000)
            pid = os.fork()
            b = np.ones(2000)
            if pid:
                os.waitpid(pid, 0)
                print("parent")
            else:
                print("child")
        """,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["child", "parent"]
    assert done.stderr.count("placed") == 1, done.stderr
    traces = sorted(p.name for p in tmp_path.glob("t.trace*"))
    assert len(traces) == 2 and traces[0] != "t.trace.gz" or traces[1] == "t.trace.gz", traces
    for trace in traces:
        report = subprocess.run(
            [sys.executable, "-m", "allocbox", "replay-trace", trace, "-p", "default"],
            capture_output=True, text=True, cwd=tmp_path, timeout=600,
        )
        assert report.returncode == 0, (trace, report.stdout, report.stderr)


def test_multiprocessing_children_leave_the_parent_s_trace_whole_and_write_their_own(tmp_path):
    # Found in issue 52: with fork-based multiprocessing children, a .gz recording came
    # out corrupt (children writing the parent's open file).
    done = allocbox_run(
        tmp_path,
        "-p", "system", "--record", "t.trace.gz", "program.py",
        program="""
            import multiprocessing as mp
            import numpy as np

            def work(n):
                return float(np.ones(n * 1000).sum())

            if __name__ == "__main__":
                keep = [np.ones(500) for _ in range(50)]
                with mp.get_context("fork").Pool(2) as pool:
                    print(sum(pool.map(work, range(1, 20))))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "190000.0"
    children = sorted(tmp_path.glob("t.trace.*.gz"))
    assert children, list(tmp_path.iterdir())
    for trace in [tmp_path / "t.trace.gz", *children]:
        replayed = subprocess.run(
            [sys.executable, "-m", "allocbox", "replay-trace", trace.name, "-p", "default"],
            capture_output=True, text=True, cwd=tmp_path, timeout=600,
        )
        assert replayed.returncode == 0, (trace.name, replayed.stdout, replayed.stderr)


def _sizes_in(trace):
    """The sizes of the blocks a text trace's mallocs and callocs ask for."""
    lines = trace_text(trace).splitlines()
    return {int(f[2]) for f in (line.split() for line in lines) if f and f[0] in ("m", "c")}


def test_spawned_workers_and_python_subprocesses_run_under_the_policy_and_record_beside_the_trace(tmp_path):
    done = allocbox_run(
        tmp_path,
        "-p", "size-classes", "--record", "t.trace", "--report", "page.html", "program.py",
        program="""
            import concurrent.futures as cf, multiprocessing as mp, os, subprocess, sys
            import numpy as np, allocbox

            def work(n):
                return os.getpid(), allocbox.handler_name(np.ones(12345))

            if __name__ == "__main__":
                with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
                    seen = list(pool.map(work, range(4)))
                print(*sorted({name for _, name in seen}))
                print(*sorted({pid for pid, _ in seen}))
                child = subprocess.run(
                    [sys.executable, "-c", "import os, numpy as np, allocbox; "
                     "print(os.getpid(), allocbox.handler_name(np.ones(54321)))"],
                    capture_output=True, text=True, check=True,
                )
                print(child.stdout.strip())
        """,
    )
    assert done.returncode == 0, done.stderr
    names, workers, child = done.stdout.splitlines()
    assert names == "size-classes", done.stdout
    child_pid, child_handler = child.split()
    assert child_handler == "size-classes", done.stdout
    for pid in workers.split():
        assert 12345 * 8 in _sizes_in(tmp_path / f"t.trace.{pid}"), pid
    assert 54321 * 8 in _sizes_in(tmp_path / f"t.trace.{child_pid}")
    assert done.stderr.count("allocbox: `size-classes` placed") == 1, "children print no summary: " + done.stderr
    assert "by the program's child processes beside it" in done.stderr, done.stderr
    traces = len(list(tmp_path.glob("t.trace*")))
    assert traces >= 4, list(tmp_path.iterdir())
    page = (tmp_path / "page.html").read_text()
    assert page.count('<section id="trace-') == traces, "a part per trace"


def test_a_child_whose_policy_will_not_load_says_so_and_runs_under_numpy_s_default(tmp_path):
    policy = tmp_path / "mine.wasm"
    policy.write_bytes(guest("size-classes").read_bytes())
    done = allocbox_run(
        tmp_path,
        "-p", policy.name, "program.py", policy.name,
        program="""
            import os, subprocess, sys
            os.remove(sys.argv[1])
            child = subprocess.run(
                [sys.executable, "-c", "import numpy as np; print(np.ones(5).sum())"],
                capture_output=True, text=True,
            )
            print(child.returncode, child.stdout.strip())
            print(child.stderr.strip())
        """,
    )
    assert done.returncode == 0, done.stderr
    status, said = done.stdout.splitlines()
    assert status == "0 5.0", done.stdout
    assert said.startswith("allocbox: process ") and "runs under NumPy's default" in said, said
    assert str(policy) in said, "the policy is named: " + said


@pytest.mark.parametrize("handed", ["{", '{"chain": 5}', '["x"]'])
def test_a_child_handed_what_allocbox_run_never_sets_says_so_and_runs_under_numpy_s_default(tmp_path, handed):
    import os

    child = subprocess.run(
        [sys.executable, "-c", "import numpy as np; print(np.ones(5).sum())"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
        env=dict(os.environ, ALLOCBOX_RUN_CHILD=handed),
    )
    assert (child.returncode, child.stdout) == (0, "5.0\n"), child.stderr
    (said,) = child.stderr.splitlines()
    assert said.startswith("allocbox: process ") and "ALLOCBOX_RUN_CHILD is not what allocbox run sets" in said, said


def test_the_summary_names_many_children_s_traces_by_a_pattern_that_matches_them_all(tmp_path):
    done = allocbox_run(
        tmp_path,
        "-p", "system", "--record", "t.trace.gz", "program.py",
        program="""
            import os, numpy as np
            for _ in range(5):
                pid = os.fork()
                if pid == 0:
                    np.ones(100)
                    os._exit(0)
                os.waitpid(pid, 0)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "and 5 by the program's child processes beside it; read them with " \
        "`allocbox report t.trace.gz t.trace.*.gz -p default -o report.html`" in done.stderr, done.stderr
    assert len(list(tmp_path.glob("t.trace.*.gz"))) == 5
