//! Cold snapshots on disk: the directory format, writing one so that neither
//! a reader nor a crash ever sees a mix of two, and verifying one completely
//! before anything of the restored VM exists (`docs/snapshots.md`).
//!
//! A snapshot is a directory of three regular files:
//! - `manifest.json`: the format name and version, a SHA-256 of its body, and
//!   the body: the VM's config and, per file, its name, size and one SHA-256
//!   per chunk (1 MiB; larger for RAM over 64 GiB, so that a manifest stays
//!   small);
//! - `state.json`: the machine state ([`MachineState`]);
//! - `memory`: guest RAM byte for byte, sparse (what the VM never wrote is a
//!   hole, and reads as zeros).
//!
//! Writing ([`write`]): the destination's parent is opened component by
//! component from `/` without following a symbolic link; the files are
//! created (0600, `O_EXCL|O_NOFOLLOW`) in a new temporary sibling directory
//! (0700) through `*at()` calls relative to it, each fsynced, then that
//! directory; then it is renamed into place (`renameat2`): with
//! `RENAME_NOREPLACE` for a new destination, with `RENAME_EXCHANGE` to replace
//! an existing snapshot (asked for explicitly), after which the old snapshot,
//! now under the temporary name, is removed. The parent is fsynced after the
//! rename. At every instant the destination is the old complete snapshot or
//! the new one; a crash leaves at worst a temporary sibling, removed by the
//! next snapshot written to that destination.
//!
//! Reading ([`open`]): the directory and its three files are opened without
//! following symbolic links and without blocking (a FIFO or a device is
//! refused after `fstat`, never read); the JSON files are size-bounded and
//! refused unread when too large; the format version, the manifest's own
//! checksum, the config (through create's validation), every size and every
//! chunk's checksum are checked, the memory file's as it is copied into the
//! new VM's memfd ([`Opened::copy_memory_into`]), so the guest gets exactly
//! the bytes that were verified.

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};
use thiserror::Error;

use super::memory::{GuestRam, PAGE, data_extents};
use super::persist::{self, MachineState};
use crate::config::VmConfig;

/// `manifest.json` in a snapshot directory.
pub const MANIFEST: &str = "manifest.json";
/// `state.json` in a snapshot directory: the machine state.
pub const STATE: &str = "state.json";
/// `memory` in a snapshot directory: guest RAM, byte for byte (sparse).
pub const MEMORY: &str = "memory";
/// The `format` field of the manifest and of the state file.
pub const FORMAT: &str = "k7d-snapshot";
/// The manifest's format version; any other is refused.
pub const VERSION: u32 = 1;
/// Largest `manifest.json` or `state.json` read (and written): 16 MiB.
pub const MAX_JSON_BYTES: u64 = 16 << 20;

/// Smallest checksum chunk (and the chunk of `state.json`).
const MIN_CHUNK: u64 = 1 << 20;
/// Most chunks per file a writer makes (the chunk grows past 64 GiB of RAM).
const MAX_CHUNKS: u64 = 1 << 16;
/// Largest chunk a reader accepts (bounds its buffer).
const MAX_CHUNK: u64 = 64 << 20;
/// Names a snapshot directory may hold; nothing else is ever removed. The
/// last one is what the format before manifests left while writing.
const SNAPSHOT_FILES: [&str; 4] = [MANIFEST, STATE, MEMORY, ".state.json.tmp"];
/// Marks a temporary sibling: `.<name>.k7d-tmp-<pid>-<n>`.
const TMP_TAG: &str = ".k7d-tmp-";

/// A snapshot directory refused, or a file operation on it that failed.
#[derive(Debug, Error)]
pub enum SnapshotError {
    /// The sentence names the path or file and why.
    #[error("{0}")]
    Refused(String),
    /// A file operation failed.
    #[error("{what}")]
    Io {
        /// What failed, naming the path.
        what: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

fn refused(msg: impl Into<String>) -> SnapshotError {
    SnapshotError::Refused(msg.into())
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> SnapshotError {
    let what = what.into();
    move |source| SnapshotError::Io { what, source }
}

/// The manifest's fields every version has (read first, to refuse an
/// unknown version before anything else is interpreted).
#[derive(Deserialize)]
struct Head {
    format: String,
    version: u32,
}

/// `manifest.json`, version 1.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    format: String,
    version: u32,
    /// SHA-256 of `body`'s exact bytes in the file.
    body_sha256: String,
    body: Box<RawValue>,
}

/// What the manifest's checksum covers.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    config: VmConfig,
    files: Vec<FileEntry>,
}

/// One file of the snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEntry {
    name: String,
    size: u64,
    chunk_bytes: u64,
    /// SHA-256 of each `chunk_bytes` of the file (the last may be shorter),
    /// lowercase hex.
    sha256: Vec<String>,
}

/// `state.json` as written.
#[derive(Serialize)]
struct StateOut<'a> {
    format: &'a str,
    version: u32,
    state: &'a MachineState,
}

/// `state.json` as read.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StateIn {
    format: String,
    version: u32,
    state: MachineState,
}

// ---------------------------------------------------------------------------
// Writing.

