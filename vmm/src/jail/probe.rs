//! What of the jail a process lacks, read from outside through `/proc`
//! (as root, or as its owner): the checks issue 36's "Must show" lists.

use std::path::Path;

/// The namespaces a jailed process must not share with the caller.
pub const NAMESPACES: [&str; 5] = ["mnt", "pid", "net", "ipc", "uts"];

/// Every way process `pid` falls short of the jail, one sentence each
/// (empty: jailed). Besides stdin, stdout and stderr it may hold only the
/// descriptors whose target (`/proc/<pid>/fd/N`'s link: a path,
/// `anon_inode:kvm-vm`, `/memfd:...`) `allowed` accepts, and its own
/// `smaps` (the jail keeps it: `jail::own_smaps`); any other is a leak. Seccomp is not judged here (a VM process's threads install their
/// filters after the jail).
pub fn violations(pid: u32, allowed: impl Fn(&str) -> bool) -> Vec<String> {
    let proc = Path::new("/proc").join(pid.to_string());
    let mut out = Vec::new();
    let status = match std::fs::read_to_string(proc.join("status")) {
        Ok(s) => s,
        Err(e) => return vec![format!("process {pid} cannot be inspected: {e}")],
    };
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(':')))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    for (name, what) in [("Uid", "uid"), ("Gid", "gid")] {
        let ids = field(name);
        if ids.is_empty() || ids.split_whitespace().any(|v| v == "0") {
            out.push(format!(
                "its {what}s are {ids} (real, effective, saved, fs): root among them"
            ));
        }
    }
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        let v = field(cap);
        if !u64::from_str_radix(&v, 16).is_ok_and(|m| m == 0) {
            out.push(format!("{cap} is {v}, not 0"));
        }
    }
    if field("NoNewPrivs") != "1" {
        out.push(format!("NoNewPrivs is {}, not 1", field("NoNewPrivs")));
    }
    for ns in NAMESPACES {
        let theirs = std::fs::read_link(proc.join("ns").join(ns));
        let ours = std::fs::read_link(Path::new("/proc/self/ns").join(ns));
        match (theirs, ours) {
            (Ok(a), Ok(b)) if a != b => {}
            (Ok(a), Ok(_)) => out.push(format!(
                "it shares the {ns} namespace ({}) with the caller",
                a.display()
            )),
            (Err(e), _) | (_, Err(e)) => out.push(format!("its {ns} namespace cannot be read: {e}")),
        }
    }
    match std::fs::read_dir(proc.join("root")) {
        Ok(entries) => {
            let names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            if !names.is_empty() {
                out.push(format!("its root directory is not empty: {}", names.join(" ")));
            }
        }
        Err(e) => out.push(format!("its root directory cannot be read: {e}")),
    }
    match std::fs::read_dir(proc.join("fd")) {
        Ok(entries) => {
            for e in entries.flatten() {
                let n: u32 = e.file_name().to_string_lossy().parse().unwrap_or(u32::MAX);
                let target = std::fs::read_link(e.path())
                    .map(|t| t.display().to_string())
                    .unwrap_or_default();
                // Its own smaps, opened before its root changed (`enter`):
                // named from the host's /proc, or from the detached mount.
                let own_smaps = target == format!("/proc/{pid}/smaps") || target == format!("/{pid}/smaps");
                if n > 2 && !own_smaps && !allowed(&target) {
                    out.push(format!("it holds fd {n} ({target}), which it was not given"));
                }
            }
        }
        Err(e) => out.push(format!("its descriptors cannot be read: {e}")),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unjailed_process_falls_short_on_every_count() {
        // This test process: root (CI runs as root) or not, it shares every
        // namespace with itself and its root is the host's.
        let v = violations(std::process::id(), |_| false);
        for want in [
            "NoNewPrivs",
            "shares the mnt namespace",
            "shares the net namespace",
            "root directory is not empty",
        ] {
            assert!(v.iter().any(|s| s.contains(want)), "no `{want}` in {v:#?}");
        }
        // A test harness holds more than stdio.
        // Reading its own fd directory holds one more descriptor.
        assert!(v.iter().any(|s| s.contains("which it was not given")), "{v:#?}");
        assert_eq!(violations(u32::MAX, |_| true).len(), 1);
    }
}
