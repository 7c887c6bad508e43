//! Why `auto` NICs fell back to the bridge chain, counted by reason for the
//! daemon's scrape (`k7d_datapath_fallbacks_total`). The counts are the
//! process's: every attach of the daemon (its own VMs' and its VM
//! processes' NICs) goes through [`crate::Datapath::attach`] in it.

use std::sync::atomic::{AtomicU64, Ordering};

/// The class of a fallback's reason; the sentence itself is in
/// [`crate::Attached::reason`] and the daemon's log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// The caller asked for a shape direct does not serve (a secondary NIC).
    Unsupported = 0,
    /// No tc object: none embedded, or the configured file is missing or bad.
    NoObject = 1,
    /// The pod's interface is missing or already a bridge's port.
    PodInterface = 2,
    /// The VM's tap could not be made or adopted in the pod's netns.
    Tap = 3,
    /// The kernel refused the programs or their attachment (verifier, TCX,
    /// clsact), or their pins.
    Programs = 4,
}

impl FallbackReason {
    /// Every reason, in label order.
    pub const ALL: [FallbackReason; 5] = [
        FallbackReason::Unsupported,
        FallbackReason::NoObject,
        FallbackReason::PodInterface,
        FallbackReason::Tap,
        FallbackReason::Programs,
    ];

    /// The reason's label in the scrape.
    pub fn name(self) -> &'static str {
        match self {
            FallbackReason::Unsupported => "unsupported",
            FallbackReason::NoObject => "no_object",
            FallbackReason::PodInterface => "pod_interface",
            FallbackReason::Tap => "tap",
            FallbackReason::Programs => "programs",
        }
    }
}

static COUNTS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

pub(crate) fn count(r: FallbackReason) {
    COUNTS[r as usize].fetch_add(1, Ordering::Relaxed);
}

/// NICs this process attached on the bridge chain after `auto` could not
/// go direct, by reason, since it started (every reason, zeros included).
pub fn fallbacks() -> [(FallbackReason, u64); 5] {
    FallbackReason::ALL.map(|r| (r, COUNTS[r as usize].load(Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_reason_has_its_own_slot_and_label() {
        let before = fallbacks();
        count(FallbackReason::Tap);
        let after = fallbacks();
        for ((r, b), (_, a)) in before.iter().zip(after) {
            assert_eq!(a - b, u64::from(*r == FallbackReason::Tap), "{r:?}");
        }
        let names: std::collections::HashSet<_> = FallbackReason::ALL.iter().map(|r| r.name()).collect();
        assert_eq!(names.len(), FallbackReason::ALL.len());
    }
}
