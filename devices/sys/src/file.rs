//! Files: advisory locks, the page size, data extents, in-kernel copies and
//! hole punching.

use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;

/// What [`flock`] takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lock {
    /// `LOCK_SH`.
    Shared,
    /// `LOCK_EX`.
    Exclusive,
    /// `LOCK_UN`.
    Unlock,
}

/// `flock(2)`: takes `lock` on `file`, waiting for it when `wait` (else a
/// held conflicting lock fails at once with `WouldBlock`). `EINTR` is
/// retried.
pub fn flock(file: &impl AsRawFd, lock: Lock, wait: bool) -> io::Result<()> {
    let op = match lock {
        Lock::Shared => libc::LOCK_SH,
        Lock::Exclusive => libc::LOCK_EX,
        Lock::Unlock => libc::LOCK_UN,
    } | if wait { 0 } else { libc::LOCK_NB };
    loop {
        // SAFETY: flock on a descriptor the caller keeps open; it touches no
        // memory.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The host page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(v).ok().filter(|&v| v > 0).unwrap_or(4096)
}

/// `lseek(2)`; `Ok(None)` for `ENXIO` (no data, or no hole, at or after
/// `at`).
fn seek(file: &impl AsRawFd, at: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let at = libc::off_t::try_from(at).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: lseek on a descriptor the caller keeps open, with integer
    // arguments; it moves the file position, which callers do not use (all
    // their I/O is positioned).
    let r = unsafe { libc::lseek(file.as_raw_fd(), at, whence) };
    if r >= 0 {
        return Ok(Some(r as u64));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENXIO) => Ok(None),
        _ => Err(e),
    }
}

/// The next extent of `file` holding data within `[pos, end)`
/// (`SEEK_DATA`, then `SEEK_HOLE`); `Ok(None)` when the rest is holes. A
/// file system that cannot tell (`EINVAL`, `EOPNOTSUPP`) reports the whole
/// rest as data, which is correct, only slower for a caller that copies it.
pub fn next_data(file: &impl AsRawFd, pos: u64, end: u64) -> io::Result<Option<Range<u64>>> {
    if pos >= end {
        return Ok(None);
    }
    let data = match seek(file, pos, libc::SEEK_DATA) {
        Ok(Some(d)) => d.max(pos),
        Ok(None) => return Ok(None),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP)) => return Ok(Some(pos..end)),
        Err(e) => return Err(e),
    };
    if data >= end {
        return Ok(None);
    }
    let hole = match seek(file, data, libc::SEEK_HOLE) {
        Ok(Some(h)) => h,
        _ => end,
    };
    Ok(Some(data..hole.clamp(data + 1, end)))
}

