"""allocbox.dask: a policy in every worker of a Dask cluster (2 worker processes), its
statistics and failures gathered to the client."""

import logging
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest

import allocbox
from conftest import guest

pytest.importorskip("distributed")
da = pytest.importorskip("dask.array")

import allocbox.dask  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402


@pytest.fixture(scope="module")
def client():
    with (
        LocalCluster(
            n_workers=2,
            processes=True,
            threads_per_worker=2,
            dashboard_address=None,
            silence_logs=logging.CRITICAL,
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


@pytest.fixture
def register(client):
    """Register a plugin for one test; the next test starts without it."""
    names = []

    def register(plugin):
        client.register_plugin(plugin)
        names.append(plugin.name)
        return plugin

    yield register
    for name in names:
        client.unregister_worker_plugin(name)


def _where_arrays_go():
    """In a task: which handler places an array here, and in a thread the task starts."""
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(thread=allocbox.handler_name(np.ones(10))))
    thread.start()
    thread.join()
    return {"task": allocbox.handler_name(np.ones(10)), **seen}


def test_importing_allocbox_does_not_import_dask():
    code = "import sys, allocbox; assert 'distributed' not in sys.modules and 'dask' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_distributed_the_import_error_says_what_to_install():
    code = (
        "import sys; sys.modules['distributed'] = None\n"
        "try:\n    import allocbox.dask\n"
        "except ImportError as error:\n    print(error)\n"
    )
    printed = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "pip install allocbox[dask]" in printed


def test_the_plugin_travels_as_its_source_not_as_a_policy():
    plugin = allocbox.dask.AllocboxPlugin("size-classes", {"bucket-depth": 7}, call_time=0.5)
    copy = pickle.loads(pickle.dumps(plugin))
    assert (copy.source, copy.config, copy.limits) == ("size-classes", {"bucket-depth": "7"}, {"call_time": 0.5})
    # A file is read here and its bytes are shipped: the workers need not see it.
    assert allocbox.dask.AllocboxPlugin(guest("broken")).source == guest("broken").read_bytes()
    assert copy.policy is None


def test_every_worker_places_its_arrays_with_the_policy(client, register):
    register(allocbox.dask.AllocboxPlugin("size-classes", {"bucket-depth": "7"}))
    workers = sorted(client.scheduler_info()["workers"])
    assert len(workers) == 2

    assert (da.ones((2000, 2000), chunks=500) * 2).sum().compute() == 8_000_000
    for worker in workers:
        placed = client.submit(_where_arrays_go, workers=[worker], pure=False).result()
        assert placed == {"task": "size-classes", "thread": "size-classes"}, worker

    report = allocbox.dask.gather(client)
    assert sorted(report) == workers
    for worker, entry in report.items():
        assert entry["policy"] == "size-classes"
        assert entry["stats"]["mallocs"] > 0, worker
        assert entry["link_stats"][0]["name"] == "size-classes"
        assert entry["failures"] == []
    # The array tasks ran through the policies: together they placed every chunk.
    assert sum(entry["stats"]["total_bytes"] for entry in report.values()) >= 2000 * 2000 * 8
    allocbox.dask.raise_if_failed(client)


def test_a_policy_given_as_bytes_reaches_the_workers(client, register):
    register(allocbox.dask.AllocboxPlugin(allocbox.DEFAULT_POLICY_WAT.encode()))
    assert da.arange(10_000, chunks=1000).sum().compute() == sum(range(10_000))
    names = {entry["policy"] for entry in allocbox.dask.gather(client).values()}
    assert names == {allocbox.builtin().name}


def test_a_policy_that_cannot_load_fails_the_registration_naming_the_worker(client):
    with pytest.raises(allocbox.LoadError, match=r"worker tcp://\S+: no shipped policy or file named 'size-clases'"):
        client.register_plugin(allocbox.dask.AllocboxPlugin("size-clases"))
    client.unregister_worker_plugin("allocbox")


def test_a_policy_failure_reaches_the_client_naming_worker_policy_and_rule(client, register):
    register(allocbox.dask.AllocboxPlugin(guest("broken"), {"fault": "misaligned-after-300"}))
    rule = r"\[misaligned\] policy `broken` broke the contract in `\w+`.*: block not aligned to the declared 16 bytes"

    # Enough chunks that a worker's policy passes its 300th call.
    with pytest.raises(allocbox.ContractViolation, match=rf"^worker tcp://\S+: {rule}; .*MemoryError in task"):
        (da.ones((2000, 2000), chunks=100) * 2).sum().compute()

    with pytest.raises(allocbox.ContractViolation, match=rf"^worker tcp://\S+: {rule}"):
        allocbox.dask.raise_if_failed(client)
    report = allocbox.dask.gather(client)
    failed = [worker for worker, entry in report.items() if entry["failures"]]
    assert failed and all(entry["policy"] == "broken" for entry in report.values())
    assert all("block not aligned" in report[worker]["failures"][0] for worker in failed)

    # The stopped policy stays the worker's handler: a later task fails for the same
    # cause (not NumPy's default handler, and not a stuck worker).
    later = client.submit(_where_arrays_go, workers=failed[:1], pure=False)
    with pytest.raises(allocbox.ContractViolation, match=rf"^worker {failed[0]}: {rule}; .*MemoryError in task"):
        later.result(timeout=60)
