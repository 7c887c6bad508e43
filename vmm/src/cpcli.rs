//! `k7d cp SRC DST`: files and directories between the host and a VM (a
//! fork child or a restored VM alike), one side `VM:PATH`, as `docker cp`
//! and `kubectl cp` do: a tar stream through the VM's guest agent
//! (`k7d exec`'s path, `docs/exec.md`), with `tar` and `sh` in the guest.
//! Modes, symbolic links and (as root) owners are kept.
//!
//! What comes back from a guest is hostile input: the host extracts it into
//! a fresh directory beside the destination, entry by entry, refusing any
//! entry outside the copy's own name, any that is not a file, directory or
//! symbolic link, any path through a symbolic link, and any stream past
//! `--max-size` bytes; only a whole copy is renamed into place, so a
//! failed one leaves nothing.

use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;

use crate::execcli::{ExecArgs, Streams, run_with};

/// How much a copy from a VM may bring by default.
const DEFAULT_MAX: u64 = 1 << 30;
/// The most entries a copy from a VM may hold.
const MAX_ENTRIES: usize = 1 << 20;
/// How much of the guest's stderr a failure quotes.
const ERR_KEEP: usize = 4096;

/// `k7d cp`'s arguments.
#[derive(Clone, Debug, Args)]
pub struct CpArgs {
    /// What to copy: a host path, or VM:PATH.
    pub src: String,
    /// Where to: a host path, or VM:PATH (exactly one side is a VM). An
    /// existing directory receives the copy under its source's name;
    /// anything else is the copy's own name.
    pub dst: String,
    /// The most bytes a copy from a VM may bring (the tar stream).
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_MAX)]
    pub max_size: u64,
    /// How long the guest's side may run before it is killed (a guest that
    /// never ends its stream cannot hold k7d cp longer).
    #[arg(long, value_name = "S", default_value_t = DEFAULT_TIMEOUT_S)]
    pub timeout: u64,
}

/// `--timeout`'s default, in seconds.
const DEFAULT_TIMEOUT_S: u64 = 600;

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Side {
    /// A path on the host.
    Host(PathBuf),
    /// `VM:PATH`: an absolute path in a VM.
    Vm { vm: String, path: String },
}

/// Reads `VM:PATH` (a VM id before the first `:`, no `/` in it, an
/// absolute path after it) or a host path.
pub fn side(s: &str) -> Result<Side, String> {
    if let Some((vm, path)) = s.split_once(':')
        && !vm.is_empty()
        && !vm.contains('/')
    {
        if !path.starts_with('/') {
            return Err(format!("{s}: the path in VM {vm} must be absolute"));
        }
        if path.contains('\0') || path.len() > 4096 {
            return Err(format!("{s}: not a path"));
        }
        return Ok(Side::Vm {
            vm: vm.to_string(),
            path: path.to_string(),
        });
    }
    Ok(Side::Host(PathBuf::from(s)))
}

/// The last component of `path` (what a copy is named after), refusing
/// `/`, `.` and `..`.
fn base_name(path: &str) -> Result<String, String> {
    match Path::new(path).components().next_back() {
        Some(Component::Normal(n)) => n
            .to_str()
            .map(str::to_string)
            .ok_or_else(|| format!("{path}: not UTF-8")),
        _ => Err(format!("{path} names no file or directory to copy")),
    }
}

/// The exec of `command` in `vm`, as `k7d exec` runs it, killed after
/// `timeout_s`.
fn exec_args(vm: &str, command: Vec<String>, timeout_s: u64) -> ExecArgs {
    ExecArgs {
        timeout: Some(std::time::Duration::from_secs(timeout_s.max(1))),
        ..ExecArgs::in_vm(vm, command)
    }
}

/// A writer that keeps the first [`ERR_KEEP`] bytes (the guest's stderr).
#[derive(Clone, Default)]
struct Kept(Arc<Mutex<Vec<u8>>>);

impl Kept {
    fn text(&self) -> String {
        let b = self.0.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&b).trim().replace('\n', "; ")
    }
}

