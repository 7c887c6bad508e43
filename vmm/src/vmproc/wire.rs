//! The channel's framing: one JSON message per line over a unix stream
//! socket, with the descriptors a message carries (a fork instant's memfds)
//! sent as `SCM_RIGHTS` with its first byte. One request is outstanding at
//! a time, so every descriptor received before a line ends belongs to it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Most descriptors one message carries (a build's files and listening
/// socket; a daemon refuses a VM that would need more).
pub const MAX_FDS: usize = 32;
/// Longest line (a fork instant's machine state is the largest message).
pub const MAX_LINE: usize = 64 << 20;

/// One end of a channel.
pub struct Channel {
    sock: UnixStream,
    buf: Vec<u8>,
    /// One `recvmsg`'s worth, kept between reads.
    chunk: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl Channel {
    /// Frames `sock`.
    pub fn new(sock: UnixStream) -> Self {
        Self {
            sock,
            buf: Vec::new(),
            chunk: vec![0u8; 64 << 10],
            fds: Vec::new(),
        }
    }

    /// The socket (timeouts, shutdown).
    pub fn socket(&self) -> &UnixStream {
        &self.sock
    }

    /// Sends `line` (no newline in it) and `fds` with its first byte.
    pub fn send(&self, line: &str, fds: &[RawFd]) -> io::Result<()> {
        if fds.len() > MAX_FDS {
            return Err(io::Error::other(format!(
                "a message carries at most {MAX_FDS} descriptors"
            )));
        }
        let mut msg = Vec::with_capacity(line.len() + 1);
        msg.extend_from_slice(line.as_bytes());
        msg.push(b'\n');
        let mut sent = self.sock.send_with_fds(&[&msg[..]], fds).map_err(io::Error::from)?;
        while sent < msg.len() {
            let n = self.sock.send_with_fds(&[&msg[sent..]], &[]).map_err(io::Error::from)?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            sent += n;
        }
        Ok(())
    }

    /// The next line and the descriptors that came with it; `None` once
    /// the other end closed.
    pub fn recv(&mut self) -> io::Result<Option<(String, Vec<OwnedFd>)>> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let rest = self.buf.split_off(i + 1);
                let mut line = std::mem::replace(&mut self.buf, rest);
                line.pop();
                let line = String::from_utf8(line)
                    .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a message is not UTF-8"))?;
                return Ok(Some((line, std::mem::take(&mut self.fds))));
            }
            if self.buf.len() > MAX_LINE {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "a message is too long"));
            }
            let mut fds: [RawFd; MAX_FDS] = [-1; MAX_FDS];
            let mut iov = [libc::iovec {
                iov_base: self.chunk.as_mut_ptr().cast(),
                iov_len: self.chunk.len(),
            }];
            // SAFETY: the iovec points at our own buffer of that length.
            let (n, nfds) = unsafe { self.sock.recv_with_fds(&mut iov, &mut fds) }.map_err(io::Error::from)?;
            for &fd in &fds[..nfds] {
                // SAFETY: the kernel just gave this process the descriptor;
                // nothing else owns it.
                let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                crate::sys::set_cloexec(owned.as_raw_fd())?;
                self.fds.push(owned);
            }
            if n == 0 && nfds == 0 {
                return Ok(None);
            }
            self.buf.extend_from_slice(&self.chunk[..n]);
        }
    }
}
