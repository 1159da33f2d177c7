"""`allocbox run`: an unmodified Python program under a policy.

    allocbox run [-p POLICY [-c KEY=VALUE]...]... [--grant KINDS] [--record FILE [--sites]]
                 [--report PAGE.html [--compare POLICY,...]] (SCRIPT | -m MODULE) [ARGS...]

Each `-p` adds a policy to the chain, top first (a shipped policy's name, `builtin`,
or a path); each `-c KEY=VALUE` configures the `-p` before it. The chain is NumPy's
handler for the program and every thread it starts, and places the arrays Numba's
compiled code makes (`allocbox.numba`). With no `-p`, the program runs under NumPy's
default handler (allocbox's native copy of it, so that `--record` can record it).
`--grant` lists the kinds of memory the policies may ask for (`guarded,numa`).
`--record FILE` writes every allocation as a trace for `allocbox report`, with its
time (gzip-compressed for a `.gz` name); `--sites` adds the line of the program's own
code behind each allocation, for the report's tables by line. The recording ends with
the program's last line, so what is live then is what leaked. `--report PAGE.html`
then replays the recording (a temporary one without `--record`) through NumPy's
default, the policy (a chain of one), and each policy `--compare` names, into one page,
and says how each compares with NumPy's default on this program.

The program's exit status is the command's; at the end a few lines on standard error
say what the policy saw. Input that cannot be used (a script or module that is not
there, a policy that will not load, a trace that cannot be written) is one sentence
and exit status 2, before the program starts. Child processes are not covered: a
`multiprocessing` child runs under NumPy's default handler, and is not recorded.
"""

import importlib.util
import os
import runpy
import subprocess
import sys
import traceback

USAGE = (
    "usage: allocbox run [-p POLICY [-c KEY=VALUE]...]... [--grant KINDS] [--record FILE [--sites]] "
    "[--report PAGE.html [--compare POLICY,...]] (SCRIPT | -m MODULE) [ARGS...]"
)


class UsageError(Exception):
    """Input `allocbox run` cannot use: said in one sentence, exit status 2."""


def parse(argv):
    """The chain `[(source, {key: value})]`, grants, `(trace path, sites)`, the report
    asked for, and the program: `("script", path)` or `("module", name)`, with its
    arguments."""
    chain, grant, record, sites = [], [], None, False
    report = {"page": None, "compare": []}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(__doc__.strip())
            raise SystemExit(0)
        if arg == "--sites":
            sites = True
            continue
        if arg in ("-p", "--policy", "-c", "--config", "--grant", "--record", "--report", "--compare", "-m"):
            if not args:
                raise UsageError(f"{arg} needs a value: {USAGE}")
            value = args.pop(0)
        else:
            value = None
        if arg in ("-p", "--policy"):
            chain.append((value, {}))
        elif arg in ("-c", "--config"):
            key, equals, setting = value.partition("=")
            if not equals or not key:
                raise UsageError(f"-c {value!r} is not KEY=VALUE: write -c bucket-depth=7")
            if not chain:
                raise UsageError(
                    f"-c {value} comes before any -p: each -c configures the policy named "
                    "before it (-p size-classes -c bucket-depth=7)"
                )
            chain[-1][1][key] = setting
        elif arg == "--grant":
            grant += [kind.strip() for kind in value.split(",") if kind.strip()]
        elif arg == "--record":
            record = value
        elif arg == "--report":
            report["page"] = value
        elif arg == "--compare":
            report["compare"] += [name.strip() for name in value.split(",") if name.strip()]
        elif arg == "-m":
            return chain, grant, (record, sites), report, ("module", value), args
        elif arg.startswith("-") and arg != "-":
            raise UsageError(f"{arg} is not an option of allocbox run: {USAGE}")
        else:
            return chain, grant, (record, sites), report, ("script", arg), args
    raise UsageError(f"name the program to run: {USAGE}")


def check_program(kind, target):
    """Refuse a program that cannot start, before anything runs."""
    if kind == "script":
        if not os.path.isfile(target):
            raise UsageError(f"the script {target!r} does not exist: name a Python file, or -m MODULE")
        return
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError) as e:
        raise UsageError(f"the module {target!r} cannot be found ({e}): check its name and sys.path") from None
    if found is None:
        raise UsageError(f"no module named {target!r} can be imported here: check its name, or install it")


def load(chain, grant, recording):
    """The handler the program runs under."""
    import allocbox

    record, sites = recording
    if sites and record is None:
        raise UsageError("--sites says what to record beside each event: add --record FILE")
    if record is not None:
        folder = os.path.dirname(os.path.abspath(record))
        if not os.path.isdir(folder):
            raise UsageError(f"the trace {record!r} cannot be written: its folder {folder!r} does not exist")
    try:
        if not chain:
            if grant:
                raise UsageError("--grant needs a policy to grant to: add -p POLICY")
            return allocbox.native_default(record=record, record_sites=sites)
        return allocbox.load_chain(*chain, record=record, record_sites=sites, grant=grant)
    except allocbox.LoadError as e:
        names = ", ".join(source for source, _ in chain)
        raise UsageError(f"the policy {names} will not load: {e}") from None
    except allocbox.AllocboxError as e:
        raise UsageError(f"{e}") from None
    except ValueError as e:
        raise UsageError(f"--grant {','.join(grant)}: {e}") from None


