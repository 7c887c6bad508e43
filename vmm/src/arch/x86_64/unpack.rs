//! A bzImage's compressed payload unpacked on the host, once, into the ELF
//! `vmlinux` it carries, and cached by the file's identity.
//!
//! A bzImage is a decompressor plus the compressed kernel. Booted as is,
//! the guest runs the decompressor on every boot: it reads the payload,
//! writes the whole kernel (~60 MiB for Debian's cloud kernel) and moves it
//! into place, all in fresh guest RAM. Unpacked once on the host, every
//! later boot loads the ELF kernel directly at its link address, as
//! Firecracker and Cloud Hypervisor boot a `vmlinux`. Only the LZ4 payload
//! (Debian's choice, `CONFIG_KERNEL_LZ4`) is unpacked; any other kernel
//! boots through its own decompressor, as before.
//!
//! The kernel file is hostile input: the payload's offsets are checked
//! against the file, each LZ4 block is bounded, the output is capped, and
//! the result must be an x86-64 executable ELF, or nothing is cached.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The LZ4 "legacy" frame's magic (`lz4 -l`, what the kernel's build uses).
pub const LZ4_LEGACY_MAGIC: u32 = 0x184c_2102;
/// A legacy frame's blocks each unpack to at most 8 MiB.
const LZ4_LEGACY_BLOCK: usize = 8 << 20;
/// LZ4_compressBound(8 MiB): no honest block is larger.
const LZ4_MAX_BLOCK_IN: usize = LZ4_LEGACY_BLOCK + LZ4_LEGACY_BLOCK / 255 + 16;
/// The most an unpacked kernel may be (a hostile payload stops here).
pub const MAX_UNPACKED: usize = 512 << 20;
/// Unpacked kernels kept in a cache directory; older ones are removed.
pub const KEEP: usize = 4;
/// Offsets in the setup header (boot protocol 2.08+).
const PAYLOAD_OFFSET: usize = 0x248;
const PAYLOAD_LENGTH: usize = 0x24c;
const SETUP_SECTS: usize = 0x1f1;
const VERSION: usize = 0x206;
const SUFFIX: &str = ".vmlinux";

fn le32(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}

/// The compressed payload of the bzImage open in `f` (`len` bytes), if it
/// is LZ4; `Ok(None)` for any other compression or an old boot protocol.
pub fn lz4_payload(f: &mut File, len: u64) -> Result<Option<Vec<u8>>, String> {
    let mut head = vec![0u8; 0x260];
    f.seek(SeekFrom::Start(0))
        .and_then(|_| f.read_exact(&mut head))
        .map_err(|e| format!("its setup header cannot be read: {e}"))?;
    let version = u16::from_le_bytes([head[VERSION], head[VERSION + 1]]);
    if version < 0x0208 {
        return Ok(None);
    }
    let sects = u64::from(if head[SETUP_SECTS] == 0 { 4 } else { head[SETUP_SECTS] });
    let (off, plen) = (
        le32(&head, PAYLOAD_OFFSET).unwrap_or(0),
        le32(&head, PAYLOAD_LENGTH).unwrap_or(0),
    );
    let start = (sects + 1) * 512 + u64::from(off);
    if plen < 8 || start.saturating_add(u64::from(plen)) > len {
        return Err(format!(
            "its payload ({plen} bytes at {start}) does not lie inside its {len} bytes"
        ));
    }
    let mut magic = [0u8; 4];
    f.seek(SeekFrom::Start(start))
        .and_then(|_| f.read_exact(&mut magic))
        .map_err(|e| format!("its payload cannot be read: {e}"))?;
    if u32::from_le_bytes(magic) != LZ4_LEGACY_MAGIC {
        return Ok(None);
    }
    let mut payload = vec![0u8; plen as usize];
    f.seek(SeekFrom::Start(start))
        .and_then(|_| f.read_exact(&mut payload))
        .map_err(|e| format!("its payload cannot be read: {e}"))?;
    Ok(Some(payload))
}

