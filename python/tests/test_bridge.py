"""The NumPy bridge: NumPy's own handler-API behaviours (numpy/_core/tests/
test_mem_policy.py) with wasm policies, and what a broken policy does inside NumPy.
Threads and processes: `test_threads.py`."""

import gc
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import allocbox
from conftest import guest, trace_text

# What the wheel carries, by name; and the good policies only the repository has (paths),
# in every language.
SHIPPED = ["aligned", "arena", "gpu-pool", "guard", "numa", "size-classes", "system", "torch-caching"]
# `gpu-pool` and `torch-caching` place arrays only in GPU memory they are granted
# (tests/test_cuda.py).
DEVICE_ONLY = ("gpu-pool", "torch-caching")
GOOD = [*(s for s in SHIPPED if s not in DEVICE_ONLY), "template", "binning", "buddy", "slab", "limit", "bump", "tracker"]


@pytest.fixture
def size_classes():
    return allocbox.load("size-classes")


def test_the_package_ships_its_policies_each_with_a_description():
    shipped = allocbox.policies()
    assert sorted(shipped) == SHIPPED
    for name, description in shipped.items():
        assert isinstance(description, str) and len(description) > 20, name


def test_the_readme_lists_the_policies_the_wheel_carries():
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    listed = readme.split("Its wheel carries the shipped policies (", 1)[1].split(")", 1)[0]
    names = sorted(name.strip(" `\n") for name in listed.split(","))
    assert names == sorted(allocbox.policies()), listed


@pytest.mark.skipif(not os.environ.get("ALLOCBOX_TEST_INSTALLED"), reason="develop build")
def test_the_package_under_test_is_the_installed_wheel():
    # CI installs the built wheel into a fresh venv: a file missing from it fails here.
    assert "site-packages" in allocbox.__file__
    assert "site-packages" in allocbox._allocbox.__file__


def test_an_unknown_policy_name_is_a_load_error_naming_the_shipped_ones():
    with pytest.raises(allocbox.LoadError, match="no shipped policy or file named 'size-clases'.*size-classes"):
        allocbox.load("size-clases")
    with pytest.raises(allocbox.LoadError, match="cannot read"):
        allocbox.load("no/such/policy.wasm")


def test_builtin_is_a_name_as_on_the_command_line():
    policy = allocbox.load("builtin")
    with allocbox.use(policy):
        a = np.ones(100)
    assert a.sum() == 100.0
    assert allocbox.handler_name(a) == policy.name


def test_the_builtin_policy_loads_by_the_name_it_gives_itself_too():
    named = allocbox.load("builtin").name
    assert named == "passthrough"
    assert allocbox.load(named).name == named, "the name handler_name shows loads it"
    with pytest.raises(allocbox.LoadError, match="builtin \\(the `passthrough` policy\\)"):
        allocbox.load("passthru")


def test_shipped_policies_chain_by_name():
    chain = allocbox.load_chain(("aligned", {"alignment": "128"}), "size-classes")
    with allocbox.use(chain):
        a = np.arange(1000.0)
    assert allocbox.handler_name(a) == chain.name
    assert a.ctypes.data % 128 == 0
    assert a.sum() == 499500.0


def test_counters_are_documented_add_up_and_a_chain_is_named_by_all_its_links():
    chain = allocbox.load_chain(("aligned", {"alignment": "64"}), "size-classes")
    assert chain.name == "aligned>size-classes"
    assert [link["name"] for link in chain.link_stats()] == ["aligned", "size-classes"]
    policy = allocbox.load("size-classes")
    with allocbox.use(policy):
        arrays = [np.ones(n) for n in range(1, 60)]
        del arrays[::2]
        stats, links = policy.stats(), policy.link_stats()
    for name in stats:
        assert f"`{name}`" in allocbox.Policy.stats.__doc__, name
    for name in links[0]:
        assert f"`{name}`" in allocbox.Policy.link_stats.__doc__, name
    assert stats["live_blocks"] >= 29 and stats["cached_blocks"] > 0, stats
    assert links[0]["live_blocks"] == stats["live_blocks"] + stats["cached_blocks"], (stats, links)
    assert stats["mallocs"] >= 59 and links[0]["malloc_many"] > 0, (stats, links)


def test_new_arrays_views_and_bases_report_their_handler(size_classes):
    with allocbox.use(size_classes):
        a = np.arange(100)
        view = a[::3]
        assert allocbox.handler_name(a) == "size-classes"
        assert allocbox.handler_name(view) is None
        assert allocbox.handler_name(view.base) == "size-classes"
        assert allocbox.handler_name() == "size-classes"
        assert np._core.multiarray.get_handler_version(a) == 1
    assert allocbox.handler_name() == "default_allocator"
    assert allocbox.handler_name(a) == "size-classes", "an array keeps its handler"


