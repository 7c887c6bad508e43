//! The node's kernel limits, written into the pod VM (`NodeLimits`).
//!
//! A container reads `threads-max`, `pid_max`, `file-max`, `nr_open` and
//! the inotify limits from the kernel it runs on. Under runc that is the
//! node's; in a pod VM it would be the VM kernel's, several of them derived
//! from its small RAM. The shim sends the node's values and the agent
//! writes them here before it makes a container, so the container reads
//! what it would read under runc.

use k7d_agent::proto::{NODE_SYSCTLS, NodeLimits};
use std::path::Path;

/// Writes each of `limits` under `proc_sys` (`/proc/sys` in the VM) whose
/// value differs, in [`NODE_SYSCTLS`]' order (`fs.nr_open` before anything
/// that may need it); returns the names written.
pub fn apply(proc_sys: &Path, limits: &NodeLimits) -> Result<Vec<&'static str>, String> {
    limits.check()?;
    let mut written = Vec::new();
    for (name, _) in NODE_SYSCTLS {
        let Some(value) = limits.sysctls.get(*name) else {
            continue;
        };
        let path = proc_sys.join(name.replace('.', "/"));
        let now = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {name}: {e}"))?;
        if now.trim().parse::<u64>().ok() == Some(*value) {
            continue;
        }
        std::fs::write(&path, format!("{value}\n")).map_err(|e| format!("cannot set {name} to {value}: {e}"))?;
        written.push(*name);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("k7d-sysctl-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        for (name, value) in [
            ("kernel.pid_max", "32768"),
            ("kernel.threads-max", "1610"),
            ("fs.nr_open", "1048576"),
        ] {
            let p = d.join(name.replace('.', "/"));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, format!("{value}\n")).unwrap();
        }
        d
    }

    #[test]
    fn only_values_that_differ_are_written_and_read_back() {
        let d = tree("write");
        let limits = NodeLimits {
            sysctls: [
                ("kernel.threads-max".to_string(), 21970),
                ("kernel.pid_max".to_string(), 32768),
                ("fs.nr_open".to_string(), 1 << 30),
            ]
            .into(),
        };
        assert_eq!(apply(&d, &limits).unwrap(), ["fs.nr_open", "kernel.threads-max"]);
        let read = |n: &str| std::fs::read_to_string(d.join(n)).unwrap();
        assert_eq!(read("kernel/threads-max"), "21970\n");
        assert_eq!(read("fs/nr_open"), "1073741824\n");
        assert_eq!(read("kernel/pid_max"), "32768\n");
        assert!(apply(&d, &limits).unwrap().is_empty(), "a second time writes nothing");
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_bad_or_unknown_limit_writes_nothing() {
        let d = tree("bad");
        let limits = NodeLimits {
            sysctls: [
                ("kernel.threads-max".to_string(), 21970),
                ("kernel.core_pattern".to_string(), 1),
            ]
            .into(),
        };
        let e = apply(&d, &limits).unwrap_err();
        assert!(e.contains("kernel.core_pattern"), "{e}");
        assert_eq!(std::fs::read_to_string(d.join("kernel/threads-max")).unwrap(), "1610\n");
        // A sysctl this kernel lacks: a clear reason.
        let inotify = NodeLimits {
            sysctls: [("fs.inotify.max_user_watches".to_string(), 8192)].into(),
        };
        let e = apply(&d, &inotify).unwrap_err();
        assert!(e.starts_with("cannot read fs.inotify.max_user_watches"), "{e}");
        std::fs::remove_dir_all(d).unwrap();
    }
}
