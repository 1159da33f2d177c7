"""`allocbox run`: an unmodified Python program under a policy.

    allocbox run [-p POLICY [-c KEY=VALUE]...]... [--grant KINDS] [--record FILE [--sites]]
                 [--report PAGE.html [--compare POLICY,...] [--no-sites]]
                 [--device-policy POLICY [--device-config KEY=VALUE]...] (SCRIPT | -m MODULE) [ARGS...]

The command line is the `allocbox` command's own (`allocbox run --help` says every
option), parsed by the same grammar as every other subcommand; the program runs here,
in this Python process. The chain is NumPy's handler for the program and every thread
it starts, and places the arrays Numba's compiled code makes (`allocbox.numba`).
`--report PAGE.html` replays the recording (a temporary one without `--record`)
through NumPy's default, the policy (a chain as it ran), and each policy `--compare`
names, into one page, with the program's lines behind its arrays unless `--no-sites`.
A policy that asked for a kind of memory it was not granted is said once, with the
`--grant` that grants it. `--device-policy` places the GPU memory of PyTorch, CuPy and
Numba's CUDA target by a device policy (`allocbox.device_use`), recorded into the
trace with the host's.

The program's exit status is the command's; at the end a few lines on standard error
say what the policy saw. Input that cannot be used (a script or module that is not
there, a policy that will not load, a trace that cannot be written) is one sentence
and exit status 2, before the program starts; an option the grammar refuses is its
usage error, exit status 2, as for every subcommand. Otherwise the program sees what
`python SCRIPT` or `python -m MODULE` gives it: its own `__main__`, `sys.argv`,
standard streams and `sys.excepthook`, the same traceback and exit status (`--` ends
the options before a script's name). Paths given to `run` are resolved before the
program starts, so a program that changes directory changes nothing of them. Every
Python process the program starts (forked, spawned by `multiprocessing`, or a
`subprocess` running this environment's Python) runs under the same policy, records
into a trace of its own beside the program's (`TRACE.PID`) and prints no summary;
`--report` reads them all.
"""

import contextlib
import importlib.machinery
import importlib.util
import os
import runpy
import subprocess
import sys
import time
import traceback

import _allocbox_startup

from . import children

class UsageError(Exception):
    """Input `allocbox run` cannot use: said in one sentence, exit status 2."""


def parse(argv):
    """The chain `[(source, {key: value})]`, grants, `(trace path, sites)`, the report
    asked for, the device policy `(source, {key: value})` or None, and the program: `("script", path)` or `("module", name)`, with its
    arguments. Parsed by the command line's own grammar (`allocbox --help`), which prints
    its help or its error itself: then the command ends with that status."""
    from ._allocbox import run_arguments

    parsed = run_arguments(list(argv))
    if isinstance(parsed, int):
        raise SystemExit(parsed)
    chain = [(source, dict(config)) for source, config in parsed["chain"]]
    # Resolved now: the program may change directory before the files are written.
    record = None if parsed["record"] is None else os.path.abspath(parsed["record"])
    page = None if parsed["report"] is None else os.path.abspath(parsed["report"])
    report = {"page": page, "compare": parsed["compare"], "no_sites": parsed["no_sites"]}
    kind, target = parsed["program"]
    program = (kind, os.fspath(target))
    device = None if parsed["device"] is None else (parsed["device"][0], dict(parsed["device"][1]))
    return chain, parsed["grant"], (record, parsed["sites"]), report, device, program, list(parsed["args"])


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
        _check_output("--record", record)
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


def _check_output(option, path):
    """Refuse a file the program's run cannot end by writing (a folder, a device, a link,
    a read-only file, a folder that does not exist), before the program starts, as the
    writer itself would."""
    import allocbox
    from allocbox import _allocbox

    try:
        _allocbox.check_output(os.path.abspath(path))
    except allocbox.AllocboxError as e:
        raise UsageError(f"{option}: {e}") from None