/// `copy_file_range(2)` of up to `len` bytes from `src` at `off` to `dst`
/// at the same offset; returns the bytes copied (0: `src` ended). `EINTR`
/// is retried; the caller falls back to reads and writes on `EXDEV`,
/// `ENOSYS`, `EOPNOTSUPP` or `EINVAL`.
pub fn copy_file_range(src: &impl AsRawFd, dst: &impl AsRawFd, off: u64, len: usize) -> io::Result<usize> {
    let off = i64::try_from(off).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    loop {
        let (mut off_in, mut off_out) = (off, off);
        // SAFETY: both descriptors are open for the call; the kernel reads
        // and updates the two offsets, locals of this frame.
        let n = unsafe { libc::copy_file_range(src.as_raw_fd(), &mut off_in, dst.as_raw_fd(), &mut off_out, len, 0) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// What [`fallocate`] does to a range (the file's size never changes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallocate {
    /// `FALLOC_FL_PUNCH_HOLE`: deallocate; the range reads as zeros.
    PunchHole,
    /// `FALLOC_FL_ZERO_RANGE`: zero, keeping (or making) it allocated.
    ZeroRange,
}

/// `fallocate(2)` of `[offset, offset + len)` with `FALLOC_FL_KEEP_SIZE`;
/// `EINTR` is retried. A file system without the mode fails with
/// `EOPNOTSUPP`.
pub fn fallocate(file: &impl AsRawFd, mode: Fallocate, offset: u64, len: u64) -> io::Result<()> {
    let (Ok(off), Ok(l)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    let mode = libc::FALLOC_FL_KEEP_SIZE
        | match mode {
            Fallocate::PunchHole => libc::FALLOC_FL_PUNCH_HOLE,
            Fallocate::ZeroRange => libc::FALLOC_FL_ZERO_RANGE,
        };
    loop {
        // SAFETY: fallocate on a descriptor the caller keeps open, with
        // integer arguments; it touches no memory of this process.
        if unsafe { libc::fallocate(file.as_raw_fd(), mode, off, l) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Reads up to `max + 1` bytes of the regular file at `path`. Opened with
/// `O_NONBLOCK`, so a FIFO or a device in the file's place is refused at
/// once instead of blocking the caller (the flag changes nothing for a
/// regular file).
pub fn read_regular_file(path: &std::path::Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    read_open_regular_file(f, max)
}

/// [`read_regular_file`] of a file already open (a descriptor handed over).
pub fn read_open_regular_file(f: std::fs::File, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "it is not a regular file",
        ));
    }
    let mut data = Vec::new();
    f.take(max.saturating_add(1)).read_to_end(&mut data)?;
    Ok(data)
}

/// `mkfifo(2)`: a FIFO at `path` with `mode` (less the umask).
pub fn mkfifo(path: &std::path::Path, mode: libc::mode_t) -> io::Result<()> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "the path has a NUL byte"))?;
    // SAFETY: a NUL-terminated path that outlives the call.
    if unsafe { libc::mkfifo(c.as_ptr(), mode) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `getrlimit(2)`: the calling process's (soft, hard) limit of `resource`
/// (`libc::RLIMIT_*`).
pub fn rlimit(resource: libc::__rlimit_resource_t) -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit the call fills in.
    if unsafe { libc::getrlimit(resource, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fd::tests::tempfile;
    use std::os::unix::fs::FileExt;

    #[test]
    fn an_exclusive_lock_refuses_a_second_holder_until_it_is_released() {
        let f = tempfile();
        let path = format!("/proc/self/fd/{}", f.as_raw_fd());
        let other = std::fs::File::open(path).unwrap();
        flock(&f, Lock::Exclusive, false).unwrap();
        let e = flock(&other, Lock::Shared, false).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        flock(&f, Lock::Unlock, false).unwrap();
        flock(&other, Lock::Shared, false).unwrap();
    }

    #[test]
    fn extents_skip_holes_and_punching_makes_one() {
        let f = tempfile();
        let page = page_size() as u64;
        assert!(page.is_power_of_two());
        f.set_len(64 * page).unwrap();
        assert_eq!(next_data(&f, 0, 64 * page).unwrap(), None, "a new file is one hole");
        f.write_all_at(&vec![7u8; 2 * page as usize], 8 * page).unwrap();
        f.write_all_at(&[9u8], 40 * page).unwrap();
        let all: Vec<_> = std::iter::successors(next_data(&f, 0, 64 * page).unwrap(), |r| {
            next_data(&f, r.end, 64 * page).unwrap()
        })
        .collect();
        // tmpfs and ext4 both report page-granular extents.
        assert_eq!(all, vec![8 * page..10 * page, 40 * page..41 * page]);
        assert_eq!(
            next_data(&f, 9 * page, 9 * page + 1).unwrap(),
            Some(9 * page..9 * page + 1)
        );
        fallocate(&f, Fallocate::PunchHole, 8 * page, 2 * page).unwrap();
        assert_eq!(next_data(&f, 0, 64 * page).unwrap(), Some(40 * page..41 * page));
        assert_eq!(f.metadata().unwrap().len(), 64 * page, "the size is kept");
        fallocate(&f, Fallocate::ZeroRange, 40 * page, page).unwrap();
        let mut b = [1u8];
        f.read_exact_at(&mut b, 40 * page).unwrap();
        assert_eq!(b, [0]);
    }

    #[test]
    fn copy_file_range_copies_at_the_same_offset() {
        let (src, dst) = (tempfile(), tempfile());
        src.write_all_at(b"0123456789", 100).unwrap();
        assert_eq!(copy_file_range(&src, &dst, 102, 4).unwrap(), 4);
        let mut b = [0u8; 4];
        dst.read_exact_at(&mut b, 102).unwrap();
        assert_eq!(&b, b"2345");
        assert_eq!(copy_file_range(&src, &dst, 200, 4).unwrap(), 0, "past the end");
    }
}