/// Writes a snapshot of a paused VM (`config` with its MACs pinned, `state`,
/// `ram`) to `dest`, an absolute path whose parent exists. An existing
/// `dest` is refused and left untouched unless `replace` is set and it is a
/// snapshot, which is then replaced atomically. Nothing is left behind on
/// failure.
pub(crate) fn write(
    dest: &Path,
    replace: bool,
    config: &VmConfig,
    state: &MachineState,
    ram: &GuestRam,
) -> Result<(), SnapshotError> {
    let t0 = Instant::now();
    let target = Target::open(dest)?;
    let existing = target.existing(replace)?;
    target.sweep_stale();
    let tmp = TempDir::create(&target)?;
    let mem = tmp.new_file(MEMORY)?;
    let chunk = chunk_for(ram.size());
    let mem_digests = write_memory(&mem, ram, chunk).map_err(io_err(format!(
        "cannot write guest memory to {}",
        tmp.path(MEMORY).display()
    )))?;
    mem.sync_all()
        .map_err(io_err(format!("cannot sync {}", tmp.path(MEMORY).display())))?;
    drop(mem);
    let state_json = serde_json::to_vec(&StateOut {
        format: FORMAT,
        version: persist::STATE_VERSION,
        state,
    })
    .map_err(|e| refused(format!("the machine state cannot be written as JSON: {e}")))?;
    if state_json.len() as u64 > MAX_JSON_BYTES {
        return Err(refused(format!(
            "the machine state is {} bytes as JSON, more than the {MAX_JSON_BYTES} bytes a snapshot's {STATE} may have",
            state_json.len()
        )));
    }
    tmp.write_file(STATE, &state_json)?;
    let manifest = manifest_bytes(config, &state_json, ram.size(), chunk, mem_digests)?;
    tmp.write_file(MANIFEST, &manifest)?;
    tmp.dir
        .sync()
        .map_err(io_err(format!("cannot sync {}", tmp.path("").display())))?;
    tmp.commit(existing)?;
    tracing::debug!(
        dest = %dest.display(),
        replaced = existing,
        elapsed_us = t0.elapsed().as_micros() as u64,
        "snapshot written"
    );
    Ok(())
}

/// `manifest.json`'s bytes for a snapshot of `config` whose `state.json` is
/// `state_json` and whose memory file is `memory_size` bytes in chunks of
/// `chunk` with these checksums. Public for the fuzz targets, which build
/// well-formed manifests around arbitrary state files.
pub fn manifest_bytes(
    config: &VmConfig,
    state_json: &[u8],
    memory_size: u64,
    chunk: u64,
    memory_sha256: Vec<String>,
) -> Result<Vec<u8>, SnapshotError> {
    let body = Body {
        config: config.clone(),
        files: vec![
            FileEntry {
                name: STATE.into(),
                size: state_json.len() as u64,
                chunk_bytes: MIN_CHUNK,
                sha256: state_json.chunks(MIN_CHUNK as usize).map(sha256_hex).collect(),
            },
            FileEntry {
                name: MEMORY.into(),
                size: memory_size,
                chunk_bytes: chunk,
                sha256: memory_sha256,
            },
        ],
    };
    let body = serde_json::to_string(&body).map_err(|e| refused(format!("the manifest cannot be written: {e}")))?;
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        body_sha256: sha256_hex(body.as_bytes()),
        body: RawValue::from_string(body).map_err(|e| refused(format!("the manifest cannot be written: {e}")))?,
    };
    let manifest =
        serde_json::to_vec(&manifest).map_err(|e| refused(format!("the manifest cannot be written: {e}")))?;
    if manifest.len() as u64 > MAX_JSON_BYTES {
        return Err(refused(format!(
            "the manifest is {} bytes, more than the {MAX_JSON_BYTES} bytes a snapshot's {MANIFEST} may have",
            manifest.len()
        )));
    }
    Ok(manifest)
}

/// The zero chunk's checksums for a memory file of `size` bytes in chunks of
/// [`chunk_for`]`(size)`: what a never-written guest's snapshot lists.
/// Public for the fuzz targets.
pub fn zero_memory_digests(size: u64) -> (u64, Vec<String>) {
    let chunk = chunk_for(size);
    let n = size.div_ceil(chunk) as usize;
    let digests = (0..n)
        .map(|c| {
            let r = chunk_range(c, chunk, size);
            zero_digest((r.end - r.start) as usize)
        })
        .collect();
    (chunk, digests)
}

/// The chunk size for a file of `size` bytes: 1 MiB, doubled until at most
/// [`MAX_CHUNKS`] chunks cover the file.
fn chunk_for(size: u64) -> u64 {
    let mut c = MIN_CHUNK;
    while size.div_ceil(c) > MAX_CHUNKS {
        c *= 2;
    }
    c
}

/// Byte range of chunk `c`.
fn chunk_range(c: usize, chunk: u64, size: u64) -> Range<u64> {
    let start = c as u64 * chunk;
    start..(start + chunk).min(size)
}

/// Marks the chunks of `[0, size)` that any of `extents` touches.
fn data_chunks(size: u64, chunk: u64, extents: impl Iterator<Item = Range<u64>>) -> Vec<bool> {
    let mut v = vec![false; size.div_ceil(chunk) as usize];
    for e in extents {
        let first = (e.start / chunk) as usize;
        let last = (e.end.saturating_sub(1) / chunk) as usize;
        for b in v.iter_mut().take(last + 1).skip(first) {
            *b = true;
        }
    }
    v
}