def load_device(device, grant, recording):
    """The device policy `run --device-policy` names, installed for the GPU libraries
    the program imports, recording into `recording`'s trace when it records; None when
    none was named, or there is no GPU (said in a line)."""
    if device is None:
        return None
    import allocbox

    from . import device_use

    source, config = device
    try:
        policy = device_use.load(source, config, grant, recording)
    except (allocbox.AllocboxError, ValueError) as e:
        raise UsageError(f"--device-policy {source}: {e}") from None
    if policy is not None:
        device_use.install(policy)
    return policy


def check_report(report, recording):
    """Refuse a report that cannot be written, before the program starts; returns the
    trace to record for it (a temporary one without `--record`)."""
    page, compare = report["page"], report["compare"]
    if page is None:
        if compare:
            raise UsageError("--compare says what a report compares: add --report PAGE.html")
        if report["no_sites"]:
            raise UsageError("--no-sites says what a report leaves out: add --report PAGE.html")
        return recording
    _check_output("--report", page)
    import allocbox

    shipped = {"default", "builtin", *allocbox.policies()}
    for name in compare:
        if name not in shipped and not os.path.exists(name):
            raise UsageError(
                f"--compare {name}: no shipped policy or file of that name; shipped: "
                + ", ".join(sorted(shipped))
            )
    record, sites = recording
    # A report's tables by line need the lines: recorded unless told not to.
    sites = sites or not report["no_sites"]
    if record is None:
        import tempfile

        report["temporary"] = tempfile.mkdtemp(prefix="allocbox-run-")
        record = os.path.join(report["temporary"], "run.trace")
    return record, sites


def write_report(report, chain, traces):
    """Replay the recordings (the program's, then its children's) through NumPy's default, the program's policy (or
    chain, as it ran) and the ones to compare, into the page; the summary goes to standard error. A
    handler that fails there is said there: the exit status stays the program's."""
    handlers = [["-p", "default"]]
    if len(chain) == 1:
        source, config = chain[0]
        settings = [["-c", f"{key}={value}"] for key, value in config.items()]
        handlers.append(["-p", source, *sum(settings, [])])
    elif chain:
        # The chain as it ran: `top>next`, each link's settings as `LINK:KEY=VALUE`.
        settings = [["-c", f"{source}:{key}={value}"] for source, config in chain for key, value in config.items()]
        handlers.append(["-p", ">".join(source for source, _ in chain), *sum(settings, [])])
    seen = {"default", *(source for source, _ in chain[:1] if len(chain) == 1)}
    handlers += [["-p", name] for name in report["compare"] if name not in seen]
    command = [sys.executable, "-m", "allocbox", "report", *traces, *sum(handlers, []), "-o", report["page"]]
    done = subprocess.run(command, stdout=sys.stderr)
    if done.returncode != 2:
        print(f"allocbox: report written to {_shown(report['page'])}", file=sys.stderr)


@contextlib.contextmanager
def _placing(handler):
    """`handler` places the program's arrays: NumPy's in this thread and in every
    thread it starts, as `allocbox.use(handler, threads=True)` does, and Numba's in the
    whole process (`allocbox.numba.use`: no question to NumPy per array, while the
    program opens no `allocbox.use` block of its own)."""
    import allocbox
    import allocbox.numba

    previous = allocbox._set_handler(handler)
    restore = allocbox._start_threads_with(handler, hold=False)
    try:
        with allocbox.numba.use(handler):
            yield
    except BaseException as error:
        allocbox._name_a_stop(error, handler)
        raise
    finally:
        restore()
        allocbox._set_handler(previous)