impl Write for Kept {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut b = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let room = ERR_KEEP.saturating_sub(b.len());
        b.extend_from_slice(&buf[..buf.len().min(room)]);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `k7d cp`: `uds` gives the VM's vsock socket (from the daemon).
pub fn run(a: &CpArgs, mut uds: impl FnMut(&str) -> Result<PathBuf>) -> Result<ExitCode> {
    match (
        side(&a.src).map_err(|e| anyhow!(e))?,
        side(&a.dst).map_err(|e| anyhow!(e))?,
    ) {
        (Side::Host(from), Side::Vm { vm, path }) => to_vm(&from, &vm, &path, &uds(&vm)?, a.timeout)?,
        (Side::Vm { vm, path }, Side::Host(to)) => from_vm(&vm, &path, &to, &uds(&vm)?, a)?,
        (Side::Host(_), Side::Host(_)) => bail!("k7d cp copies between the host and a VM: name one side VM:PATH"),
        (Side::Vm { .. }, Side::Vm { .. }) => bail!("k7d cp copies between the host and a VM, not between two VMs"),
    }
    Ok(ExitCode::SUCCESS)
}

/// The guest's side of a copy into it: the archive's one top entry `$2`
/// goes into `$1` when that is a directory, else becomes `$1`.
const GUEST_UNPACK: &str = r#"set -e
dst=$1 name=$2
if [ -d "$dst" ]; then exec tar -x -f - -C "$dst"; fi
parent=$(dirname "$dst")
t=$(mktemp -d "$parent/.k7d-cp.XXXXXX")
trap 'rm -rf "$t"' EXIT
tar -x -f - -C "$t"
mv "$t/$name" "$dst""#;

/// The guest's side of a copy out of it: `$1` as a tar stream, named by
/// its last component.
const GUEST_PACK: &str = r#"set -e
cd "$(dirname "$1")"
exec tar -c -f - "$(basename "$1")""#;

fn to_vm(from: &Path, vm: &str, path: &str, uds: &Path, timeout_s: u64) -> Result<()> {
    let meta = std::fs::symlink_metadata(from).with_context(|| format!("cannot read {}", from.display()))?;
    let name = base_name(&from.to_string_lossy()).map_err(|e| anyhow!(e))?;
    let (reader, writer) = std::io::pipe().context("cannot make a pipe")?;
    let src = from.to_path_buf();
    let packer = std::thread::spawn(move || -> std::io::Result<()> {
        let mut b = tar::Builder::new(writer);
        b.follow_symlinks(false);
        if meta.is_dir() {
            b.append_dir_all(&name, &src)?;
        } else {
            b.append_path_with_name(&src, &name)?;
        }
        b.into_inner()?.flush()
    });
    let err = Kept::default();
    let command = vec![
        "sh".into(),
        "-c".into(),
        GUEST_UNPACK.into(),
        "sh".into(),
        path.into(),
        base_name(&from.to_string_lossy()).map_err(|e| anyhow!(e))?,
    ];
    let status = run_with(
        vm,
        uds.to_path_buf(),
        &exec_args(vm, command, timeout_s),
        Streams::piped(Box::new(std::io::sink()), Box::new(err.clone()), Some(Box::new(reader))),
    )?;
    let packed = packer.join().map_err(|_| anyhow!("the archive's thread panicked"))?;
    if status != 0 {
        bail!("vm {vm}: unpacking into {path} failed (exit {status}): {}", err.text());
    }
    packed.with_context(|| format!("cannot read {} to copy it", from.display()))
}

fn from_vm(vm: &str, path: &str, to: &Path, uds: &Path, a: &CpArgs) -> Result<()> {
    let name = base_name(path).map_err(|e| anyhow!(e))?;
    // An existing directory receives the copy under its name.
    let (parent, final_name) = if to.is_dir() {
        (to.to_path_buf(), name.clone())
    } else {
        let parent = match to.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        (parent, base_name(&to.to_string_lossy()).map_err(|e| anyhow!(e))?)
    };
    let target = parent.join(&final_name);
    if std::fs::symlink_metadata(&target).is_ok() {
        bail!("{} exists: k7d cp does not replace it", target.display());
    }
    let (reader, writer) = std::io::pipe().context("cannot make a pipe")?;
    let err = Kept::default();
    let command = vec!["sh".into(), "-c".into(), GUEST_PACK.into(), "sh".into(), path.into()];
    let (vm_c, uds_c, err_c, timeout_s) = (vm.to_string(), uds.to_path_buf(), err.clone(), a.timeout);
    let exec = std::thread::spawn(move || {
        run_with(
            &vm_c,
            uds_c,
            &exec_args(&vm_c, command, timeout_s),
            Streams::piped(Box::new(writer), Box::new(err_c), None),
        )
    });
    let tmp = tempdir_in(&parent)?;
    let unpacked = unpack(reader, &tmp, &name, a.max_size);
    let status = exec.join().map_err(|_| anyhow!("the exec's thread panicked"))?;
    // A check here first (the guest's tar then fails on its cut stream),
    // then the guest's own failure (a missing path: its tar says so).
    let refused = matches!(&unpacked, Err(e) if e.downcast_ref::<Refused>().is_some());
    let result = match (status, unpacked) {
        (_, Err(e)) if refused => Err(e.context(format!("vm {vm}: the copy of {path} was refused"))),
        (Ok(0), Ok(())) => std::fs::rename(tmp.join(&name), &target)
            .with_context(|| format!("cannot move the copy to {}", target.display())),
        (Ok(0), Err(e)) => Err(e.context(format!("vm {vm}: the copy of {path} was refused"))),
        (Ok(st), _) => Err(anyhow!("vm {vm}: packing {path} failed (exit {st}): {}", err.text())),
        (Err(e), _) => Err(e),
    };
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

/// A fresh directory in `parent` (mode 0700), for a copy to land in whole.
fn tempdir_in(parent: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    for i in 0..100u32 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let p = parent.join(format!(".k7d-cp.{}.{nanos}.{i}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("cannot make a directory in {}", parent.display())),
        }
    }
    bail!("cannot make a fresh directory in {}", parent.display())
}

/// A copy from a VM stopped by a check here (not by the stream's end):
/// what the user is told even when the guest's side then failed too.
#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// A check here stops the copy.
fn refuse(why: String) -> anyhow::Error {
    anyhow::Error::new(Refused(why))
}

/// A reader that fails past `left` bytes.
struct Bounded<R> {
    inner: R,
    left: u64,
    max: u64,
    over: std::rc::Rc<std::cell::Cell<bool>>,
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            // One byte more says whether the stream is over or too long.
            let mut one = [0u8; 1];
            return match self.inner.read(&mut one)? {
                0 => Ok(0),
                _ => {
                    self.over.set(true);
                    Err(std::io::Error::other(format!(
                        "the copy is larger than {} bytes (--max-size)",
                        self.max
                    )))
                }
            };
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}

/// Unpacks the tar stream `from` into the empty directory `dir`: every
/// entry must be `name` or under it (relative, no `..`), a file, directory
/// or symbolic link, reached through no symbolic link; the stream at most
/// `max` bytes and [`MAX_ENTRIES`] entries. The first refusal ends it.
pub fn unpack(from: impl Read, dir: &Path, name: &str, max: u64) -> Result<()> {
    let over = std::rc::Rc::new(std::cell::Cell::new(false));
    let r = unpack_bounded(from, dir, name, max, over.clone());
    match r {
        Err(_) if over.get() => Err(refuse(format!("the copy is larger than {max} bytes (--max-size)"))),
        r => r,
    }
}

fn unpack_bounded(
    from: impl Read,
    dir: &Path,
    name: &str,
    max: u64,
    over: std::rc::Rc<std::cell::Cell<bool>>,
) -> Result<()> {
    let mut archive = tar::Archive::new(Bounded {
        inner: from,
        left: max,
        max,
        over,
    });
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(crate::sys::euid() == 0);
    archive.set_overwrite(false);
    archive.set_unpack_xattrs(false);
    let mut n = 0usize;
    for entry in archive.entries().context("the copy is not a tar stream")? {
        let mut entry = entry.context("the copy's tar stream is broken")?;
        n += 1;
        if n > MAX_ENTRIES {
            return Err(refuse(format!("the copy has more than {MAX_ENTRIES} entries")));
        }
        let path = entry.path().context("an entry's path is not readable")?.into_owned();
        let shown = path.display().to_string();
        let mut parts = path.components();
        let inside = matches!(parts.next(), Some(Component::Normal(first)) if first == name)
            && parts.all(|c| matches!(c, Component::Normal(_)));
        if !inside {
            return Err(refuse(format!("the entry {shown:?} is outside the copy of {name}")));
        }
        let kind = entry.header().entry_type();
        if !(kind.is_file() || kind.is_dir() || kind.is_symlink()) {
            return Err(refuse(format!(
                "the entry {shown:?} is a {kind:?}, not a file, directory or symbolic link"
            )));
        }
        // No path through a symbolic link the copy made: each parent must
        // be a real directory of the copy.
        let mut at = dir.to_path_buf();
        for c in path.parent().into_iter().flat_map(Path::components) {
            at.push(c);
            match std::fs::symlink_metadata(&at) {
                Ok(m) if m.file_type().is_symlink() => {
                    return Err(refuse(format!(
                        "the entry {shown:?} goes through the symbolic link {}",
                        at.display()
                    )));
                }
                _ => {}
            }
        }
        if !entry
            .unpack_in(dir)
            .with_context(|| format!("cannot write the entry {shown:?}"))?
        {
            return Err(refuse(format!("the entry {shown:?} is outside the copy of {name}")));
        }
    }
    if n == 0 {
        bail!("the copy is empty");
    }
    if std::fs::symlink_metadata(dir.join(name)).is_err() {
        bail!("the copy holds no {name}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("k7d-cp-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A tar stream with entries as a hostile guest could write them
    /// (raw names, no checks).
    fn raw_tar(entries: &[(&str, tar::EntryType, &[u8], &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data, link) in entries {
            let mut h = tar::Header::new_gnu();
            {
                let name = h.as_old_mut().name.as_mut();
                name[..path.len()].copy_from_slice(path.as_bytes());
            }
            h.set_entry_type(*kind);
            h.set_mode(0o644);
            h.set_size(data.len() as u64);
            if !link.is_empty() {
                h.set_link_name(link).unwrap();
            }
            h.set_cksum();
            b.append(&h, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn sides_are_read_as_docker_cp_reads_them() {
        assert_eq!(side("./a/b"), Ok(Side::Host("./a/b".into())));
        assert_eq!(side("/etc/x:y"), Ok(Side::Host("/etc/x:y".into())));
        assert_eq!(
            side("web-f1:/tmp/obs"),
            Ok(Side::Vm {
                vm: "web-f1".into(),
                path: "/tmp/obs".into()
            })
        );
        assert!(side("web:tmp").unwrap_err().contains("must be absolute"));
        assert_eq!(base_name("/tmp/obs/"), Ok("obs".into()));
        assert!(base_name("/").is_err() && base_name("/tmp/..").is_err());
    }

    #[test]
    fn a_copy_comes_back_with_its_modes_and_links() {
        let d = tmp("ok");
        let src = d.join("src");
        std::fs::create_dir_all(src.join("obs/sub")).unwrap();
        std::fs::write(src.join("obs/sub/f"), b"data").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(src.join("obs/sub/f"), std::fs::Permissions::from_mode(0o751)).unwrap();
        std::os::unix::fs::symlink("sub/f", src.join("obs/link")).unwrap();
        let mut b = tar::Builder::new(Vec::new());
        b.follow_symlinks(false);
        b.append_dir_all("obs", src.join("obs")).unwrap();
        let stream = b.into_inner().unwrap();
        let out = d.join("out");
        std::fs::create_dir(&out).unwrap();
        unpack(&stream[..], &out, "obs", 1 << 20).unwrap();
        assert_eq!(std::fs::read(out.join("obs/sub/f")).unwrap(), b"data");
        assert_eq!(
            std::fs::metadata(out.join("obs/sub/f")).unwrap().permissions().mode() & 0o777,
            0o751
        );
        assert_eq!(std::fs::read_link(out.join("obs/link")).unwrap(), Path::new("sub/f"));
        // Over the bound: refused, whatever was written stays in the
        // scratch directory the caller removes.
        let out2 = d.join("out2");
        std::fs::create_dir(&out2).unwrap();
        let e = unpack(&stream[..], &out2, "obs", 100).unwrap_err();
        assert!(format!("{e:#}").contains("larger than 100 bytes"), "{e:#}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_hostile_guest_cannot_write_outside_the_copy() {
        let d = tmp("hostile");
        let outside = d.join("outside");
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "dot-dot",
                raw_tar(&[("obs/../../x", tar::EntryType::Regular, b"x", "")]),
            ),
            (
                "absolute",
                raw_tar(&[("/tmp/k7d-cp-abs", tar::EntryType::Regular, b"x", "")]),
            ),
            ("another name", raw_tar(&[("other", tar::EntryType::Regular, b"x", "")])),
            (
                "through a link",
                raw_tar(&[
                    ("obs", tar::EntryType::Directory, b"", ""),
                    ("obs/l", tar::EntryType::Symlink, b"", outside.to_str().unwrap()),
                    ("obs/l/x", tar::EntryType::Regular, b"x", ""),
                ]),
            ),
            ("a device", raw_tar(&[("obs", tar::EntryType::Char, b"", "")])),
            (
                "a hard link",
                raw_tar(&[("obs", tar::EntryType::Link, b"", "/etc/passwd")]),
            ),
        ];
        std::fs::create_dir(&outside).unwrap();
        for (what, stream) in cases {
            let out = d.join(format!("out-{}", what.replace(' ', "-")));
            std::fs::create_dir(&out).unwrap();
            let e = unpack(&stream[..], &out, "obs", 1 << 20);
            assert!(e.is_err(), "{what}: accepted");
            assert!(
                std::fs::read_dir(&outside).unwrap().next().is_none(),
                "{what}: wrote outside the copy"
            );
            assert!(
                !d.join("x").exists() && !Path::new("/tmp/k7d-cp-abs").exists(),
                "{what}"
            );
        }
        // A stream that claims 10 GiB stops at the bound.
        let mut h = tar::Header::new_gnu();
        h.set_path("obs").unwrap();
        h.set_size(10 << 30);
        h.set_cksum();
        let mut big = h.as_bytes().to_vec();
        big.extend(std::iter::repeat_n(0u8, 1 << 16));
        let out = d.join("out-big");
        std::fs::create_dir(&out).unwrap();
        assert!(unpack(&big[..], &out, "obs", 1 << 12).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