/// Writes RAM into `dst` (sized to the RAM, sparse) and returns each chunk's
/// checksum. Only chunks that hold data are read: the memfd's data extents
/// (`SEEK_DATA`) and, after a fork, the chunks of the pages this VM wrote
/// privately since. Nothing is read through the guest mapping that the VM
/// has not written, so taking a snapshot allocates no guest page.
fn write_memory(dst: &File, ram: &GuestRam, chunk: u64) -> io::Result<Vec<String>> {
    let size = ram.size();
    dst.set_len(size)?;
    let memfd = ram.memfd();
    let mut data = data_chunks(size, chunk, data_extents(&memfd, size));
    if ram.is_frozen() {
        for p in ram.diverged_pages() {
            if let Some(b) = data.get_mut((p * PAGE / chunk) as usize) {
                *b = true;
            }
        }
    }
    let mut buf = vec![0u8; chunk as usize];
    let mut digests = Vec::with_capacity(data.len());
    for (c, has_data) in data.iter().enumerate() {
        let r = chunk_range(c, chunk, size);
        let len = (r.end - r.start) as usize;
        if !has_data {
            digests.push(zero_digest(len));
            continue;
        }
        let b = &mut buf[..len];
        ram.read_as_seen(r.start, b)?;
        digests.push(sha256_hex(b));
        write_nonzero_pages(dst, b, r.start)?;
    }
    Ok(digests)
}

/// Writes the pages of `buf` (at file offset `at`) that are not all zeros,
/// each run of them with one write: zero pages stay holes in `dst`.
pub(crate) fn write_nonzero_pages(dst: &File, buf: &[u8], at: u64) -> io::Result<()> {
    let page = PAGE as usize;
    let zero = |i: usize| buf[i..(i + page).min(buf.len())].iter().fold(0u8, |a, &b| a | b) == 0;
    let mut i = 0;
    while i < buf.len() {
        if zero(i) {
            i += page;
            continue;
        }
        let start = i;
        while i < buf.len() && !zero(i) {
            i += page;
        }
        dst.write_all_at(&buf[start..i.min(buf.len())], at + start as u64)?;
    }
    Ok(())
}

/// Copies `len` bytes from `src` into `dst` through the sparse walk: only
/// `src`'s data extents are read and only nonzero pages written, so holes
/// stay holes (the memfd of a VM restored from another's RAM file).
pub(crate) fn copy_sparse(src: &File, dst: &File, len: u64) -> Result<(), SnapshotError> {
    let mut buf = vec![0u8; MIN_CHUNK as usize];
    for e in data_extents(src, len) {
        let mut at = e.start;
        while at < e.end {
            let n = (e.end - at).min(MIN_CHUNK) as usize;
            src.read_exact_at(&mut buf[..n], at)
                .map_err(io_err("cannot read the saved guest memory"))?;
            write_nonzero_pages(dst, &buf[..n], at).map_err(io_err("cannot write the restored guest memory"))?;
            at += n as u64;
        }
    }
    Ok(())
}

/// The destination: its parent (opened without following a link) and name.
struct Target {
    parent: Dir,
    name: OsString,
    path: PathBuf,
}

impl Target {
    fn open(dest: &Path) -> Result<Self, SnapshotError> {
        let parts = components(dest)?;
        let Some((name, parents)) = parts.split_last() else {
            return Err(refused(format!(
                "snapshot path `{}` names no directory to write",
                dest.display()
            )));
        };
        Ok(Self {
            parent: walk(parents)?,
            name: name.to_os_string(),
            path: dest.to_path_buf(),
        })
    }

    /// Whether the destination exists (and may be replaced); refuses what
    /// may not be written over.
    fn existing(&self, replace: bool) -> Result<bool, SnapshotError> {
        let shown = self.path.display();
        let st = self
            .parent
            .lstat(&self.name)
            .map_err(io_err(format!("cannot look at {shown}")))?;
        let Some(st) = st else { return Ok(false) };
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {}
            libc::S_IFLNK => {
                return Err(refused(format!(
                    "{shown} is a symbolic link; a snapshot is written only to a path without one"
                )));
            }
            m => {
                return Err(refused(format!(
                    "{shown} exists and is {}, not a snapshot directory",
                    kind(m)
                )));
            }
        }
        if !replace {
            return Err(refused(format!(
                "{shown} already exists; a snapshot is written over another only when replacing it is asked for"
            )));
        }
        let d = self
            .parent
            .open_dir(&self.name)
            .map_err(io_err(format!("cannot open {shown}")))?;
        let regular =
            |f: &str| matches!(d.lstat(OsStr::new(f)), Ok(Some(st)) if st.st_mode & libc::S_IFMT == libc::S_IFREG);
        // A snapshot of this format has its manifest; one of the format
        // before it has both its state and its memory. Any other directory
        // (one that merely holds a state.json) is never replaced.
        let is_snapshot = regular(MANIFEST) || (regular(STATE) && regular(MEMORY));
        if !is_snapshot {
            return Err(refused(format!(
                "{shown} exists and is not a k7d snapshot (it has neither {MANIFEST} nor both {STATE} and {MEMORY}), so it is not replaced"
            )));
        }
        Ok(true)
    }

    /// The prefix of this destination's temporary siblings.
    fn tmp_prefix(&self) -> Vec<u8> {
        let mut v = b".".to_vec();
        v.extend_from_slice(self.name.as_bytes());
        v.extend_from_slice(TMP_TAG.as_bytes());
        v
    }

    /// Removes the temporary siblings that writers which died (their pid is
    /// gone) left for this destination: a half-written snapshot, or an old
    /// one a replace had not finished removing.
    fn sweep_stale(&self) {
        let prefix = self.tmp_prefix();
        let names = match self.parent.names() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(dest = %self.path.display(), error = %e, "cannot list the snapshot's parent for leftovers");
                return;
            }
        };
        for n in names {
            let Some(rest) = n.as_bytes().strip_prefix(prefix.as_slice()) else {
                continue;
            };
            let pid = rest
                .split(|&b| b == b'-')
                .next()
                .and_then(|p| std::str::from_utf8(p).ok())
                .and_then(|p| p.parse::<u32>().ok());
            match pid {
                Some(pid) if !crate::sys::pid_alive(pid) => match remove_snapshot_dir(&self.parent, &n) {
                    Ok(()) => tracing::info!(
                        dest = %self.path.display(),
                        leftover = %n.to_string_lossy(),
                        "removed what an interrupted snapshot left"
                    ),
                    Err(e) => tracing::warn!(
                        dest = %self.path.display(),
                        leftover = %n.to_string_lossy(),
                        error = %e,
                        "cannot remove what an interrupted snapshot left"
                    ),
                },
                _ => {}
            }
        }
    }
}

