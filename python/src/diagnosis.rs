//! Naming the array a client misused: where each block of a diagnosing handler
//! ([`allocbox::Handler::diagnoses`]) was allocated, the warnings a policy's client-misuse
//! reports become, and the fault handler that names the array whose guard page a write
//! hit before the process stops.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::io::Write;
use std::sync::{Mutex, OnceLock};

use allocbox::ClientMisuse;
use allocbox::mapped::GuardPage;
use pyo3::prelude::*;

pyo3::create_exception!(
    allocbox,
    ClientMisuseWarning,
    pyo3::exceptions::PyUserWarning,
    "A policy found NumPy's client writing where it must not (past a block's end, into a \
     freed block). Turn it into an error with `warnings.simplefilter(\"error\", \
     allocbox.ClientMisuseWarning)`: raised while an array is freed, it reaches \
     `sys.unraisablehook`."
);

/// Where a block was allocated: its size, and the Python file and line.
pub(crate) struct Site {
    size: u64,
    file: String,
    line: u32,
}

/// Every live block of a diagnosing handler, by address (blocks of live handlers are
/// disjoint, so one map serves them all). A fault handler reads it: it only tries the
/// lock.
static SITES: Mutex<BTreeMap<u64, Site>> = Mutex::new(BTreeMap::new());

fn sites() -> std::sync::MutexGuard<'static, BTreeMap<u64, Site>> {
    SITES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Record that the block at `block` of `size` bytes was allocated by the innermost
/// Python code outside NumPy and allocbox.
pub(crate) fn record_site(block: *mut c_void, size: usize) {
    if block.is_null() {
        return;
    }
    let Some((file, line)) = Python::attach(caller) else {
        return;
    };
    let site = Site {
        size: size as u64,
        file,
        line,
    };
    sites().insert(block as u64, site);
}

/// Take the site of a block its client is about to give back, before the handler may
/// lend its address again: a block another thread then gets at that address keeps the
/// site it records (without the GIL, as Numba's workers allocate, the two overlap).
pub(crate) fn take_site(block: *mut c_void) -> Option<Site> {
    match block.is_null() {
        true => None,
        false => sites().remove(&(block as u64)),
    }
}

/// Put back the site of a block whose client still holds it (a refused realloc).
pub(crate) fn put_back_site(block: *mut c_void, site: Option<Site>) {
    if let Some(site) = site {
        sites().insert(block as u64, site);
    }
}

/// The file and line of the innermost Python frame outside NumPy and allocbox: the
/// code that asked for the array. Any exception NumPy has pending is kept.
fn caller(py: Python<'_>) -> Option<(String, u32)> {
    let pending = PyErr::take(py);
    let found = innermost_user_frame(py);
    if let Some(pending) = pending {
        pending.restore(py);
    }
    found
}

fn innermost_user_frame(py: Python<'_>) -> Option<(String, u32)> {
    let mut frame = py
        .import("sys")
        .and_then(|sys| sys.call_method1("_getframe", (0,)))
        .ok()?;
    while !frame.is_none() {
        let file: String = frame
            .getattr("f_code")
            .and_then(|code| code.getattr("co_filename"))
            .and_then(|name| name.extract())
            .ok()?;
        if !crate::sites::is_machinery(py, &file) {
            let line: u32 = frame.getattr("f_lineno").and_then(|l| l.extract()).ok()?;
            return Some((file, line));
        }
        frame = frame.getattr("f_back").ok()?;
    }
    None
}

/// The warning a policy's report becomes, naming the block's allocation site.
fn warning_text(misuse: &ClientMisuse, site: Option<&Site>) -> String {
    let allocated = site.map_or(String::new(), |s| {
        format!(", allocated at {}:{}", s.file, s.line)
    });
    format!(
        "policy `{}` found a misused {}-byte array{allocated}: {}",
        misuse.policy, misuse.size, misuse.message
    )
}

/// The site of `block`: the one taken out when the call gave it back, else the map's.
fn site_of<'a>(
    block: u64,
    given_back: Option<(u64, &'a Site)>,
    sites: &'a BTreeMap<u64, Site>,
) -> Option<&'a Site> {
    given_back
        .filter(|(given, _)| *given == block)
        .map(|(_, site)| site)
        .or_else(|| sites.get(&block))
}

/// Warn about each report (`ClientMisuseWarning`), from a free: an exception the
/// warning raises (the filter says "error") goes to `sys.unraisablehook`, as any
/// exception while an object is freed. `given_back` is the block this call gave back
/// and its site, taken out before ([`take_site`]).
pub(crate) fn warn(reports: Vec<ClientMisuse>, given_back: Option<(u64, &Site)>) {
    let texts: Vec<String> = {
        let sites = sites();
        reports
            .iter()
            .map(|m| warning_text(m, site_of(m.block, given_back, &sites)))
            .collect()
    };
    Python::attach(|py| {
        let pending = PyErr::take(py);
        for text in texts {
            let category = py.get_type::<ClientMisuseWarning>();
            let text = std::ffi::CString::new(text.replace('\0', " ")).unwrap_or_default();
            if let Err(raised) = PyErr::warn(py, &category, &text, 1) {
                raised.write_unraisable(py, None);
            }
        }
        if let Some(pending) = pending {
            pending.restore(py);
        }
    });
}

