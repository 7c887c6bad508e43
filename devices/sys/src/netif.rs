//! A thread's network namespace and its interfaces' IPv4 settings, read
//! and changed with the classic calls (`setns`, `getifaddrs`, the
//! `SIOC*IF*` ioctls): what reading a pod's network from inside its
//! namespace takes.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Moves the calling thread into the network namespace open at `ns` (a
/// file that is not one is refused by the kernel).
pub fn setns_net(ns: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: setns only reads the fd number; the caller keeps it open.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An `AF_INET` socket (in this thread's network namespace) and an
/// `ifreq` naming `name`.
fn if_request(name: &str) -> io::Result<(OwnedFd, libc::ifreq)> {
    // SAFETY: `socket` takes plain integers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by `socket` and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `ifreq` is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() || name.as_bytes().contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not an interface name"),
        ));
    }
    for (dst, &src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = src as libc::c_char;
    }
    Ok((sock, req))
}

/// Removes interface `name`'s IPv4 address (`SIOCSIFADDR` of 0.0.0.0, as
/// `ifconfig NAME 0.0.0.0` does); its routes go with it.
pub fn release_ipv4(name: &str) -> io::Result<()> {
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
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The MTU of interface `name` in this thread's network namespace.
pub fn mtu_of(name: &str) -> io::Result<u32> {
    let (sock, mut req) = if_request(name)?;
    // SAFETY: `req` is a valid `ifreq` that SIOCGIFMTU fills.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFMTU, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFMTU filled the `ifru_mtu` member of the union.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    u32::try_from(mtu).map_err(|_| io::Error::other(format!("the kernel reported MTU {mtu}")))
}

/// The IPv4 address and prefix length of interface `name` (this thread's
/// network namespace), if it has one.
pub fn ipv4_of(name: &str) -> io::Result<Option<(Ipv4Addr, u8)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_has_its_address_and_an_mtu_and_bad_names_are_refused() {
        assert_eq!(ipv4_of("lo").unwrap(), Some((Ipv4Addr::LOCALHOST, 8)));
        assert!(mtu_of("lo").unwrap() > 0);
        assert_eq!(ipv4_of("k7d-no-such-if").unwrap(), None);
        assert_eq!(
            mtu_of("a-name-far-too-long-for-ifreq").unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        let e = setns_net(&std::fs::File::open("/proc/self/status").unwrap()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
    }
}