/// A new temporary sibling of the destination; removed on drop unless
/// committed.
struct TempDir<'a> {
    target: &'a Target,
    name: OsString,
    dir: Dir,
    /// Moved into place: nothing to remove.
    committed: bool,
    /// Exchanged: the name holds the replaced snapshot, to remove.
    holds_old: bool,
}

impl<'a> TempDir<'a> {
    fn create(target: &'a Target) -> Result<Self, SnapshotError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let mut name = target.tmp_prefix();
        name.extend_from_slice(format!("{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)).as_bytes());
        let name = OsString::from_vec(name);
        let shown = target.path.with_file_name(&name);
        target
            .parent
            .mkdir(&name, 0o700)
            .map_err(io_err(format!("cannot create {}", shown.display())))?;
        let dir = match target.parent.open_dir(&name) {
            Ok(d) => d,
            Err(e) => {
                let _ = target.parent.rmdir(&name);
                return Err(io_err(format!("cannot open {}", shown.display()))(e));
            }
        };
        let tmp = Self {
            target,
            name,
            dir,
            committed: false,
            holds_old: false,
        };
        // Exactly 0700 whatever the umask (Drop removes it on failure).
        tmp.dir
            .chmod(0o700)
            .map_err(io_err(format!("cannot set the mode of {}", shown.display())))?;
        Ok(tmp)
    }

    fn path(&self, file: &str) -> PathBuf {
        self.target.path.with_file_name(&self.name).join(file)
    }

    /// Creates `file` in the temporary directory: 0600, exclusively, not
    /// through a link.
    fn new_file(&self, file: &str) -> Result<File, SnapshotError> {
        let shown = self.path(file);
        let fd = self
            .dir
            .openat(OsStr::new(file), libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o600)
            .map_err(io_err(format!("cannot create {}", shown.display())))?;
        let f = File::from(fd);
        {
            use std::os::unix::fs::PermissionsExt;
            f.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(io_err(format!("cannot set the mode of {}", shown.display())))?;
        }
        Ok(f)
    }

    fn write_file(&self, file: &str, bytes: &[u8]) -> Result<(), SnapshotError> {
        let shown = self.path(file);
        let mut f = self.new_file(file)?;
        f.write_all(bytes)
            .map_err(io_err(format!("cannot write {}", shown.display())))?;
        f.sync_all().map_err(io_err(format!("cannot sync {}", shown.display())))
    }

    /// Renames the directory into place: exchanged with the existing
    /// snapshot, or moved where nothing is. The parent is synced after, and
    /// an exchanged old snapshot removed.
    fn commit(mut self, existing: bool) -> Result<(), SnapshotError> {
        let t = self.target;
        let shown = t.path.display();
        let parent_shown = t.path.parent().unwrap_or(Path::new("/")).display().to_string();
        let mut exchanged = false;
        if existing {
            match t.parent.rename(&self.name, &t.name, libc::RENAME_EXCHANGE) {
                Ok(()) => {
                    exchanged = true;
                    self.holds_old = true;
                }
                // Gone since it was looked at: nothing to exchange with.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    return Err(refused(format!(
                        "the file system of {parent_shown} cannot exchange two directories atomically (RENAME_EXCHANGE), so {shown} is not replaced; remove it first"
                    )));
                }
                Err(e) => return Err(io_err(format!("cannot replace {shown}"))(e)),
            }
        }
        if !exchanged {
            match t.parent.rename(&self.name, &t.name, libc::RENAME_NOREPLACE) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                    return Err(refused(format!(
                        "{shown} appeared while the snapshot was being written; it was left as it is"
                    )));
                }
                Err(e) => return Err(io_err(format!("cannot move the snapshot into {shown}"))(e)),
            }
            self.committed = true;
        }
        t.parent.sync().map_err(io_err(format!("cannot sync {parent_shown}")))?;
        // Exchanged: the old snapshot is under the temporary name now; Drop
        // removes it (a crash before leaves it for the next writer's sweep).
        Ok(())
    }
}

impl Drop for TempDir<'_> {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        if let Err(e) = remove_snapshot_dir(&self.target.parent, &self.name) {
            let leftover = self.target.path.with_file_name(&self.name);
            if self.holds_old {
                tracing::warn!(leftover = %leftover.display(), error = %e, "the replaced snapshot could not be removed");
            } else {
                tracing::warn!(leftover = %leftover.display(), error = %e, "cannot remove a snapshot's temporary directory");
            }
        }
    }
}