def test_set_handler_returns_the_previous_and_none_restores_the_default_singleton(size_classes):
    default = allocbox.get_handler()
    previous = allocbox.set_handler(size_classes)
    try:
        assert previous is default
        assert allocbox.get_handler() is size_classes.capsule()
    finally:
        allocbox.set_handler(None)
    assert allocbox.get_handler() is default, "the same default capsule object"


def test_an_invalid_handler_is_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="Policy"):
        allocbox.set_handler("not a handler")
    with pytest.raises(TypeError):
        allocbox.set_handler(object())


def test_arrays_outliving_a_switch_are_freed_by_their_own_handler(size_classes):
    with allocbox.use(size_classes):
        kept = [np.full(n, n, dtype=np.int64) for n in (1, 10, 1000, 100_000)]
    live = size_classes.stats()["live_blocks"]
    assert live == 4
    arena = allocbox.load("arena")
    with allocbox.use(arena):
        del kept
        gc.collect()
    assert size_classes.stats()["live_blocks"] == 0
    assert arena.stats()["frees"] == 0


@pytest.mark.parametrize("name", GOOD)
def test_every_good_policy_places_arrays_numpy_computes_with_correctly(name):
    policy = allocbox.load(name if name in SHIPPED else guest(name))
    rng = np.random.default_rng(7)
    sizes = [0, 1, 7, 100, 4096, 100_000, 2_000_000]
    expected = [rng.standard_normal(n) for n in sizes]
    with allocbox.use(policy):
        for x in expected:
            y = np.array(x)                      # copied into policy memory
            assert allocbox.handler_name(y) == policy.name
            z = (y * 3 + 1) @ np.ones_like(y) if y.size else 0.0
            np.testing.assert_allclose(z, (x * 3 + 1).sum() if x.size else 0.0)
            s = np.sort(np.concatenate([y, y[::-1]]))
            np.testing.assert_array_equal(s, np.sort(np.concatenate([x, x[::-1]])))
            grown = np.resize(y, y.size * 2 + 1)
            assert grown.size == y.size * 2 + 1
        text = np.fromstring("1 2 3", sep=" ")   # NumPy's realloc-then-wrong-size-free path
        np.testing.assert_array_equal(text, [1, 2, 3])
    gc.collect()
    policy.raise_if_failed()
    assert policy.failure is None


def test_numpy_s_wrong_size_frees_are_corrected_and_counted(size_classes):
    with allocbox.use(size_classes):
        for _ in range(5):
            np.fromstring("", sep=" ")
    gc.collect()
    stats = size_classes.stats()
    assert stats["live_blocks"] == 0
    assert stats["size_corrections"] >= 1, stats


def test_a_broken_policy_does_not_crash_python_and_loses_no_data():
    before = np.arange(1000.0)
    bad = allocbox.load(guest("broken"), {"fault": "misaligned"})
    with allocbox.use(bad):
        with pytest.raises(MemoryError):
            np.ones(100)
        with pytest.raises(MemoryError):
            np.ones(100)                         # stopped: fails cleanly again
    np.testing.assert_array_equal(before, np.arange(1000.0))
    assert "misaligned" in bad.failure or "aligned" in bad.failure
    assert bad.stats()["failed"] == 2, "each MemoryError is a request that got no block"
    # The rule's name first, as the command line and SECURITY.md name it (issue 64).
    with pytest.raises(allocbox.ContractViolation, match=r"^\[misaligned\] policy `broken`"):
        bad.raise_if_failed()
    with pytest.raises(allocbox.PoisonedPolicy, match=r"^refusing a stopped policy: \[misaligned\] "):
        allocbox.set_handler(bad)


def test_a_policy_failing_after_arrays_were_made_keeps_their_data():
    bad = allocbox.load(guest("broken"), {"fault": "trap-realloc"})
    with allocbox.use(bad):
        a = np.arange(10_000.0)
        b = np.arange(3, dtype=np.int8)
        with pytest.raises(MemoryError):
            a.resize(20_000, refcheck=False)     # realloc traps inside the policy
    np.testing.assert_array_equal(a, np.arange(10_000.0))
    np.testing.assert_array_equal(b, [0, 1, 2])
    with pytest.raises(allocbox.PoisonedPolicy):
        bad.raise_if_failed()
    del a, b
    gc.collect()
    assert bad.stats()["live_blocks"] == 0


