//! NEP 49 behaviours as NumPy's own `test_mem_policy.py` asserts them, on the Rust API.

use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use allocbox::nep49::{self, Buffer, HookData, SharedHandler};
use allocbox::{Call, Error, HandlerBuilder, Limits, Runtime, WasmHook};

use super::support::*;

fn wasm(guest: &allocbox_artifacts::Guest) -> SharedHandler {
    Arc::new(handler(guest, &[]))
}

#[test]
fn new_buffers_carry_the_current_handler_s_name_views_carry_none() {
    let _exclusive = exclusive();
    let size_classes = wasm(&allocbox_artifacts::SIZE_CLASSES);
    let buf = nep49::with_handler(size_classes.clone(), || Buffer::new(100)).unwrap();
    assert_eq!(buf.handler_name(), "size-classes");
    assert_eq!(buf.handler_version(), 1);
    let view = buf.view(10..20);
    assert_eq!(view.handler_name(), None, "a view owns no data");
    assert_eq!(view.base().handler_name(), "size-classes", "its base does");
    assert_eq!(nep49::current_handler_name(), "default_allocator");
    assert_eq!(nep49::current_handler_version(), 1);
}

#[test]
fn set_handler_returns_the_previous_and_none_resets_to_the_default_singleton() {
    let system = wasm(&allocbox_artifacts::SYSTEM);
    let before = nep49::set_handler(Some(system.clone())).unwrap();
    assert!(Arc::ptr_eq(&before, &nep49::default_handler()));
    assert_eq!(nep49::get_handler().name(), "system");
    let previous = nep49::set_handler(None).unwrap();
    assert!(Arc::ptr_eq(&previous, &system));
    assert!(
        Arc::ptr_eq(&nep49::get_handler(), &nep49::default_handler()),
        "the same object"
    );
}

#[test]
fn a_stopped_handler_is_refused_with_its_reason() {
    let h = Arc::new(broken("misaligned"));
    assert!(h.malloc(16).is_err());
    let err = nep49::set_handler(Some(h)).unwrap_err();
    assert!(matches!(err, Error::Poisoned { .. }), "{err}");
    assert!(
        err.to_string().contains("misaligned") || err.to_string().contains("aligned"),
        "{err}"
    );
    assert_eq!(
        nep49::current_handler_name(),
        "default_allocator",
        "nothing changed"
    );
}

#[test]
fn a_new_thread_starts_at_the_default_it_does_not_inherit() {
    let system = wasm(&allocbox_artifacts::SYSTEM);
    nep49::with_handler(system, || {
        assert_eq!(nep49::current_handler_name(), "system");
        let seen = std::thread::spawn(nep49::current_handler_name)
            .join()
            .unwrap();
        assert_eq!(seen, "default_allocator");
    });
}

/// Polls futures by hand, interleaving them, like an executor running two tasks.
fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
}

/// Yields once, so two tasks interleave.
struct YieldOnce(bool);
impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            Poll::Pending
        }
    }
}

#[test]
fn tasks_inherit_at_creation_keep_their_own_handler_and_leak_nothing_back() {
    let _exclusive = exclusive();
    let system = wasm(&allocbox_artifacts::SYSTEM);
    let arena = wasm(&allocbox_artifacts::ARENA);
    let task = |mine: SharedHandler, expect_inherited: &'static str| {
        Box::pin(nep49::scoped(async move {
            assert_eq!(nep49::current_handler_name(), expect_inherited);
            let name = mine.name().to_string();
            nep49::set_handler(Some(mine)).unwrap();
            YieldOnce(false).await;
            assert_eq!(
                nep49::current_handler_name(),
                name,
                "kept across a suspension"
            );
            Buffer::new(8).unwrap().handler_name().to_string()
        }))
    };
    let (mut a, mut b) = nep49::with_handler(system.clone(), || {
        (
            task(arena.clone(), "system"),
            task(system.clone(), "system"),
        )
    });
    assert!(poll_once(&mut a).is_pending());
    assert!(poll_once(&mut b).is_pending());
    assert_eq!(
        nep49::current_handler_name(),
        "default_allocator",
        "nothing leaked back"
    );
    assert_eq!(poll_once(&mut a), Poll::Ready("arena".to_string()));
    assert_eq!(poll_once(&mut b), Poll::Ready("system".to_string()));
}

