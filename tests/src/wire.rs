//! The far side of a tap: an AF_PACKET socket bound to it. Frames sent on
//! it come out of the tap's fd (the VM's NIC receives them); frames the NIC
//! transmits into the tap arrive on it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The ethertype of the tests' frames (IEEE local experimental).
pub const ETHERTYPE_TEST: u16 = 0x88b5;

/// A non-blocking AF_PACKET socket bound to one interface.
pub struct Wire(OwnedFd);

impl Wire {
    /// A wire on interface `ifindex`.
    pub fn open(ifindex: u32) -> std::io::Result<Self> {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2) call; the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                i32::from(proto),
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an all-zero sockaddr_ll is a valid value of this C struct.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: `sll` is a live sockaddr_ll and the length matches it.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self(fd))
    }

    /// Sends one frame; false when the kernel refused it (a full queue).
    pub fn try_send(&self, frame: &[u8]) -> bool {
        // SAFETY: `frame` is a live slice of `frame.len()` bytes.
        let n = unsafe { libc::send(self.0.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        n == frame.len() as isize
    }

    /// Sends one frame; a refusal fails the test.
    pub fn send(&self, frame: &[u8]) {
        assert!(
            self.try_send(frame),
            "send on the wire: {}",
            std::io::Error::last_os_error()
        );
    }

    /// Frames with [`ETHERTYPE_TEST`] that arrive within `timeout`, until `want`.
    pub fn recv_test_frames(&self, want: usize, timeout: Duration) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 70_000];
        while out.len() < want && Instant::now() < deadline {
            // SAFETY: `buf` is a live, writable slice of `buf.len()` bytes.
            let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            let f = &buf[..n as usize];
            if f.len() >= 14 && u16::from_be_bytes([f[12], f[13]]) == ETHERTYPE_TEST {
                out.push(f.to_vec());
            }
        }
        out
    }

    /// Sends broadcast test frames of `len` bytes, each with a new counter in
    /// its payload (so every frame changes the page it lands in), in bursts
    /// of 8, until `stop`; returns how many it sent.
    pub fn flood(&self, len: usize, stop: &AtomicBool) -> u64 {
        let mut frame = vec![0u8; len];
        frame[..6].fill(0xff);
        frame[6..12].copy_from_slice(&[0x02, 0x6b, 0x37, 0x64, 0, 1]);
        frame[12..14].copy_from_slice(&ETHERTYPE_TEST.to_be_bytes());
        let mut sent = 0u64;
        while !stop.load(Ordering::SeqCst) {
            for _ in 0..8 {
                sent += 1;
                for (i, b) in frame[14..].iter_mut().enumerate() {
                    *b = (sent as u8).wrapping_add(i as u8);
                }
                self.try_send(&frame);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        sent
    }
}