/// Removes the directory `name` in `parent` and the snapshot files in it
/// (only those names: a link among them is removed, not followed; anything
/// else makes the final `rmdir` fail and the directory stay).
fn remove_snapshot_dir(parent: &Dir, name: &OsStr) -> io::Result<()> {
    let d = parent.open_dir(name)?;
    for f in SNAPSHOT_FILES {
        match d.unlink(OsStr::new(f)) {
            Err(e) if e.raw_os_error() != Some(libc::ENOENT) => return Err(e),
            _ => {}
        }
    }
    drop(d);
    parent.rmdir(name)
}

// ---------------------------------------------------------------------------
// Reading.

/// A snapshot whose every part but the memory file's checksums is verified;
/// those are verified by [`Opened::copy_memory_into`].
pub(crate) struct Opened {
    /// The saved config, its id replaced by the new VM's; valid.
    pub config: VmConfig,
    /// The machine state; it fits the config.
    pub state: MachineState,
    memory: File,
    memory_entry: FileEntry,
    memory_path: PathBuf,
}

/// Opens and verifies the snapshot in `dir` for a VM to be called `id`.
pub(crate) fn open(dir: &Path, id: &str) -> Result<Opened, SnapshotError> {
    let d = walk(&components(dir)?)?;
    let path = |f: &str| dir.join(f);
    // All three files are opened before any is read: a replace that removes
    // this (then old) snapshot's files later cannot change what is read.
    let manifest_f = open_regular(&d, dir, MANIFEST)?;
    let state_f = open_regular(&d, dir, STATE)?;
    let memory_f = open_regular(&d, dir, MEMORY)?;
    if state_f.1 > MAX_JSON_BYTES {
        return Err(too_big(&path(STATE), state_f.1));
    }
    let manifest_bytes = read_bounded(&manifest_f.0, manifest_f.1, &path(MANIFEST))?;
    let state_bytes = read_bounded(&state_f.0, state_f.1, &path(STATE))?;
    let v = verify(dir, id, &manifest_bytes, &state_bytes, memory_f.1)?;
    Ok(Opened {
        config: v.config,
        state: v.state,
        memory: memory_f.0,
        memory_entry: v.memory_entry,
        memory_path: path(MEMORY),
    })
}

/// What [`verify`] found good.
struct Verified {
    config: VmConfig,
    state: MachineState,
    memory_entry: FileEntry,
}

/// [`open`]'s checks on bytes alone (`memory_len`: the memory file's size),
/// for the fuzz targets: `Ok` only for a snapshot `open` would accept.
pub fn verify_bytes(dir: &Path, id: &str, manifest: &[u8], state: &[u8], memory_len: u64) -> Result<(), SnapshotError> {
    verify(dir, id, manifest, state, memory_len).map(|_| ())
}

/// What [`open`] checks of a snapshot in `dir` once its JSON files are read:
/// the manifest (format, version, its checksum, its entries), the config as
/// create checks it (with `id`), each size against the manifest, `state.json`
/// against its checksums, its format and version, and the state against the
/// config. Nothing here touches a file: the fuzz target
/// `snapshot_verify` drives it through [`verify_bytes`].
fn verify(
    dir: &Path,
    id: &str,
    manifest: &[u8],
    state_bytes: &[u8],
    memory_len: u64,
) -> Result<Verified, SnapshotError> {
    let path = |f: &str| dir.join(f);
    let (mut config, mut entries) = parse_manifest(manifest, &path(MANIFEST))?;
    let state_entry = entries
        .remove(STATE)
        .ok_or_else(|| refused(format!("{} lists no {STATE}", path(MANIFEST).display())))?;
    let memory_entry = entries
        .remove(MEMORY)
        .ok_or_else(|| refused(format!("{} lists no {MEMORY}", path(MANIFEST).display())))?;

    config.id = Some(id.to_string());
    config
        .validate_restored()
        .map_err(|e| refused(format!("the config in {} is refused: {e}", path(MANIFEST).display())))?;
    if memory_entry.size != config.memory_bytes() {
        return Err(refused(format!(
            "{} says {MEMORY} is {} bytes, but the config's RAM is {} MiB ({} bytes)",
            path(MANIFEST).display(),
            memory_entry.size,
            config.memory_mib,
            config.memory_bytes()
        )));
    }
    check_size(state_bytes.len() as u64, &state_entry, &path(STATE))?;
    check_size(memory_len, &memory_entry, &path(MEMORY))?;

    let chunks = state_bytes.chunks(state_entry.chunk_bytes as usize);
    if chunks.len() != state_entry.sha256.len() {
        return Err(refused(format!(
            "{} lists {} checksums for {STATE}, which has {} chunks",
            path(MANIFEST).display(),
            state_entry.sha256.len(),
            chunks.len()
        )));
    }
    for (c, (chunk, want)) in chunks.zip(&state_entry.sha256).enumerate() {
        if sha256_hex(chunk) != *want {
            return Err(mismatch(
                &path(STATE),
                chunk_range(c, state_entry.chunk_bytes, state_entry.size),
            ));
        }
    }
    let state: StateIn = serde_json::from_slice(state_bytes)
        .map_err(|e| refused(format!("{} is not a k7d snapshot state: {e}", path(STATE).display())))?;
    if state.format != FORMAT || state.version != persist::STATE_VERSION {
        return Err(refused(format!(
            "{} is `{}` version {}, this k7d reads `{FORMAT}` version {}",
            path(STATE).display(),
            state.format,
            state.version,
            persist::STATE_VERSION
        )));
    }
    persist::check_fits(&config, &state.state)
        .map_err(|e| refused(format!("{} does not fit its config: {e}", path(STATE).display())))?;
    Ok(Verified {
        config,
        state: state.state,
        memory_entry,
    })
}

