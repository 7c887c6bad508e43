//! The I/O bus: guest port-I/O or MMIO ranges dispatched to devices.
//!
//! One [`Bus`] serves PIO and another MMIO. Each device sits behind its own
//! mutex, so vCPUs touching different devices never contend.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use thiserror::Error;

/// A device reachable from the guest through a bus range.
pub trait BusDevice: Send {
    /// A read of `data.len()` bytes at `offset` from the device's base.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// A write of `data` at `offset` from the device's base.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors from building a bus.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BusError {
    /// The new range overlaps one already on the bus.
    #[error("bus range {base:#x}+{len:#x} overlaps an existing device")]
    Overlap {
        /// Base of the refused range.
        base: u64,
        /// Length of the refused range.
        len: u64,
    },
    /// A zero-length range or one that wraps around.
    #[error("bus range {base:#x}+{len:#x} is empty or wraps")]
    BadRange {
        /// Base of the refused range.
        base: u64,
        /// Length of the refused range.
        len: u64,
    },
}

/// A shared device on the bus.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Clone)]
struct Entry {
    len: u64,
    dev: SharedDevice,
}

/// An address-ordered map of device ranges.
#[derive(Clone, Default)]
pub struct Bus {
    ranges: BTreeMap<u64, Entry>,
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Places `dev` at `[base, base + len)`.
    pub fn insert(&mut self, base: u64, len: u64, dev: SharedDevice) -> Result<(), BusError> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(BusError::BadRange { base, len })?;
        let before = self.ranges.range(..end).next_back();
        if let Some((b, e)) = before
            && b + e.len > base
        {
            return Err(BusError::Overlap { base, len });
        }
        self.ranges.insert(base, Entry { len, dev });
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(u64, &Entry)> {
        let (base, e) = self.ranges.range(..=addr).next_back()?;
        let off = addr - base;
        (off.checked_add(size as u64)? <= e.len).then_some((off, e))
    }

    /// Dispatches a read; `false` when no device covers the access.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, e)) => {
                lock(&e.dev).read(off, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a write; `false` when no device covers the access.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, e)) => {
                lock(&e.dev).write(off, data);
                true
            }
            None => false,
        }
    }
}

/// Locks a device, recovering from a poisoned mutex: a device that panicked
/// once keeps its last state rather than taking the vCPU thread down with it.
pub fn lock(dev: &SharedDevice) -> std::sync::MutexGuard<'_, dyn BusDevice + 'static> {
    dev.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rec(Vec<(u64, Vec<u8>)>);
    impl BusDevice for Rec {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatch_and_overlap() {
        let mut bus = Bus::new();
        let d: SharedDevice = Arc::new(Mutex::new(Rec(vec![])));
        bus.insert(0x3f8, 8, d.clone()).unwrap();
        assert_eq!(
            bus.insert(0x3fc, 8, d.clone()),
            Err(BusError::Overlap { base: 0x3fc, len: 8 })
        );
        assert_eq!(
            bus.insert(0x3f0, 9, d.clone()),
            Err(BusError::Overlap { base: 0x3f0, len: 9 })
        );
        bus.insert(0x3f0, 8, d.clone()).unwrap();
        assert!(matches!(
            bus.insert(u64::MAX, 2, d.clone()),
            Err(BusError::BadRange { .. })
        ));
        let mut b = [0u8; 1];
        assert!(bus.read(0x3fd, &mut b));
        assert_eq!(b[0], 5);
        assert!(!bus.read(0x400, &mut b));
        // An access that straddles the end of a range is not dispatched.
        let mut w = [0u8; 2];
        assert!(!bus.read(0x3ff, &mut w));
        assert!(bus.write(0x3f8, &[1]));
    }
}
