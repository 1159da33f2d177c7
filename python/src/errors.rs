//! Python's exceptions for allocbox, and which one each host error raises.

use allocbox::Error;
use pyo3::create_exception;

create_exception!(
    allocbox,
    AllocboxError,
    pyo3::exceptions::PyException,
    "Any allocbox failure."
);
create_exception!(
    allocbox,
    LoadError,
    AllocboxError,
    "A file or bytes that are not a usable policy."
);
create_exception!(
    allocbox,
    ContractViolation,
    AllocboxError,
    "A policy broke the handler contract."
);
create_exception!(
    allocbox,
    PoisonedPolicy,
    AllocboxError,
    "A policy that was stopped earlier (violation, trap, time or memory limit)."
);
create_exception!(
    allocbox,
    ClientError,
    AllocboxError,
    "A client double or unknown free."
);

/// The exception that says what `error` was, with its sentence; a policy's fault
/// starts with the rule's name in brackets (`[wrong-memory] policy ...`), as the
/// command line's `BROKEN [wrong-memory]` and SECURITY.md name it.
pub(crate) fn to_py(error: &Error) -> pyo3::PyErr {
    let text = error.to_string();
    let named = || format!("[{}] {text}", error.kind());
    match error {
        Error::Violation(_) => ContractViolation::new_err(named()),
        Error::Poisoned { .. } => PoisonedPolicy::new_err(named()),
        Error::Client(_) => ClientError::new_err(text),
        // No policy is at fault: the host cannot reach the handler (a fork mid-call),
        // or a call waited for other threads' past its time limit.
        Error::Unreachable { .. } | Error::Waited { .. } => AllocboxError::new_err(text),
        _ => PoisonedPolicy::new_err(named()),
    }
}