impl Opened {
    /// Copies the memory file into `ram` (a fresh memfd of the config's
    /// size) through the sparse walk, verifying each chunk's checksum on the
    /// bytes copied: a chunk with no data in the file must be the zero
    /// chunk's; the first mismatch is refused naming its byte range.
    pub(crate) fn copy_memory_into(&self, ram: &GuestRam) -> Result<(), SnapshotError> {
        let e = &self.memory_entry;
        let shown = self.memory_path.display();
        if ram.size() != e.size {
            return Err(refused(format!(
                "{shown} is {} bytes, the new VM's RAM {}",
                e.size,
                ram.size()
            )));
        }
        let data = data_chunks(e.size, e.chunk_bytes, data_extents(&self.memory, e.size));
        let mut buf = vec![0u8; e.chunk_bytes as usize];
        for (c, has_data) in data.iter().enumerate() {
            let r = chunk_range(c, e.chunk_bytes, e.size);
            let len = (r.end - r.start) as usize;
            if !has_data {
                if zero_digest(len) != e.sha256[c] {
                    return Err(mismatch(&self.memory_path, r));
                }
                continue;
            }
            let b = &mut buf[..len];
            self.memory
                .read_exact_at(b, r.start)
                .map_err(io_err(format!("cannot read {shown}")))?;
            if sha256_hex(b) != e.sha256[c] {
                return Err(mismatch(&self.memory_path, r));
            }
            write_nonzero_pages(&ram.memfd(), b, r.start).map_err(io_err("cannot write the restored guest memory"))?;
        }
        Ok(())
    }
}

fn mismatch(file: &Path, r: Range<u64>) -> SnapshotError {
    refused(format!(
        "{}: bytes {:#x} to {:#x} do not match the manifest's checksum (the snapshot is damaged or was changed)",
        file.display(),
        r.start,
        r.end.saturating_sub(1)
    ))
}

/// Checks `manifest.json`'s bytes: format, version, its body's
/// checksum, the body, and each file entry's shape. Returns the config and
/// the entries by name.
fn parse_manifest(
    bytes: &[u8],
    shown: &Path,
) -> Result<(VmConfig, std::collections::HashMap<String, FileEntry>), SnapshotError> {
    let s = shown.display();
    let head: Head =
        serde_json::from_slice(bytes).map_err(|e| refused(format!("{s} is not a k7d snapshot manifest: {e}")))?;
    if head.format != FORMAT {
        return Err(refused(format!("{s} has format `{}`, not `{FORMAT}`", head.format)));
    }
    if head.version != VERSION {
        return Err(refused(format!(
            "{s} is format version {}; this k7d reads version {VERSION} only",
            head.version
        )));
    }
    let m: Manifest = serde_json::from_slice(bytes).map_err(|e| refused(format!("{s} is damaged: {e}")))?;
    if sha256_hex(m.body.get().as_bytes()) != m.body_sha256 {
        return Err(refused(format!(
            "{s} is damaged: its body does not match its own checksum"
        )));
    }
    let body: Body =
        serde_json::from_str(m.body.get()).map_err(|e| refused(format!("{s} has an unreadable body: {e}")))?;
    let mut entries = std::collections::HashMap::new();
    for e in body.files {
        if e.name != STATE && e.name != MEMORY {
            return Err(refused(format!("{s} lists an unknown file `{}`", e.name)));
        }
        if !e.chunk_bytes.is_power_of_two() || !(PAGE..=MAX_CHUNK).contains(&e.chunk_bytes) {
            return Err(refused(format!(
                "{s} gives {} a chunk of {} bytes; a chunk is a power of two from {PAGE} to {MAX_CHUNK} bytes",
                e.name, e.chunk_bytes
            )));
        }
        if e.sha256.len() as u64 != e.size.div_ceil(e.chunk_bytes) {
            return Err(refused(format!(
                "{s} gives {} {} checksums for {} bytes in chunks of {}",
                e.name,
                e.sha256.len(),
                e.size,
                e.chunk_bytes
            )));
        }
        if let Some(bad) = e.sha256.iter().find(|h| !is_sha256_hex(h)) {
            return Err(refused(format!(
                "{s} gives {} a checksum `{bad}` that is not 64 lowercase hex digits",
                e.name
            )));
        }
        let name = e.name.clone();
        if entries.insert(name.clone(), e).is_some() {
            return Err(refused(format!("{s} lists {name} twice")));
        }
    }
    Ok((body.config, entries))
}

/// Refuses a file whose size is not the manifest's.
fn check_size(len: u64, e: &FileEntry, shown: &Path) -> Result<(), SnapshotError> {
    if len != e.size {
        return Err(refused(format!(
            "{} is {} bytes, the manifest says {}",
            shown.display(),
            len,
            e.size
        )));
    }
    Ok(())
}

