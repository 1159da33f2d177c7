//! What the checker drives: a handler of one chain, or of one chain per client thread
//! for a policy that says its state is per instance. The client and the leak check
//! see both through [`Checked`].

use std::ptr::NonNull;
use std::sync::Arc;

use allocbox::gpu::Placement;
use allocbox::{Error, Handler, LinkStats, ShardedHandler, Stats};

/// The calls the checker makes of the handler under check.
pub(super) trait Checked: Sync {
    fn name(&self) -> &str;
    fn placement(&self) -> Placement;
    fn keeps_magazines(&self) -> bool;
    fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error>;
    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error>;
    fn realloc(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<Option<NonNull<u8>>, Error>;
    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error>;
    fn trim(&self) -> Result<(), Error>;
    fn stats(&self) -> Result<Stats, Error>;
    /// Every chain's policies' counters, each chain top first.
    fn link_stats(&self) -> Result<Vec<LinkStats>, Error>;
    fn failure(&self) -> Option<Arc<Error>>;
    fn leak_check(&self) -> Result<(), Error>;
}

/// The methods of the same names on each handler.
macro_rules! delegate {
    ($handler:ty, $placement:expr, $magazines:expr) => {
        impl Checked for $handler {
            fn name(&self) -> &str {
                <$handler>::name(self)
            }
            fn placement(&self) -> Placement {
                $placement(self)
            }
            fn keeps_magazines(&self) -> bool {
                $magazines(self)
            }
            fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
                <$handler>::malloc(self, size)
            }
            fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
                <$handler>::calloc(self, nelem, elsize)
            }
            fn realloc(
                &self,
                ptr: Option<NonNull<u8>>,
                size: usize,
            ) -> Result<Option<NonNull<u8>>, Error> {
                <$handler>::realloc(self, ptr, size)
            }
            fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
                <$handler>::free(self, ptr, size)
            }
            fn trim(&self) -> Result<(), Error> {
                <$handler>::trim(self)
            }
            fn stats(&self) -> Result<Stats, Error> {
                <$handler>::stats(self)
            }
            fn link_stats(&self) -> Result<Vec<LinkStats>, Error> {
                <$handler>::link_stats(self)
            }
            fn failure(&self) -> Option<Arc<Error>> {
                <$handler>::failure(self)
            }
            fn leak_check(&self) -> Result<(), Error> {
                <$handler>::leak_check(self)
            }
        }
    };
}

delegate!(Handler, Handler::placement, Handler::keeps_magazines);
// Every chain of a handler per thread is of host memory and keeps no magazines.
delegate!(ShardedHandler, |_| Placement::Host, |_| false);
