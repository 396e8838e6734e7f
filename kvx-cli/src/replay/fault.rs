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
    /// After the last stall ended.
    After,
}

/// Applies the stalls to a mount as the replay clock passes them.
pub struct StallSchedule {
    windows: Vec<(Instant, Instant)>,
    frozen: bool,
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
            log: Vec::new(),
            start,
        }
    }

    /// Freeze or thaw `mount` as `now` requires.
    pub fn apply(&mut self, now: Instant, mount: Option<&StallMount>) {
        let Some(m) = mount else { return };
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
        self.windows.clear();
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
        } else if t >= last {
            Phase::After
        } else {
            Phase::During
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
        assert_eq!(s.phase(t0 + Duration::from_secs(15)), Phase::After);
    }
}
