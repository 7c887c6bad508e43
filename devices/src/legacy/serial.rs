//! 8250/16550 UART (vm-superio) writing to a per-VM log file and, optionally,
//! to the terminal.

use std::fs::File;
use std::io::{self, Write};

use crate::bus::BusDevice;
use crate::irq::IrqLine;

/// Where the guest's serial output goes.
pub struct SerialOutput {
    log: Option<File>,
    console: bool,
}

impl SerialOutput {
    /// Output to `log` (appended) and, with `console`, to this process's stdout.
    pub fn new(log: Option<File>, console: bool) -> Self {
        Self { log, console }
    }
}

impl Write for SerialOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(f) = self.log.as_mut() {
            f.write_all(buf)?;
        }
        if self.console {
            // Unbuffered on purpose: the first byte must show up at once
            // (the start-latency benchmark reads it).
            let mut out = io::stdout().lock();
            out.write_all(buf)?;
            out.flush()?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if let Some(f) = self.log.as_mut() {
            f.flush()?;
        }
        Ok(())
    }
}

/// The COM1 device: vm-superio's UART on an irqfd.
pub struct Serial {
    inner: vm_superio::Serial<IrqLine, vm_superio::serial::NoEvents, SerialOutput>,
}

impl Serial {
    /// A UART raising `irq` and writing to `out`.
    pub fn new(irq: IrqLine, out: SerialOutput) -> Self {
        Self {
            inner: vm_superio::Serial::new(irq, out),
        }
    }

    /// Queues host input for the guest to read.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        self.inner.enqueue_raw_bytes(bytes).unwrap_or(0)
    }
}

impl BusDevice for Serial {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let (Some(d), Ok(off)) = (data.first_mut(), u8::try_from(offset)) {
            *d = self.inner.read(off);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let (Some(&v), Ok(off)) = (data.first(), u8::try_from(offset)) else {
            return;
        };
        if let Err(e) = self.inner.write(off, v) {
            tracing::warn!(error = ?e, "serial write failed");
        }
    }
}
