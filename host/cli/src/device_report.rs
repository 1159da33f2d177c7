//! A trace's GPU memory in `allocbox report`: each GPU's events replayed through each
//! device policy, on a stand-in GPU (host memory the host treats as the GPU's and never
//! touches, so no GPU is needed), as a part of the page of its own beside the host
//! memory's: what the program held on that GPU, and what each policy held in the
//! regions it mapped for it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use allocbox::gpu::{Gpu, StandIn};
use allocbox::mapped::KindGrant;
use allocbox::trace::leak_after_replay;
use allocbox::trace::timeline::{Replayed, Timeline, chain_held, timeline_counted};
use allocbox::{HandlerBuilder, Limits, Runtime, WasmHook};
use anyhow::{Context, Result};

use crate::named::{hook_report, load_hook, observed};
use crate::progress;
use crate::report::{self, Memory};
use crate::survey::Survey;

/// What the device policies of a report are and the GPU they run on.
pub(crate) struct DevicePolicies {
    /// Shipped device policies' names or policy files, each replayed on its own.
    pub(crate) policies: Vec<String>,
    /// The stand-in GPU's memory, per GPU: a policy that needs more runs out.
    pub(crate) memory: u64,
}

/// Whether each device policy's replay fit the stand-in GPU's `memory`: a line each,
/// what a user who ran out of memory on a real GPU decides on.
pub(crate) fn fit_lines(part: &GpuPart, memory: u64) -> String {
    let mut out = String::new();
    for t in &part.timelines {
        let verdict = t.ran_out_text().unwrap_or_else(|| {
            format!(
                "fit: it held at most {} for the program's {} at the most",
                report::bytes(t.peak_held),
                report::bytes(t.peak_live)
            )
        });
        out += &format!(
            "on GPU {} of {} (--device-memory), `{}` {verdict}\n",
            part.gpu,
            report::bytes(memory),
            t.label
        );
    }
    out
}

/// One GPU's part of a report: its title, its part of the page, its timelines.
pub(crate) struct GpuPart {
    pub(crate) gpu: u16,
    pub(crate) name: String,
    pub(crate) part: String,
    pub(crate) timelines: Vec<Timeline>,
    /// The event hook's report on each device policy, as for the host's.
    pub(crate) hook_reports: String,
    pub(crate) hook_failed: bool,
}

/// A part for each GPU whose memory the surveyed trace has events of (none for a trace
/// of host memory alone), each GPU's events through every device policy.
pub(crate) fn gpu_parts(
    found: &mut Survey,
    device: &DevicePolicies,
    hook: Option<&Path>,
    limits: &Limits,
) -> Result<Vec<GpuPart>> {
    // At most `survey::MAX_GPUS`: the survey refuses a trace naming more.
    let gpus = found.gpus();
    let trace_name = found.path.clone();
    let mut parts = Vec::new();
    for gpu in gpus {
        // The program's lines behind the GPU's bytes, when the recording says which.
        let at_peak = found.at_peak(Some(gpu));
        let lines = found.lines(Some(gpu), at_peak)?;
        let mut timelines = Vec::new();
        let (mut hook_reports, mut hook_failed) = (String::new(), false);
        for policy in &device.policies {
            // A hook of its own for each policy, as each host policy has.
            let hook = hook.map(|h| load_hook(h, limits)).transpose()?;
            let timeline =
                gpu_timeline(found, gpu, policy, device.memory, limits, hook.as_deref())?;
            if let Some(hook) = &hook {
                hook_reports += &hook_report(hook, &timeline.label);
                hook_failed |= hook.failure().is_some();
            }
            timelines.push(timeline);
        }
        let name = format!("{}, GPU {gpu}", trace_name.display());
        let placement = &found.placements[&Some(gpu)];
        let recorded = report::Recorded {
            times: Some(&placement.times),
            lines: lines.as_ref().map(|lines| (lines, &found.trace.site_table)),
        };
        let part = report::render_part(
            &name,
            &timelines,
            &found.marks(Some(gpu)),
            &recorded,
            Memory::Gpu(gpu),
        );
        parts.push(GpuPart {
            gpu,
            name,
            part,
            timelines,
            hook_reports,
            hook_failed,
        });
    }
    Ok(parts)
}

/// GPU `gpu`'s events through `policy`, a device handler of a stand-in GPU of `memory`
/// bytes: each free goes back at once (a trace's stream has no work left to wait for
/// when it is replayed).
fn gpu_timeline(
    found: &Survey,
    gpu: u16,
    policy: &str,
    memory: u64,
    limits: &Limits,
    hook: Option<&WasmHook>,
) -> Result<Timeline> {
    let runtime = Runtime::shared();
    let loaded = crate::named::load(runtime, Some(&PathBuf::from(policy)))?;
    let mut limits = limits.clone();
    limits.grants.memory.grant(KindGrant::Device);
    // Issue 74: the policies' share of a GPU (three quarters of it) left them 3/4 of
    // `--device-memory`. `--device-memory` is what they may map: the stand-in GPU has as
    // much more as the share keeps for the program.
    let (kept, of) = allocbox::shares::DEVICE_SHARE;
    let stand_in_memory = memory.div_ceil(kept).saturating_mul(of);
    limits.grants.gpu = Gpu::stand_in(Arc::new(StandIn::new(u32::from(gpu) + 1, stand_in_memory)));
    let handler = HandlerBuilder::new(runtime)
        .link(&loaded)
        .limits(limits)
        .build_device(u32::from(gpu))
        .with_context(|| format!("device policy `{policy}`"))?;
    let done = AtomicU64::new(0);
    let label = format!("GPU {gpu}: {policy}");
    let len = found.placements[&Some(gpu)].events;
    let marks = found.marks(Some(gpu));
    let mut pass = found.pass(Some(gpu))?;
    let mut timeline = progress::counting_events(&label, len, &done, || {
        observed(&handler, hook, |watched| {
            let held = chain_held(handler.handler());
            let replayed = Replayed {
                events: pass.events(),
                len,
                marks: &marks,
            };
            timeline_counted(policy, watched, held, replayed, &done)
        })
    });
    pass.finish()?;
    if timeline.replay.failure.is_none() {
        timeline.replay.leak = leak_after_replay(handler.handler());
    }
    Ok(timeline)
}