def test_errors_are_distinct_exception_classes():
    classes = [allocbox.LoadError, allocbox.ContractViolation, allocbox.PoisonedPolicy, allocbox.ClientError]
    assert len(set(classes)) == 4
    assert all(issubclass(c, allocbox.AllocboxError) for c in classes)
    with pytest.raises(allocbox.LoadError, match="not a WebAssembly file"):
        allocbox.load(b"definitely not wasm")
    with pytest.raises(allocbox.LoadError, match="refused its configuration"):
        allocbox.load("aligned", {"alignment": "3"})


def test_a_bound_is_named_in_python_s_words_and_a_misspelt_one_is_refused_with_the_list():
    with pytest.raises(allocbox.LoadError) as small:
        allocbox.load("system", memory=1)
    assert "`memory=` in Python" in str(small.value), small.value
    with pytest.raises(TypeError) as misspelt:
        allocbox.load("system", memry=1)
    message = str(misspelt.value)
    assert "'memry' is not a bound allocbox knows" in message and "memory" in message, message
    assert "load_chain()" not in message


def test_a_shipped_policy_that_refuses_its_configuration_is_named_not_bytes():
    with pytest.raises(allocbox.LoadError) as refused:
        allocbox.load("size-classes", {"bukket-depth": "7"})
    message = str(refused.value)
    assert message.startswith("policy `size-classes` refused its configuration"), message
    assert "bucket-depth" in message and "<bytes>" not in message
    with pytest.raises(allocbox.LoadError, match="policy `builtin` refused"):
        allocbox.load("builtin", {"no-such-key": "1"})


def test_recording_writes_numpy_s_calls_as_a_trace(tmp_path, size_classes):
    path = tmp_path / "numpy.trace"
    policy = allocbox.load("system", record=str(path))
    with allocbox.use(policy):
        a = np.arange(50)
        del a
    policy.finish_recording()
    lines = [line for line in trace_text(path).splitlines() if not line.startswith("#")]
    assert lines[0].startswith("m 1 400 ") or lines[0].startswith("c 1 400 "), lines[:3]
    assert any(line.startswith("f 1 400 ") for line in lines)


def test_the_realloc_use_after_free_of_issue_9_is_refused_inside_numpy():
    bad = allocbox.load(guest("broken"), {"fault": "realloc-free-answer-old"})
    with allocbox.use(bad):
        b = np.ones(64, dtype=np.uint8)
        with pytest.raises(MemoryError):
            b.resize(32, refcheck=False)
    np.testing.assert_array_equal(b, np.ones(64, dtype=np.uint8))   # intact, not freed
    assert "use after free" in bad.failure
    with pytest.raises(allocbox.ContractViolation, match="use after free"):
        bad.raise_if_failed()


def test_bounds_are_knobs_and_hoarding_past_the_overhead_budget_is_refused_and_counted():
    hoarder = allocbox.load(
        guest("broken"), {"fault": "hoard"}, overhead=128 << 20, call_time=0.5, batch=64
    )
    with allocbox.use(hoarder):
        arrays = [np.full(100, i, dtype=np.uint8) for i in range(8)]
    for i, a in enumerate(arrays):
        assert (a == i).all()
    assert hoarder.stats()["budget_refusals"] >= 6
    assert hoarder.link_stats()[0]["budget_refusals"] == hoarder.stats()["budget_refusals"]
    with pytest.raises(ValueError, match="call_time"):
        allocbox.load("system", call_time=0)


def test_compile_bounds_refuse_a_policy_before_compiling_it_and_can_be_loosened():
    # The way to raise a bound is said in Python's words too.
    with pytest.raises(allocbox.LoadError, match=r'the `functions` compile bound; .*`compile_bounds=\{"functions": N\}` in Python'):
        allocbox.load("system", compile_bounds={"functions": 5})
    loose = allocbox.load("system", compile_bounds={"functions": 1_000_000, "code_bytes": 1 << 30})
    assert loose.name == "system"
    with pytest.raises(ValueError, match="no compile bound is called 'funcs'"):
        allocbox.load("system", compile_bounds={"funcs": 5})


def test_a_malloc_many_past_the_batch_bound_stops_the_policy_with_a_clear_error():
    bad = allocbox.load(guest("broken"), {"fault": "malloc-many-huge"}, batch=1000)
    with allocbox.use(bad):
        with pytest.raises(MemoryError):
            np.ones(10)
    assert "batch bound" in bad.failure and "asked 4294967295, limit 1000" in bad.failure


def test_the_native_default_serves_numpy_through_the_same_bridge():
    native = allocbox.native_default()
    with allocbox.use(native):
        small = np.arange(50, dtype=np.int64)
        grown = np.concatenate([small, np.ones(100_000)])
        assert allocbox.handler_name(small) == "default_allocator"
        assert small.sum() == 49 * 50 // 2
        assert grown[50:].sum() == 100_000
    del small, grown
    gc.collect()
    native.raise_if_failed()


