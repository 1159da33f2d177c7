//! Running a script against a fresh handler: the handler started for each case, the
//! client threads run on it (`client.rs`), and the leak check after them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use allocbox::gpu::{Gpu, StandIn};
use allocbox::mapped::KindGrant;
use allocbox::{Adversary, DeviceHandler, Handler, HandlerBuilder, Limits, LoadError};
use allocbox::{Policy, Runtime, ShardedHandler, WasmHook};

use super::client::{Client, Mailboxes};
use super::holdings::Holdings;
use super::script::{CallPath, Case, Op, Script};
use super::verdict::{Finding, Tally};
use allocbox::PolicyHandler;

/// A handler of host memory, of the checker's stand-in GPU, or of an instance per
/// client thread.
pub(super) enum Started {
    Host(Handler),
    Device(DeviceHandler),
    PerThread(ShardedHandler),
}

impl std::ops::Deref for Started {
    type Target = dyn PolicyHandler + 'static;
    fn deref(&self) -> &(dyn PolicyHandler + 'static) {
        match self {
            Started::Host(h) => h,
            Started::Device(d) => d,
            Started::PerThread(s) => s,
        }
    }
}

/// The stand-in GPU every device check of this process runs on: host memory, so the
/// checker can look at every block as it does for host memory.
fn checker_gpu() -> Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| Gpu::stand_in(Arc::new(StandIn::new(1, 1 << 32))))
        .clone()
}

/// Everything needed to start a fresh handler for one case.
pub(super) struct Subject<'a> {
    pub(super) runtime: &'a Runtime,
    pub(super) policy: &'a Policy,
    /// The configuration of the round running: the one given, and what the check drew
    /// (`sweep`).
    pub(super) config: Vec<(String, String)>,
    pub(super) limits: &'a Limits,
    /// The seed of the checker's upstream for every case.
    pub(super) upstream_seed: u64,
    pub(super) hook: Option<&'a WasmHook>,
    /// Summed over the cases run.
    pub(super) tally: Tally,
}

impl Subject<'_> {
    /// A fresh handler over a fresh checker's upstream from the subject's seed, asking
    /// its policy the way `path` says.
    /// A policy granted `device` is checked as a device handler of the checker's own
    /// stand-in GPU, whose memory the checker (playing the GPU's kernels) can fill and
    /// read.
    /// With [`CallPath::PerThread`], one instance per client thread of `threads`.
    pub(super) fn start(
        &self,
        path: CallPath,
        magazine_depth: Option<u8>,
        threads: usize,
    ) -> Result<(Started, Arc<Adversary>), LoadError> {
        let adversary = Adversary::new(self.upstream_seed);
        let mut limits = self.limits.clone();
        let device = limits.grants.memory.granted(KindGrant::Device);
        if device {
            limits.grants.gpu = checker_gpu();
        }
        let config: Vec<(&str, &str)> = (self.config.iter())
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let builder = HandlerBuilder::new(self.runtime)
            .link_with(self.policy, &config)
            .limits(limits)
            .checked(true)
            .magazines(path == CallPath::Magazines)
            .adversary(Arc::clone(&adversary));
        let builder = match magazine_depth {
            Some(most) => builder.magazine_depth(usize::from(most)),
            None => builder,
        };
        let started = match (device, path) {
            (true, _) => Started::Device(builder.build_device(0)?),
            (false, CallPath::PerThread) => Started::PerThread(builder.build_sharded(threads)?),
            (false, _) => Started::Host(builder.build()?),
        };
        Ok((started, adversary))
    }

    /// Count what was refused on purpose in a case that ran on `handler`, and what the
    /// policy counted.
    fn tally(&self, handler: &dyn PolicyHandler, adversary: &Adversary) {
        // A handler the checker's own threads called is reachable; were it not, the leak
        // check has said so already.
        if let Ok(stats) = handler.stats() {
            self.tally
                .budget
                .fetch_add(stats.budget_refusals, Ordering::Relaxed);
            self.tally
                .budget_held
                .fetch_add(stats.budget_refusals_held, Ordering::Relaxed);
        }
        self.tally
            .injected
            .fetch_add(adversary.refusals(), Ordering::Relaxed);
        let links = handler.link_stats().unwrap_or_default();
        for link in &links {
            self.tally.add_ungranted(&link.ungranted);
        }
        if let Some(top) = links.into_iter().next() {
            self.tally.add_counters(top.counters);
        }
    }

    /// Run a case's threads (one op list per client thread), then free everything,
    /// trim, and look for leaks. Returns the resolved script and the first finding.
    /// Past `deadline` no operation starts: the case ends where it is, unjudged (the
    /// handler is dropped, which calls no policy), so a check's time budget holds
    /// within one call of the policy whatever each call costs. `None`: the case
    /// ended so, with the operations it ran.
    pub(super) fn run(
        &self,
        case: &Case,
        deadline: Option<Instant>,
    ) -> Result<(Script, Option<Finding>), Script> {
        let threads = &case.threads;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Script::default());
        }
        let (handler, adversary) = match self.start(case.path, case.magazine_depth, threads.len()) {
            Ok(started) => started,
            Err(e) => {
                let finding = Finding {
                    rule: "start",
                    message: e.to_string(),
                };
                return Ok((Script::default(), Some(finding)));
            }
        };
        // Before anything runs: a policy that fails is no longer served from magazines.
        let path = path_taken(&handler);
        if let Started::PerThread(sharded) = &handler {
            self.tally.instances(sharded.shard_count());
        }
        // Each operation takes a ticket as it starts, so the order the handler saw them
        // in can be written down and replayed.
        let clock = AtomicU64::new(0);
        let mailboxes = Mailboxes::new(threads.len());
        let handler = &*handler;
        let results: Vec<Ran> = if threads.len() == 1 {
            vec![run_client(
                handler,
                &adversary,
                self.hook,
                (0, &threads[0], &mailboxes),
                &clock,
                deadline,
            )]
        } else {
            std::thread::scope(|s| {
                let running: Vec<_> = threads
                    .iter()
                    .enumerate()
                    .map(|(t, ops)| {
                        let (adversary, clock, mailboxes) = (&*adversary, &clock, &mailboxes);
                        let hook = self.hook;
                        s.spawn(move || {
                            let thread = (t, &ops[..], mailboxes);
                            run_client(handler, adversary, hook, thread, clock, deadline)
                        })
                    })
                    .collect();
                running
                    .into_iter()
                    .map(|t| t.join().expect("client thread"))
                    .collect()
            })
        };
        let mut script = Script {
            upstream_seed: self.upstream_seed,
            path,
            magazine_depth: case.magazine_depth.filter(|_| path == CallPath::Magazines),
            ..Script::default()
        };
        let mut finding = None;
        let mut turns = Vec::new();
        let unfinished = results.iter().any(|ran| ran.unfinished);
        if results.iter().any(|ran| ran.waited) {
            self.tally.waited.fetch_add(1, Ordering::Relaxed);
        }
        for (thread, ran) in results.into_iter().enumerate() {
            self.tally
                .holdings
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .merge(ran.holdings);
            turns.extend(ran.tickets.iter().map(|&ticket| (ticket, thread)));
            script.threads.push(ran.ops);
            finding = finding.or(ran.finding);
        }
        if script.threads.len() > 1 {
            turns.sort_unstable();
            script.order = turns.into_iter().map(|(_, thread)| thread).collect();
        }
        if unfinished && finding.is_none() {
            return Err(script);
        }
        if finding.is_none() {
            finding = free_passed(handler, &adversary, &mailboxes).or_else(|| leak_check(handler));
        }
        self.tally
            .passed
            .fetch_add(mailboxes.freed(), Ordering::Relaxed);
        self.tally(handler, &adversary);
        Ok((script, finding.map(|f| f.after_refusals(&adversary))))
    }
}

