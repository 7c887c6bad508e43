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
/// Longest reply to anything but a capture (status, peek, hello): a VM
/// process is untrusted, and its caller holds no more of it than this.
pub const MAX_SMALL_LINE: usize = 1 << 20;

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
    /// the other end closed. Waits as long as the socket's read timeout
    /// allows each read; a line may be [`MAX_LINE`] long.
    pub fn recv(&mut self) -> io::Result<Option<(String, Vec<OwnedFd>)>> {
        self.recv_within(None, MAX_LINE)
    }

    /// [`Channel::recv`] that ends by `deadline` with `TimedOut` however
    /// the other end trickles its bytes, and refuses a line longer than
    /// `max` (`InvalidData`).
    pub fn recv_within(
        &mut self,
        deadline: Option<std::time::Instant>,
        max: usize,
    ) -> io::Result<Option<(String, Vec<OwnedFd>)>> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                if i > max {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("a message is longer than {max} bytes"),
                    ));
                }
                let rest = self.buf.split_off(i + 1);
                let mut line = std::mem::replace(&mut self.buf, rest);
                line.pop();
                let line = String::from_utf8(line)
                    .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a message is not UTF-8"))?;
                return Ok(Some((line, std::mem::take(&mut self.fds))));
            }
            if self.buf.len() > max {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("a message is longer than {max} bytes"),
                ));
            }
            if let Some(d) = deadline {
                let left = d.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                self.sock.set_read_timeout(Some(left))?;
            }
            let mut fds: [RawFd; MAX_FDS] = [-1; MAX_FDS];
            let mut iov = [libc::iovec {
                iov_base: self.chunk.as_mut_ptr().cast(),
                iov_len: self.chunk.len(),
            }];
            // SAFETY: the iovec points at our own buffer of that length.
            let (n, nfds) = match unsafe { self.sock.recv_with_fds(&mut iov, &mut fds) } {
                Ok(got) => got,
                // The read timeout set above ran out: the deadline passed
                // inside the read (the socket says EAGAIN).
                Err(e) if deadline.is_some() && e.errno() == libc::EAGAIN => {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                Err(e) => return Err(io::Error::from(e)),
            };
            for &fd in &fds[..nfds] {
                // SAFETY: the kernel just gave this process the descriptor;
                // nothing else owns it.
                let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                crate::sys::set_cloexec(owned.as_raw_fd())?;
                self.fds.push(owned);
            }
            // One message carries at most MAX_FDS, however many reads it
            // spans: a peer cannot fill this process's descriptor table.
            if self.fds.len() > MAX_FDS {
                self.fds.clear();
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("a message carries more than {MAX_FDS} descriptors"),
                ));
            }
            if n == 0 && nfds == 0 {
                return Ok(None);
            }
            self.buf.extend_from_slice(&self.chunk[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::{Duration, Instant};

    #[test]
    fn a_trickled_reply_ends_at_the_deadline_not_at_each_read() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        // One byte every 20 ms, never a newline: each read alone would
        // succeed long before a per-read timeout.
        let writer = std::thread::spawn(move || {
            for _ in 0..100 {
                if theirs.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let mut chan = Channel::new(ours);
        let t = Instant::now();
        let e = chan
            .recv_within(Some(Instant::now() + Duration::from_millis(200)), MAX_SMALL_LINE)
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        drop(chan);
        writer.join().unwrap();
    }

    #[test]
    fn a_reply_longer_than_its_bound_is_refused_with_or_without_its_newline() {
        for newline in [false, true] {
            let (ours, mut theirs) = UnixStream::pair().unwrap();
            let writer = std::thread::spawn(move || {
                let mut line = vec![b'a'; 5000];
                if newline {
                    line.push(b'\n');
                }
                let _ = theirs.write_all(&line);
            });
            let mut chan = Channel::new(ours);
            let e = chan.recv_within(None, 4096).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
            assert!(e.to_string().contains("longer than 4096 bytes"), "{e}");
            writer.join().unwrap();
        }
        // Descriptors past MAX_FDS, sent a few per read, are refused (and
        // closed) before the line ends.
        let (ours, theirs) = UnixStream::pair().unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        let fds = [null.as_raw_fd(); 8];
        for _ in 0..(MAX_FDS / 8 + 1) {
            theirs.send_with_fds(&[&b"x"[..]], &fds).unwrap();
        }
        drop(theirs);
        let e = Channel::new(ours).recv_within(None, 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains("more than 32 descriptors"), "{e}");
        // Within the bound, the same line is read whole.
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        theirs.write_all(b"{\"reply\":\"ok\"}\n").unwrap();
        let (line, fds) = Channel::new(ours).recv_within(None, 4096).unwrap().unwrap();
        assert_eq!((line.as_str(), fds.len()), ("{\"reply\":\"ok\"}", 0));
    }
}
