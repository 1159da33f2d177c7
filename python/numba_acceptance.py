"""Numba's own allocation tests as the acceptance test for `allocbox.numba`: run Numba's
test modules with Numba's own allocator, and again with an allocbox policy installed
for the whole run (`allocbox.use`, which routes every array Numba's compiled code makes
through the policy), and require the same outcome for every test. Numba's
`MemoryLeakMixin` checks NRT's allocation counters around each test, so a block the
route loses or frees twice fails a test.

    python python/numba_acceptance.py                 # CI's representative part
    python python/numba_acceptance.py --full          # the five allocation modules (minutes)
    python python/numba_acceptance.py --policy arena  # another shipped policy, or a path

Exit 0: same results; 1: a test's outcome changed or the policy broke the contract.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

# Beside this file: the same comparison as NumPy's acceptance run.
from numpy_acceptance import changed_outcomes

FULL = [
    "numba.tests.test_nrt",
    "numba.tests.test_dyn_array",
    "numba.tests.test_array_return",
    "numba.tests.test_array_exprs",
    "numba.tests.test_ndarray_subclasses",
]
# Between them: NRT's own tests (MemInfos, external allocators, leak counters), arrays
# made in compiled code, and arrays returned to Python; about a minute here.
REPRESENTATIVE = [
    "numba.tests.test_nrt",
    "numba.tests.test_array_return",
    "numba.tests.test_ndarray_subclasses",
    "numba.tests.test_dyn_array.TestNdZeros",
    "numba.tests.test_dyn_array.TestNdEmptyLike",
    "numba.tests.test_dyn_array.TestDynArray",
]

# Run in a child process: the tests, under the policy when one is named, each test's
# outcome written as JSON.
CHILD = r"""
import json, sys, unittest
policy_source, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
import numba
suite = unittest.defaultTestLoader.loadTestsFromNames(names)

class Outcomes(unittest.TextTestResult):
    outcomes = {}
    def addSuccess(self, test):
        super().addSuccess(test); self.outcomes[test.id()] = "passed"
    def addFailure(self, test, err):
        super().addFailure(test, err); self.outcomes[test.id()] = "failure"
    def addError(self, test, err):
        super().addError(test, err); self.outcomes[test.id()] = "error"
    def addSkip(self, test, reason):
        super().addSkip(test, reason); self.outcomes[test.id()] = "skipped"
    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err); self.outcomes[test.id()] = "expected failure"
    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test); self.outcomes[test.id()] = "unexpected success"

runner = unittest.TextTestRunner(resultclass=Outcomes, verbosity=0, stream=sys.stderr)
failure = None
if policy_source:
    import allocbox
    policy = allocbox.load(policy_source)
    with allocbox.use(policy):
        runner.run(suite)
    failure = policy.failure
    stats = policy.stats()
    print(f"policy {policy.name}: {stats['mallocs']} blocks placed, "
          f"{stats['live_blocks']} live at the end, failure: {failure}", file=sys.stderr)
else:
    runner.run(suite)
json.dump({"outcomes": Outcomes.outcomes, "failure": failure}, open(out, "w"))
"""


def run(targets, policy, report):
    command = [sys.executable, "-c", CHILD, policy or "", report, *targets]
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    tail = done.stderr.strip().splitlines()[-4:]
    if not os.path.exists(report):
        sys.exit("the test run ended before it wrote its results:\n" + done.stderr[-3000:])
    with open(report) as f:
        result = json.load(f)
    return result["outcomes"], result["failure"], tail


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="size-classes")
    parser.add_argument("--full", action="store_true", help="the five allocation modules whole")
    args = parser.parse_args()
    targets = FULL if args.full else REPRESENTATIVE

    with tempfile.TemporaryDirectory() as tmp:
        baseline, _, base_tail = run(targets, None, f"{tmp}/baseline.json")
        with_policy, failure, tail = run(targets, args.policy, f"{tmp}/policy.json")
    print("Numba's own allocator:", *base_tail, sep="\n  ")
    print(f"with {args.policy}:", *tail, sep="\n  ")
    changed = changed_outcomes(baseline, with_policy)
    counts = {}
    for outcome in with_policy.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    print(f"{len(baseline)} tests ({summary}); {len(changed)} changed outcome; policy failure: {failure or 'none'}")
    return 0 if not changed and failure is None else 1


if __name__ == "__main__":
    sys.exit(main())