/// The way `handler` asks its policy: through magazines only when it keeps them (a
/// policy that neither batches nor observes is asked on every call whatever the
/// script said).
pub(super) fn path_taken(started: &Started) -> CallPath {
    match started {
        Started::PerThread(_) => CallPath::PerThread,
        _ if started.keeps_magazines() => CallPath::Magazines,
        _ => CallPath::PerCall,
    }
}

/// Free what was passed to a thread after its last turn (its `free_all` had run):
/// from the checker's own thread, another thread than the maker's again.
fn free_passed(
    handler: &dyn PolicyHandler,
    adversary: &Adversary,
    mailboxes: &Mailboxes,
) -> Option<Finding> {
    (0..mailboxes.len()).find_map(|thread| {
        let mut client = Client::new(handler, adversary, None, (thread, mailboxes));
        client.free_all().err()
    })
}

/// What one client thread ran: the operations that reached the handler, the ticket
/// each took as it started, and the first finding.
pub(super) struct Ran {
    ops: Vec<Op>,
    tickets: Vec<u64>,
    finding: Option<Finding>,
    /// Stopped at the deadline, before or while freeing its blocks, or by a call that
    /// waited past its limit: nothing to judge.
    unfinished: bool,
    /// A call waited past its limit behind other client threads' calls.
    waited: bool,
    /// What the policy held beside this thread's bytes ([`Client::holdings`]).
    holdings: Holdings,
}

/// [`allocbox::Error::kind`] of a call that waited for other threads' calls past its
/// limit: no policy's fault.
const WAITED: &str = "waited";