def _command(*args, cwd):
    """`python -m allocbox ARGS`, as a user runs it: exit status and all output."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "allocbox", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    return done.returncode, done.stdout + done.stderr


def test_python_dash_m_allocbox_checks_a_shipped_policy_by_name(tmp_path):
    code, out = _command("check", "size-classes", "--rounds", "1", "--cases", "8", "--regressions", str(tmp_path), cwd=tmp_path)
    assert code == 0, out
    assert out.startswith("size-classes: every rule held"), out


def test_the_command_reports_a_trace_and_refuses_bad_input_with_a_sentence(tmp_path):
    trace = tmp_path / "small.trace"
    trace.write_text("# a test\nm 1 64 1\nc 2 4096 1\nr 1 200 1\nf 1 200 1\nf 2 4096 1\n")
    code, out = _command("report", str(trace), "-p", "size-classes", "-p", "default", "-o", "r.html", cwd=tmp_path)
    assert code == 0, out
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    code, out = _command("report", str(trace), "-p", "size-clases", "-o", "r.html", cwd=tmp_path)
    assert code == 2
    assert "no file or shipped policy is called `size-clases`" in out, out


@pytest.mark.skipif(not os.environ.get("ALLOCBOX_TEST_INSTALLED"), reason="develop build")
def test_the_wheel_installs_the_allocbox_command(tmp_path):
    import subprocess
    import sys
    import sysconfig

    command = pathlib.Path(sysconfig.get_path("scripts")) / "allocbox"
    assert command.exists(), f"{command} was not installed"
    done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("allocbox "), done
    done = subprocess.run(
        [command, "inspect", "arena"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "language   Rust" in done.stdout, done


def test_failure_and_failures_are_both_attributes_of_the_policy_s_state():
    bad = allocbox.load(guest("broken"), {"fault": "misaligned"})
    assert bad.failure is None and bad.failures == []
    with allocbox.use(bad):
        with pytest.raises(MemoryError):
            np.ones(100)
    assert "align" in bad.failure
    assert isinstance(bad.failures, list)


def test_a_policy_file_past_the_file_bound_is_refused_by_its_size_before_it_is_read(tmp_path):
    # Found in issue 52: a 2 GB (sparse) file given to allocbox.load took +2 GB resident
    # and 7-10 s before its refusal. Measured in a child, by the peak of its own memory
    # since it started (ru_maxrss would count the forked test process's).
    huge = tmp_path / "huge.wasm"
    with open(huge, "wb") as f:
        f.truncate(2 << 30)
    probe = (
        "import sys, allocbox\n"
        "try:\n"
        "    allocbox.load(sys.argv[1])\n"
        "except allocbox.LoadError as e:\n"
        "    print(e)\n"
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(huge)], capture_output=True, text=True, timeout=600)
    said, peak_kib = done.stdout.strip().splitlines()
    assert "huge.wasm" in said and "2147483648 bytes in its file" in said and "file-bytes" in said, said
    assert int(peak_kib) < 512 << 10, f"refusing it took {peak_kib} KiB resident"


def test_the_docs_of_load_name_every_kind_of_memory_a_policy_may_be_granted():
    # Issue 65: the hand-written lists of kinds went stale. The host's own error lists
    # them all; `load` (and `allocbox.cuda.load`, for device memory) names each.
    import allocbox.cuda

    with pytest.raises(ValueError) as refused:
        allocbox.load("system", grant=["telepathy"])
    kinds = str(refused.value).split("use ", 1)[1].replace(" or ", ", ").split(", ")
    assert "pinned" in kinds and "device" in kinds, kinds
    docs = allocbox.load.__doc__ + allocbox.cuda.load.__doc__
    for kind in kinds:
        assert f'"{kind}"' in docs or f"`{kind}`" in docs, kind


def test_a_per_thread_policy_records_the_program_s_lines_as_one_chain_does(tmp_path):
    # Issue 65: a handler per thread is recorded by the same code as one chain, sites too.
    path = tmp_path / "per-thread.trace"
    policy = allocbox.load("size-classes", per_thread=True, record=str(path), record_sites=True)
    assert policy.instances >= 1
    with allocbox.use(policy):
        a = np.ones(5000)  # the line the trace names
        del a
    policy.finish_recording()
    text = trace_text(path)
    assert any(line.startswith("#@site ") and "test_bridge.py" in line for line in text.splitlines()), text[:2000]
    assert any(line.startswith("m ") and " s=" in line for line in text.splitlines()), text[:2000]
