"""NumPy's own test suite as the acceptance test: run `numpy._core` tests with NumPy's
default handler and again with an allocbox policy installed for the whole run (the
`allocbox.pytest_plugin`), and require the same outcome for every test.

    python python/numpy_acceptance.py                      # CI's representative part
    python python/numpy_acceptance.py --full               # all of numpy._core (minutes)
    python python/numpy_acceptance.py --policy arena       # another shipped policy, or a path

Exit 0: same results; 1: a test's outcome changed or the policy broke the contract.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

# Quick, and between them they cover array creation, ufuncs, indexing, item selection
# and NumPy's own handler-API tests.
REPRESENTATIVE = ["test_numeric", "test_indexing", "test_item_selection", "test_umath", "test_mem_policy"]


def run(targets, policy, config, report):
    env = dict(os.environ)
    # NumPy's handler-API tests build a C extension with meson from this environment.
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")])
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    if policy:
        env["ALLOCBOX_POLICY"] = policy
        env["ALLOCBOX_CONFIG"] = config
        command += ["-p", "allocbox.pytest_plugin"]
    command += ["--pyargs", *targets]
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    tail = done.stdout.strip().splitlines()[-3:]
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[name] = kinds[0] if kinds else "passed"
    return done.returncode, outcomes, tail


def changed_outcomes(baseline, with_policy):
    """Each test whose outcome differs between the runs, `(name, before, after)`,
    sorted; the first 50 are printed."""
    changed = sorted(
        (name, baseline.get(name), with_policy.get(name))
        for name in baseline.keys() | with_policy.keys()
        if baseline.get(name) != with_policy.get(name)
    )
    for name, before, after in changed[:50]:
        print(f"CHANGED {name}: {before} -> {after}")
    return changed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="size-classes")
    parser.add_argument("--config", default="")
    parser.add_argument("--full", action="store_true", help="all of numpy._core")
    args = parser.parse_args()
    targets = ["numpy._core"] if args.full else [f"numpy._core.tests.{t}" for t in REPRESENTATIVE]

    with tempfile.TemporaryDirectory() as tmp:
        _, baseline, base_tail = run(targets, None, "", f"{tmp}/baseline.xml")
        code, with_policy, tail = run(targets, args.policy, args.config, f"{tmp}/policy.xml")
    print("NumPy's default handler:", *base_tail, sep="\n  ")
    print(f"with {args.policy}:", *tail, sep="\n  ")
    changed = changed_outcomes(baseline, with_policy)
    broke = any("FAILURE inside NumPy" in line for line in tail)
    same = not changed and not broke
    print(f"{len(baseline)} tests; {len(changed)} changed outcome; policy failures: {'yes' if broke else 'none'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
