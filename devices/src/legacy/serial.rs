//! 8250/16550 UART (vm-superio) writing to a per-VM log file and, optionally,
//! to the terminal.

use std::fs::File;
use std::io::{self, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::bus::BusDevice;
use crate::irq::IrqLine;
use crate::virtio::diag::{now_ns, seconds_ago};

/// Output counters, shared with the state dump (read without the device's
/// lock, so a vCPU stuck writing output still shows up).
#[derive(Debug, Default)]
pub struct SerialOutputStats {
    bytes: AtomicU64,
    last_ns: AtomicU64,
    /// When the write in progress began (0: none in progress).
    writing_since_ns: AtomicU64,
    /// The console's last byte was not a newline.
    mid_line: AtomicBool,
}

/// Where the guest's serial output goes.
pub struct SerialOutput {
    log: Option<File>,
    console: bool,
    stats: Arc<SerialOutputStats>,
}

impl SerialOutput {
    /// Output to `log` (appended) and, with `console`, to this process's stdout.
    pub fn new(log: Option<File>, console: bool) -> Self {
        Self {
            log,
            console,
            stats: Arc::default(),
        }
    }

    fn write_sinks(&mut self, buf: &[u8]) -> io::Result<()> {
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
        Ok(())
    }
}

impl Write for SerialOutput {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let now = now_ns().max(1);
        self.stats.writing_since_ns.store(now, Ordering::Relaxed);
        let r = self.write_sinks(buf);
        self.stats.writing_since_ns.store(0, Ordering::Relaxed);
        self.stats.last_ns.store(now, Ordering::Relaxed);
        self.stats.bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
        if self.console
            && let Some(&last) = buf.last()
        {
            self.stats.mid_line.store(last != b'\n', Ordering::Relaxed);
        }
        r.map(|()| buf.len())
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

impl SerialSnapshot {
    /// The UART had raised an interrupt the guest has not acknowledged yet
    /// (IIR names a cause that IER enables). Its edge may not be in the
    /// saved irqchip state: the line is an irqfd, and KVM injects a
    /// pin-routed irqfd from a workqueue, so an edge raised just before the
    /// pause can still be in flight when the irqchip is read. The UART
    /// never raises that cause again until the guest reads IIR, and a guest
    /// driver (Linux's 8250) waits for it: a restore must raise it anew.
    pub fn interrupt_pending(&self) -> bool {
        let (iir, ier) = (self.interrupt_identification, self.interrupt_enable);
        iir & IIR_NO_INTERRUPT == 0
            && ((iir & IIR_THR_EMPTY != 0 && ier & IER_THR_EMPTY != 0)
                || (iir & IIR_RX_DATA != 0 && ier & IER_RX_DATA != 0))
    }
}

/// IIR bit 0: no interrupt pending.
const IIR_NO_INTERRUPT: u8 = 0x01;
/// IIR: the transmitter holding register is empty.
const IIR_THR_EMPTY: u8 = 0x02;
/// IIR: received data is available.
const IIR_RX_DATA: u8 = 0x04;
/// IER: interrupt when received data is available.
const IER_RX_DATA: u8 = 0x01;
/// IER: interrupt when the transmitter holding register is empty.
const IER_THR_EMPTY: u8 = 0x02;

/// The lock-free half of the serial state dump: output and interrupt
/// counters, readable while a vCPU holds the device (e.g. blocked writing).
#[derive(Clone, Debug)]
pub struct SerialProbe {
    out: Arc<SerialOutputStats>,
    raised: Arc<AtomicU64>,
}

/// [`SerialProbe`]'s view.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SerialCounters {
    /// Bytes the guest wrote to THR (sent to the log/console).
    pub bytes_out: u64,
    /// Seconds since the last byte, `None` if none yet.
    pub since_out_s: Option<f64>,
    /// Seconds a write to the log/console has been in progress (a vCPU
    /// blocked in it), `None` if none is.
    pub writing_for_s: Option<f64>,
    /// Times the interrupt line was raised.
    pub irqs_raised: u64,
    /// The console's last byte was not a newline.
    pub mid_line: bool,
}

impl SerialProbe {
    /// The counters now.
    pub fn counters(&self) -> SerialCounters {
        let o = &self.out;
        SerialCounters {
            bytes_out: o.bytes.load(Ordering::Relaxed),
            since_out_s: seconds_ago(o.last_ns.load(Ordering::Relaxed)),
            writing_for_s: seconds_ago(o.writing_since_ns.load(Ordering::Relaxed)),
            irqs_raised: self.raised.load(Ordering::Relaxed),
            mid_line: o.mid_line.load(Ordering::Relaxed),
        }
    }
}

/// The UART's registers as the state dump shows them (read without side
/// effects: reading IIR or RBR through the bus would change them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SerialRegs {
    /// Interrupt enable register.
    pub ier: u8,
    /// Interrupt identification register (as a guest read would return it, FIFO bits included).
    pub iir: u8,
    /// Line status register.
    pub lsr: u8,
    /// Line control register.
    pub lcr: u8,
    /// Modem control register.
    pub mcr: u8,
    /// Bytes waiting in the receive FIFO.
    pub rx_fifo: usize,
}

