//! A CRI pod's network as the CNI set it up: containerd's CRI plugin made
//! the pod's network namespace (named in the sandbox spec) and the CNI put
//! the pod's interface (`eth0`) there with its address and routes. The pod
//! VM's NIC is attached to that interface through k7d's datapath (the
//! daemon does it), and the guest agent gives the VM's NIC the same
//! address, gateway and MTU ([`PodNet`], read here from inside the netns).

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
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

/// Reads `POD_IF`'s IPv4 address, MTU and default gateway inside `netns`
/// (on a thread that enters it: the shim's own namespace is untouched).
pub fn read(netns: &Path) -> anyhow::Result<PodNet> {
    let ns = std::fs::File::open(netns)
        .with_context(|| format!("cannot open the pod's network namespace {}", netns.display()))?;
    let path = netns.to_path_buf();
    std::thread::Builder::new()
        .name("k7d-shim-podnet".into())
        .spawn(move || -> anyhow::Result<PodNet> {
            // SAFETY: setns changes this thread's network namespace only;
            // `ns` is an open descriptor (a non-namespace file is refused).
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                bail!(
                    "{} is not a network namespace the shim can enter: {}",
                    path.display(),
                    std::io::Error::last_os_error()
                );
            }
            let (addr, prefix) = ipv4_of(POD_IF)?.with_context(|| {
                format!(
                    "the pod's {POD_IF} in {} has no IPv4 address (the CNI did not set it up)",
                    path.display()
                )
            })?;
            let mtu = std::fs::read_to_string(format!("/sys/class/net/{POD_IF}/mtu"))
                .ok()
                .and_then(|m| m.trim().parse().ok())
                .unwrap_or(1500);
            // /proc/thread-self: /proc/self/net is the thread group
            // leader's namespace, not this thread's.
            let routes = std::fs::read_to_string("/proc/thread-self/net/route")
                .context("cannot read the pod's routes (/proc/thread-self/net/route)")?;
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

/// The IPv4 address and prefix of interface `name` (this thread's netns).
fn ipv4_of(name: &str) -> anyhow::Result<Option<(Ipv4Addr, u8)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        bail!("cannot list the pod's addresses: {}", std::io::Error::last_os_error());
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null name is a NUL-terminated string of the list.
        let n = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: a non-null address points at a sockaddr of its family.
        if n.to_bytes() != name.as_bytes() || i32::from(unsafe { (*ifa.ifa_addr).sa_family }) != libc::AF_INET {
            continue;
        }
        // SAFETY: AF_INET: both point at `sockaddr_in`s.
        let (a, m) = unsafe {
            (
                (*ifa.ifa_addr.cast::<libc::sockaddr_in>()).sin_addr.s_addr,
                (*ifa.ifa_netmask.cast::<libc::sockaddr_in>()).sin_addr.s_addr,
            )
        };
        found = Some((Ipv4Addr::from(u32::from_be(a)), u32::from_be(m).count_ones() as u8));
        break;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(found)
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
        // native-endian (x86: little-endian) word.
        (gw != 0).then(|| Ipv4Addr::from(gw.to_le_bytes()))
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