def check_report(report, recording):
    """Refuse a report that cannot be written, before the program starts; returns the
    trace to record for it (a temporary one without `--record`)."""
    page, compare = report["page"], report["compare"]
    if page is None:
        if compare:
            raise UsageError("--compare says what a report compares: add --report PAGE.html")
        return recording
    folder = os.path.dirname(os.path.abspath(page))
    if not os.path.isdir(folder):
        raise UsageError(f"the report {page!r} cannot be written: its folder {folder!r} does not exist")
    import allocbox

    shipped = {"default", "builtin", *allocbox.policies()}
    for name in compare:
        if name not in shipped and not os.path.exists(name):
            raise UsageError(
                f"--compare {name}: no shipped policy or file of that name; shipped: "
                + ", ".join(sorted(shipped))
            )
    record, sites = recording
    if record is None:
        import tempfile

        report["temporary"] = tempfile.mkdtemp(prefix="allocbox-run-")
        record = os.path.join(report["temporary"], "run.trace")
    return record, sites


def write_report(report, chain, record):
    """Replay the recording through NumPy's default, the program's policy (a chain of
    one) and the ones to compare, into the page; the summary goes to standard error. A
    handler that fails there is said there: the exit status stays the program's."""
    handlers = [["-p", "default"]]
    if len(chain) == 1:
        source, config = chain[0]
        settings = [["-c", f"{key}={value}"] for key, value in config.items()]
        handlers.append(["-p", source, *sum(settings, [])])
    seen = {"default", *(source for source, _ in chain[:1] if len(chain) == 1)}
    handlers += [["-p", name] for name in report["compare"] if name not in seen]
    command = [sys.executable, "-m", "allocbox", "report", record, *sum(handlers, []), "-o", report["page"]]
    done = subprocess.run(command, stdout=sys.stderr)
    if done.returncode != 2:
        print(f"allocbox: report written to {report['page']}", file=sys.stderr)


def run_program(kind, target, args, kept):
    """Run the program as `python SCRIPT` or `python -m MODULE` would; returns its exit
    status, and puts its module's globals in `kept` (as `python` keeps `__main__`'s
    until it shuts down, so what they hold is live where the recording ends).
    KeyboardInterrupt goes on up, as it does without allocbox."""
    sys.argv = [target, *args]
    # As `python` sets it: the script's folder, or for -m the current one.
    sys.path[0] = os.path.dirname(os.path.abspath(target)) if kind == "script" else os.getcwd()
    try:
        if kind == "script":
            kept.append(runpy.run_path(target, run_name="__main__"))
        else:
            kept.append(runpy.run_module(target, run_name="__main__", alter_sys=True))
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        raise
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def size_text(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def summary(handler, record):
    """What the handler saw, in a few lines, the cause of a stop first."""
    lines = []
    failure = handler.failure
    if failure:
        lines.append(f"allocbox: policy `{handler.name}` was stopped: {failure}")
    stats = handler.stats()
    made = stats["mallocs"] + stats["callocs"]
    lines.append(
        f"allocbox: `{handler.name}` placed {made:,} arrays ({size_text(stats['total_bytes'])}); "
        f"peak {size_text(stats['peak_bytes'])} live; "
        f"{stats['live_blocks']:,} ({size_text(stats['live_bytes'])}) still live at the end"
    )
    if stats["failed"]:
        lines.append(f"allocbox: {stats['failed']:,} requests got no memory (the program saw MemoryError)")
    for failure in handler.failures[:3]:
        lines.append(f"allocbox: inside NumPy: {failure}")
    counters = stats["counters"]
    if counters:
        lines.append("allocbox: counters: " + ", ".join(f"{k} {v:,}" for k, v in counters.items()))
    if record is not None:
        lines.append(f"allocbox: trace written to {record}; read it with `allocbox report {record}`")
    return lines


def main(argv):
    try:
        chain, grant, recording, report, (kind, target), args = parse(argv)
        check_program(kind, target)
        recording = check_report(report, recording)
        handler = load(chain, grant, recording)
        record = recording[0]
    except UsageError as e:
        print(f"allocbox run: {e}", file=sys.stderr)
        return 2
    import allocbox

    code = None
    kept = []
    try:
        with allocbox.use(handler, threads=True):
            code = run_program(kind, target, args, kept)
    finally:
        # The recording ends with the program: what is live now is what it leaked.
        try:
            handler.finish_recording()
        except allocbox.AllocboxError as e:
            print(f"allocbox: the trace {record!r} could not be written: {e}", file=sys.stderr)
            code = code or 1
        sys.stdout.flush()
        for line in summary(handler, None if "temporary" in report else record):
            print(line, file=sys.stderr)
    if report["page"] is not None:
        write_report(report, chain, record)
    if "temporary" in report:
        import shutil

        shutil.rmtree(report["temporary"], ignore_errors=True)
    return code
