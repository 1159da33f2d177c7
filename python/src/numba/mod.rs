//! Numba's arrays through allocbox: `route` rebinds what Numba's compiled code calls for
//! a new array and places it with the handler NumPy has current; `blocks` says which
//! bridge a block goes back to when no NumPy handler is at hand (Numba's worker threads,
//! the process-wide mode). `route` uses `blocks`.

pub(crate) mod blocks;
pub(crate) mod route;
