//! MSI-X: the capability, the vector table and the pending-bit array (PBA).
//!
//! Delivery is split between the device and the VMM:
//! - each vector has an eventfd ([`MsixVectors::irqfds`]) the VMM registers as a
//!   KVM irqfd on a GSI of its choosing;
//! - whenever the guest programs or (un)masks a vector, the device calls
//!   [`MsiRouter::route`] so the VMM can point that GSI at the new MSI address
//!   and data (`KVM_SET_GSI_ROUTING`);
//! - [`MsixVectors::trigger`] writes the eventfd only when the vector is
//!   deliverable (MSI-X enabled, function and vector unmasked); otherwise it
//!   sets the vector's pending bit, and the interrupt is delivered on unmask.

use std::sync::{Arc, Mutex, MutexGuard};

use thiserror::Error;
use tracing::{debug, warn};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// Bytes per MSI-X table entry.
pub const MSIX_ENTRY_SIZE: u64 = 16;
const MSG_CTRL_ENABLE: u16 = 1 << 15;
const MSG_CTRL_FUNCTION_MASK: u16 = 1 << 14;
const VECTOR_CTRL_MASK: u32 = 1;
/// The most vectors an MSI-X capability can declare.
pub const MAX_MSIX_VECTORS: u16 = 2048;

/// An MSI message: what the guest programmed into a table entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MsiMessage {
    /// Message address, low 32 bits.
    pub address_lo: u32,
    /// Message address, high 32 bits.
    pub address_hi: u32,
    /// Message data.
    pub data: u32,
}

/// An error the VMM reports from [`MsiRouter::route`].
#[derive(Debug, Error)]
#[error("routing MSI-X vector {vector} failed")]
pub struct MsiRouteError {
    /// The vector that could not be routed.
    pub vector: u16,
    /// What went wrong (typically a KVM ioctl error).
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// The VMM side of MSI-X: keeps the interrupt routing of one device's vectors
/// in step with the guest's table.
///
/// Called on a vCPU thread with the device's MSI-X state locked: an
/// implementation must not call back into the device. It is called with
/// `masked = true` when the vector is masked (vector mask, function mask or
/// MSI-X disabled); the VMM may then disable the route, which is what keeps a
/// masked vector quiet for backends that write the irqfd directly (vhost).
pub trait MsiRouter: Send + Sync {
    /// Points `vector` at `msg`, or marks it masked.
    fn route(&self, vector: u16, msg: MsiMessage, masked: bool) -> Result<(), MsiRouteError>;
}

/// A router that does nothing: for tests, and for VMMs that route every
/// vector up front.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopMsiRouter;

impl MsiRouter for NoopMsiRouter {
    fn route(&self, _vector: u16, _msg: MsiMessage, _masked: bool) -> Result<(), MsiRouteError> {
        Ok(())
    }
}

/// Errors from MSI-X state.
#[derive(Debug, Error)]
pub enum MsixError {
    /// Table size out of range.
    #[error("an MSI-X table needs 1 to 2048 vectors, not {0}")]
    TableSize(u16),
    /// Creating a vector's eventfd failed.
    #[error("creating an MSI-X vector eventfd failed")]
    EventFd(#[source] std::io::Error),
    /// A saved table has another number of vectors than this device.
    #[error("the saved MSI-X table has {saved} vectors, this device {have}")]
    Mismatch {
        /// Vectors in the saved state.
        saved: usize,
        /// Vectors of this device.
        have: usize,
    },
    /// The device signalled a vector the table does not have.
    #[error("MSI-X vector {0} does not exist")]
    NoSuchVector(u16),
    /// Writing a vector's eventfd failed.
    #[error("signalling MSI-X vector {vector} failed")]
    Signal {
        /// The vector.
        vector: u16,
        /// The eventfd error.
        #[source]
        source: std::io::Error,
    },
}

/// Builds the body of an MSI-X capability (everything after ID and next).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsixCapability {
    /// Number of vectors.
    pub table_size: u16,
    /// BAR holding the table.
    pub table_bar: u8,
    /// Offset of the table in its BAR (8-byte aligned).
    pub table_offset: u32,
    /// BAR holding the PBA.
    pub pba_bar: u8,
    /// Offset of the PBA in its BAR (8-byte aligned).
    pub pba_offset: u32,
}

impl MsixCapability {
    /// The 10 bytes after the capability ID and next pointer.
    pub fn body(&self) -> [u8; 10] {
        let mut b = [0u8; 10];
        b[0..2].copy_from_slice(&(self.table_size.saturating_sub(1) & 0x7ff).to_le_bytes());
        b[2..6].copy_from_slice(&((self.table_offset & !7) | u32::from(self.table_bar & 7)).to_le_bytes());
        b[6..10].copy_from_slice(&((self.pba_offset & !7) | u32::from(self.pba_bar & 7)).to_le_bytes());
        b
    }

