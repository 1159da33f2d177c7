"""The `numa` policy places large arrays on the NUMA node asked for, as /proc/self/numa_maps
shows, from several threads at once; without the `numa` grant nothing is placed."""

import threading

import numpy as np

import allocbox

MIB = 1 << 20


def placement_of(address):
    """The NUMA policy numa_maps shows for the mapping that holds `address` (adjacent
    mappings with the same policy are merged into one): the one that starts last at or
    below it. One read of one file: other threads map and unmap meanwhile, so a start
    read from /proc/self/maps may no longer start a mapping by the time numa_maps is
    read."""
    holder = None
    with open("/proc/self/numa_maps") as maps:
        for line in maps:
            first, policy = line.split()[:2]
            start = int(first, 16)
            if start <= address and (holder is None or start > holder[0]):
                holder = (start, policy)
    return holder and holder[1]


def test_a_64_mib_array_is_bound_to_node_0_in_each_of_8_threads_at_once():
    policy = allocbox.load("numa", {"node": "0"}, grant=["numa"])
    barrier = threading.Barrier(8)
    seen, errors = [], []

    def worker():
        try:
            allocbox.set_handler(policy)
            barrier.wait()
            a = np.ones(64 * MIB, np.uint8)
            seen.append((placement_of(a.ctypes.data), int(a.sum())))
            del a
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen == [("bind:0", 64 * MIB)] * 8, seen
    counters = policy.stats()["counters"]
    assert counters["placed"] == 8 and counters["refused"] == 0, counters
    assert counters["placed-bytes"] == 8 * 64 * MIB
    assert policy.stats()["live_blocks"] == 0


def test_interleave_spreads_pages_and_small_arrays_pass_through():
    policy = allocbox.load("numa", {"interleave": "all"}, grant=["numa"])
    with allocbox.use(policy):
        big = np.zeros(2 * MIB, np.uint8)
        small = np.ones(100)
        assert placement_of(big.ctypes.data).startswith("interleave:")
        assert placement_of(small.ctypes.data) == "default"
        del big, small
    assert policy.stats()["counters"]["placed"] == 1


def test_without_the_grant_arrays_are_placed_by_default_and_the_refusal_counted():
    policy = allocbox.load("numa", {"node": "0"})
    with allocbox.use(policy):
        big = np.ones(2 * MIB, np.uint8)
        assert placement_of(big.ctypes.data) != "bind:0"
        assert big.sum() == 2 * MIB
        del big
    counters = policy.stats()["counters"]
    assert counters["placed"] == 0 and counters["refused"] == 1, counters


def test_a_node_the_machine_lacks_is_refused_and_served_from_upstream():
    policy = allocbox.load("numa", {"node": "63"}, grant=["numa"])
    with allocbox.use(policy):
        big = np.ones(2 * MIB, np.uint8)
        assert big.sum() == 2 * MIB
        del big
    assert policy.stats()["counters"]["refused"] == 1