/// Unpacks an LZ4 legacy frame as the kernel's build writes it: the magic,
/// blocks of `[u32 size][LZ4 block]` (each unpacking to at most 8 MiB; the
/// magic may repeat between concatenated frames), and the unpacked size as
/// the last 4 bytes, which must match.
pub fn lz4_legacy(data: &[u8]) -> Result<Vec<u8>, String> {
    if le32(data, 0) != Some(LZ4_LEGACY_MAGIC) {
        return Err("the payload is not an LZ4 legacy frame".into());
    }
    let Some(body_end) = data.len().checked_sub(4) else {
        return Err("the payload is truncated".into());
    };
    let want = le32(data, body_end).unwrap_or(0) as usize;
    if want == 0 || want > MAX_UNPACKED {
        return Err(format!(
            "the payload says it unpacks to {want} bytes (at most {MAX_UNPACKED} are accepted)"
        ));
    }
    let mut out = vec![0u8; want];
    let (mut pos, mut filled) = (4usize, 0usize);
    while pos < body_end {
        let size = le32(data, pos).ok_or("a block header is truncated")? as usize;
        pos += 4;
        if size as u32 == LZ4_LEGACY_MAGIC {
            continue;
        }
        if size == 0 || size > LZ4_MAX_BLOCK_IN || size > body_end - pos {
            return Err(format!("a block of {size} bytes at offset {} is malformed", pos - 4));
        }
        let room = (want - filled).min(LZ4_LEGACY_BLOCK);
        let n = lz4_flex::block::decompress_into(&data[pos..pos + size], &mut out[filled..filled + room])
            .map_err(|e| format!("the block at offset {} does not unpack: {e}", pos - 4))?;
        filled += n;
        pos += size;
    }
    if filled != want {
        return Err(format!(
            "the payload unpacked to {filled} bytes, its trailer says {want}"
        ));
    }
    Ok(out)
}

/// The cache file's name: the kernel file's identity (device, inode, size,
/// modification and change times). A rewritten or replaced kernel gets a new
/// name; `ctime` cannot be set back by a file's owner.
fn cache_name(meta: &std::fs::Metadata) -> String {
    format!(
        "{:x}-{:x}-{:x}-{:x}.{:x}-{:x}.{:x}{SUFFIX}",
        meta.dev(),
        meta.ino(),
        meta.size(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ctime(),
        meta.ctime_nsec()
    )
}

/// An unpacked kernel: its cache path (for messages) and the file, open
/// (the loader reads this descriptor, so a concurrent eviction of the path
/// cannot take it away between the check and the load).
#[derive(Debug)]
pub struct Unpacked {
    /// Where it is cached.
    pub path: PathBuf,
    /// Open for reading.
    pub file: File,
}

/// The cache entry at `path`, open, if this process may trust it: a regular
/// file (not a link: `O_NOFOLLOW`) owned by this user that no one else can
/// write, checked on the open descriptor.
fn open_trusted(path: &Path) -> Option<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .ok()?;
    let m = f.metadata().ok()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    (m.file_type().is_file() && m.uid() == me && m.mode() & 0o022 == 0).then_some(f)
}

/// The unpacked ELF of bzImage `kernel` in `cache`: found there, or unpacked
/// now and written there. `Ok(None)`: the kernel's payload is not LZ4 (it
/// boots through its own decompressor). An error says why in one sentence;
/// the caller boots the bzImage instead and nothing is left behind.
pub fn unpacked(kernel: &Path, cache: &Path) -> Result<Option<Unpacked>, String> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(kernel)
        .map_err(|e| format!("cannot open {}: {e}", kernel.display()))?;
    let meta = f
        .metadata()
        .map_err(|e| format!("cannot stat {}: {e}", kernel.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", kernel.display()));
    }
    let path = cache.join(cache_name(&meta));
    if let Some(file) = open_trusted(&path) {
        return Ok(Some(Unpacked { path, file }));
    }
    let Some(payload) = lz4_payload(&mut f, meta.len()).map_err(|e| format!("{}: {e}", kernel.display()))? else {
        return Ok(None);
    };
    let elf = lz4_legacy(&payload).map_err(|e| format!("{}: {e}", kernel.display()))?;
    drop(payload);
    if elf.len() < 64 || !elf.starts_with(b"\x7fELF") || elf[4] != 2 || u16::from_le_bytes([elf[18], elf[19]]) != 62 {
        return Err(format!(
            "{}: its payload unpacks to something other than an x86-64 ELF kernel",
            kernel.display()
        ));
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(cache)
        .map_err(|e| format!("cannot create the kernel cache {}: {e}", cache.display()))?;
    // Unique per process and call: two VMs of one daemon may unpack the
    // same kernel at once (the second rename wins; both files are equal).
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = cache.join(format!(".{}.{}.{seq}.tmp", cache_name(&meta), std::process::id()));
    let written = (|| {
        let mut out = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        out.write_all(&elf)?;
        out.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        Ok::<File, std::io::Error>(out)
    })();
    let file = match written {
        Ok(f) => f,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(format!("cannot write {}: {e}", path.display()));
        }
    };
    evict(cache, &path);
    tracing::info!(
        "unpacked {} ({} MiB of LZ4) into {} ({} MiB)",
        kernel.display(),
        meta.len() >> 20,
        path.display(),
        elf.len() >> 20
    );
    Ok(Some(Unpacked { path, file }))
}