    /// Write mask of the capability's bytes from its start: only the enable
    /// and function-mask bits of Message Control are writable.
    pub fn writable_mask() -> [u8; 4] {
        [0, 0, 0, 0xc0]
    }

    /// Decodes (enable, function mask) from a Message Control value.
    pub fn decode_control(ctrl: u16) -> (bool, bool) {
        (ctrl & MSG_CTRL_ENABLE != 0, ctrl & MSG_CTRL_FUNCTION_MASK != 0)
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    msg: MsiMessage,
    ctrl: u32,
}

impl Default for Entry {
    fn default() -> Self {
        Self {
            msg: MsiMessage::default(),
            ctrl: VECTOR_CTRL_MASK,
        }
    }
}

#[derive(Debug)]
struct MsixState {
    entries: Vec<Entry>,
    pba: Vec<u64>,
    enabled: bool,
    function_masked: bool,
    /// Vectors whose irqfd a kernel backend (vhost) writes directly,
    /// bypassing [`MsixVectors::trigger`] and so the pending bit.
    kernel_writer: Vec<bool>,
}

impl MsixState {
    fn masked(&self, v: usize) -> bool {
        !self.enabled || self.function_masked || self.entries[v].ctrl & VECTOR_CTRL_MASK != 0
    }
    fn pending(&self, v: usize) -> bool {
        self.pba[v / 64] & (1 << (v % 64)) != 0
    }
    fn set_pending(&mut self, v: usize, on: bool) {
        if on {
            self.pba[v / 64] |= 1 << (v % 64);
        } else {
            self.pba[v / 64] &= !(1 << (v % 64));
        }
    }
}

/// The MSI-X table, PBA and per-vector eventfds of one function. Shared
/// (`Arc`) between the transport (guest accesses on vCPU threads) and the
/// device workers (which call [`MsixVectors::trigger`]).
pub struct MsixVectors {
    state: Mutex<MsixState>,
    irqfds: Vec<EventFd>,
    router: Arc<dyn MsiRouter>,
}

impl std::fmt::Debug for MsixVectors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsixVectors")
            .field("vectors", &self.irqfds.len())
            .finish_non_exhaustive()
    }
}

/// The guest-programmed MSI-X state of a device, for a snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MsixSnapshot {
    /// Per vector: message address low, address high, data, vector control.
    pub entries: Vec<[u32; 4]>,
    /// Pending bits.
    pub pba: Vec<u64>,
    /// MSI-X enable (capability control).
    pub enabled: bool,
    /// Function mask (capability control).
    pub function_masked: bool,
}

