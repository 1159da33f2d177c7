//! A GPU made of host memory, for tests and `allocbox check` on machines without one:
//! its "device memory" is host memory the host treats exactly as device memory (never
//! read or written through `bytes`, never a host handler's answer), and its streams
//! finish only when a test says so, so that stream-ordered frees can be checked.

use std::alloc::Layout;
use std::collections::HashMap;

use parking_lot::Mutex;

use super::{Backend, DEVICE_ALIGNMENT, Event, GpuError, Stream};
use crate::kind::KindGrant;

/// A stand-in GPU: `devices` devices of `memory` bytes each.
#[derive(Debug)]
pub struct StandIn {
    devices: u32,
    memory: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Live device allocations: address → (device, size).
    allocated: HashMap<u64, (u32, u64)>,
    used: HashMap<u32, u64>,
    registered: HashMap<u64, u64>,
    /// Per stream: work queued so far, and work finished.
    streams: HashMap<(u32, Stream), (u64, u64)>,
    /// Events recorded: handle → (device, stream, work queued before it).
    events: HashMap<u64, (u32, Stream, u64)>,
    next_event: u64,
}

impl StandIn {
    pub fn new(devices: u32, memory: u64) -> StandIn {
        StandIn {
            devices,
            memory,
            state: Mutex::default(),
        }
    }

    /// Work is queued on `stream` of `device` (a kernel launch, a copy): events recorded
    /// from now on complete only once it has [`StandIn::finish`]ed.
    pub fn queue(&self, device: u32, stream: Stream) {
        self.state
            .lock()
            .streams
            .entry((device, stream))
            .or_default()
            .0 += 1;
    }

    /// Every piece of work queued on `stream` of `device` so far has finished.
    pub fn finish(&self, device: u32, stream: Stream) {
        let mut state = self.state.lock();
        let counts = state.streams.entry((device, stream)).or_default();
        counts.1 = counts.0;
    }

    /// Bytes of device memory allocated on `device` now.
    pub fn allocated(&self, device: u32) -> u64 {
        self.state.lock().used.get(&device).copied().unwrap_or(0)
    }

    /// Host bytes registered (pinned) now.
    pub fn registered(&self) -> u64 {
        self.state.lock().registered.values().sum()
    }

    fn has(&self, device: u32) -> Result<(), GpuError> {
        if device < self.devices {
            Ok(())
        } else {
            Err(GpuError::Unavailable(format!(
                "the stand-in GPU has no device {device} ({} made)",
                self.devices
            )))
        }
    }

    fn layout(size: u64) -> Option<Layout> {
        let size = usize::try_from(size.max(1)).ok()?;
        Layout::from_size_align(size, DEVICE_ALIGNMENT as usize).ok()
    }
}

impl Backend for StandIn {
    fn name(&self) -> &'static str {
        "the stand-in GPU"
    }

    fn memory(&self, device: u32) -> Result<(u64, u64), GpuError> {
        self.has(device)?;
        Ok((self.memory - self.allocated(device), self.memory))
    }

    // Every kind the stand-in makes is host memory: the host's rules, not the stand-in,
    // keep a device kind's bytes untouched.
    fn alloc(&self, _: KindGrant, device: u32, size: u64) -> Result<u64, GpuError> {
        self.has(device)?;
        let mut state = self.state.lock();
        let used = state.used.entry(device).or_default();
        if used.saturating_add(size) > self.memory {
            return Err(GpuError::OutOfMemory);
        }
        let layout = StandIn::layout(size).ok_or(GpuError::OutOfMemory)?;
        // SAFETY: a layout of non-zero size (at least 1 byte).
        let addr = unsafe { std::alloc::alloc(layout) } as u64;
        if addr == 0 {
            return Err(GpuError::OutOfMemory);
        }
        *used += size;
        state.allocated.insert(addr, (device, size));
        Ok(addr)
    }

    unsafe fn free(&self, _: KindGrant, device: u32, addr: u64) {
        let mut state = self.state.lock();
        let Some((on, size)) = state.allocated.remove(&addr) else {
            panic!("the stand-in GPU was asked to free {addr:#x}, which it never allocated");
        };
        assert_eq!(
            on, device,
            "freed on another device than it was allocated on"
        );
        *state.used.entry(device).or_default() -= size;
        let layout = StandIn::layout(size).expect("allocated with it");
        // SAFETY: allocated above with this layout, given back once (removed above).
        unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
    }

    unsafe fn register(&self, _: KindGrant, addr: u64, len: u64) -> Result<(), GpuError> {
        let mut state = self.state.lock();
        if state.registered.insert(addr, len).is_some() {
            return Err(GpuError::Driver {
                call: "cuMemHostRegister",
                message: "part or all of the range is already registered".into(),
            });
        }
        Ok(())
    }

    unsafe fn unregister(&self, _: KindGrant, addr: u64) {
        let removed = self.state.lock().registered.remove(&addr);
        assert!(
            removed.is_some(),
            "unregistered {addr:#x}, never registered"
        );
    }

    fn record(&self, device: u32, stream: Stream) -> Result<Event, GpuError> {
        self.has(device)?;
        let mut state = self.state.lock();
        let queued = state.streams.get(&(device, stream)).map_or(0, |s| s.0);
        state.next_event += 1;
        let handle = state.next_event;
        state.events.insert(handle, (device, stream, queued));
        Ok(Event { device, handle })
    }

    fn finished(&self, event: &Event) -> bool {
        let state = self.state.lock();
        let (device, stream, queued) = state.events[&event.handle];
        state
            .streams
            .get(&(device, stream))
            .is_none_or(|&(_, finished)| finished >= queued)
    }

    fn wait(&self, event: &Event) {
        let (device, stream, _) = self.state.lock().events[&event.handle];
        self.finish(device, stream);
    }

    fn wait_idle(&self, device: u32) {
        let mut state = self.state.lock();
        for (&(on, _), counts) in state.streams.iter_mut() {
            if on == device {
                counts.1 = counts.0;
            }
        }
    }

    fn release(&self, event: Event) {
        self.state.lock().events.remove(&event.handle);
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        for (addr, (_, size)) in self.state.get_mut().allocated.drain() {
            let layout = StandIn::layout(size).expect("allocated with it");
            // SAFETY: still allocated (never freed: it is in the map), given back once.
            unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
        }
    }
}