#[test]
fn buffers_made_before_a_switch_are_freed_by_their_own_handler() {
    let _exclusive = exclusive();
    let system = wasm(&allocbox_artifacts::SYSTEM);
    let arena = wasm(&allocbox_artifacts::ARENA);
    let old = nep49::with_handler(system.clone(), || Buffer::new(64)).unwrap();
    let mut grown = nep49::with_handler(system.clone(), || Buffer::zeroed(10)).unwrap();
    nep49::with_handler(arena.clone(), || {
        grown.resize(5000).unwrap();
        assert_eq!(grown.handler_name(), "system", "resized by its own handler");
        drop(old);
        drop(grown);
    });
    assert_eq!(system.stats().unwrap().live_blocks, 0);
    assert_eq!(system.stats().unwrap().frees, 2);
    assert_eq!(
        arena.stats().unwrap().mallocs + arena.stats().unwrap().frees,
        0,
        "the current one saw nothing"
    );
}

/// Events seen by the hook on the test's own thread (tests run in parallel, and a hook
/// is process-wide).
type Seen = (std::thread::ThreadId, Arc<Mutex<Vec<(bool, bool, usize)>>>);

#[test]
fn event_hooks_see_new_free_and_renew_and_may_allocate() {
    let _exclusive = exclusive();
    let seen: Seen = (std::thread::current().id(), Arc::default());
    let data: HookData = Arc::new(seen.clone());
    let hook: nep49::Hook = Arc::new(
        |old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size, data: &HookData| {
            let (thread, seen) = data.downcast_ref::<Seen>().unwrap();
            if *thread == std::thread::current().id() {
                seen.lock()
                    .unwrap()
                    .push((old.is_some(), new.is_some(), size));
            }
            // A hook that allocates through the handler: no deadlock, no recursion.
            drop(Buffer::new(3).unwrap());
        },
    );
    assert!(nep49::set_event_hook(Some((hook.clone(), data.clone()))).is_none());
    let system = wasm(&allocbox_artifacts::SYSTEM);
    nep49::with_handler(system, || {
        let mut b = Buffer::new(40).unwrap();
        b.resize(80).unwrap();
        drop(b);
    });
    let (previous, previous_data) = nep49::set_event_hook(None).expect("the hook we set");
    assert!(Arc::ptr_eq(&previous, &hook));
    assert!(Arc::ptr_eq(&previous_data, &data));
    assert_eq!(
        *seen.1.lock().unwrap(),
        [(false, true, 40), (true, true, 80), (true, false, 0)],
        "new (none, new, size), renew (old, new, size), free (old, none, 0)"
    );
}

/// Hooks are process-wide: tests that make buffers (and so fire hooks) take turns.
static HOOK_TESTS: Mutex<()> = Mutex::new(());

fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    HOOK_TESTS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn a_wasm_hook_counts_every_event_in_its_sandbox() {
    let _exclusive = exclusive();
    let source = include_str!("../../guest-handlers/hooks/wat/counting-hook/counting-hook.wat");
    let hook = WasmHook::start(
        Runtime::shared(),
        source.as_bytes(),
        "counting-hook",
        Limits::default(),
    )
    .unwrap();
    nep49::set_event_hook(Some(hook.as_hook()));
    nep49::with_handler(wasm(&allocbox_artifacts::SIZE_CLASSES), || {
        let mut a = Buffer::new(100).unwrap();
        let b = Buffer::zeroed(28).unwrap();
        a.resize(300).unwrap();
        drop((a, b));
    });
    nep49::set_event_hook(None);
    assert_eq!(
        hook.report().unwrap(),
        [2, 2, 1, 128],
        "[new, free, renew, bytes]"
    );
}

#[test]
fn a_failing_wasm_hook_is_stopped_and_allocation_goes_on() {
    let _exclusive = exclusive();
    let trapping = r#"(module
        (func (export "allocbox:policy/events@0.1.0#on-event") (param i64 i64 i64) unreachable)
        (func (export "allocbox:policy/events@0.1.0#report") (result i32) unreachable)
        (memory (export "memory") 1))"#;
    let hook = WasmHook::start(
        Runtime::shared(),
        trapping.as_bytes(),
        "trapping",
        Limits::default(),
    )
    .unwrap();
    nep49::set_event_hook(Some(hook.as_hook()));
    let buffer = Buffer::new(64);
    nep49::set_event_hook(None);
    assert_eq!(buffer.unwrap().len(), 64, "the allocation stands");
    let failure = hook.failure().expect("the hook was stopped");
    assert!(
        matches!(&*failure, Error::Hook { cause, .. } if matches!(**cause, Error::Trap { call: Call::Event, .. })),
        "{failure}"
    );
    // Named as the hook it is, in the call it was making.
    assert!(
        failure
            .to_string()
            .starts_with("event hook `trapping` trapped in `on-event`"),
        "{failure}"
    );
    assert!(matches!(
        hook.report(),
        Err(Error::Hook { cause, .. }) if matches!(*cause, Error::Poisoned { .. })
    ));
}

