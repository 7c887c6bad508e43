//! Retiring the fork templates and warm pools an edited config left.
//!
//! A template's and a pool's name hash everything their VMs were booted
//! from (`template::shape_hex`: the config's kernel, initramfs and command
//! line, the files' identity, the shape), so after a config is edited, or
//! its kernel or initramfs replaced (a package upgrade), new pods use a new
//! template and a new pool and the old ones would stay paused in the
//! daemon. Each template and pool directory therefore holds an `origin`
//! file: the config it was made from and its shape. [`sweep`] (run by the
//! node's `k7d template-make` and `k7d pool-fill`, so by every refill too)
//! removes the templates and drains the pools whose origin names this
//! config but whose name is no longer the one the config gives that shape.
//! Templates and pools of other configs are never touched.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::config::ShimConfig;
use crate::daemon::Daemon;
use crate::{pool, template};

/// The file in a template's or pool's directory that says what made it.
const ORIGIN: &str = "origin";

/// The most an `origin` file may hold (it is a few lines).
const MAX_ORIGIN_BYTES: u64 = 4096;

/// How long a sweep waits for a template's lock (a shim making or checking
/// it holds it) before it leaves that template for the next sweep.
const LOCK_WAIT: Duration = Duration::from_secs(5);

/// What made a template or a pool, and which configs use it (two config
/// files that boot the same VMs, say a RuntimeClass's that only changes
/// `pod_start`, share one template).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin {
    /// The config files, as resolved when each was noted.
    pub configs: Vec<PathBuf>,
    /// vCPUs and memory (MiB).
    pub shape: (u8, u64),
}

/// The config file `cfg` was read from, resolved (symlinks, `..`) when it
/// can be, so two spellings of one file agree.
fn config_key(cfg: &ShimConfig) -> Option<PathBuf> {
    let p = cfg.source.as_ref()?;
    Some(std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
}

/// Notes in `dir/origin` that `cfg`'s file uses this template or pool of
/// `shape` (nothing when `cfg` was not read from a file). Call with the
/// template's or pool's lock held.
pub(crate) fn note_origin(dir: &Path, cfg: &ShimConfig, shape: (u8, u64)) -> anyhow::Result<()> {
    let Some(key) = config_key(cfg) else {
        return Ok(());
    };
    // One line of text per config: a path with a line break in it, or one
    // that is no UTF-8 (it would not read back as written), is not noted;
    // its template or pool is then retired by hand only.
    if key.to_str().is_none_or(|k| k.contains('\n')) {
        return Ok(());
    }
    let mut o = read_origin(dir).unwrap_or(Origin {
        configs: Vec::new(),
        shape,
    });
    if o.configs.contains(&key) {
        return Ok(());
    }
    o.configs.push(key);
    write_origin(dir, &o)
}

fn write_origin(dir: &Path, o: &Origin) -> anyhow::Result<()> {
    let mut text = format!("vcpus={}\nmemory_mib={}\n", o.shape.0, o.shape.1);
    for c in &o.configs {
        text.push_str(&format!("config={}\n", c.display()));
    }
    let tmp = dir.join("origin.tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, dir.join(ORIGIN)))
        .with_context(|| format!("cannot write {}", dir.join(ORIGIN).display()))
}

/// Reads `dir/origin`; `None` when there is none or it does not parse
/// (a directory this code never wrote one into is left alone).
pub(crate) fn read_origin(dir: &Path) -> Option<Origin> {
    let bytes = k7d_sys::file::read_regular_file(&dir.join(ORIGIN), MAX_ORIGIN_BYTES).ok()?;
    if bytes.len() as u64 > MAX_ORIGIN_BYTES {
        return None;
    }
    let text = String::from_utf8(bytes).ok()?;
    let (mut configs, mut vcpus, mut memory) = (Vec::new(), None, None);
    for line in text.lines() {
        match line.split_once('=')? {
            ("config", v) => configs.push(PathBuf::from(v)),
            ("vcpus", v) => vcpus = Some(v.parse().ok()?),
            ("memory_mib", v) => memory = Some(v.parse().ok()?),
            _ => return None,
        }
    }
    if configs.is_empty() {
        return None;
    }
    Some(Origin {
        configs,
        shape: (vcpus?, memory?),
    })
}

/// Takes `key` out of the origin in `dir` when the config no longer names
/// `hex` for the origin's shape (the lock held); returns whether no config
/// uses the template or pool any more, and its shape.
fn drop_config(cfg: &ShimConfig, key: &Path, hex: &str, dir: &Path) -> anyhow::Result<Option<(bool, (u8, u64))>> {
    let Some(mut o) = read_origin(dir) else {
        return Ok(None);
    };
    if !o.configs.iter().any(|c| c == key) || template::shape_hex(cfg, o.shape.0, o.shape.1) == hex {
        return Ok(None);
    }
    o.configs.retain(|c| c != key);
    if o.configs.is_empty() {
        return Ok(Some((true, o.shape)));
    }
    write_origin(dir, &o)?;
    Ok(Some((false, o.shape)))
}

/// The directories under `root` named as a template's or pool's hash.
fn hashed_dirs(root: &Path) -> Vec<(String, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut v: Vec<_> = rd
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            (name.len() == 16 && name.bytes().all(|b| b.is_ascii_hexdigit())).then(|| (name, e.path()))
        })
        .collect();
    v.sort();
    v
}

