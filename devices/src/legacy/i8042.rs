//! The i8042 controller, reduced to what a VMM needs: the CPU reset command
//! (`0xfe` to port `0x64`), which k7d turns into a clean stop of the VM.

use std::sync::Arc;

use crate::bus::BusDevice;

/// Called when the guest asks for a reset.
pub type ResetHandler = Arc<dyn Fn() + Send + Sync>;

struct ResetTrigger(ResetHandler);

impl vm_superio::Trigger for ResetTrigger {
    type E = std::convert::Infallible;

    fn trigger(&self) -> Result<(), Self::E> {
        (self.0)();
        Ok(())
    }
}

/// i8042 at ports `0x60..=0x64` (base `0x60`, length 5).
pub struct I8042 {
    inner: vm_superio::I8042Device<ResetTrigger>,
}

impl I8042 {
    /// A controller that calls `on_reset` when the guest resets the CPU.
    pub fn new(on_reset: ResetHandler) -> Self {
        Self {
            inner: vm_superio::I8042Device::new(ResetTrigger(on_reset)),
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Some(d), Ok(off)) = (data.first_mut(), u8::try_from(offset)) {
            *d = self.inner.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Some(&v), Ok(off)) = (data.first(), u8::try_from(offset)) {
            // Infallible.
            let _ = self.inner.write(off, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn reset_command_calls_handler() {
        let n = Arc::new(AtomicU32::new(0));
        let n2 = n.clone();
        let mut dev = I8042::new(Arc::new(move || {
            n2.fetch_add(1, Ordering::SeqCst);
        }));
        dev.write(4, &[0x01]);
        assert_eq!(n.load(Ordering::SeqCst), 0);
        dev.write(4, &[0xfe]);
        assert_eq!(n.load(Ordering::SeqCst), 1);
        dev.write(0, &[0xfe]);
        assert_eq!(n.load(Ordering::SeqCst), 1, "only the command port resets");
    }
}