/// Reads a JSON file of `size` bytes (by `fstat`), refusing it unread when
/// over [`MAX_JSON_BYTES`] (and refusing it if it grew past the bound).
fn read_bounded(f: &File, size: u64, shown: &Path) -> Result<Vec<u8>, SnapshotError> {
    if size > MAX_JSON_BYTES {
        return Err(too_big(shown, size));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    // One byte more than `fstat` said: a file that grew (or shrank) after it
    // was checked is refused, never read past its checked size.
    f.take(size + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err(format!("cannot read {}", shown.display())))?;
    if bytes.len() as u64 != size {
        return Err(refused(format!(
            "{} changed size while it was read ({size} bytes when checked)",
            shown.display()
        )));
    }
    Ok(bytes)
}

fn too_big(shown: &Path, n: u64) -> SnapshotError {
    refused(format!(
        "{} is {n} bytes, more than the {MAX_JSON_BYTES} bytes it may have; it was not read",
        shown.display()
    ))
}

/// Opens `name` in `d` (the directory at `dir`) for reading if it is a
/// regular file: looked at first without following a link (a FIFO, device,
/// socket or link is refused without being opened), then opened with
/// `O_NOFOLLOW|O_NONBLOCK` (so a file swapped for a FIFO in between does not
/// block the open either) and checked again with `fstat`. Returns the file
/// and its size.
fn open_regular(d: &Dir, dir: &Path, name: &str) -> Result<(File, u64), SnapshotError> {
    let shown = dir.join(name);
    let s = shown.display();
    let pre = d
        .lstat(OsStr::new(name))
        .map_err(io_err(format!("cannot look at {s}")))?;
    let Some(pre) = pre else {
        return Err(if name == MANIFEST {
            refused(format!(
                "{} is not a k7d snapshot: it has no {MANIFEST} (a snapshot directory holds {MANIFEST}, {STATE} and {MEMORY})",
                dir.display()
            ))
        } else {
            refused(format!("{s} is missing"))
        });
    };
    let not_regular =
        |mode: libc::mode_t| refused(format!("{s} is {}, not a regular file; it was not read", kind(mode)));
    if pre.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(not_regular(pre.st_mode));
    }
    let fd = d
        .openat(OsStr::new(name), libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY, 0)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                not_regular(libc::S_IFLNK)
            } else {
                io_err(format!("cannot open {s}"))(e)
            }
        })?;
    let st = fstat(&fd).map_err(io_err(format!("cannot stat {s}")))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(not_regular(st.st_mode));
    }
    if (st.st_dev, st.st_ino) != (pre.st_dev, pre.st_ino) {
        return Err(refused(format!("{s} changed while it was being opened")));
    }
    Ok((File::from(fd), u64::try_from(st.st_size).unwrap_or(0)))
}

// ---------------------------------------------------------------------------
// Checksums.

fn sha256_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in d.iter() {
        use std::fmt::Write as _;
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The checksum of `len` zero bytes (the 1 MiB one is computed once).
fn zero_digest(len: usize) -> String {
    static MIB: OnceLock<String> = OnceLock::new();
    if len as u64 == MIN_CHUNK {
        return MIB.get_or_init(|| sha256_hex(&vec![0u8; len])).clone();
    }
    sha256_hex(&vec![0u8; len])
}

// ---------------------------------------------------------------------------
// Paths, walked without following a symbolic link.

/// The components of an absolute path without `..`; refuses anything else.
fn components(path: &Path) -> Result<Vec<&OsStr>, SnapshotError> {
    if !path.is_absolute() {
        return Err(refused(format!(
            "snapshot path `{}` is relative; give an absolute path (the daemon does not share the caller's working directory)",
            path.display()
        )));
    }
    let mut parts = Vec::new();
    for c in path.components() {
        match c {
            Component::RootDir => {}
            Component::Normal(n) => parts.push(n),
            Component::ParentDir => {
                return Err(refused(format!(
                    "snapshot path `{}` contains `..`; give it without",
                    path.display()
                )));
            }
            Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(parts)
}

/// Opens the directory `/parts[0]/parts[1]/...` one component at a time with
/// `O_NOFOLLOW`: a symbolic link anywhere on the way is refused.
fn walk(parts: &[&OsStr]) -> Result<Dir, SnapshotError> {
    let mut dir = Dir::root().map_err(io_err("cannot open /"))?;
    let mut shown = PathBuf::from("/");
    for p in parts {
        shown.push(p);
        let next = match dir.open_dir(p) {
            Ok(d) => d,
            Err(e) => {
                let s = shown.display();
                let st = dir.lstat(p).ok().flatten();
                return Err(match st.map(|st| st.st_mode & libc::S_IFMT) {
                    None => refused(format!("{s} does not exist")),
                    Some(libc::S_IFLNK) => refused(format!(
                        "{s} is a symbolic link; snapshot paths are walked without following one (give the path with the link resolved)"
                    )),
                    Some(libc::S_IFDIR) => io_err(format!("cannot open {s}"))(e),
                    Some(m) => refused(format!("{s} is {}, not a directory", kind(m))),
                });
            }
        };
        dir = next;
    }
    Ok(dir)
}

/// What kind of file a mode says, as a phrase.
fn kind(mode: libc::mode_t) -> &'static str {
    match mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        _ => "a file of unknown kind",
    }
}

/// An open directory; every operation is relative to it and follows no
/// symbolic link in the name it is given.
struct Dir {
    fd: OwnedFd,
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn c_name(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a name has a NUL byte"))
}

fn fstat(fd: &impl AsRawFd) -> io::Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `fd` is open; `st` is a valid out pointer for one `stat`.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: fstat succeeded, so it filled `st`.
    Ok(unsafe { st.assume_init() })
}

impl Dir {
    fn root() -> io::Result<Self> {
        // SAFETY: a NUL-terminated path literal and valid flags.
        let fd = cvt(unsafe { libc::open(c"/".as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) })?;
        // SAFETY: `fd` was just opened and belongs to nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { fd })
    }

    /// `openat(name, flags | O_NOFOLLOW | O_CLOEXEC, mode)`.
    fn openat(&self, name: &OsStr, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
        let c = c_name(name)?;
        // SAFETY: `self.fd` is an open directory and `c` NUL-terminated; the
        // mode is passed as the variadic argument openat reads with O_CREAT.
        let fd = cvt(unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                libc::c_uint::from(mode),
            )
        })?;
        // SAFETY: `fd` was just opened and belongs to nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn open_dir(&self, name: &OsStr) -> io::Result<Dir> {
        self.openat(name, libc::O_RDONLY | libc::O_DIRECTORY, 0)
            .map(|fd| Dir { fd })
    }

    /// `fstatat(name, AT_SYMLINK_NOFOLLOW)`; `None` when it does not exist.
    fn lstat(&self, name: &OsStr) -> io::Result<Option<libc::stat>> {
        let c = c_name(name)?;
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: `self.fd` is an open directory, `c` NUL-terminated, `st` a
        // valid out pointer for one `stat`.
        let rc = unsafe {
            libc::fstatat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                st.as_mut_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return if e.raw_os_error() == Some(libc::ENOENT) {
                Ok(None)
            } else {
                Err(e)
            };
        }
        // SAFETY: fstatat succeeded, so it filled `st`.
        Ok(Some(unsafe { st.assume_init() }))
    }

    fn mkdir(&self, name: &OsStr, mode: libc::mode_t) -> io::Result<()> {
        let c = c_name(name)?;
        // SAFETY: `self.fd` is an open directory and `c` NUL-terminated.
        cvt(unsafe { libc::mkdirat(self.fd.as_raw_fd(), c.as_ptr(), mode) }).map(drop)
    }

    /// `renameat2` within this directory.
    fn rename(&self, from: &OsStr, to: &OsStr, flags: libc::c_uint) -> io::Result<()> {
        let (f, t) = (c_name(from)?, c_name(to)?);
        let fd = self.fd.as_raw_fd();
        // SAFETY: `fd` is an open directory, both names NUL-terminated.
        cvt(unsafe { libc::renameat2(fd, f.as_ptr(), fd, t.as_ptr(), flags) }).map(drop)
    }

    fn unlink(&self, name: &OsStr) -> io::Result<()> {
        let c = c_name(name)?;
        // SAFETY: `self.fd` is an open directory and `c` NUL-terminated.
        cvt(unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) }).map(drop)
    }

    fn rmdir(&self, name: &OsStr) -> io::Result<()> {
        let c = c_name(name)?;
        // SAFETY: `self.fd` is an open directory and `c` NUL-terminated.
        cvt(unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), libc::AT_REMOVEDIR) }).map(drop)
    }

    fn sync(&self) -> io::Result<()> {
        // SAFETY: fsync of an open fd.
        cvt(unsafe { libc::fsync(self.fd.as_raw_fd()) }).map(drop)
    }

    fn chmod(&self, mode: libc::mode_t) -> io::Result<()> {
        // SAFETY: fchmod of an open fd.
        cvt(unsafe { libc::fchmod(self.fd.as_raw_fd(), mode) }).map(drop)
    }

    /// The names in this directory (through `/proc/self/fd`, which leads to
    /// this very directory whatever its path has become).
    fn names(&self) -> io::Result<Vec<OsString>> {
        std::fs::read_dir(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))?
            .map(|e| e.map(|e| e.file_name()))
            .collect()
    }
}

