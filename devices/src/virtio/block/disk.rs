//! The backing image: a raw file, read-write or read-only.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use tracing::{info, warn};
use vm_memory::VolatileMemoryError;
use vm_memory::VolatileSlice;
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, WriteVolatile};

use super::{BlockError, SECTOR_SHIFT, SECTOR_SIZE};

/// A raw disk image.
#[derive(Debug)]
pub struct DiskImage {
    file: File,
    read_only: bool,
    sectors: u64,
    path: String,
}

impl DiskImage {
    /// Opens `path`: `O_RDWR`, or `O_RDONLY` when `read_only` (the device then
    /// advertises `VIRTIO_BLK_F_RO` and fails writes with IOERR).
    pub fn open(path: impl AsRef<std::path::Path>, read_only: bool) -> Result<Self, BlockError> {
        let p = path.as_ref();
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(p)
            .map_err(|source| BlockError::Open {
                path: p.display().to_string(),
                source,
            })?;
        Self::from_file(file, read_only, p.display().to_string())
    }

    /// Wraps an open file (tests, memfds). `read_only` must match how it was
    /// opened if writes are to fail in the device rather than in the kernel.
    pub fn from_file(file: File, read_only: bool, path: String) -> Result<Self, BlockError> {
        let len = file.metadata().map_err(BlockError::Metadata)?.len();
        let sectors = len >> SECTOR_SHIFT;
        if sectors == 0 {
            return Err(BlockError::Empty);
        }
        if !len.is_multiple_of(SECTOR_SIZE) {
            warn!(
                path,
                len, "disk image length is not a multiple of 512; the tail is not visible"
            );
        }
        info!(path, sectors, read_only, "virtio-blk image opened");
        Ok(Self {
            file,
            read_only,
            sectors,
            path,
        })
    }

    /// Capacity in 512-byte sectors.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    /// Whether the image is read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The path it was opened from (for logs).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The open file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Makes written data durable (`fdatasync`).
    pub fn flush(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    /// Deallocates `[offset, offset + len)` (`FALLOC_FL_PUNCH_HOLE`). Discard
    /// is advisory: a filesystem without hole punching makes it a no-op.
    pub fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        match self.fallocate(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            r => r,
        }
    }

    /// Zeroes `[offset, offset + len)`: punches a hole when `unmap` is allowed,
    /// else `FALLOC_FL_ZERO_RANGE`, falling back to writing zeros.
    pub fn write_zeroes(&self, offset: u64, len: u64, unmap: bool) -> std::io::Result<()> {
        let mode = if unmap {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        match self.fallocate(mode, offset, len) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                let zeros = vec![0u8; 64 * 1024];
                let mut done = 0u64;
                while done < len {
                    let n = (len - done).min(zeros.len() as u64) as usize;
                    self.file.write_all_at(&zeros[..n], offset + done)?;
                    done += n as u64;
                }
                Ok(())
            }
            r => r,
        }
    }

    fn fallocate(&self, mode: i32, offset: u64, len: u64) -> std::io::Result<()> {
        let (Ok(off), Ok(l)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(std::io::Error::from(ErrorKind::InvalidInput));
        };
        loop {
            // SAFETY: fallocate on an fd we own with plain integer arguments;
            // it touches no memory of this process.
            let r = unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off, l) };
            if r == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// A file at a position: `pread`/`pwrite` as vm-memory's `ReadVolatile` /
/// `WriteVolatile`, so `GuestMemory::read_exact_volatile_from(addr, &mut
/// FileAt, len)` moves image bytes straight into guest RAM **and marks the
/// destination in the region's dirty bitmap** (as vm-memory's own fd readers
/// do). The position advances by what was transferred.
#[derive(Debug)]
pub struct FileAt<'a> {
    /// The file.
    pub file: &'a File,
    /// Byte offset of the next transfer.
    pub offset: u64,
}

impl ReadVolatile for FileAt<'_> {
    fn read_volatile<B: BitmapSlice>(&mut self, buf: &mut VolatileSlice<B>) -> Result<usize, VolatileMemoryError> {
        let guard = buf.ptr_guard_mut();
        let mut done = 0usize;
        let result = loop {
            if done == buf.len() {
                break Ok(done);
            }
            let Ok(off) = i64::try_from(self.offset) else {
                break Err(VolatileMemoryError::IOError(ErrorKind::InvalidInput.into()));
            };
            // SAFETY: `guard` pins a VolatileSlice of `buf.len()` bytes of
            // mapped guest memory that is valid for writes while the guard
            // lives; we write at most `buf.len() - done` bytes from `done`.
            let n = unsafe {
                libc::pread64(
                    self.file.as_raw_fd(),
                    guard.as_ptr().add(done).cast::<libc::c_void>(),
                    buf.len() - done,
                    off,
                )
            };
            match n {
                0 => break Ok(done),
                n if n > 0 => {
                    done += n as usize;
                    self.offset += n as u64;
                }
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == ErrorKind::Interrupted {
                        continue;
                    }
                    break Err(VolatileMemoryError::IOError(e));
                }
            }
        };
        // The write into guest memory bypassed `Bytes`, so mark it here:
        // everything on error (a partial read may have happened), else what
        // was read. Marking after the copy is the order that cannot lose a
        // write to a concurrent harvest.
        match &result {
            Ok(n) => buf.bitmap().mark_dirty(0, *n),
            Err(_) => buf.bitmap().mark_dirty(0, buf.len()),
        }
        result
    }
}

impl WriteVolatile for FileAt<'_> {
    fn write_volatile<B: BitmapSlice>(&mut self, buf: &VolatileSlice<B>) -> Result<usize, VolatileMemoryError> {
        let guard = buf.ptr_guard();
        let mut done = 0usize;
        while done < buf.len() {
            let Ok(off) = i64::try_from(self.offset) else {
                return Err(VolatileMemoryError::IOError(ErrorKind::InvalidInput.into()));
            };
            // SAFETY: `guard` pins `buf.len()` readable bytes of mapped guest
            // memory; we read at most `buf.len() - done` bytes from `done`.
            let n = unsafe {
                libc::pwrite64(
                    self.file.as_raw_fd(),
                    guard.as_ptr().add(done).cast::<libc::c_void>(),
                    buf.len() - done,
                    off,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                return Err(VolatileMemoryError::IOError(e));
            }
            if n == 0 {
                return Err(VolatileMemoryError::IOError(ErrorKind::WriteZero.into()));
            }
            done += n as usize;
            self.offset += n as u64;
        }
        Ok(done)
    }
}
