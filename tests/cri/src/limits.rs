//! `k7d-cri pod --limits-out/--limits-like`: the limits a container sees,
//! compared between runtimes line by line, and 1 000 processes of a
//! non-root container (issue 38, "limits as under runc").
//!
//! Container B runs as [`USER`]. It reports `ulimit -a` and the kernel
//! limits it can read ([`SYSCTLS`]); the runc pod writes the report to a
//! file, the k7d pod's must equal it line by line. Then B starts
//! [`PROCESSES`] processes at once: a pod VM's kernel alone would stop it
//! near 800 (its `RLIMIT_NPROC` comes from its small RAM).

use crate::{Client, exec};
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::time::{Duration, Instant};

/// B's user: `nobody`, not root.
pub const USER: i64 = 65534;
/// How many processes B starts at once.
pub const PROCESSES: usize = 1000;
/// The kernel limits a container reads, under /proc/sys.
const SYSCTLS: &[&str] = &[
    "fs/file-max",
    "fs/nr_open",
    "fs/inotify/max_user_instances",
    "fs/inotify/max_user_watches",
    "kernel/pid_max",
    "kernel/threads-max",
];

/// The report B prints: `ulimit -a`, then `<sysctl>: <value>` lines.
fn report_script() -> String {
    format!(
        "ulimit -a && for f in {}; do echo \"$f: $(cat /proc/sys/$f)\"; done",
        SYSCTLS.join(" ")
    )
}

/// How many step limits B's [`PROCESSES`] may take: 1 000 forks of a shell
/// in a nested pod VM on an emulated L1 took most of one step's 120 s on a
/// slow host, where runc's, in L1 itself, take a few seconds.
const PROCESSES_LIMITS: u32 = 4;

/// B starts [`PROCESSES`] sleepers, each sleeping `sleep_s` (longer than the
/// whole start may take, so none has ended when they are counted), counts
/// its PID namespace's processes while they all live, then stops them;
/// prints the count.
fn processes_script(sleep_s: u64) -> String {
    format!(
        "n=0; p=; while [ $n -lt {PROCESSES} ]; do sleep {sleep_s} & p=\"$p $!\"; n=$((n+1)); done; \
         c=$(ls /proc | grep -c '^[0-9][0-9]*$'); kill $p; wait; echo $c"
    )
}

/// The limit of the `limits` step, whose last exec may take
/// [`PROCESSES_LIMITS`] step limits.
pub fn step_limit(limit: Duration) -> Duration {
    limit * (PROCESSES_LIMITS + 2)
}

/// The lines of `ours` that differ from `like`'s, described.
fn differences(like: &str, ours: &str) -> Vec<String> {
    let (a, b): (Vec<&str>, Vec<&str>) = (like.lines().collect(), ours.lines().collect());
    let mut out = Vec::new();
    for i in 0..a.len().max(b.len()) {
        let (x, y) = (a.get(i).copied(), b.get(i).copied());
        if x != y {
            out.push(format!(
                "line {}: reference '{}', here '{}'",
                i + 1,
                x.unwrap_or("(none)"),
                y.unwrap_or("(none)")
            ));
        }
    }
    out
}

/// Checks B's user, writes its report to `out` and/or compares it with
/// `like`'s, and starts [`PROCESSES`] processes in it.
pub async fn check(
    client: &mut Client,
    b: &str,
    limit: Duration,
    out: Option<&Path>,
    like: Option<&Path>,
) -> Result<()> {
    let uid = exec(client, b, &["id", "-u"], limit).await?;
    if uid != USER.to_string() {
        bail!("container B runs as uid {uid}, expected {USER} (run_as_user)");
    }
    let report = exec(client, b, &["sh", "-c", &report_script()], limit).await?;
    for line in report.lines() {
        println!("cri: limits: {line}");
    }
    if let Some(out) = out {
        std::fs::write(out, format!("{report}\n")).with_context(|| format!("cannot write {}", out.display()))?;
    }
    if let Some(like) = like {
        let reference = std::fs::read_to_string(like).with_context(|| format!("cannot read {}", like.display()))?;
        let diff = differences(&reference, &report);
        for d in &diff {
            println!("cri: limits differ: {d}");
        }
        if !diff.is_empty() {
            bail!(
                "{} of the limits B sees differ from {}'s (first: {})",
                diff.len(),
                like.display(),
                diff[0]
            );
        }
        println!(
            "cri: limits: all {} lines as in {}",
            report.lines().count(),
            like.display()
        );
    }
    let t = Instant::now();
    let within = limit * PROCESSES_LIMITS;
    let script = processes_script(within.as_secs() + 60);
    let count = exec(client, b, &["sh", "-c", &script], within)
        .await
        .with_context(|| format!("B (uid {USER}) could not start {PROCESSES} processes"))?;
    let count: usize = count
        .parse()
        .with_context(|| format!("B's process count '{count}' is not a number"))?;
    // The sleepers, and at least B's own init and the exec's shell.
    if count < PROCESSES + 2 {
        bail!(
            "B counted {count} processes while its {PROCESSES} sleepers lived, expected at least {}",
            PROCESSES + 2
        );
    }
    println!(
        "cri: limits: uid {USER} ran {count} processes at once ({} ms)",
        t.elapsed().as_millis()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differing_lines_are_named_with_both_sides() {
        assert!(differences("a\nb\n", "a\nb").is_empty());
        assert_eq!(
            differences("-p: processes 10985\nx", "-p: processes 805"),
            [
                "line 1: reference '-p: processes 10985', here '-p: processes 805'",
                "line 2: reference 'x', here '(none)'"
            ]
        );
    }

    #[test]
    fn the_scripts_name_every_sysctl_and_the_process_count() {
        let r = report_script();
        assert!(SYSCTLS.iter().all(|s| r.contains(s)));
        let p = processes_script(540);
        assert!(p.contains("-lt 1000") && p.contains("sleep 540 &"), "{p}");
        assert_eq!(step_limit(Duration::from_secs(120)), Duration::from_secs(720));
    }
}