/// What a snapshot of a VM is written from in another process
/// ([`Vm::snapshot_parts`]).
pub struct SnapshotParts {
    /// The machine state.
    pub state: MachineState,
    /// The guest RAM.
    pub ram: SnapshotRam,
}

/// A VM's guest RAM as files ([`SnapshotParts`]).
pub enum SnapshotRam {
    /// Its memfd: all of it.
    Whole(std::sync::Arc<File>),
    /// A fork source's: the frozen base and the pages that differ from it
    /// (bitmap words over the whole RAM) at their offsets in `delta`.
    Forked {
        /// The frozen base.
        base: std::sync::Arc<File>,
        /// The diverged pages.
        delta: File,
        /// Which pages `delta` holds.
        words: Vec<u64>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_stay_few_and_cover_the_file() {
        assert_eq!(chunk_for(16 << 20), MIN_CHUNK);
        assert_eq!(chunk_for(64 << 30), MIN_CHUNK);
        assert_eq!(chunk_for((64 << 30) + (1 << 20)), 2 * MIN_CHUNK);
        let tib = 1u64 << 40;
        assert!(tib.div_ceil(chunk_for(tib)) <= MAX_CHUNKS);
        assert!(chunk_for(tib) <= MAX_CHUNK);
        assert_eq!(chunk_range(2, 4, 10), 8..10);
    }

    #[test]
    fn data_chunks_marks_every_touched_chunk() {
        let v = data_chunks(
            10 << 20,
            1 << 20,
            [(1 << 20) - 1..(1 << 20) + 1, (5 << 20)..(5 << 20) + 1].into_iter(),
        );
        let marked: Vec<usize> = v.iter().enumerate().filter(|(_, b)| **b).map(|(i, _)| i).collect();
        assert_eq!(marked, vec![0, 1, 5]);
    }

    #[test]
    fn relative_and_dotdot_paths_are_refused() {
        let e = components(Path::new("snap")).unwrap_err().to_string();
        assert!(e.contains("relative"), "{e}");
        let e = components(Path::new("/a/../b")).unwrap_err().to_string();
        assert!(e.contains(".."), "{e}");
        assert_eq!(
            components(Path::new("/a/./b")).unwrap(),
            vec![OsStr::new("a"), OsStr::new("b")]
        );
    }
}
