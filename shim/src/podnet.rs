//! A CRI pod's network as the CNI set it up: containerd's CRI plugin made
//! the pod's network namespace (named in the sandbox spec) and the CNI put
//! the pod's interface (`eth0`) there with its address and routes. The pod
//! VM's NIC is attached to that interface through k7d's datapath (the
//! daemon does it), and the guest agent gives the VM's NIC the same
//! address, gateway and MTU ([`PodNet`], read here from inside the netns).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// The interface the CNI gives a pod.
pub const POD_IF: &str = "eth0";

/// The pod's IPv4 network on its interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodNet {
    /// The pod's network namespace.
    pub netns: PathBuf,
    /// `a.b.c.d/len`.
    pub address: String,
    /// The default route's gateway.
    pub gateway: Option<String>,
    /// The interface's MTU.
    pub mtu: u32,
}

/// The network namespace the sandbox spec joins (`linux.namespaces`, type
/// `network`, with a path); none for a host-network pod or a plain
/// `ctr run`.
pub fn netns_path(spec: &serde_json::Value) -> Option<PathBuf> {
    spec.pointer("/linux/namespaces")?
        .as_array()?
        .iter()
        .find(|n| n.get("type").and_then(|t| t.as_str()) == Some("network"))?
        .get("path")?
        .as_str()
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// Takes the pod's network for its VM: reads `POD_IF`'s IPv4 address, MTU
/// and default gateway inside `netns`, then removes the address from
/// `POD_IF` (on a thread that enters the netns: the shim's own namespace is
/// untouched). The address belongs to the guest now: left on `POD_IF`, the
/// pod netns would answer ARP for it itself once `POD_IF` is a port of the
/// bridge chain (`docs/datapath.md`), and the pods could not talk.
pub fn take(netns: &Path) -> anyhow::Result<PodNet> {
    use std::os::unix::fs::OpenOptionsExt;
    // O_NONBLOCK: a FIFO in the namespace's place must not hang the create
    // (setns refuses anything but a namespace).
    let ns = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(netns)
        .with_context(|| format!("cannot open the pod's network namespace {}", netns.display()))?;
    let path = netns.to_path_buf();
    std::thread::Builder::new()
        .name("k7d-shim-podnet".into())
        .spawn(move || -> anyhow::Result<PodNet> {
            // This thread's network namespace only (a non-namespace file
            // is refused).
            if let Err(e) = k7d_sys::netif::setns_net(&ns) {
                bail!("{} is not a network namespace the shim can enter: {e}", path.display());
            }
            let (addr, prefix) = k7d_sys::netif::ipv4_of(POD_IF)
                .context("cannot list the pod's addresses")?
                .with_context(|| {
                    format!(
                        "the pod's {POD_IF} in {} has no IPv4 address (the CNI did not set it up)",
                        path.display()
                    )
                })?;
            // Not /sys/class/net: sysfs shows the namespace of whoever
            // mounted it, not this thread's.
            let mtu =
                k7d_sys::netif::mtu_of(POD_IF).with_context(|| format!("cannot read the MTU of the pod's {POD_IF}"))?;
            // /proc/thread-self: /proc/self/net is the thread group
            // leader's namespace, not this thread's.
            let routes = std::fs::read_to_string("/proc/thread-self/net/route")
                .context("cannot read the pod's routes (/proc/thread-self/net/route)")?;
            k7d_sys::netif::release_ipv4(POD_IF)
                .with_context(|| format!("cannot take the address off the pod's {POD_IF}"))?;
            Ok(PodNet {
                netns: path,
                address: format!("{addr}/{prefix}"),
                gateway: default_gateway(&routes, POD_IF).map(|g| g.to_string()),
                mtu,
            })
        })
        .context("cannot start a thread to read the pod's network")?
        .join()
        .map_err(|_| anyhow::anyhow!("reading the pod's network failed (the thread panicked)"))?
}

/// The gateway of the default route through `iface` in `/proc/net/route`'s
/// text.
fn default_gateway(routes: &str, iface: &str) -> Option<Ipv4Addr> {
    routes.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() < 8 || f[0] != iface || f[1] != "00000000" || f[7] != "00000000" {
            return None;
        }
        let gw = u32::from_str_radix(f[2], 16).ok()?;
        // The kernel prints the address's memory (network order) as a
        // native-endian word.
        (gw != 0).then(|| Ipv4Addr::from(gw.to_ne_bytes()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sandbox_specs_netns_path_is_found() {
        let spec = serde_json::json!({"linux": {"namespaces": [
            {"type": "pid"}, {"type": "network", "path": "/var/run/netns/cni-1234"}
        ]}});
        assert_eq!(netns_path(&spec), Some(PathBuf::from("/var/run/netns/cni-1234")));
        let host = serde_json::json!({"linux": {"namespaces": [{"type": "network"}]}});
        assert_eq!(netns_path(&host), None, "a new netns of its own: no pod network");
        assert_eq!(netns_path(&serde_json::json!({})), None);
    }

    /// A real pod netns (made with `ip`; needs root): the CNI's view of
    /// eth0 as the shim reads it, MTU included (not the host's sysfs).
    #[test]
    fn a_pods_address_mtu_and_gateway_are_read_inside_its_netns() {
        let ns = format!("k7d-shim-podnet-{}", std::process::id());
        let ip = |args: &[&str]| {
            let out = std::process::Command::new("ip").args(args).output().unwrap();
            assert!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        ip(&["netns", "add", &ns]);
        let r = std::panic::catch_unwind(|| {
            ip(&[
                "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
            ]);
            ip(&["-n", &ns, "link", "set", "eth0", "mtu", "1410", "up"]);
            ip(&["-n", &ns, "link", "set", "peer0", "up"]);
            ip(&["-n", &ns, "addr", "add", "10.99.0.5/24", "dev", "eth0"]);
            ip(&["-n", &ns, "route", "add", "default", "via", "10.99.0.1", "dev", "eth0"]);
            let p = PathBuf::from(format!("/run/netns/{ns}"));
            let got = take(&p).unwrap();
            assert_eq!(
                got,
                PodNet {
                    netns: p.clone(),
                    address: "10.99.0.5/24".into(),
                    gateway: Some("10.99.0.1".into()),
                    mtu: 1410,
                }
            );
            // The address is the guest's now: gone from the pod's eth0.
            let out = std::process::Command::new("ip")
                .args(["-n", &ns, "-4", "-o", "addr", "show", "dev", "eth0"])
                .output()
                .unwrap();
            assert_eq!(
                String::from_utf8_lossy(&out.stdout).trim(),
                "",
                "eth0 keeps no IPv4 address"
            );
            // Not a namespace: one sentence, no hang.
            let e = format!("{:#}", take(Path::new("/proc/version")).unwrap_err());
            assert!(e.contains("is not a network namespace"), "{e}");
        });
        ip(&["netns", "delete", &ns]);
        if let Err(p) = r {
            std::panic::resume_unwind(p);
        }
    }

    #[test]
    fn the_default_gateway_is_read_from_the_route_table() {
        let routes = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
            eth0\t00000000\t0100580A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
            eth0\t0000580A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n";
        assert_eq!(default_gateway(routes, "eth0"), Some(Ipv4Addr::new(10, 88, 0, 1)));
        assert_eq!(default_gateway(routes, "eth1"), None);
        let no_default = "Iface\tDestination\tGateway\n eth0\t0000580A\t00000000\t0001\t0\t0\t0\t0000FFFF\n";
        assert_eq!(default_gateway(no_default, "eth0"), None);
    }
}
