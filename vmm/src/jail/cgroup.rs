//! The cgroup v2 leaf of each VM process (issue 36, `docs/security.md`):
//! the daemon makes `<root>/vm-<uid>` for a VM process, moves the process
//! into it before the process is handed any guest input, and sets its
//! limits when it knows the VM: `memory.max` of the guest's RAM plus
//! [`VMM_ALLOWANCE_MIB`] (twice the RAM once it is a fork source: its
//! frozen base stays charged to it, and what it writes after the fork is
//! copied on top), `cpu.max` of one CPU per vCPU plus one for the device
//! workers. The root (`k7d daemon --jail-cgroup`, by default
//! `/sys/fs/cgroup/k7d`) must sit in a cgroup v2 hierarchy whose parent
//! has the memory and cpu controllers: a daemon that cannot have them
//! refuses to start (`--jail-cgroup off` runs VM processes without limits,
//! and says so in each VM's `info`).
//!
//! A pod VM's leaf then moves under its pod's cgroup ([`enter_pod`], the
//! `pod_cgroup` request): the same name and limits, so the kubelet's
//! accounting of the pod includes its VM.
//!
//! Everything here is file writes under cgroupfs, from outside the VM
//! process (which has no filesystem to reach its own cgroup through).

use std::path::{Path, PathBuf};

/// What a VM process may use beyond its guest's RAM (its own code, thread
/// stacks, device buffers, the page cache of what its devices read).
pub const VMM_ALLOWANCE_MIB: u64 = 128;

/// The period of `cpu.max`, in microseconds (the kernel's default).
const CPU_PERIOD_US: u64 = 100_000;

/// The controllers a leaf needs.
const CONTROLLERS: [&str; 2] = ["memory", "cpu"];

/// The directory under which VM processes' leaves are made.
#[derive(Debug, Clone)]
pub struct CgroupRoot {
    dir: PathBuf,
}

/// The leaf name of the VM process with `uid`.
pub fn leaf_name(uid: u32) -> String {
    format!("vm-{uid}")
}

impl CgroupRoot {
    /// Makes `dir` (if missing) in its parent cgroup v2 directory and
    /// delegates the memory and cpu controllers to it and its leaves;
    /// refuses, with a sentence, a parent that is not cgroup v2 or lacks
    /// either controller.
    pub fn prepare(dir: &Path) -> Result<Self, String> {
        let off =
            "(--jail-cgroup off runs VM processes without memory or CPU limits, --jail off every VM inside the daemon)";
        let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).ok_or_else(|| {
            format!(
                "the VM processes' cgroup {} has no parent directory {off}",
                dir.display()
            )
        })?;
        let have = std::fs::read_to_string(parent.join("cgroup.controllers")).map_err(|e| {
            format!(
                "{} is not a cgroup v2 directory (no cgroup.controllers: {e}) {off}",
                parent.display()
            )
        })?;
        let have: Vec<&str> = have.split_whitespace().collect();
        if let Some(missing) = CONTROLLERS.iter().find(|c| !have.contains(c)) {
            return Err(format!(
                "the cgroup {} has no {missing} controller (it has: {}) {off}",
                parent.display(),
                have.join(" ")
            ));
        }
        enable_controllers(parent).map_err(|e| format!("{e} {off}"))?;
        match std::fs::create_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("cannot make the cgroup {}: {e} {off}", dir.display())),
        }
        enable_controllers(dir).map_err(|e| format!("{e} {off}"))?;
        Ok(Self { dir: dir.to_path_buf() })
    }

    /// Where the leaves are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Makes the leaf of the VM process `uid` (host pid `pid`) and moves
    /// the process into it.
    pub fn enter(&self, uid: u32, pid: u32) -> Result<PathBuf, String> {
        enter_leaf(self.dir.join(leaf_name(uid)), pid)
    }

    /// Removes the empty leaves `vm-<uid>` whose uid is `mine` (a VM
    /// process of this daemon's id range gone with an earlier daemon, not
    /// one it re-attached); a leaf still holding a process stays, and so
    /// does every leaf of another daemon's range (it may be one made a
    /// moment before its process enters it). Returns how many went.
    pub fn sweep(&self, mine: impl Fn(u32) -> bool) -> usize {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        rd.flatten()
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_prefix("vm-"))
                    .and_then(|u| u.parse::<u32>().ok())
                    .is_some_and(&mine)
            })
            .filter(|e| std::fs::remove_dir(e.path()).is_ok())
            .count()
    }
}

/// Where the node's cgroup v2 hierarchy is mounted: a pod's
/// `cgroup_parent` is a path from here.
pub const NODE_CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Makes the leaf `name` under the pod's cgroup `pod` (a cgroup v2
/// directory, made by the kubelet), delegates the memory and cpu
/// controllers to it, and moves the VM process `pid` into it. On an error
/// the process stays where it was and the new leaf is gone.
pub fn enter_pod(pod: &Path, name: &str, pid: u32) -> Result<PathBuf, String> {
    if !pod.join("cgroup.controllers").is_file() {
        return Err(format!("{} is not a cgroup v2 directory", pod.display()));
    }
    enable_controllers(pod)?;
    enter_leaf(pod.join(name), pid)
}