def run_program(kind, target, args, kept, handler):
    """Run the program as `python SCRIPT` or `python -m MODULE` would, in a `__main__`
    module of its own; returns its exit status, and puts that module in `kept` (as
    `python` keeps `__main__` until it shuts down, so what its globals hold is live
    where the recording ends). An uncaught exception goes to `sys.excepthook` (the
    program's own, if it set one) with the frames of `allocbox run` taken off, so the
    traceback is the one `python` prints (with a note naming the policy, when its stop
    is why an allocation failed); a KeyboardInterrupt is printed so and raised
    again, to end the process as Ctrl-C ends `python`."""
    import allocbox

    sys.argv = [target, *args]
    # As `python` sets it: the script's folder, or for -m the current one.
    sys.path[0] = os.path.dirname(os.path.abspath(target)) if kind == "script" else os.getcwd()
    try:
        if kind == "module":
            # What `python -m` itself calls: the module runs in `sys.modules["__main__"]`
            # (a fresh one, not the module that runs allocbox), and its traceback has
            # the same two frames of runpy's.
            _fresh_main(kept)
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            _run_script(os.path.abspath(target), kept)
    except SystemExit as e:
        return _exit_status(e)
    except BaseException as e:  # noqa: B036 - the program's, given to its excepthook
        # The traceback printed is the exception's own, whatever the hook is given.
        tb = e.__traceback__ = _program_frames(e.__traceback__)
        allocbox._name_a_stop(e, handler)
        try:
            sys.excepthook(type(e), e, tb)
        except SystemExit as exit:
            return _exit_status(exit)
        except BaseException as hook_error:  # noqa: B036 - printed as python prints it
            # As python reports it: the hook was not called while handling anything.
            hook_error.__context__ = None
            hook_error.__traceback__ = _program_frames(hook_error.__traceback__)
            print("Error in sys.excepthook:", file=sys.stderr)
            sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
            print("\nOriginal exception was:", file=sys.stderr)
            sys.__excepthook__(type(e), e, tb)
        if isinstance(e, KeyboardInterrupt):
            # Printed already: the interpreter's own report of it would repeat it. A
            # KeyboardInterrupt itself (no subclass), for the interpreter ends the
            # process by SIGINT only for that type, after `atexit`, as for `python`.
            sys.excepthook = lambda *_: None
            raise KeyboardInterrupt from None
        return 1
    return 0