impl MsixVectors {
    /// `num` vectors, all masked, MSI-X disabled, each with a fresh eventfd.
    pub fn new(num: u16, router: Arc<dyn MsiRouter>) -> Result<Self, MsixError> {
        if num == 0 || num > MAX_MSIX_VECTORS {
            return Err(MsixError::TableSize(num));
        }
        let irqfds = (0..num)
            .map(|_| EventFd::new(EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()
            .map_err(MsixError::EventFd)?;
        let n = usize::from(num);
        let state = MsixState {
            entries: vec![Entry::default(); n],
            pba: vec![0; n.div_ceil(64)],
            enabled: false,
            function_masked: false,
            kernel_writer: vec![false; n],
        };
        Ok(Self {
            state: Mutex::new(state),
            irqfds,
            router,
        })
    }

    fn lock(&self) -> MutexGuard<'_, MsixState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The table, pending bits and control as the guest left them.
    pub fn save(&self) -> MsixSnapshot {
        let st = self.lock();
        MsixSnapshot {
            entries: st
                .entries
                .iter()
                .map(|e| [e.msg.address_lo, e.msg.address_hi, e.msg.data, e.ctrl])
                .collect(),
            pba: st.pba.clone(),
            enabled: st.enabled,
            function_masked: st.function_masked,
        }
    }

    /// Puts back a state from [`Self::save`] of a device with as many vectors
    /// and tells the router about every vector, so the new VM's interrupt
    /// routes match the guest's table; an unmasked pending vector fires.
    pub fn restore(&self, s: &MsixSnapshot) -> Result<(), MsixError> {
        let mut st = self.lock();
        if s.entries.len() != st.entries.len() || s.pba.len() != st.pba.len() {
            return Err(MsixError::Mismatch {
                saved: s.entries.len(),
                have: st.entries.len(),
            });
        }
        for (e, [lo, hi, data, ctrl]) in st.entries.iter_mut().zip(s.entries.iter().copied()) {
            e.msg = MsiMessage {
                address_lo: lo,
                address_hi: hi,
                data,
            };
            e.ctrl = ctrl & VECTOR_CTRL_MASK;
        }
        st.pba.copy_from_slice(&s.pba);
        st.enabled = s.enabled;
        st.function_masked = s.function_masked;
        for v in 0..st.entries.len() {
            self.update_vector(&mut st, v, true);
        }
        Ok(())
    }

    /// Number of vectors.
    pub fn num_vectors(&self) -> u16 {
        self.irqfds.len() as u16
    }

    /// The per-vector eventfds, indexed by vector: register each as an irqfd.
    pub fn irqfds(&self) -> &[EventFd] {
        &self.irqfds
    }

    /// Size of the table in bytes.
    pub fn table_len(&self) -> u64 {
        self.irqfds.len() as u64 * MSIX_ENTRY_SIZE
    }

    /// Size of the PBA in bytes (whole qwords).
    pub fn pba_len(&self) -> u64 {
        (self.irqfds.len() as u64).div_ceil(64) * 8
    }

    /// Applies a Message Control write (MSI-X enable, function mask).
    pub fn set_control(&self, enabled: bool, function_masked: bool) {
        let mut st = self.lock();
        if st.enabled == enabled && st.function_masked == function_masked {
            return;
        }
        let before: Vec<bool> = (0..st.entries.len()).map(|v| st.masked(v)).collect();
        st.enabled = enabled;
        st.function_masked = function_masked;
        debug!(enabled, function_masked, "MSI-X control");
        for (v, was) in before.into_iter().enumerate() {
            if was != st.masked(v) {
                self.update_vector(&mut st, v, was);
            }
        }
    }

    /// Whether MSI-X is enabled and not function-masked.
    pub fn is_enabled(&self) -> bool {
        let st = self.lock();
        st.enabled && !st.function_masked
    }

    /// Declares that a kernel backend (vhost) writes `vector`'s irqfd itself.
    /// Such writes bypass [`Self::trigger`]: while the vector is masked its
    /// KVM route is off and KVM drops them, with no pending bit to deliver
    /// later. So when a kernel-written vector becomes deliverable again, its
    /// irqfd is written once, whether or not anything was lost: a spurious
    /// virtio interrupt costs the guest one look at its used ring, a lost one
    /// can stall a queue for good.
    pub fn set_kernel_writer(&self, vector: u16, on: bool) {
        let mut st = self.lock();
        if let Some(k) = st.kernel_writer.get_mut(usize::from(vector)) {
            *k = on;
        }
    }

    /// Routes vector `v` after a change (`was_masked`: its mask state before
    /// it), then delivers its pending interrupt if it just became
    /// deliverable, or, for a kernel-written vector that was masked, replays
    /// what the kernel may have written meanwhile. Routing comes first so the
    /// interrupt goes to the new address.
    fn update_vector(&self, st: &mut MsixState, v: usize, was_masked: bool) {
        let masked = st.masked(v);
        if let Err(e) = self.router.route(v as u16, st.entries[v].msg, masked) {
            warn!(error = %e, source = %e.source, "MSI-X route update failed");
        }
        if masked {
            return;
        }
        let pending = st.pending(v);
        let replay = was_masked && st.kernel_writer.get(v).copied().unwrap_or(false);
        if pending || replay {
            st.set_pending(v, false);
            if let Err(e) = self.irqfds[v].write(1) {
                warn!(vector = v, error = %e, "delivering a pending MSI-X vector failed");
            }
        }
    }

    /// A guest read of the table at `offset` (4- or 8-byte aligned accesses;
    /// anything else reads as ones).
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        let st = self.lock();
        let read_dword = |off: u64| -> Option<u32> {
            let e = st.entries.get(usize::try_from(off / MSIX_ENTRY_SIZE).ok()?)?;
            Some(match off % MSIX_ENTRY_SIZE {
                0 => e.msg.address_lo,
                4 => e.msg.address_hi,
                8 => e.msg.data,
                _ => e.ctrl,
            })
        };
        match data.len() {
            4 if offset.is_multiple_of(4) => {
                data.copy_from_slice(&read_dword(offset).unwrap_or(u32::MAX).to_le_bytes());
            }
            8 if offset.is_multiple_of(8) => {
                let lo = read_dword(offset).unwrap_or(u32::MAX);
                let hi = read_dword(offset + 4).unwrap_or(u32::MAX);
                data.copy_from_slice(&(u64::from(hi) << 32 | u64::from(lo)).to_le_bytes());
            }
            _ => data.fill(0xff),
        }
    }

    /// A guest write to the table at `offset` (4- or 8-byte aligned; others
    /// are ignored).
    pub fn write_table(&self, offset: u64, data: &[u8]) {
        let dwords: Vec<(u64, u32)> = match data.len() {
            4 if offset.is_multiple_of(4) => vec![(offset, u32::from_le_bytes([data[0], data[1], data[2], data[3]]))],
            8 if offset.is_multiple_of(8) => vec![
                (offset, u32::from_le_bytes([data[0], data[1], data[2], data[3]])),
                (offset + 4, u32::from_le_bytes([data[4], data[5], data[6], data[7]])),
            ],
            _ => {
                debug!(offset, len = data.len(), "ignoring odd-sized MSI-X table write");
                return;
            }
        };
        let mut st = self.lock();
        for (off, val) in dwords {
            let Some(v) = usize::try_from(off / MSIX_ENTRY_SIZE)
                .ok()
                .filter(|v| *v < st.entries.len())
            else {
                continue;
            };
            let before = st.entries[v];
            let was_masked = st.masked(v);
            let e = &mut st.entries[v];
            match off % MSIX_ENTRY_SIZE {
                0 => e.msg.address_lo = val,
                4 => e.msg.address_hi = val,
                8 => e.msg.data = val,
                _ => e.ctrl = val & VECTOR_CTRL_MASK,
            }
            let after = *e;
            if before.msg != after.msg || before.ctrl != after.ctrl {
                self.update_vector(&mut st, v, was_masked);
            }
        }
    }

    /// A guest read of the PBA (4- or 8-byte aligned accesses).
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        let st = self.lock();
        let qword = |i: u64| {
            usize::try_from(i)
                .ok()
                .and_then(|i| st.pba.get(i).copied())
                .unwrap_or(0)
        };
        match data.len() {
            8 if offset.is_multiple_of(8) => data.copy_from_slice(&qword(offset / 8).to_le_bytes()),
            4 if offset.is_multiple_of(4) => {
                let q = qword(offset / 8);
                let d = if offset.is_multiple_of(8) {
                    q as u32
                } else {
                    (q >> 32) as u32
                };
                data.copy_from_slice(&d.to_le_bytes());
            }
            _ => data.fill(0),
        }
    }

