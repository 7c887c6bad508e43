//! Unix stream sockets connected without blocking on a full backlog.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// `sockaddr_un` for `path` and its length.
fn address(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: an all-zero sockaddr_un is a valid value (family set below).
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a unix socket path must be 1 to {} bytes without NUL",
                addr.sun_path.len() - 1
            ),
        ));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1) as libc::socklen_t;
    Ok((addr, len))
}

/// A fresh non-blocking, close-on-exec unix stream socket.
fn socket() -> io::Result<UnixStream> {
    // SAFETY: socket(2) with constant, valid arguments.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    Ok(unsafe { UnixStream::from_raw_fd(fd) })
}

/// One `connect(2)` attempt.
fn connect(stream: &UnixStream, addr: &libc::sockaddr_un, len: libc::socklen_t) -> io::Result<()> {
    // SAFETY: `addr` is an initialized sockaddr_un of which the first `len`
    // bytes are meaningful; `stream` owns an open socket.
    let rc = unsafe { libc::connect(stream.as_raw_fd(), (addr as *const libc::sockaddr_un).cast(), len) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Connects to `path` without ever blocking and returns a non-blocking
/// stream: a listener whose backlog is full fails with `WouldBlock`, which
/// the caller treats like a refusal.
pub fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let (addr, len) = address(path)?;
    let stream = socket()?;
    loop {
        match connect(&stream, &addr, len) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            r => return r.map(|()| stream),
        }
    }
}

/// Connects to `path`, giving up after `timeout`: a listener whose backlog is
/// full (nobody accepts) makes a plain `connect` block without limit; this
/// one retries a non-blocking `connect` until the deadline and then fails
/// with `TimedOut`. The stream it returns blocks.
pub fn connect_with_timeout(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let (addr, len) = address(path)?;
    let stream = socket()?;
    let deadline = Instant::now() + timeout;
    while let Err(e) = connect(&stream, &addr, len) {
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            // The listener's backlog is full: nobody has accepted yet.
            Some(libc::EAGAIN) | Some(libc::EINPROGRESS) => {
                if Instant::now() >= deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the listener accepted no connection in time (its backlog is full)",
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Some(libc::EISCONN) => break,
            _ => return Err(e),
        }
    }
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// Whether a connected stream is still open with nothing unread (a peek of
/// one byte that would block): a connection kept idle is worth reusing only
/// then. One the peer closed (a read of 0) or that holds unread bytes is not.
pub fn idle_and_open(stream: &impl AsRawFd) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: a valid buffer of one byte on an open socket; MSG_PEEK leaves
    // the byte unread and MSG_DONTWAIT never blocks.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    #[test]
    fn both_connects_reach_a_listener_and_refuse_bad_paths() {
        let dir = std::env::temp_dir().join(format!("k7d-sys-sock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("l.sock");
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        let mut a = connect_with_timeout(&path, Duration::from_secs(1)).unwrap();
        let b = connect_nonblocking(&path).unwrap();
        assert!(b.peer_addr().is_ok());
        let (mut s, _) = l.accept().unwrap();
        a.write_all(b"hi").unwrap();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi");
        let long = dir.join("x".repeat(200));
        assert_eq!(
            connect_nonblocking(&long).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            connect_nonblocking(&dir.join("none")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
