//! The guest's cgroup v2 statistics as containerd's `io.containerd.cgroups.v2.Metrics`
//! (what `ctr task metrics` and CRI's stats read).

use containerd_shim::protos::cgroups_v2::metrics::{CPUStat, MemoryEvents, MemoryStat, Metrics, PidsStat};
use containerd_shim::protos::protobuf::MessageField;
use k7d_agent::proto::CgroupStats;

/// The type URL containerd decodes the Any by.
pub const V2_TYPE_URL: &str = "io.containerd.cgroups.v2.Metrics";

fn field(list: &[(String, u64)], name: &str) -> u64 {
    list.iter().find(|(k, _)| k == name).map_or(0, |(_, v)| *v)
}

/// The metrics message for `s`.
pub fn v2(s: &CgroupStats) -> Metrics {
    let c = &s.cpu;
    let m = &s.memory_stat;
    let e = &s.memory_events;
    Metrics {
        pids: MessageField::some(PidsStat {
            current: s.pids_current,
            limit: s.pids_limit,
            ..Default::default()
        }),
        cpu: MessageField::some(CPUStat {
            usage_usec: field(c, "usage_usec"),
            user_usec: field(c, "user_usec"),
            system_usec: field(c, "system_usec"),
            nr_periods: field(c, "nr_periods"),
            nr_throttled: field(c, "nr_throttled"),
            throttled_usec: field(c, "throttled_usec"),
            ..Default::default()
        }),
        memory: MessageField::some(MemoryStat {
            anon: field(m, "anon"),
            file: field(m, "file"),
            kernel_stack: field(m, "kernel_stack"),
            slab: field(m, "slab"),
            sock: field(m, "sock"),
            shmem: field(m, "shmem"),
            file_mapped: field(m, "file_mapped"),
            file_dirty: field(m, "file_dirty"),
            inactive_anon: field(m, "inactive_anon"),
            active_anon: field(m, "active_anon"),
            inactive_file: field(m, "inactive_file"),
            active_file: field(m, "active_file"),
            unevictable: field(m, "unevictable"),
            pgfault: field(m, "pgfault"),
            pgmajfault: field(m, "pgmajfault"),
            usage: s.memory_usage,
            usage_limit: s.memory_limit,
            ..Default::default()
        }),
        memory_events: MessageField::some(MemoryEvents {
            low: field(e, "low"),
            high: field(e, "high"),
            max: field(e, "max"),
            oom: field(e, "oom"),
            oom_kill: field(e, "oom_kill"),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim::protos::protobuf::Message;

    #[test]
    fn guest_cgroup_fields_land_in_containerds_v2_metrics() {
        let s = CgroupStats {
            pids_current: 3,
            pids_limit: 0,
            cpu: vec![("usage_usec".into(), 1234), ("user_usec".into(), 1000)],
            memory_usage: 4096,
            memory_limit: 1 << 20,
            memory_stat: vec![("anon".into(), 512)],
            memory_events: vec![("oom_kill".into(), 1)],
        };
        let m = v2(&s);
        let back = Metrics::parse_from_bytes(&m.write_to_bytes().unwrap()).unwrap();
        assert_eq!(back.pids.current, 3);
        assert_eq!(back.cpu.usage_usec, 1234);
        assert_eq!(back.cpu.user_usec, 1000);
        assert_eq!(back.memory.usage, 4096);
        assert_eq!(back.memory.usage_limit, 1 << 20);
        assert_eq!(back.memory.anon, 512);
        assert_eq!(back.memory_events.oom_kill, 1);
    }
}
