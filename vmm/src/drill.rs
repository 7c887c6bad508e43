//! The escape drill's device (issue 36), built only with the test-only
//! `escape-drill` feature, never in a release: it stands for a device
//! model with a memory-safety bug that a guest has turned into arbitrary
//! reads of its VMM process. A guest hands it an address and a command
//! through its ports (`k7d_guest::drill`); it answers 20 bytes: a status
//! dword, then 16 bytes read.
//!
//! It runs on the vCPU thread that takes the port write, under that
//! thread's seccomp filter and the process's jail, as an attacker's code
//! would: the drill proves what such a guest reaches
//! (`vmm/tests/escape_drill.rs`), in a VM process and inside a daemon.

use k7d_devices::bus::BusDevice;
use k7d_guest::drill as d;

/// The ports it takes: command, answer, address low and high.
pub const PORTS: (u64, u64) = (d::PORT as u64, 10);

/// The device.
#[derive(Default)]
pub struct Drill {
    addr: u64,
    answer: Vec<u8>,
    next: usize,
}

impl Drill {
    fn run(&mut self, cmd: u8) {
        let (status, data) = match u32::from(cmd) {
            d::CMD_READ => read(self.addr),
            d::CMD_OPEN => open(),
            d::CMD_CONNECT => connect((self.addr & 0xffff) as u16),
            d::CMD_PANIC => panic!("escape drill: a device model's bug, reached by a guest"),
            _ => (d::FAILED, [0; 16]),
        };
        tracing::warn!(
            cmd,
            addr = self.addr,
            status,
            "escape drill: a guest used the drill device"
        );
        self.answer = status.to_le_bytes().iter().chain(&data).copied().collect();
        self.next = 0;
    }
}

/// 16 bytes at `addr` of this process, unless the page is not mapped
/// (`madvise` answers `ENOMEM` for an unmapped range without touching it).
fn read(addr: u64) -> (u32, [u8; 16]) {
    let page = addr & !0xfff;
    let len = (addr + 16).saturating_sub(page).next_multiple_of(4096) as usize;
    // SAFETY: madvise(MADV_NORMAL) changes no contents; on an unmapped
    // range it fails with ENOMEM. That is the drill's probe.
    let rc = unsafe { libc::madvise(page as *mut libc::c_void, len, libc::MADV_NORMAL) };
    if rc != 0 {
        return (d::UNMAPPED, [0; 16]);
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        // SAFETY: none: this is the bug the drill stands for, a read of an
        // address the guest chose. The range is mapped (above); the tests
        // point it at guest RAM mappings, which are readable.
        *b = unsafe { std::ptr::read_volatile((addr as usize + i) as *const u8) };
    }
    (d::DONE, out)
}

fn open() -> (u32, [u8; 16]) {
    match std::fs::File::open("/etc/passwd") {
        Ok(_) => (d::DONE, [0; 16]),
        Err(_) => (d::FAILED, [0; 16]),
    }
}

fn connect(port: u16) -> (u32, [u8; 16]) {
    let to = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    match std::net::TcpStream::connect_timeout(&to, std::time::Duration::from_millis(500)) {
        Ok(_) => (d::DONE, [0; 16]),
        Err(_) => (d::FAILED, [0; 16]),
    }
}

impl BusDevice for Drill {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset == u64::from(d::ANSWER_PORT - d::PORT) {
            for b in data.iter_mut() {
                *b = self.answer.get(self.next).copied().unwrap_or(0);
                self.next += 1;
            }
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let dword = || data.get(..4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
        match offset {
            0 => {
                if let Some(&c) = data.first() {
                    self.run(c);
                }
            }
            o if o == u64::from(d::ADDR_LO_PORT - d::PORT) => {
                if let Some(v) = dword() {
                    self.addr = (self.addr & !0xffff_ffff) | u64::from(v);
                }
            }
            o if o == u64::from(d::ADDR_HI_PORT - d::PORT) => {
                if let Some(v) = dword() {
                    self.addr = (self.addr & 0xffff_ffff) | (u64::from(v) << 32);
                }
            }
            _ => {}
        }
    }
}