impl SerialRegs {
    /// `ier=0x02(thri) iir=0xc2(thr) lsr=0x60 lcr=0x03 mcr=0x08 irq_pending=yes rx_fifo=0/64`.
    pub fn words(&self) -> String {
        let mut ier: Vec<&str> = Vec::new();
        for (bit, name) in [(1u8, "rdi"), (2, "thri"), (4, "rlsi"), (8, "msi")] {
            if self.ier & bit != 0 {
                ier.push(name);
            }
        }
        let iir = match self.iir & 0x0f {
            0x01 => "none".to_string(),
            v => {
                let mut w = Vec::new();
                if v & 0x02 != 0 {
                    w.push("thr");
                }
                if v & 0x04 != 0 {
                    w.push("rda");
                }
                w.join("+")
            }
        };
        format!(
            "ier={:#04x}({}) iir={:#04x}({iir}) lsr={:#04x} lcr={:#04x} mcr={:#04x} irq_pending={} rx_fifo={}/{FIFO_SIZE}",
            self.ier,
            ier.join(","),
            self.iir,
            self.lsr,
            self.lcr,
            self.mcr,
            if self.iir & 0x01 == 0 { "yes" } else { "no" },
            self.rx_fifo,
        )
    }
}

/// The receive FIFO of vm-superio's UART.
const FIFO_SIZE: usize = 64;

/// The COM1 device: vm-superio's UART on an irqfd.
pub struct Serial {
    inner: vm_superio::Serial<IrqLine, vm_superio::serial::NoEvents, SerialOutput>,
    probe: SerialProbe,
}

impl Serial {
    /// A UART raising `irq` and writing to `out`.
    pub fn new(irq: IrqLine, out: SerialOutput) -> Self {
        let probe = SerialProbe {
            out: out.stats.clone(),
            raised: irq.raised(),
        };
        Self {
            inner: vm_superio::Serial::new(irq, out),
            probe,
        }
    }

    /// The lock-free counters, for the state dump.
    pub fn probe(&self) -> SerialProbe {
        self.probe.clone()
    }

    /// The registers now, for the state dump (no side effects).
    pub fn debug_regs(&self) -> SerialRegs {
        let st = self.inner.state();
        SerialRegs {
            ier: st.interrupt_enable,
            iir: st.interrupt_identification | 0xc0,
            lsr: st.line_status,
            lcr: st.line_control,
            mcr: st.modem_control,
            rx_fifo: st.in_buffer.len(),
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
        let probe = SerialProbe {
            out: out.stats.clone(),
            raised: irq.raised(),
        };
        vm_superio::Serial::from_state(&st, irq, vm_superio::serial::NoEvents, out)
            .map(|inner| Self { inner, probe })
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

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    const IER: u64 = 1;
    const IIR: u64 = 2;

    fn uart() -> (Serial, EventFd) {
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let irq = IrqLine::new(evt.try_clone().unwrap());
        (Serial::new(irq, SerialOutput::new(None, true)), evt)
    }

    /// What Linux's 8250 driver relies on, and what the dump shows of it:
    /// setting THRI while THR is empty raises the interrupt at once; after
    /// the guest's IIR read, writing a byte raises it again.
    #[test]
    fn thri_raises_and_the_dump_sees_registers_and_counters() {
        let (mut s, evt) = uart();
        assert_eq!(
            s.debug_regs().words(),
            "ier=0x00() iir=0xc1(none) lsr=0x60 lcr=0x03 mcr=0x08 irq_pending=no rx_fifo=0/64"
        );
        s.write(IER, &[0x02]);
        assert_eq!(evt.read().unwrap(), 1, "THRI on an empty THR must interrupt");
        assert_eq!(
            s.debug_regs().words(),
            "ier=0x02(thri) iir=0xc2(thr) lsr=0x60 lcr=0x03 mcr=0x08 irq_pending=yes rx_fifo=0/64"
        );
        let mut b = [0u8];
        s.read(IIR, &mut b);
        assert_eq!(b[0], 0xc2);
        s.write(0, b"x");
        assert_eq!(evt.read().unwrap(), 1, "a byte written with THRI on interrupts again");
        let c = s.probe().counters();
        assert_eq!((c.bytes_out, c.irqs_raised, c.mid_line), (1, 2, true));
        assert!(c.since_out_s.is_some() && c.writing_for_s.is_none());
        s.write(0, b"\n");
        assert!(!s.probe().counters().mid_line);
    }

    /// A snapshot taken between the UART's raise and the guest's IIR read
    /// says an interrupt is pending; one taken after the read, or with the
    /// cause disabled, does not.
    #[test]
    fn a_snapshot_says_when_an_interrupt_awaits_the_guest() {
        let (mut s, _evt) = uart();
        assert!(!s.snapshot().interrupt_pending(), "a new UART has nothing pending");
        s.write(IER, &[0x02]);
        assert!(s.snapshot().interrupt_pending(), "THRI raised and not acknowledged");
        let mut b = [0u8];
        s.read(IIR, &mut b);
        assert!(
            !s.snapshot().interrupt_pending(),
            "the guest's IIR read acknowledged it"
        );
        s.write(0, b"x");
        assert!(s.snapshot().interrupt_pending(), "a byte written raised THRI again");
        s.write(IER, &[0x00]);
        assert!(
            !s.snapshot().interrupt_pending(),
            "a cause the guest disabled is not pending"
        );
        s.write(IER, &[0x01]);
        s.enqueue_input(b"k");
        assert!(s.snapshot().interrupt_pending(), "received data with RDI on");
        s.read(0, &mut b);
        assert!(!s.snapshot().interrupt_pending(), "the guest read the byte");
    }
}