/// Makes the cgroup `leaf` (if missing) and moves process `pid` into it;
/// on an error the process stays where it was and the leaf is gone.
fn enter_leaf(leaf: PathBuf, pid: u32) -> Result<PathBuf, String> {
    match std::fs::create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot make the cgroup {}: {e}", leaf.display())),
    }
    if let Err(e) = std::fs::write(leaf.join("cgroup.procs"), pid.to_string()) {
        let _ = std::fs::remove_dir(&leaf);
        return Err(format!(
            "cannot move VM process {pid} into the cgroup {}: {e}",
            leaf.display()
        ));
    }
    Ok(leaf)
}

/// Sets the limits of the leaf `leaf` for a VM of `memory_mib` MiB and
/// `vcpus` vCPUs (module docs).
pub fn limit(leaf: &Path, memory_mib: u64, vcpus: u8) -> Result<(), String> {
    let memory = memory_mib.saturating_add(VMM_ALLOWANCE_MIB).saturating_mul(1 << 20);
    let cpu = (u64::from(vcpus) + 1) * CPU_PERIOD_US;
    for (file, value) in [
        ("memory.max", memory.to_string()),
        ("cpu.max", format!("{cpu} {CPU_PERIOD_US}")),
    ] {
        std::fs::write(leaf.join(file), &value)
            .map_err(|e| format!("cannot set {file} of the cgroup {} to {value}: {e}", leaf.display()))?;
    }
    Ok(())
}

/// Removes the leaf `leaf` once its process is gone (a cgroup empties a
/// moment after its last process is reaped): tries for up to a second.
pub fn remove(leaf: &Path) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        match std::fs::remove_dir(leaf) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) if std::time::Instant::now() >= until => {
                tracing::warn!(cgroup = %leaf.display(), error = %e, "cannot remove a VM process's cgroup");
                return;
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
}

/// Delegates [`CONTROLLERS`] to `dir`'s children (those it has already
/// are left as they are).
fn enable_controllers(dir: &Path) -> Result<(), String> {
    let file = dir.join("cgroup.subtree_control");
    let on = std::fs::read_to_string(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let on: Vec<&str> = on.split_whitespace().collect();
    let want: Vec<String> = CONTROLLERS
        .iter()
        .filter(|c| !on.contains(c))
        .map(|c| format!("+{c}"))
        .collect();
    if want.is_empty() {
        return Ok(());
    }
    std::fs::write(&file, want.join(" ")).map_err(|e| {
        format!(
            "cannot delegate the {} controllers to the children of {}: {e}",
            CONTROLLERS.join(" and "),
            dir.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("k7d-cgroup-unit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_parent_that_is_not_cgroup_v2_or_lacks_a_controller_is_refused_with_a_sentence() {
        let d = scratch("refused");
        let e = CgroupRoot::prepare(&d.join("k7d")).unwrap_err();
        assert!(
            e.contains("is not a cgroup v2 directory") && e.contains("--jail-cgroup off"),
            "{e}"
        );
        assert!(!d.join("k7d").exists(), "nothing made for a refused root");
        std::fs::write(d.join("cgroup.controllers"), "cpuset cpu io pids\n").unwrap();
        let e = CgroupRoot::prepare(&d.join("k7d")).unwrap_err();
        assert!(
            e.contains("has no memory controller") && e.contains("cpuset cpu io pids"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn limits_are_guest_ram_plus_the_allowance_and_a_cpu_per_vcpu_plus_one() {
        let d = scratch("limits");
        limit(&d, 256, 2).unwrap();
        let mem = std::fs::read_to_string(d.join("memory.max")).unwrap();
        assert_eq!(mem, ((256 + VMM_ALLOWANCE_MIB) << 20).to_string());
        assert_eq!(std::fs::read_to_string(d.join("cpu.max")).unwrap(), "300000 100000");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_sweep_removes_only_empty_leaves_of_its_own_free_ids() {
        let d = scratch("sweep");
        for n in ["vm-5", "vm-6", "vm-7", "vm-100", "vm-x", "other"] {
            std::fs::create_dir(d.join(n)).unwrap();
        }
        // A leaf still holding a process cannot be removed (here: a file).
        std::fs::write(d.join("vm-6").join("cgroup.procs"), "42\n").unwrap();
        let root = CgroupRoot { dir: d.clone() };
        // Ids 5..10 are this daemon's; 7 was re-attached.
        assert_eq!(root.sweep(|u| (5..10).contains(&u) && u != 7), 1);
        assert!(!d.join("vm-5").exists());
        for kept in ["vm-6", "vm-7", "vm-100", "vm-x", "other"] {
            assert!(d.join(kept).exists(), "{kept} was swept");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn delegation_writes_only_the_controllers_missing() {
        let d = scratch("delegate");
        std::fs::write(d.join("cgroup.subtree_control"), "cpu pids\n").unwrap();
        enable_controllers(&d).unwrap();
        assert_eq!(
            std::fs::read_to_string(d.join("cgroup.subtree_control")).unwrap(),
            "+memory"
        );
        std::fs::write(d.join("cgroup.subtree_control"), "memory cpu\n").unwrap();
        enable_controllers(&d).unwrap();
        assert_eq!(
            std::fs::read_to_string(d.join("cgroup.subtree_control")).unwrap(),
            "memory cpu\n",
            "nothing written when both are on"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