/// An overrun was reported: the fault may come back through the handlers chained after
/// ours, and is reported once.
static REPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The handlers that were in place before ours, for faults that are not ours.
static PREVIOUS: OnceLock<Vec<(c_int, libc::sigaction)>> = OnceLock::new();

/// Catch a fault in a guard page: installed once, when the first diagnosing handler is
/// made; every other fault goes to the handler that was there before (wasmtime's, which
/// turns a guest's fault into a trap; Python's `faulthandler`; the default).
pub(crate) fn install_fault_handler() {
    PREVIOUS.get_or_init(|| {
        [libc::SIGSEGV, libc::SIGBUS]
            .into_iter()
            .map(|signal| {
                // SAFETY: zeroed `sigaction`s are valid (no handler, empty mask) and are
                // filled before use; `on_fault` has the SA_SIGINFO signature; the old
                // action is written by the kernel.
                unsafe {
                    let mut ours: libc::sigaction = std::mem::zeroed();
                    ours.sa_sigaction = on_fault as *const () as usize;
                    ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                    libc::sigemptyset(&mut ours.sa_mask);
                    let mut before: libc::sigaction = std::mem::zeroed();
                    libc::sigaction(signal, &ours, &mut before);
                    (signal, before)
                }
            })
            .collect()
    });
}

extern "C" fn on_fault(signal: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as u64;
    if let Some((guard, page)) = allocbox::mapped::guard_page_at(addr)
        && !REPORTED.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        report_overrun(addr, guard, &page);
    }
    // The handler before ours goes on as without allocbox: Python's `faulthandler`
    // prints the traceback of the access; the default stops the process.
    let previous = PREVIOUS
        .get()
        .and_then(|all| all.iter().find(|(s, _)| *s == signal))
        .map(|(_, action)| *action);
    match previous {
        Some(action) if action.sa_flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: a SA_SIGINFO handler has this signature; it is called as the
            // kernel would have called it.
            let handler: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
                unsafe { std::mem::transmute(action.sa_sigaction) };
            handler(signal, info, context);
        }
        Some(action)
            if action.sa_sigaction != libc::SIG_DFL && action.sa_sigaction != libc::SIG_IGN =>
        {
            // SAFETY: a handler installed without SA_SIGINFO has this signature.
            let handler: extern "C" fn(c_int) = unsafe { std::mem::transmute(action.sa_sigaction) };
            handler(signal);
        }
        _ => reset_to_default(signal),
    }
}

fn reset_to_default(signal: c_int) {
    // SAFETY: restores the default action of `signal`; async-signal-safe.
    unsafe { libc::signal(signal, libc::SIG_DFL) };
}

/// Print which array the access at `addr` overran, from inside the fault handler: no
/// lock is waited for and nothing is allocated.
fn report_overrun(addr: u64, guard: u64, page: &GuardPage) {
    let mut buffer = [0u8; 1024];
    let mut out = std::io::Cursor::new(&mut buffer[..]);
    let sites = SITES.try_lock().ok();
    let region_end = page.region_start + page.region_len;
    let block = sites.as_ref().and_then(|sites| {
        if guard >= region_end {
            sites.range(page.region_start..=addr).next_back()
        } else {
            sites.range(addr..region_end).next()
        }
    });
    let _ = match block {
        Some((&start, site)) => {
            let offset = addr as i128 - start as i128;
            let (bytes, side) = if offset >= site.size as i128 {
                (offset - site.size as i128 + 1, "past its end")
            } else {
                (-offset, "before its start")
            };
            writeln!(
                out,
                "allocbox: an access at offset {offset} of a {}-byte array ({bytes} byte(s) {side}) hit a guard page of policy `{}`; the array was allocated at {}:{}. The process stops here: fix the code that wrote outside the array.",
                site.size, page.policy, site.file, site.line
            )
        }
        None => writeln!(
            out,
            "allocbox: an access at {addr:#x} hit a guard page of policy `{}` next to a block it lent. The process stops here: fix the code that wrote outside the array.",
            page.policy
        ),
    };
    let len = out.position() as usize;
    // SAFETY: writes `len` initialised bytes of `buffer` to stderr; async-signal-safe.
    unsafe { libc::write(2, buffer.as_ptr().cast(), len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(file: &str, line: u32) -> Site {
        Site {
            size: 64,
            file: file.into(),
            line,
        }
    }

    /// Thread A frees a block; before A's warning is made, thread B gets a block at
    /// the same address and records its site. A's warning names A's line, and B's
    /// block keeps B's.
    #[test]
    fn a_block_given_back_is_named_by_its_own_site_and_a_new_block_at_its_address_keeps_its_own() {
        let block = 0x5eed_0000_1000u64;
        sites().insert(block, site("a.py", 1));
        let taken = take_site(block as *mut c_void).expect("recorded");
        sites().insert(block, site("b.py", 2));
        let misuse = ClientMisuse {
            policy: "guard".into(),
            block,
            size: 64,
            offset: 64,
            message: "a write past its end".into(),
        };
        let text = {
            let sites = sites();
            warning_text(&misuse, site_of(block, Some((block, &taken)), &sites))
        };
        assert!(text.contains("allocated at a.py:1"), "{text}");
        let kept = sites().remove(&block).map(|s| (s.file, s.line));
        assert_eq!(kept, Some(("b.py".to_string(), 2)));
    }
}