pub(super) fn run_client(
    handler: &dyn PolicyHandler,
    adversary: &Adversary,
    hook: Option<&WasmHook>,
    (thread, ops, mailboxes): (usize, &[Op], &Mailboxes),
    clock: &AtomicU64,
    deadline: Option<Instant>,
) -> Ran {
    let mut client = Client::new(handler, adversary, hook, (thread, mailboxes));
    let mut tickets = Vec::new();
    let mut finding = None;
    for op in ops {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ran {
                ops: client.ran,
                tickets,
                finding: None,
                unfinished: true,
                waited: false,
                holdings: Holdings::default(),
            };
        }
        let ticket = clock.fetch_add(1, Ordering::Relaxed);
        let before = client.ran.len();
        let result = client.run(op);
        if client.ran.len() > before {
            tickets.push(ticket);
        }
        if let Err(f) = result {
            finding = Some(f);
            break;
        }
    }
    let mut unfinished = false;
    if finding.is_none() {
        // The case's end is where a trim would come next.
        client.sample_holdings();
        match client.free_all_by(deadline) {
            Ok(all) => unfinished = !all,
            Err(found) => finding = Some(found),
        }
    }
    // A call that waited past its limit behind the other client threads' calls never
    // reached the policy: the checker asked too much at once, and the case is not judged.
    let waited = finding.as_ref().is_some_and(|f| f.rule == WAITED);
    if waited {
        return Ran {
            ops: client.ran,
            tickets,
            finding: None,
            unfinished: true,
            waited,
            holdings: Holdings::default(),
        };
    }
    // After a failure the rest are released host-side, so nothing leaks here either.
    if finding.is_some() {
        let _ = client.free_all();
    }
    Ran {
        ops: client.ran,
        tickets,
        finding,
        unfinished,
        waited,
        holdings: client.holdings,
    }
}

/// Run a script's threads on one handler, each on a thread of its own, taking turns in
/// `order` (the thread of each operation in turn), so the handler sees exactly the
/// recorded sequence; then each thread frees what it holds, in thread order.
pub(super) fn run_in_order(
    handler: &dyn PolicyHandler,
    adversary: &Adversary,
    script: &Script,
    order: &[usize],
) -> Option<Finding> {
    use std::sync::{Condvar, Mutex};
    const STOPPED: usize = usize::MAX;
    let turn = Mutex::new(0usize);
    let moved = Condvar::new();
    let found: Mutex<Option<Finding>> = Mutex::new(None);
    let threads = script.threads.len();
    let mailboxes = Mailboxes::new(threads);
    // After the recorded operations, one more turn per thread to free what it holds.
    let turns: Vec<usize> = order.iter().copied().chain(0..threads).collect();
    let steps_of = |me: usize| turns.iter().enumerate().filter(move |&(_, &t)| t == me);
    std::thread::scope(|s| {
        let mut clients = Vec::new();
        for (me, ops) in script.threads.iter().enumerate() {
            let (turn, moved, found, turns) = (&turn, &moved, &found, &turns);
            let mailboxes = &mailboxes;
            let steps: Vec<usize> = steps_of(me).map(|(step, _)| step).collect();
            clients.push(s.spawn(move || {
                // A thread that panics stops the others rather than leave them waiting
                // for its turn for ever.
                struct StopOnPanic<'a>(&'a Mutex<usize>, &'a Condvar);
                impl Drop for StopOnPanic<'_> {
                    fn drop(&mut self) {
                        if std::thread::panicking() {
                            *self.0.lock().unwrap_or_else(|p| p.into_inner()) = STOPPED;
                            self.1.notify_all();
                        }
                    }
                }
                let _stop = StopOnPanic(turn, moved);
                let mut client = Client::new(handler, adversary, None, (me, mailboxes));
                let mut ops = ops.iter();
                for step in steps {
                    let mut now = turn.lock().unwrap_or_else(|p| p.into_inner());
                    while *now != step && *now != STOPPED {
                        now = moved.wait(now).unwrap_or_else(|p| p.into_inner());
                    }
                    if *now == STOPPED {
                        break;
                    }
                    let result = match ops.next() {
                        Some(op) if step < turns.len() - threads => client.run(op),
                        _ => client.free_all(),
                    };
                    *now = match result {
                        Ok(()) => step + 1,
                        Err(f) => {
                            let mut found = found.lock().unwrap_or_else(|p| p.into_inner());
                            found.get_or_insert(f);
                            STOPPED
                        }
                    };
                    moved.notify_all();
                }
                // After a failure the rest are released host-side, so nothing leaks.
                let _ = client.free_all();
            }));
        }
        // Joined, not left to the scope: a join waits for the thread's exit, where its
        // cache goes back to the policy (calls that can fail), as in `run`; the end of a
        // scope does not, and the leak check would race with it.
        for client in clients {
            if let Err(panic) = client.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
    let finding = found.into_inner().unwrap_or_else(|p| p.into_inner());
    finding
        .or_else(|| free_passed(handler, adversary, &mailboxes))
        .or_else(|| leak_check(handler))
        .map(|f| f.after_refusals(adversary))
}

pub(super) fn leak_check(handler: &dyn PolicyHandler) -> Option<Finding> {
    // A failure that no call returned is a finding too: a client thread that ended gave
    // its cache back to the policy, which failed there.
    if let Some(failure) = handler.failure() {
        return Some(Finding::from_error(&failure));
    }
    if let Err(leak) = handler.leak_check() {
        return Some(Finding::from_error(&leak));
    }
    // Its counters are part of what a policy serves: one that fails to report them is
    // stopped, and that is a finding like any other failure.
    let _ = handler.link_stats();
    handler
        .failure()
        .map(|failure| Finding::from_error(&failure))
}
