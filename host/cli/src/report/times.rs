//! A recording's times through a trace of any length, for the charts' x axis: one every
//! so many events, the step doubling as the trace goes on, within a bound.

/// The most times a placement keeps for its charts' x axis: past them, every other one
/// is dropped and the axis takes every other event's time.
const MAX_TIMES: usize = 1 << 16;

/// Seconds since the recording started at every `every`-th event: the charts' x axis.
#[derive(Debug, Clone)]
pub struct TimeAxis {
    every: u64,
    times: Vec<u64>,
    seen: u64,
    any: bool,
    last: Option<u64>,
    /// The smallest step the times advance by, in nanoseconds: the resolution of the
    /// clock that made them.
    step: Option<u64>,
}

impl Default for TimeAxis {
    fn default() -> Self {
        TimeAxis {
            every: 1,
            times: Vec::new(),
            seen: 0,
            any: false,
            last: None,
            step: None,
        }
    }
}

impl TimeAxis {
    /// The axis of a trace's times, one an event (`Trace::times`).
    pub fn of(times: &[u64]) -> TimeAxis {
        let mut axis = TimeAxis::default();
        for &time in times {
            axis.add(Some(time));
        }
        axis
    }

    /// The next event's time (`None`: the trace gave none yet).
    pub(crate) fn add(&mut self, time: Option<u64>) {
        self.any |= time.is_some();
        let time = time.unwrap_or(0);
        if let Some(last) = self.last
            && time > last
        {
            self.step = Some(self.step.map_or(time - last, |s| s.min(time - last)));
        }
        self.last = Some(time);
        if self.seen.is_multiple_of(self.every) {
            self.times.push(time);
            if self.times.len() > MAX_TIMES {
                let mut at = 0;
                self.times.retain(|_| {
                    at += 1;
                    at % 2 == 1
                });
                self.every *= 2;
            }
        }
        self.seen += 1;
    }

    /// Whether the trace has times.
    pub fn is_empty(&self) -> bool {
        !self.any
    }

    /// Nanoseconds since the recording started when `events` had been made (the time of
    /// the last of them, to the axis's resolution); `None` without times.
    pub fn at(&self, events: u64) -> Option<u64> {
        if !self.any || self.times.is_empty() {
            return None;
        }
        let i = ((events.max(1) - 1) / self.every).min(self.times.len() as u64 - 1);
        Some(self.times[i as usize])
    }

    /// The clock's resolution when it is coarser than a microsecond (a recorder's
    /// coarse clock moves in steps of a few ms).
    pub fn clock_step(&self) -> Option<u64> {
        self.step.filter(|&step| step >= 1000 && self.any)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_s_clock_step_is_its_smallest_advance_when_coarser_than_a_microsecond() {
        let step = |times: &[u64]| TimeAxis::of(times).clock_step();
        assert_eq!(
            step(&[0, 0, 4_000_000, 4_000_000, 12_000_000]),
            Some(4_000_000)
        );
        assert_eq!(step(&[0, 10, 25]), None, "a fine clock");
        assert_eq!(step(&[5, 5]), None);
    }

    #[test]
    fn a_long_trace_s_axis_keeps_every_other_time_past_its_bound_and_finds_each_moment() {
        let times: Vec<u64> = (0..5 * MAX_TIMES as u64).map(|i| i * 10).collect();
        let axis = TimeAxis::of(&times);
        assert!(axis.times.len() <= MAX_TIMES);
        assert_eq!(axis.every, 8);
        assert_eq!(axis.at(1), Some(0));
        // The time of the 1000th event, to the axis's resolution of 8 events.
        assert_eq!(axis.at(1000), Some(9920));
        assert_eq!(axis.at(u64::MAX), Some(3_276_720), "the last time kept");
        assert_eq!(TimeAxis::of(&[]).at(5), None);
    }
}