/// Retires what `cfg`'s file used before it (or its kernel or initramfs)
/// changed: it stops being one of their configs, and a template or pool
/// no config uses any more is removed (the template) or drained (the
/// pool); returns those (`tmpl-<hex>`, `pool-<hex>`). A template another
/// shim holds the lock of, or a pool with members still booting, is left
/// for the next sweep.
pub fn sweep(cfg: &ShimConfig, daemon: &dyn Daemon) -> anyhow::Result<Vec<String>> {
    let Some(key) = config_key(cfg) else {
        return Ok(Vec::new());
    };
    let mut retired = Vec::new();
    for (hex, dir) in hashed_dirs(&cfg.state_dir.join("templates")) {
        let t = template::named(cfg, &hex);
        let r =
            t.hold(std::time::Instant::now() + LOCK_WAIT)
                .and_then(|_held| match drop_config(cfg, &key, &hex, &dir)? {
                    Some((true, _)) => t.remove_held(daemon).map(|_| true),
                    _ => Ok(false),
                });
        match r {
            Ok(true) => {
                tracing::info!(template = %t.vm_id, config = %key.display(), "fork template of an earlier version of the config retired");
                retired.push(t.vm_id);
            }
            Ok(false) => {}
            Err(e) => tracing::warn!("cannot retire the fork template {}: {e:#}", t.vm_id),
        }
    }
    for (hex, dir) in hashed_dirs(&cfg.state_dir.join("pools")) {
        // Its shape is the origin's, read under the lock.
        let any_shape = pool::named(cfg, &hex, (0, 0));
        let name = any_shape.name();
        let r = any_shape.lock().and_then(|_held| {
            let Some((true, shape)) = drop_config(cfg, &key, &hex, &dir)? else {
                return Ok(None);
            };
            let (removed, booting) = pool::named(cfg, &hex, shape).drain_held(daemon)?;
            if booting == 0 {
                template::remove_dir(&dir);
            }
            Ok(Some((removed, booting)))
        });
        match r {
            Ok(Some((removed, booting))) => {
                tracing::info!(pool = %name, removed, booting, config = %key.display(), "warm pool of an earlier version of the config drained");
                retired.push(name);
            }
            Ok(None) => {}
            Err(e) => tracing::warn!("cannot retire the warm pool {name}: {e:#}"),
        }
    }
    Ok(retired)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::VmLife;
    use crate::pool::tests::Lives;

    fn cfg(state: &Path, file: &Path, cmdline: &str) -> ShimConfig {
        std::fs::write(
            file,
            format!(
                "kernel = \"/k\"\ninitramfs = \"/i\"\nstate_dir = \"{}\"\ncmdline = \"{cmdline}\"\npool_size = 1\n",
                state.display()
            ),
        )
        .unwrap();
        ShimConfig::read(file).unwrap()
    }

    #[test]
    fn an_origin_notes_each_config_once_and_garbage_is_none() {
        let dir = std::env::temp_dir().join(format!("k7d-origin-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let a = cfg(&dir.join("state"), &dir.join("a.toml"), "console=ttyS0");
        let b = cfg(&dir.join("state"), &dir.join("b.toml"), "console=ttyS0");
        note_origin(&dir, &a, (2, 512)).unwrap();
        note_origin(&dir, &b, (2, 512)).unwrap();
        note_origin(&dir, &a, (2, 512)).unwrap();
        let canon = |f: &str| std::fs::canonicalize(dir.join(f)).unwrap();
        assert_eq!(
            read_origin(&dir),
            Some(Origin {
                configs: vec![canon("a.toml"), canon("b.toml")],
                shape: (2, 512)
            })
        );
        // A config path with a line break is not noted (it would read back
        // as other lines).
        let odd = cfg(&dir.join("state"), &dir.join("c\nvcpus=9.toml"), "console=ttyS0");
        note_origin(&dir, &odd, (2, 512)).unwrap();
        assert_eq!(read_origin(&dir).unwrap().configs.len(), 2);
        std::fs::write(
            dir.join(ORIGIN),
            format!("vcpus=1\nmemory_mib=1\nconfig=/a{}\n", "b".repeat(5000)),
        )
        .unwrap();
        assert_eq!(read_origin(&dir), None, "an origin over 4 KiB");
        for bad in [
            "",
            "config=/a\nvcpus=x\nmemory_mib=1\n",
            "config=/a\nvcpus=1\n",
            "vcpus=1\nmemory_mib=1\n",
            "other=1\n",
        ] {
            std::fs::write(dir.join(ORIGIN), bad).unwrap();
            assert_eq!(read_origin(&dir), None, "{bad:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_edited_config_retires_what_only_it_used() {
        let dir = std::env::temp_dir().join(format!("k7d-retire-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let state = dir.join("state");
        let (file, twin_file, other_file) = (dir.join("shim.toml"), dir.join("fork.toml"), dir.join("other.toml"));
        let old = cfg(&state, &file, "console=ttyS0");
        // Another file that boots the same VMs (one template), and one that does not.
        let twin = cfg(&state, &twin_file, "console=ttyS0");
        let other = cfg(&state, &other_file, "console=ttyS0 quiet");
        let d = Lives::default();
        let shape = (old.vcpus, old.memory_mib);
        let t = template::for_shape(&old, shape.0, shape.1);
        assert_eq!(t, template::for_shape(&twin, shape.0, shape.1));
        std::fs::create_dir_all(&t.dir).unwrap();
        note_origin(&t.dir, &old, shape).unwrap();
        d.lives.lock().unwrap().insert(t.vm_id.clone(), VmLife::Paused);
        let other_t = template::for_shape(&other, shape.0, shape.1);
        std::fs::create_dir_all(&other_t.dir).unwrap();
        note_origin(&other_t.dir, &other, shape).unwrap();
        d.lives.lock().unwrap().insert(other_t.vm_id.clone(), VmLife::Paused);
        // The old config's pool, one ready member.
        let p = pool::for_shape(&old, shape.0, shape.1);
        let proot = state.join("pools").join(p.name().trim_start_matches("pool-"));
        std::fs::create_dir_all(proot.join("0")).unwrap();
        std::fs::write(proot.join("0").join("ready"), b"").unwrap();
        note_origin(&proot, &old, shape).unwrap();
        d.lives.lock().unwrap().insert(p.member_id(0), VmLife::Paused);
        // Unchanged: nothing is stale.
        assert!(sweep(&old, &d).unwrap().is_empty());
        assert!(d.deleted.lock().unwrap().is_empty());
        // The twin uses the template too; then the first config is edited:
        // its pool goes, the shared template stays (the twin's now), the
        // other config's template stays.
        note_origin(&t.dir, &twin, shape).unwrap();
        let new = cfg(&state, &file, "console=ttyS0 loglevel=7");
        assert_eq!(sweep(&new, &d).unwrap(), [p.name()]);
        assert_eq!(*d.deleted.lock().unwrap(), [p.member_id(0)]);
        assert!(!proot.exists());
        assert!(t.dir.exists() && other_t.dir.exists());
        assert_eq!(
            read_origin(&t.dir).unwrap().configs,
            [std::fs::canonicalize(&twin_file).unwrap()]
        );
        // The twin is edited too: now nothing uses the template.
        let twin_new = cfg(&state, &twin_file, "console=ttyS0 loglevel=7");
        assert_eq!(sweep(&twin_new, &d).unwrap(), std::slice::from_ref(&t.vm_id));
        assert!(d.deleted.lock().unwrap().contains(&t.vm_id) && !t.dir.exists());
        assert_eq!(d.lives.lock().unwrap().get(&other_t.vm_id), Some(&VmLife::Paused));
        assert!(other_t.dir.exists());
        // A replaced kernel file (same path) is a change too.
        let k = dir.join("vmlinuz");
        std::fs::write(&k, b"one").unwrap();
        let mut a = new.clone();
        a.kernel = k.clone();
        let before = template::shape_hex(&a, 1, 256);
        std::fs::write(&k, b"another kernel").unwrap();
        assert_ne!(before, template::shape_hex(&a, 1, 256));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
