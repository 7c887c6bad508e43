//! The limits a container would get under runc on this node, for a pod VM.
//!
//! runc gives a container the spec's `process.rlimits` and, for every
//! resource the spec leaves out, what runc inherited: the runc shim's,
//! which are containerd's. It runs on the node's kernel, so the container
//! reads the node's `threads-max`, `pid_max`, `file-max`, `nr_open` and
//! inotify limits. A pod VM's agent inherits its small kernel's defaults
//! instead, several derived from the VM's RAM (a 256 MiB VM gives its first
//! process `RLIMIT_NPROC` 805 where the node gives 10 985), so the shim
//! fills every missing rlimit with its own (inherited from containerd, as
//! runc's shim inherits them) and sends the node's sysctls for the agent
//! to write ([`NodeLimits`]).

use k7d_agent::proto::{NODE_SYSCTLS, NodeLimits};
use serde_json::{Value, json};
use std::sync::OnceLock;

/// Every rlimit, by its OCI name.
const RLIMITS: [(&str, libc::__rlimit_resource_t); 16] = [
    ("RLIMIT_CPU", libc::RLIMIT_CPU),
    ("RLIMIT_FSIZE", libc::RLIMIT_FSIZE),
    ("RLIMIT_DATA", libc::RLIMIT_DATA),
    ("RLIMIT_STACK", libc::RLIMIT_STACK),
    ("RLIMIT_CORE", libc::RLIMIT_CORE),
    ("RLIMIT_RSS", libc::RLIMIT_RSS),
    ("RLIMIT_NPROC", libc::RLIMIT_NPROC),
    ("RLIMIT_NOFILE", libc::RLIMIT_NOFILE),
    ("RLIMIT_MEMLOCK", libc::RLIMIT_MEMLOCK),
    ("RLIMIT_AS", libc::RLIMIT_AS),
    ("RLIMIT_LOCKS", libc::RLIMIT_LOCKS),
    ("RLIMIT_SIGPENDING", libc::RLIMIT_SIGPENDING),
    ("RLIMIT_MSGQUEUE", libc::RLIMIT_MSGQUEUE),
    ("RLIMIT_NICE", libc::RLIMIT_NICE),
    ("RLIMIT_RTPRIO", libc::RLIMIT_RTPRIO),
    ("RLIMIT_RTTIME", libc::RLIMIT_RTTIME),
];

/// What this node gives a container under runc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// (OCI name, soft, hard) for every rlimit this process could read.
    pub rlimits: Vec<(&'static str, u64, u64)>,
    /// The node's values of [`NODE_SYSCTLS`] (those it has).
    pub sysctls: NodeLimits,
}

impl Node {
    /// This process's rlimits and the node's sysctls. The shim never
    /// changes its own limits, so they are containerd's, as runc's shim's are.
    pub fn read() -> Node {
        let rlimits = RLIMITS
            .iter()
            .filter_map(|&(name, resource)| {
                let (soft, hard) = k7d_sys::file::rlimit(resource).ok()?;
                Some((name, soft, hard))
            })
            .collect();
        let sysctls = NODE_SYSCTLS
            .iter()
            .filter_map(|(name, range)| {
                let path = format!("/proc/sys/{}", name.replace('.', "/"));
                let v = std::fs::read_to_string(path).ok()?.trim().parse::<u64>().ok()?;
                range.contains(&v).then(|| (name.to_string(), v))
            })
            .collect();
        Node {
            rlimits,
            sysctls: NodeLimits { sysctls },
        }
    }

    /// This node's, read once per shim.
    pub fn get() -> &'static Node {
        static NODE: OnceLock<Node> = OnceLock::new();
        NODE.get_or_init(Node::read)
    }

    /// Adds to an OCI `process` object's `rlimits` each rlimit it lacks,
    /// with this node's values; the ones it names stay as they are.
    pub fn fill_rlimits(&self, process: &mut Value) -> Result<(), String> {
        let process = process
            .as_object_mut()
            .ok_or("the spec's process is not a JSON object")?;
        let list = process.entry("rlimits").or_insert_with(|| json!([]));
        let list = list
            .as_array_mut()
            .ok_or("the spec's process.rlimits is not an array")?;
        let named: Vec<String> = list
            .iter()
            .filter_map(|r| r.get("type").and_then(Value::as_str).map(str::to_owned))
            .collect();
        for &(name, soft, hard) in &self.rlimits {
            if !named.iter().any(|n| n == name) {
                list.push(json!({"type": name, "soft": soft, "hard": hard}));
            }
        }
        Ok(())
    }

    /// [`Node::fill_rlimits`] on a whole spec's `process`.
    pub fn fill_spec(&self, spec: &mut Value) -> Result<(), String> {
        match spec.get_mut("process") {
            Some(p) => self.fill_rlimits(p),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_and_node_are_read() {
        let n = Node::read();
        assert_eq!(n.rlimits.len(), RLIMITS.len(), "every rlimit reads on Linux");
        let nproc = n.rlimits.iter().find(|r| r.0 == "RLIMIT_NPROC").unwrap();
        assert!(nproc.1 <= nproc.2, "soft {} above hard {}", nproc.1, nproc.2);
        let pid_max = n.sysctls.sysctls.get("kernel.pid_max").copied().unwrap();
        let read: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(pid_max, read);
        assert!(n.sysctls.sysctls.contains_key("kernel.threads-max"));
        assert_eq!(n.sysctls.check(), Ok(()));
    }

    #[test]
    fn the_spec_keeps_its_own_rlimits_and_gets_the_nodes_for_the_rest() {
        let node = Node {
            rlimits: vec![("RLIMIT_NOFILE", 1024, 4096), ("RLIMIT_NPROC", 10985, 10985)],
            sysctls: NodeLimits::default(),
        };
        let mut spec = json!({"process": {"args": ["sh"],
            "rlimits": [{"type": "RLIMIT_NOFILE", "soft": 100, "hard": 200}]}});
        node.fill_spec(&mut spec).unwrap();
        assert_eq!(
            spec["process"]["rlimits"],
            json!([{"type": "RLIMIT_NOFILE", "soft": 100, "hard": 200},
                   {"type": "RLIMIT_NPROC", "soft": 10985, "hard": 10985}])
        );
        let mut bare = json!({"args": ["sh"]});
        node.fill_rlimits(&mut bare).unwrap();
        assert_eq!(bare["rlimits"].as_array().unwrap().len(), 2);
        let mut none = json!({"root": {}});
        node.fill_spec(&mut none).unwrap();
        assert_eq!(none, json!({"root": {}}), "no process: nothing to fill");
        for bad in [json!({"process": 1}), json!({"process": {"rlimits": {}}})] {
            let mut b = bad.clone();
            assert!(node.fill_spec(&mut b).is_err(), "{bad}");
        }
    }
}