#[test]
fn a_policy_is_not_a_hook() {
    let err = WasmHook::start(
        Runtime::shared(),
        allocbox::DEFAULT_POLICY_WAT.as_bytes(),
        "x",
        Limits::default(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            allocbox::LoadError::WrongWorld { .. } | allocbox::LoadError::Componentize { .. }
        ),
        "{err}"
    );
}
#[test]
fn per_link_statistics_and_a_leak_check_a_test_can_assert_on() {
    let h = HandlerBuilder::new(Runtime::shared())
        .link(&load(&allocbox_artifacts::SIZE_CLASSES))
        .link(&load(&allocbox_artifacts::SYSTEM))
        .magazines(false)
        .build()
        .unwrap();
    let small = h.malloc(10).unwrap();
    let big = h.malloc(5000).unwrap();
    let links = h.link_stats().unwrap();
    assert_eq!(links[0].name, "size-classes");
    assert_eq!(links[0].mallocs, 2);
    assert_eq!(links[0].live_blocks, 2);
    assert_eq!(links[1].name, "system");
    assert_eq!(links[1].live_bytes, 5010);
    assert_eq!(h.live_blocks().unwrap().len(), 2);
    h.free(small, 10).unwrap();
    h.free(big, 5000).unwrap();
    assert_eq!(h.stats().unwrap().peak_bytes, 5010);
    h.leak_check().unwrap();

    let leaky = broken("leak");
    let p = leaky.malloc(100).unwrap();
    leaky.free(p, 100).unwrap();
    let err = leaky.leak_check().unwrap_err();
    assert_eq!(err.rule().map(|r| r.name()), Some("leak"), "{err}");
}

/// Found probing the hook world: a hook answered its report with its whole memory as
/// numbers (16.7 M of them), which the command line printed, a GB of it. A report is
/// cut at its bound right after it is lifted.
#[test]
fn a_hook_s_report_is_cut_at_its_bound() {
    // The answer: a list at byte 8 of 2,000,000 numbers (0x1e8480), all of its memory.
    let flooding = r#"(module
        (memory (export "memory") 300)
        (data (i32.const 0) "\08\00\00\00\80\84\1e\00")
        (func (export "allocbox:policy/events@0.1.0#on-event") (param i64 i64 i64))
        (func (export "allocbox:policy/events@0.1.0#report") (result i32) i32.const 0))"#;
    let hook = WasmHook::start(
        Runtime::shared(),
        flooding.as_bytes(),
        "flooding",
        Limits::default(),
    )
    .unwrap();
    let numbers = hook.report().unwrap();
    assert_eq!(numbers.len(), allocbox::MAX_REPORTED_NUMBERS);
}

#[test]
fn removing_a_failed_hook_removes_only_that_hook_never_one_set_meanwhile() {
    let _turn = exclusive();
    let hook: nep49::Hook = Arc::new(|_, _, _, _: &HookData| {});
    let (failed, replacement): (HookData, HookData) = (Arc::new(1u8), Arc::new(2u8));
    let is_failed = |data: &HookData| Arc::ptr_eq(data, &failed);
    nep49::set_event_hook(Some((hook.clone(), replacement.clone())));
    assert!(
        nep49::remove_event_hook_if(is_failed).is_none(),
        "another thread's hook, set after the failed one, stays"
    );
    assert!(nep49::event_hook_set());
    nep49::set_event_hook(Some((hook, failed.clone())));
    let (_, removed) = nep49::remove_event_hook_if(is_failed).expect("the failed hook");
    assert!(Arc::ptr_eq(&removed, &failed));
    assert!(!nep49::event_hook_set());
    assert!(nep49::set_event_hook(None).is_none());
}
