"""The `guard` policy as NumPy's handler: a write past the end of a guarded array stops
the process with a report naming the array's size, the offset and the line that
allocated it; a canary overrun is reported when the array is freed, and the program goes
on. Memory kinds are granted explicitly, never by default. Each case that may crash runs
in a subprocess."""

import subprocess
import sys
import textwrap
import numpy as np
import pytest

import allocbox


def run_script(tmp_path, body):
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    ), script


def line_of(script, marker):
    lines = script.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line)


def test_a_write_one_byte_past_a_guarded_array_stops_the_process_naming_size_offset_and_line(tmp_path):
    result, script = run_script(
        tmp_path,
        """
        import ctypes
        import numpy as np
        import allocbox

        policy = allocbox.load("guard", {"sample": "1"}, grant=["guarded"])
        allocbox.set_handler(policy)
        a = np.ones(1000, np.uint8)  # the array
        print("allocated", flush=True)
        ctypes.memset(a.ctypes.data + 1000, 7, 1)
        print("not reached", flush=True)
        """,
    )
    assert result.returncode != 0
    assert "allocated" in result.stdout and "not reached" not in result.stdout
    line = line_of(script, "# the array")
    assert "offset 1000 of a 1000-byte array (1 byte(s) past its end)" in result.stderr, result.stderr
    assert "policy `guard`" in result.stderr
    assert f"{script}:{line}" in result.stderr, result.stderr


# `per_thread=True` changes nothing for `guard`, which diagnoses its client (and does
# not say it is shardable): one instance, its reports as ever.
@pytest.mark.parametrize("per_thread", [False, True], ids=["plain", "per_thread asked"])
def test_a_canary_overrun_is_a_warning_at_free_naming_size_offset_and_line_and_the_program_goes_on(
    tmp_path, per_thread
):
    result, script = run_script(
        tmp_path,
        f"""
        import ctypes
        import warnings
        import numpy as np
        import allocbox

        warnings.simplefilter("always", allocbox.ClientMisuseWarning)
        policy = allocbox.load("guard", {{"sample": "1000000"}}, per_thread={per_thread})
        assert policy.instances == 1
        allocbox.set_handler(policy)
        first = np.ones(16, np.uint8)  # sampled: the first allocation
        a = np.ones(1000, np.uint8)  # the array
        ctypes.memset(a.ctypes.data + 1000, 7, 3)
        with warnings.catch_warnings(record=True) as caught:
            del a
        print("warnings", len(caught), caught[0].category.__name__)
        print(caught[0].message)
        print("misuse", policy.stats()["client_misuse"])
        print("still running")
        """,
    )
    assert result.returncode == 0, result.stderr
    line = line_of(script, "# the array")
    assert "warnings 1 ClientMisuseWarning" in result.stdout, result.stdout
    assert "policy `guard` found a misused 1000-byte array" in result.stdout
    assert f"allocated at {script}:{line}" in result.stdout, result.stdout
    assert "3 bytes of the canary after it changed, the first at offset 1000" in result.stdout
    assert "misuse 1" in result.stdout and "still running" in result.stdout


def test_without_the_grant_guard_uses_canaries_and_counts_the_refusals():
    policy = allocbox.load("guard", {"sample": "1"})
    with allocbox.use(policy):
        arrays = [np.ones(100) for _ in range(10)]
        del arrays
    counters = policy.stats()["counters"]
    assert counters["guarded"] == 0
    assert counters["guard-refused"] >= 10
    assert counters["canaries-checked"] >= 10
    assert counters["overruns"] == 0
    [link] = policy.link_stats()
    assert link["counters"] == counters and link["mapped_regions"] == 0
    assert link["ungranted"] == {"guarded": counters["guard-refused"]}


def test_with_the_grant_every_sampled_array_is_in_a_region_of_its_own():
    policy = allocbox.load("guard", {"sample": "1"}, grant=["guarded"])
    with allocbox.use(policy):
        arrays = [np.ones(1000, np.uint8) for _ in range(5)]
        [link] = policy.link_stats()
        assert link["mapped_regions"] >= 5 and link["ungranted"] == {}
        assert all(a.sum() == 1000 for a in arrays)
        del arrays
    assert policy.stats()["counters"]["guarded"] >= 5


def test_an_unknown_grant_is_refused_with_the_names_there_are():
    with pytest.raises(ValueError, match="`gpu` is not a kind of memory.*numa, huge-pages, locked, guarded, pinned or device"):
        allocbox.load("guard", grant=["gpu"])


def test_a_policy_without_counters_reports_an_empty_dict():
    policy = allocbox.load("passthrough" if "passthrough" in allocbox.policies() else "system")
    assert policy.stats()["counters"] == {}
    assert policy.stats()["client_misuse"] == 0


def test_guard_with_sample_1_serves_800_000_live_small_arrays_as_numpy_does(tmp_path):
    # Found on NumPy's own test_large_zip: after 526,782 live arrays every allocation
    # failed, the live guarded regions holding the overhead budget. Guarded regions now
    # take at most half the budget and the policies' share of the process's mappings;
    # the rest get canaries. Run alone: it holds the mapping share while it runs.
    result, _ = run_script(
        tmp_path,
        """
        import numpy as np
        import allocbox

        policy = allocbox.load("guard", {"sample": "1"}, grant=["guarded"])
        with allocbox.use(policy):
            arrays = [np.empty(2) for _ in range(800_000)]
        counters = policy.stats()["counters"]
        print("live", len(arrays), "guarded", counters["guarded"], "canaries",
              counters["guard-refused"] + counters["guard-budget"], flush=True)
        del arrays
        print("failure", policy.failure, flush=True)
        """,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    words = result.stdout.split()
    assert words[0:2] == ["live", "800000"], result.stdout
    guarded, canaries = int(words[3]), int(words[5])
    assert guarded > 1000 and guarded + canaries >= 800_000, result.stdout
    assert "failure None" in result.stdout, result.stdout
