"""The `allocbox` command, as the wheel installs it: `allocbox check size-classes`,
`allocbox report TRACE -p size-classes -o report.html`, ... (`allocbox --help`), and
`allocbox run SCRIPT`, which runs a Python program under a policy in this process
(`allocbox.run`). `python -m allocbox` runs the same command."""

import signal
import sys


def main():
    if sys.argv[1:2] == ["run"]:
        # The program runs here, in Python, with Python's own Ctrl-C.
        from .run import main as run

        return run(sys.argv[2:])
    from ._allocbox import run_command

    # The command runs in Rust, where Python's own SIGINT handler would never get to
    # run: Ctrl-C stops it the way it stops the native binary.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    return run_command(["allocbox", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
