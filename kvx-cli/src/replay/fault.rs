//! Fault injection: `--fault stall-disk@T+D` freezes the file tier's FUSE mount from T to T+D
//! seconds into the replay.

use std::time::{Duration, Instant};

use kvx_fusefs::StallMount;

use super::error::ReplayError;

/// One stall of the file tier, relative to the start of the replay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StallSpec {
    /// When the mount freezes.
    pub at: Duration,
    /// How long it stays frozen.
    pub duration: Duration,
}

/// Parse `stall-disk@T+D` (seconds, fractions allowed).
pub fn parse_fault(s: &str) -> Result<StallSpec, ReplayError> {
    let bad = |why: &str| {
        ReplayError::BadOption(format!(
            "--fault {s:?}: {why} (expected stall-disk@T+D, T and D in seconds)"
        ))
    };
    let rest = s
        .strip_prefix("stall-disk@")
        .ok_or_else(|| bad("unknown fault"))?;
    let (t, d) = rest.split_once('+').ok_or_else(|| bad("missing +D"))?;
    let secs = |x: &str| {
        x.trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0 && *v < 1e6)
            .map(Duration::from_secs_f64)
    };
    let at = secs(t).ok_or_else(|| bad("T is not a number of seconds"))?;
    let duration = secs(d)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| bad("D is not a positive number of seconds"))?;
    Ok(StallSpec { at, duration })
}

/// Where an instant falls relative to the stalls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Before the first stall began (or no stall at all).
    Before,
    /// While a stall is scheduled.
    During,
    /// After the last stall ended, until the file tier's breaker was seen closed again.
    Recovering,
    /// After that.
    After,
}

impl Phase {
    /// Every phase, in order.
    pub const ALL: [Phase; 4] = [
        Phase::Before,
        Phase::During,
        Phase::Recovering,
        Phase::After,
    ];

    /// The phase's index in [`Phase::ALL`].
    pub fn index(self) -> usize {
        match self {
            Phase::Before => 0,
            Phase::During => 1,
            Phase::Recovering => 2,
            Phase::After => 3,
        }
    }

    /// The phase's name in the JSON output.
    pub fn key(self) -> &'static str {
        match self {
            Phase::Before => "before_stall",
            Phase::During => "during_stall",
            Phase::Recovering => "after_thaw_until_breaker_closed",
            Phase::After => "after_recovery",
        }
    }
}

/// Applies the stalls to a mount as the replay clock passes them.
pub struct StallSchedule {
    windows: Vec<(Instant, Instant)>,
    frozen: bool,
    ended: bool,
    /// When the breaker was first seen closed after the last thaw.
    recovered: Option<Instant>,
    /// Times the mount was frozen and thawed (for the report).
    pub log: Vec<(Duration, &'static str)>,
    start: Instant,
}

impl StallSchedule {
    /// Stalls `specs` on a replay that started at `start`.
    pub fn new(start: Instant, specs: &[StallSpec]) -> StallSchedule {
        let mut windows: Vec<(Instant, Instant)> = specs
            .iter()
            .map(|s| (start + s.at, start + s.at + s.duration))
            .collect();
        windows.sort_by_key(|w| w.0);
        StallSchedule {
            windows,
            frozen: false,
            ended: false,
            recovered: None,
            log: Vec::new(),
            start,
        }
    }

    /// Freeze or thaw `mount` as `now` requires.
    pub fn apply(&mut self, now: Instant, mount: Option<&StallMount>) {
        let Some(m) = mount else { return };
        if self.ended {
            return;
        }
        let want = self.windows.iter().any(|(a, b)| now >= *a && now < *b);
        if want != self.frozen {
            if want {
                m.freeze();
            } else {
                m.thaw();
            }
            self.frozen = want;
            self.log
                .push((now - self.start, if want { "freeze" } else { "thaw" }));
        }
    }

    /// Thaw for good (end of the replay).
    pub fn end(&mut self, now: Instant, mount: Option<&StallMount>) {
        if self.frozen
            && let Some(m) = mount
        {
            m.thaw();
            self.frozen = false;
            self.log.push((now - self.start, "thaw (end of replay)"));
        }
        self.ended = true;
    }

    /// True after the last stall, until [`StallSchedule::recovered`] was called.
    pub fn awaiting_recovery(&self, now: Instant) -> bool {
        self.recovered.is_none()
            && self
                .windows
                .iter()
                .map(|w| w.1)
                .max()
                .is_some_and(|l| now >= l)
    }

    /// The file tier's breaker was seen closed at `now`, after the last stall.
    pub fn recovered(&mut self, now: Instant) {
        if self.awaiting_recovery(now) {
            self.recovered = Some(now);
            self.log.push((now - self.start, "breaker closed"));
        }
    }

    /// The phase of `t`.
    pub fn phase(&self, t: Instant) -> Phase {
        let (Some(first), Some(last)) = (
            self.windows.iter().map(|w| w.0).min(),
            self.windows.iter().map(|w| w.1).max(),
        ) else {
            return Phase::Before;
        };
        if t < first {
            Phase::Before
        } else if t < last {
            Phase::During
        } else if self.recovered.is_some_and(|r| t >= r) {
            Phase::After
        } else {
            Phase::Recovering
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stall_specs() {
        let s = parse_fault("stall-disk@5+10").unwrap();
        assert_eq!(s.at, Duration::from_secs(5));
        assert_eq!(s.duration, Duration::from_secs(10));
        assert_eq!(
            parse_fault("stall-disk@0.5+1.5").unwrap().duration,
            Duration::from_millis(1500)
        );
        for bad in [
            "stall-net@1+2",
            "stall-disk@5",
            "stall-disk@x+1",
            "stall-disk@1+0",
        ] {
            assert!(parse_fault(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn phases_follow_the_windows() {
        let t0 = Instant::now();
        let s = StallSchedule::new(
            t0,
            &[StallSpec {
                at: Duration::from_secs(5),
                duration: Duration::from_secs(10),
            }],
        );
        assert_eq!(s.phase(t0 + Duration::from_secs(1)), Phase::Before);
        assert_eq!(s.phase(t0 + Duration::from_secs(6)), Phase::During);
        assert_eq!(s.phase(t0 + Duration::from_secs(15)), Phase::Recovering);
        let mut s = s;
        assert!(!s.awaiting_recovery(t0 + Duration::from_secs(14)));
        assert!(s.awaiting_recovery(t0 + Duration::from_secs(16)));
        s.recovered(t0 + Duration::from_secs(17));
        assert!(!s.awaiting_recovery(t0 + Duration::from_secs(18)));
        assert_eq!(s.phase(t0 + Duration::from_secs(16)), Phase::Recovering);
        assert_eq!(s.phase(t0 + Duration::from_secs(17)), Phase::After);
    }
}
