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

/// The UART's registers and pending input, as saved in a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SerialSnapshot {
    /// Divisor latch low byte.
    pub baud_divisor_low: u8,
    /// Divisor latch high byte.
    pub baud_divisor_high: u8,
    /// Interrupt enable register.
    pub interrupt_enable: u8,
    /// Interrupt identification register.
    pub interrupt_identification: u8,
    /// Line control register.
    pub line_control: u8,
    /// Line status register.
    pub line_status: u8,
    /// Modem control register.
    pub modem_control: u8,
    /// Modem status register.
    pub modem_status: u8,
    /// Scratch register.
    pub scratch: u8,
    /// Bytes the guest has not read yet.
    pub in_buffer: Vec<u8>,
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

    /// The device's state (for snapshots).
    pub fn snapshot(&self) -> SerialSnapshot {
        let st = self.inner.state();
        SerialSnapshot {
            baud_divisor_low: st.baud_divisor_low,
            baud_divisor_high: st.baud_divisor_high,
            interrupt_enable: st.interrupt_enable,
            interrupt_identification: st.interrupt_identification,
            line_control: st.line_control,
            line_status: st.line_status,
            modem_control: st.modem_control,
            modem_status: st.modem_status,
            scratch: st.scratch,
            in_buffer: st.in_buffer,
        }
    }

    /// A UART in the state `snap` describes, raising `irq` and writing to `out`.
    pub fn from_snapshot(snap: &SerialSnapshot, irq: IrqLine, out: SerialOutput) -> Result<Self, String> {
        let st = vm_superio::serial::SerialState {
            baud_divisor_low: snap.baud_divisor_low,
            baud_divisor_high: snap.baud_divisor_high,
            interrupt_enable: snap.interrupt_enable,
            interrupt_identification: snap.interrupt_identification,
            line_control: snap.line_control,
            line_status: snap.line_status,
            modem_control: snap.modem_control,
            modem_status: snap.modem_status,
            scratch: snap.scratch,
            in_buffer: snap.in_buffer.clone(),
        };
        vm_superio::Serial::from_state(&st, irq, vm_superio::serial::NoEvents, out)
            .map(|inner| Self { inner })
            .map_err(|e| format!("the saved serial state is invalid: {e:?}"))
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