def _program_frames(tb):
    """`tb` without its first frames, those of `allocbox run` itself."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _run_script(path, kept):
    """`python SCRIPT`: the script compiled under its absolute path (`python` names it
    so in tracebacks and `__file__`) and run in a fresh `__main__`, which stays in
    `sys.modules` (pickling and `multiprocessing` find the program's classes there). A
    zip file or a folder with `__main__.py` runs as `python` runs those, by runpy."""
    import io

    if not os.path.isfile(path) or _is_zip(path):
        kept.append(runpy.run_path(path, run_name="__main__"))
        return
    with io.open_code(path) as file:
        source = file.read()
    main = _fresh_main(kept)
    main.__file__ = path
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__spec__ = None
    code = compile(source, path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _fresh_main(kept):
    """A new, empty `__main__` module in `sys.modules`, kept in `kept`."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    kept.append(main)
    return main


def _is_zip(path):
    import zipfile

    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def _exit_status(e):
    """The exit status `python` gives a SystemExit: its code, 0 for none, or 1 after
    printing any other value."""
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# The directory `run` started in: paths given to it are resolved from there.
_STARTED_IN = os.getcwd()


def _shown(path):
    """A path as the user would give it: relative to where `run` started, if inside."""
    relative = os.path.relpath(path, _STARTED_IN)
    return path if relative.startswith("..") else relative


def size_text(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def ungranted(handler, said):
    """A line for each kind of memory a policy of `handler` asked for and was not
    granted, with the option that grants it: each `(policy, kind)` once, kept in `said`."""
    lines = []
    if not hasattr(handler, "link_stats"):
        return lines
    try:
        links = handler.link_stats()
    except Exception:  # noqa: BLE001 - a stopped policy: its failure says why
        return lines
    for link in links:
        for kind, asked in link["ungranted"].items():
            if (link["name"], kind) in said:
                continue
            said.add((link["name"], kind))
            times = "once" if asked == 1 else f"{asked:,} times"
            lines.append(
                f"allocbox: policy `{link['name']}` asked for {kind} memory {times}, which was not "
                f"granted, and ran without it: add `--grant {kind}` to run it as written"
            )
    return lines


def summary(handler, traces, said=None, device=None):
    """What the handler saw, in a few lines, the cause of a stop first, and where the
    `traces` are; the kinds of memory a policy asked for and was not granted, but for
    those in `said`; what the `device` policy placed, when there is one."""
    lines = []
    if handler.failure:
        import allocbox

        lines.append(allocbox._stop_sentence(handler))
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
    lines += ungranted(handler, set() if said is None else said)
    if device is not None:
        d = device.stats()
        lines.append(
            f"allocbox: device policy `{device.name}` placed {d['mallocs']:,} blocks of GPU {device.device} "
            f"({size_text(d['total_bytes'])}); peak {size_text(d['peak_bytes'])} live; "
            f"{d['live_blocks']:,} ({size_text(d['live_bytes'])}) still live at the end"
        )
    if traces:
        shown = [_shown(trace) for trace in traces]
        if len(shown) == 1:
            lines.append(
                f"allocbox: trace written to {shown[0]}; read it with "
                f"`allocbox report {shown[0]} -p default -o report.html`"
            )
        else:
            # Named one by one while few; a pool's many workers, by the shell's pattern.
            children = " ".join(shown[1:]) if len(shown) <= 4 else _children_pattern(shown[0])
            lines.append(
                f"allocbox: trace written to {shown[0]}, and {len(shown) - 1} by the program's child "
                f"processes beside it; read them with `allocbox report {shown[0]} {children} -p default "
                "-o report.html`"
            )
    return lines


def _children_pattern(trace):
    """The shell's pattern for the children's traces beside `trace` (`TRACE.PID`,
    `TRACE.PID.gz` for `TRACE.gz`)."""
    return trace[:-3] + ".*.gz" if trace.endswith(".gz") else trace + ".*"


def main(argv):
    # A run started by a program under another run runs its own policy, not that one's.
    _allocbox_startup.disarm()
    try:
        chain, grant, recording, report, device, (kind, target), args = parse(argv)
        check_program(kind, target)
        recording = check_report(report, recording)
        handler = load(chain, grant, recording)
        record = recording[0]
        report["device"] = load_device(device, grant, handler if record is not None else None)
    except UsageError as e:
        print(f"allocbox run: {e}", file=sys.stderr)
        return 2
    import allocbox

    # A policy that asked for memory of a kind not granted while it started: said now,
    # with the option that grants it (what it asks later is said at the end).
    said = set()
    for line in ungranted(handler, said):
        print(line, file=sys.stderr)
    report["ungranted_said"] = said
    started_in = os.getpid()
    started_at = time.time()
    if record is not None:
        children.finish_in_forked_children(handler)
    if chain or record is not None or device is not None:
        children.hand_down(chain, grant, record, recording[1], device)
    code = None
    kept = []
    try:
        with _placing(handler):
            code = run_program(kind, target, args, kept, handler)
    finally:
        if os.getpid() == started_in:
            traces = [record, *children.traces(record, started_at)] if record is not None else []
            code = _end(handler, traces, report, code)
    if os.getpid() != started_in:
        # A child the program forked that returned here: it ends as the program's
        # code did, with no summary of its own (the process that started says it).
        return code
    if report["page"] is not None:
        write_report(report, chain, traces)
    if "temporary" in report:
        import shutil

        shutil.rmtree(report["temporary"], ignore_errors=True)
    return code


def _end(handler, traces, report, code):
    """End the recording where the program ended (what is live now is what it
    leaked) and say what the policy saw, naming the traces (the program's first, then
    its children's); returns the exit status."""
    import allocbox

    lines = []
    try:
        handler.finish_recording()
    except allocbox.AllocboxError as e:
        lines.append(f"allocbox: {e}")
        code = code or 1
    try:
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        pass
    shown = [] if "temporary" in report else traces
    children.say(*lines, *summary(handler, shown, report.get("ungranted_said"), report.get("device")))
    return code
