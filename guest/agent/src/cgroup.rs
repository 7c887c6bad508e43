//! Reading a container's cgroup v2 files (`/sys/fs/cgroup/k7d/<id>`).

use k7d_agent::proto::CgroupStats;
use std::path::Path;

/// Parses a flat-keyed file (`cpu.stat`, `memory.stat`, `memory.events`):
/// `key value` lines. Lines that do not parse are skipped.
pub fn parse_keyed(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|line| {
            let mut it = line.split_whitespace();
            let key = it.next()?;
            let value = it.next()?.parse().ok()?;
            Some((key.to_owned(), value))
        })
        .collect()
}

/// Parses a single-value file (`memory.current`, `pids.max`): `max` and
/// anything unparsable are 0.
pub fn parse_value(text: &str) -> u64 {
    text.trim().parse().unwrap_or(0)
}

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).unwrap_or_default()
}

/// The cgroup's statistics; missing files read as zero or empty.
pub fn stats(dir: &Path) -> CgroupStats {
    CgroupStats {
        pids_current: parse_value(&read(dir, "pids.current")),
        pids_limit: parse_value(&read(dir, "pids.max")),
        cpu: parse_keyed(&read(dir, "cpu.stat")),
        memory_usage: parse_value(&read(dir, "memory.current")),
        memory_limit: parse_value(&read(dir, "memory.max")),
        memory_stat: parse_keyed(&read(dir, "memory.stat")),
        memory_events: parse_keyed(&read(dir, "memory.events")),
    }
}

/// `memory.events`'s `oom_kill` count (0 when unreadable).
pub fn oom_kills(dir: &Path) -> u64 {
    parse_keyed(&read(dir, "memory.events"))
        .into_iter()
        .find(|(k, _)| k == "oom_kill")
        .map_or(0, |(_, v)| v)
}

/// Moves `pid` into the cgroup `dir`, made first when missing.
pub fn enter(dir: &Path, pid: i32) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("cgroup.procs"), pid.to_string())
}

/// The pids in `cgroup.procs` (empty when the cgroup does not exist).
pub fn pids(dir: &Path) -> Vec<u32> {
    read(dir, "cgroup.procs")
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_and_single_value_files_parse_and_max_is_zero() {
        let cpu = "usage_usec 1234\nuser_usec 1000\nsystem_usec 234\nnr_periods 0\nbogus\nx y\n";
        assert_eq!(
            parse_keyed(cpu),
            [
                ("usage_usec".into(), 1234),
                ("user_usec".into(), 1000),
                ("system_usec".into(), 234),
                ("nr_periods".into(), 0)
            ]
        );
        assert_eq!(parse_value("max\n"), 0);
        assert_eq!(parse_value("268435456\n"), 268_435_456);
        assert_eq!(parse_value(""), 0);
    }

    #[test]
    fn stats_read_a_cgroup_directory_and_tolerate_missing_files() {
        let dir = std::env::temp_dir().join(format!("k7d-agent-cg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("pids.current"), "3\n").unwrap();
        std::fs::write(dir.join("pids.max"), "max\n").unwrap();
        std::fs::write(dir.join("memory.current"), "4096\n").unwrap();
        std::fs::write(dir.join("memory.max"), "1048576\n").unwrap();
        std::fs::write(dir.join("memory.events"), "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n").unwrap();
        std::fs::write(dir.join("cgroup.procs"), "12\n40\n").unwrap();
        let s = stats(&dir);
        assert_eq!(s.pids_current, 3);
        assert_eq!(s.pids_limit, 0);
        assert_eq!(s.memory_usage, 4096);
        assert_eq!(s.memory_limit, 1_048_576);
        assert!(s.cpu.is_empty(), "cpu.stat is missing");
        assert_eq!(s.memory_events.len(), 5);
        assert_eq!(oom_kills(&dir), 1);
        assert_eq!(pids(&dir), [12, 40]);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(oom_kills(&dir), 0);
        assert_eq!(stats(&dir), CgroupStats::default());
    }
}