    /// For the state dump: (MSI-X enabled, function masked).
    pub fn debug_control(&self) -> (bool, bool) {
        let st = self.lock();
        (st.enabled, st.function_masked)
    }

    /// For the state dump: whether `vector` is masked (by any of the three
    /// masks) and whether its pending bit is set; `None` past the table.
    pub fn debug_vector(&self, vector: u16) -> Option<(bool, bool)> {
        let st = self.lock();
        let v = usize::from(vector);
        (v < st.entries.len()).then(|| (st.masked(v), st.pending(v)))
    }

    /// Whether `vector`'s pending bit is set.
    pub fn is_pending(&self, vector: u16) -> bool {
        let st = self.lock();
        usize::from(vector) < st.entries.len() && st.pending(usize::from(vector))
    }

    /// Whether `vector` is currently masked (by any of the three masks).
    pub fn is_masked(&self, vector: u16) -> bool {
        let st = self.lock();
        usize::from(vector) >= st.entries.len() || st.masked(usize::from(vector))
    }

    /// Signals `vector`: writes its eventfd if deliverable, else sets its
    /// pending bit.
    pub fn trigger(&self, vector: u16) -> Result<(), MsixError> {
        let mut st = self.lock();
        let v = usize::from(vector);
        if v >= st.entries.len() {
            return Err(MsixError::NoSuchVector(vector));
        }
        if st.masked(v) {
            st.set_pending(v, true);
            return Ok(());
        }
        self.irqfds[v]
            .write(1)
            .map_err(|source| MsixError::Signal { vector, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Rec(Mutex<Vec<(u16, MsiMessage, bool)>>);
    impl MsiRouter for Rec {
        fn route(&self, vector: u16, msg: MsiMessage, masked: bool) -> Result<(), MsiRouteError> {
            self.0.lock().unwrap().push((vector, msg, masked));
            Ok(())
        }
    }

    #[test]
    fn cap_body_layout() {
        let b = MsixCapability {
            table_size: 3,
            table_bar: 0,
            table_offset: 0x4000,
            pba_bar: 0,
            pba_offset: 0x6000,
        }
        .body();
        assert_eq!(b, [2, 0, 0, 0x40, 0, 0, 0, 0x60, 0, 0]);
    }

    #[test]
    fn mask_pend_unmask_deliver_and_route() {
        let rec = Arc::new(Rec::default());
        let m = MsixVectors::new(2, rec.clone()).unwrap();
        // Disabled: pending, no write.
        m.trigger(1).unwrap();
        assert!(m.is_pending(1));
        assert!(m.irqfds()[1].read().is_err());
        m.set_control(true, false);
        m.write_table(16, &0xfee0_0000u32.to_le_bytes());
        m.write_table(24, &0x41u32.to_le_bytes());
        assert!(m.is_pending(1), "vector still masked");
        m.write_table(28, &0u32.to_le_bytes());
        assert!(!m.is_pending(1));
        assert_eq!(m.irqfds()[1].read().unwrap(), 1);
        let last = *rec.0.lock().unwrap().last().unwrap();
        assert_eq!(
            last,
            (
                1,
                MsiMessage {
                    address_lo: 0xfee0_0000,
                    address_hi: 0,
                    data: 0x41
                },
                false
            )
        );
        // Function mask.
        m.set_control(true, true);
        assert!(rec.0.lock().unwrap().last().unwrap().2);
        m.trigger(1).unwrap();
        let mut pba = [0u8; 8];
        m.read_pba(0, &mut pba);
        assert_eq!(u64::from_le_bytes(pba), 0b10);
        m.set_control(true, false);
        assert_eq!(m.irqfds()[1].read().unwrap(), 1);
        let mut d = [0u8; 4];
        m.read_table(24, &mut d);
        assert_eq!(u32::from_le_bytes(d), 0x41);
        assert!(matches!(m.trigger(2), Err(MsixError::NoSuchVector(2))));
        // Out-of-range and odd accesses don't panic.
        m.set_kernel_writer(9, true);
        m.write_table(0x1000, &[1, 2, 3, 4]);
        m.write_table(3, &[1, 2]);
        m.read_table(0x1000, &mut d);
        assert_eq!(d, [0xff; 4]);
    }

    /// A vector whose irqfd vhost writes directly: what the kernel wrote
    /// while the vector was masked (KVM dropped it: the route was off, and
    /// no pending bit was set) is replayed once on unmask; a vector only
    /// `trigger` writes gets no spurious interrupt.
    #[test]
    fn a_kernel_written_vector_is_replayed_on_unmask() {
        let m = MsixVectors::new(3, Arc::new(NoopMsiRouter)).unwrap();
        m.set_control(true, false);
        for v in 1..3u64 {
            m.write_table(v * 16 + 12, &0u32.to_le_bytes());
        }
        m.set_kernel_writer(1, true);
        for v in [1u64, 2] {
            // Mask, (vhost writes the irqfd: KVM drops it), unmask.
            m.write_table(v * 16 + 12, &1u32.to_le_bytes());
            m.write_table(v * 16 + 12, &0u32.to_le_bytes());
        }
        assert_eq!(
            m.irqfds()[1].read().unwrap(),
            1,
            "the kernel-written vector is replayed"
        );
        assert!(
            m.irqfds()[2].read().is_err(),
            "a trigger-only vector gets no spurious interrupt"
        );
        // The function mask counts as a mask too.
        m.set_control(true, true);
        m.set_control(true, false);
        assert_eq!(m.irqfds()[1].read().unwrap(), 1);
        assert!(m.irqfds()[2].read().is_err());
        // A pending interrupt and a replay are one write.
        m.set_control(true, true);
        m.trigger(1).unwrap();
        m.set_control(true, false);
        assert_eq!(m.irqfds()[1].read().unwrap(), 1);
    }
}
