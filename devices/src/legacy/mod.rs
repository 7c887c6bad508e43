//! Legacy PC devices: the 8250/16550 serial port and the i8042 reset line.

mod i8042;
mod serial;

pub use i8042::I8042;
pub use serial::{Serial, SerialCounters, SerialOutput, SerialProbe, SerialRegs, SerialSnapshot};
