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
            // Not /sys/class/net: sysfs shows the namespace of whoever
            // mounted it, not this thread's.
            let mtu = mtu_of(POD_IF).with_context(|| format!("cannot read the MTU of the pod's {POD_IF}"))?;
            // /proc/thread-self: /proc/self/net is the thread group
            // leader's namespace, not this thread's.
            let routes = std::fs::read_to_string("/proc/thread-self/net/route")
                .context("cannot read the pod's routes (/proc/thread-self/net/route)")?;
            release_ipv4(POD_IF).with_context(|| format!("cannot take the address off the pod's {POD_IF}"))?;
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

/// An `AF_INET` socket (in this thread's network namespace) and an
/// `ifreq` naming `name`.
fn if_request(name: &str) -> anyhow::Result<(std::os::fd::OwnedFd, libc::ifreq)> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: `socket` takes plain integers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        bail!("cannot open a socket: {}", std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by `socket` and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `ifreq` is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        bail!("the interface name {name} is too long");
    }
    for (dst, &src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = src as libc::c_char;
    }
    Ok((sock, req))
}

/// Removes interface `name`'s IPv4 address (`SIOCSIFADDR` of 0.0.0.0, as
/// `ifconfig NAME 0.0.0.0` does); its routes go with it.
fn release_ipv4(name: &str) -> anyhow::Result<()> {
    let (sock, mut req) = if_request(name)?;
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: 0 },
        sin_zero: [0; 8],
    };
    // SAFETY: `sockaddr_in` and `sockaddr` are both 16 bytes of plain data.
    req.ifr_ifru.ifru_addr = unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) };
    // SAFETY: `req` is a valid `ifreq` that SIOCSIFADDR reads.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFADDR, &req) } < 0 {
        bail!("SIOCSIFADDR failed: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// The MTU of interface `name` in this thread's network namespace.
fn mtu_of(name: &str) -> anyhow::Result<u32> {
    let (sock, mut req) = if_request(name)?;
    // SAFETY: `req` is a valid `ifreq` that SIOCGIFMTU fills.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFMTU, &mut req) } < 0 {
        bail!("SIOCGIFMTU failed: {}", std::io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFMTU filled the `ifru_mtu` member of the union.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    u32::try_from(mtu).map_err(|_| anyhow::anyhow!("the kernel reported MTU {mtu}"))
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