/// Keeps the [`KEEP`] most recently written kernels of `cache` (`keep` among
/// them) and removes the rest; leftovers of a crashed write go too.
fn evict(cache: &Path, keep: &Path) {
    let Ok(dir) = std::fs::read_dir(cache) else { return };
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = dir
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let m = e.metadata().ok()?;
            let stale_tmp = name.ends_with(".tmp")
                && m.modified()
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|a| a.as_secs() > 600);
            if stale_tmp {
                let _ = std::fs::remove_file(e.path());
                return None;
            }
            if !name.ends_with(SUFFIX) || e.path() == keep {
                return None;
            }
            Some((m.modified().ok()?, e.path()))
        })
        .collect();
    entries.sort();
    let excess = (entries.len() + 1).saturating_sub(KEEP);
    for (_, p) in entries.into_iter().take(excess) {
        if let Err(e) = std::fs::remove_file(&p) {
            tracing::warn!("cannot remove the old unpacked kernel {}: {e}", p.display());
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `data` as the kernel's build packs it: an LZ4 legacy frame of
    /// `block`-byte blocks (8 MiB in real kernels), then the unpacked size.
    pub(crate) fn pack(data: &[u8], block: usize) -> Vec<u8> {
        let mut out = LZ4_LEGACY_MAGIC.to_le_bytes().to_vec();
        for chunk in data.chunks(block) {
            let c = lz4_flex::block::compress(chunk);
            out.extend_from_slice(&(c.len() as u32).to_le_bytes());
            out.extend_from_slice(&c);
        }
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out
    }

    fn sample(n: usize) -> Vec<u8> {
        (0..n).map(|i| ((i / 7) % 251) as u8 ^ (i % 3) as u8).collect()
    }

    #[test]
    fn a_legacy_frame_unpacks_across_blocks_and_repeated_magics() {
        let data = sample(LZ4_LEGACY_BLOCK + 12_345);
        assert_eq!(lz4_legacy(&pack(&data, LZ4_LEGACY_BLOCK)).unwrap(), data);
        // Two frames back to back (the magic between them is skipped).
        let half = data.len() / 2;
        let mut two = pack(&data[..half], LZ4_LEGACY_BLOCK);
        two.truncate(two.len() - 4);
        let second = pack(&data[half..], LZ4_LEGACY_BLOCK);
        two.extend_from_slice(&second[..second.len() - 4]);
        two.extend_from_slice(&(data.len() as u32).to_le_bytes());
        assert_eq!(lz4_legacy(&two).unwrap(), data);
    }

    #[test]
    fn malformed_frames_are_refused_in_one_sentence() {
        let data = sample(100_000);
        let good = pack(&data, 4096);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"junk".to_vec(), "not an LZ4 legacy frame"),
            (
                {
                    let mut b = good.clone();
                    let n = b.len();
                    b[n - 4..].copy_from_slice(&99u32.to_le_bytes());
                    b
                },
                "unpack",
            ),
            (
                {
                    let mut b = good.clone();
                    let n = b.len();
                    b[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
                    b
                },
                "at most",
            ),
            (
                {
                    let mut b = good.clone();
                    b[4..8].copy_from_slice(&(1u32 << 30).to_le_bytes());
                    b
                },
                "malformed",
            ),
            (
                {
                    let mut b = good.clone();
                    b[4..8].copy_from_slice(&0u32.to_le_bytes());
                    b
                },
                "malformed",
            ),
            (
                {
                    let mut b = good.clone();
                    b.truncate(b.len() / 2);
                    b
                },
                "",
            ),
            (
                {
                    let mut b = good.clone();
                    let n = b.len();
                    b[n - 4..].copy_from_slice(&200_000u32.to_le_bytes());
                    b
                },
                "its trailer says 200000",
            ),
            (
                {
                    let mut b = good.clone();
                    for x in &mut b[8..40] {
                        *x = 0xff;
                    }
                    b
                },
                "",
            ),
        ];
        for (bytes, want) in cases {
            let e = lz4_legacy(&bytes).unwrap_err();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains('\n') && !e.ends_with('.'), "{e}");
        }
    }
}
