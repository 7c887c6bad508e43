//! Raw I/O on file descriptors.

use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

use vm_memory::VolatileSlice;
use vm_memory::bitmap::BitmapSlice;

/// Whether `fd` was opened read-only (the access mode of `F_GETFL`).
pub fn is_read_only(fd: &impl AsRawFd) -> io::Result<bool> {
    // SAFETY: fcntl on a descriptor the caller holds, no argument.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(flags & libc::O_ACCMODE == libc::O_RDONLY)
}

/// Makes descriptor `target` refer to what `from` refers to (`dup3`,
/// close-on-exec): `target` keeps its number, so whoever holds it reads
/// through the new open file from then on; the open file it referred to
/// is closed (with its locks, unless another descriptor shares it).
pub fn dup_over(from: &impl AsRawFd, target: &impl AsRawFd) -> io::Result<()> {
    if from.as_raw_fd() == target.as_raw_fd() {
        return Ok(());
    }
    // SAFETY: dup3 on two descriptors the caller holds; `target` stays
    // open (atomically re-pointed), so its owner's handle stays valid.
    if unsafe { libc::dup3(from.as_raw_fd(), target.as_raw_fd(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `read(2)` into `buf`.
pub fn read(fd: &impl AsRawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, writable slice of `buf.len()` bytes.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// `write(2)` of `buf`.
pub fn write(fd: &impl AsRawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, readable slice of `buf.len()` bytes.
    let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// `writev(2)`: writes what `iov` gathers; returns the bytes written.
///
/// # Safety
/// Each entry must describe memory that is readable for its length and
/// stays mapped for the call (guest RAM the caller holds mapped, or a live
/// local buffer).
pub unsafe fn writev(fd: &impl AsRawFd, iov: &[libc::iovec]) -> io::Result<usize> {
    let cnt = libc::c_int::try_from(iov.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `iov` is a live slice of `cnt` iovecs; writev only reads the
    // memory they describe, which the caller guarantees readable and mapped.
    let n = unsafe { libc::writev(fd.as_raw_fd(), iov.as_ptr(), cnt) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Reads from `fd` at file offset `off` into `buf` (guest memory) until
/// `buf` is full or the file ends; returns the bytes read. `EINTR` is
/// retried. Marking the written bytes dirty is the caller's (it knows what
/// a partial read on error means for it).
pub fn pread_volatile<B: BitmapSlice>(fd: &impl AsRawFd, buf: &mut VolatileSlice<B>, off: u64) -> io::Result<usize> {
    let guard = buf.ptr_guard_mut();
    let mut done = 0usize;
    while done < buf.len() {
        let at = off
            .checked_add(done as u64)
            .and_then(|a| i64::try_from(a).ok())
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `guard` pins `buf.len()` bytes of mapped memory that are
        // valid for writes while it lives; the kernel writes at most
        // `buf.len() - done` bytes starting `done` bytes in.
        let n = unsafe { libc::pread64(fd.as_raw_fd(), guard.as_ptr().add(done).cast(), buf.len() - done, at) };
        match n {
            0 => break,
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(done)
}

/// Writes all of `buf` (guest memory) to `fd` at file offset `off`; returns
/// its length. `EINTR` is retried; a write that makes no progress fails
/// with `WriteZero`.
pub fn pwrite_volatile<B: BitmapSlice>(fd: &impl AsRawFd, buf: &VolatileSlice<B>, off: u64) -> io::Result<usize> {
    let guard = buf.ptr_guard();
    let mut done = 0usize;
    while done < buf.len() {
        let at = off
            .checked_add(done as u64)
            .and_then(|a| i64::try_from(a).ok())
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: `guard` pins `buf.len()` readable bytes of mapped memory;
        // the kernel reads at most `buf.len() - done` bytes from `done`.
        let n = unsafe { libc::pwrite64(fd.as_raw_fd(), guard.as_ptr().add(done).cast(), buf.len() - done, at) };
        match n {
            0 => return Err(io::ErrorKind::WriteZero.into()),
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(done)
}

/// Waits until one of `fds` is readable (or hung up), at most `timeout`
/// (`None`: no limit); returns, for each fd, whether it is. An interrupted
/// wait returns all false.
pub fn poll_readable(fds: &[&dyn AsRawFd], timeout: Option<Duration>) -> io::Result<Vec<bool>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = match timeout {
        None => -1,
        Some(t) => libc::c_int::try_from(t.as_millis()).unwrap_or(libc::c_int::MAX),
    };
    // SAFETY: `pfds` is a live array of `pfds.len()` pollfd structs; their
    // fds belong to the objects `fds` borrows, open for the whole call.
    let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(vec![false; pfds.len()]);
        }
        return Err(e);
    }
    Ok(pfds.iter().map(|p| p.revents != 0).collect())
}

/// Sets or clears `O_NONBLOCK` on `fd` (a FIFO opened without waiting for
/// its writer, then read waiting for data: clear).
pub fn set_nonblocking(fd: &impl AsRawFd, on: bool) -> io::Result<()> {
    let fd = fd.as_raw_fd();
    // SAFETY: fcntl(F_GETFL) on a descriptor the caller keeps open; no pointers.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let want = if on {
        flags | libc::O_NONBLOCK
    } else {
        flags & !libc::O_NONBLOCK
    };
    // SAFETY: as above; F_SETFL takes the flags as an integer.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, want) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn read_write_and_poll_move_bytes_between_the_ends_of_a_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        assert_eq!(poll_readable(&[&b], Some(Duration::ZERO)).unwrap(), vec![false]);
        assert_eq!(write(&a, b"k7d").unwrap(), 3);
        let two = [libc::iovec {
            iov_base: b"ab".as_ptr() as *mut libc::c_void,
            iov_len: 2,
        }];
        // SAFETY: the one entry points at a static string of that length.
        assert_eq!(unsafe { writev(&a, &two) }.unwrap(), 2);
        assert_eq!(
            poll_readable(&[&a, &b], Some(Duration::from_secs(1))).unwrap(),
            vec![false, true]
        );
        let mut buf = [0u8; 8];
        assert_eq!(read(&b, &mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"k7dab");
    }

    #[test]
    fn positioned_io_moves_memory_to_and_from_a_file() {
        let f = tempfile();
        let mut data = *b"positioned";
        // SAFETY: `data` is a live local that outlives the slice.
        let src = unsafe { VolatileSlice::new(data.as_mut_ptr(), data.len()) };
        assert_eq!(pwrite_volatile(&f, &src, 4096).unwrap(), 10);
        let mut back = [0u8; 12];
        // SAFETY: `back` is a live local that outlives the slice.
        let mut dst = unsafe { VolatileSlice::new(back.as_mut_ptr(), back.len()) };
        assert_eq!(
            pread_volatile(&f, &mut dst, 4096).unwrap(),
            10,
            "short at the end of the file"
        );
        assert_eq!(&back[..10], b"positioned");
        // SAFETY: as above.
        let mut dst = unsafe { VolatileSlice::new(back.as_mut_ptr(), back.len()) };
        assert_eq!(pread_volatile(&f, &mut dst, 1 << 20).unwrap(), 0);
        assert_eq!(
            pread_volatile(&f, &mut dst, u64::MAX).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }

    pub(crate) fn tempfile() -> std::fs::File {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .open(std::env::temp_dir())
            .unwrap()
    }
}
