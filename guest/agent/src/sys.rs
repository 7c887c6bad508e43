//! Thin, checked wrappers over the Linux system calls the agent needs that
//! std does not offer: mounts, chroot, hostname, kernel release, signals, device
//! nodes, terminal size, fd passing, module loading, vsock sockets, an IPC
//! namespace for a child, non-blocking descriptors and `poll`.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// `s` as a C string, or `InvalidInput` when it holds a NUL byte.
fn cstr(s: &[u8]) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a string holds a NUL byte"))
}

fn cpath(p: &Path) -> io::Result<CString> {
    cstr(p.as_os_str().as_bytes())
}

/// Turns a `-1` return into the thread's `errno`.
fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `mount(2)`: `data` is the filesystem's option string.
pub fn mount(source: &OsStr, target: &Path, fstype: &str, flags: libc::c_ulong, data: Option<&str>) -> io::Result<()> {
    let source = cstr(source.as_bytes())?;
    let target = cpath(target)?;
    let fstype = cstr(fstype.as_bytes())?;
    let data = data.map(|d| cstr(d.as_bytes())).transpose()?;
    let data_ptr = data
        .as_ref()
        .map_or(std::ptr::null(), |d| d.as_ptr().cast::<libc::c_void>());
    // SAFETY: every pointer is a valid NUL-terminated string (or null for
    // `data`) that outlives the call.
    check(unsafe { libc::mount(source.as_ptr(), target.as_ptr(), fstype.as_ptr(), flags, data_ptr) })?;
    Ok(())
}

/// `umount2(target, MNT_DETACH)`: the mount leaves the namespace at once and
/// goes away when its last user does.
pub fn umount_detach(target: &Path) -> io::Result<()> {
    let target = cpath(target)?;
    // SAFETY: `target` is a valid NUL-terminated path.
    check(unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) })?;
    Ok(())
}

/// `umount2(target, 0)`: fails with `EBUSY` while the mount is in use.
pub fn umount(target: &Path) -> io::Result<()> {
    let target = cpath(target)?;
    // SAFETY: `target` is a valid NUL-terminated path.
    check(unsafe { libc::umount2(target.as_ptr(), 0) })?;
    Ok(())
}

/// Makes `cmd`'s child unshare its IPC namespace (`unshare(CLONE_NEWIPC)`)
/// before it execs; a failure fails the spawn.
pub fn in_new_ipc_namespace(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the hook runs in the forked child before exec and only makes
    // one async-signal-safe system call; it touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            check(libc::unshare(libc::CLONE_NEWIPC))?;
            Ok(())
        });
    }
}

/// Whether this process runs as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Runs `cmd` in a session of its own, as `uid`:`gid` with no
/// supplementary groups (an exec in the VM itself, `crate::vmexec`). An
/// agent that is not root (a host-side test) keeps its own ids.
pub fn as_user_in_new_session(cmd: &mut std::process::Command, uid: u32, gid: u32, controlling_tty: bool) {
    use std::os::unix::process::CommandExt;
    let root = is_root();
    // SAFETY: the hook runs in the forked child before exec (after std has
    // made its stdio fds 0-2) and only makes async-signal-safe system calls
    // on integers; it touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            check(libc::setsid())?;
            if controlling_tty {
                // Its stdin is a pty's peer: the new session's terminal.
                check(libc::ioctl(0, libc::TIOCSCTTY, 0))?;
            }
            if root {
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setgid(gid))?;
                check(libc::setuid(uid))?;
            }
            Ok(())
        });
    }
}

/// Whether this process runs as `uid`:`gid` (real and effective) with no
/// supplementary groups: what [`as_user_in_new_session`] would make of a
/// child, so a child needs no hook to be it.
pub fn runs_as(uid: u32, gid: u32) -> bool {
    // SAFETY: these take no arguments (getgroups with a zero size and a
    // null list only counts) and cannot fail.
    unsafe {
        libc::getuid() == uid
            && libc::geteuid() == uid
            && libc::getgid() == gid
            && libc::getegid() == gid
            && libc::getgroups(0, std::ptr::null_mut()) == 0
    }
}

/// `mknod(2)` of a node with `mode` (type and permissions) and `rdev`.
pub fn mknod(path: &Path, mode: u32, rdev: u64) -> io::Result<()> {
    let p = cpath(path)?;
    // SAFETY: `p` is a valid NUL-terminated path; the rest are integers.
    check(unsafe { libc::mknod(p.as_ptr(), mode as libc::mode_t, rdev as libc::dev_t) })?;
    Ok(())
}

/// `fork(2)`, for a process that has one thread (PID 1 before it starts
/// any): 0 in the child, the child's pid in the parent.
pub fn fork_single_threaded() -> io::Result<i32> {
    // SAFETY: fork has no memory arguments; with one thread in the caller
    // no lock is held by another thread at the fork, so the child may
    // allocate and run as a process of its own.
    let pid = unsafe { libc::fork() };
    check(pid)?;
    Ok(pid)
}

/// `setsid(2)`: a session (and process group) of its own.
pub fn setsid() -> io::Result<()> {
    // SAFETY: setsid takes no arguments.
    check(unsafe { libc::setsid() })?;
    Ok(())
}

/// `chroot(2)`.
pub fn chroot(path: &Path) -> io::Result<()> {
    let p = cpath(path)?;
    // SAFETY: `p` is a valid NUL-terminated path.
    check(unsafe { libc::chroot(p.as_ptr()) })?;
    Ok(())
}

/// Moves the mount at `from` onto `to` (`mount(2)` with `MS_MOVE`).
pub fn move_mount(from: &Path, to: &Path) -> io::Result<()> {
    let (f, t) = (cpath(from)?, cpath(to)?);
    // SAFETY: both are valid NUL-terminated paths; fstype and data are null.
    check(unsafe {
        libc::mount(
            f.as_ptr(),
            t.as_ptr(),
            std::ptr::null(),
            libc::MS_MOVE,
            std::ptr::null(),
        )
    })?;
    Ok(())
}

/// The filesystem type magic of the filesystem holding `path` (`statfs(2)`).
pub fn fs_magic(path: &Path) -> io::Result<i64> {
    let p = cpath(path)?;
    // SAFETY: all-zero is a valid `statfs`.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `p` is a valid path and `st` a writable `statfs`.
    check(unsafe { libc::statfs(p.as_ptr(), &mut st) })?;
    Ok(st.f_type as i64)
}

/// `sethostname(2)`.
pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: the pointer and length describe `name`'s bytes.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })?;
    Ok(())
}

/// The running kernel's release (`uname -r`).
pub fn kernel_release() -> String {
    // SAFETY: `utsname` is plain old data; all zeroes is a valid value.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uts` is a valid, writable `utsname`.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return String::from("unknown");
    }
    let bytes: Vec<u8> = uts.release.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `kill(2)`.
pub fn kill(pid: i32, signal: i32) -> io::Result<()> {
    // SAFETY: `kill` takes plain integers.
    check(unsafe { libc::kill(pid, signal) })?;
    Ok(())
}

/// Creates a block device node `path` for `major:minor` (mode 0600).
pub fn mknod_block(path: &Path, major: u32, minor: u32) -> io::Result<()> {
    let p = cpath(path)?;
    // SAFETY: `p` is a valid NUL-terminated path; the rest are integers.
    check(unsafe { libc::mknod(p.as_ptr(), libc::S_IFBLK | 0o600, libc::makedev(major, minor)) })?;
    Ok(())
}

/// A new pseudo-terminal: its master and its peer, both close-on-exec and
/// neither the agent's controlling terminal. The peer comes from the master
/// itself (`TIOCGPTPEER`), not from a path under `/dev/pts` another process
/// could swap.
pub fn open_pty() -> io::Result<(File, File)> {
    // SAFETY: posix_openpt takes flags only and returns a new fd or -1.
    let m = check(unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) })?;
    // SAFETY: `m` is a new fd that nothing else owns.
    let master = unsafe { File::from_raw_fd(m) };
    // SAFETY: unlockpt takes an open pty master fd.
    check(unsafe { libc::unlockpt(master.as_raw_fd()) })?;
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: TIOCGPTPEER takes open flags as its integer argument and
    // returns a new fd on the master's peer, or -1.
    let p = check(unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, flags) })?;
    // SAFETY: `p` is a new fd that nothing else owns.
    let peer = unsafe { File::from_raw_fd(p) };
    Ok((master, peer))
}

/// Sets a terminal's size (`TIOCSWINSZ`).
pub fn set_winsize(tty: &File, cols: u16, rows: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: `tty` is an open fd; `TIOCSWINSZ` reads one `winsize` from the
    // valid pointer.
    check(unsafe { libc::ioctl(tty.as_raw_fd(), libc::TIOCSWINSZ, &ws) })?;
    Ok(())
}

/// Receives one file descriptor sent with `SCM_RIGHTS` (runc's
/// `--console-socket` protocol: the data is the pty's name, the fd its
/// master). Any further fds in the message are closed.
pub fn recv_fd(sock: &UnixStream) -> io::Result<OwnedFd> {
    let mut data = [0u8; 4096];
    // Room for a `cmsghdr` and a few fds, 8-byte aligned.
    let mut control = [0u64; 16];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // SAFETY: `msghdr` is plain old data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    let n = loop {
        // SAFETY: `msg` points at live, writable buffers of the stated sizes.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: `msg` was filled by `recvmsg`; the CMSG_* helpers walk its
    // control buffer within `msg_controllen`.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: `cmsg` is non-null and points into `control`.
        let hdr = unsafe { &*cmsg };
        if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN(0) is a constant computation.
            let head = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = (hdr.cmsg_len as usize).saturating_sub(head) / std::mem::size_of::<RawFd>();
            // SAFETY: the header is an `SCM_RIGHTS` message of `cmsg_len`
            // bytes, inside `control`.
            let base = unsafe { libc::CMSG_DATA(cmsg) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: `i < count` stays within the message's data; the
                // data may be unaligned, hence `read_unaligned`.
                let fd = unsafe { base.add(i).read_unaligned() };
                if fd >= 0 {
                    // SAFETY: the kernel just installed `fd` in this process
                    // for us; nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        // SAFETY: as for CMSG_FIRSTHDR.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    if fds.is_empty() {
        let what = if n == 0 {
            "the peer closed without sending"
        } else {
            "a message without a descriptor"
        };
        return Err(io::Error::new(io::ErrorKind::InvalidData, what));
    }
    Ok(fds.swap_remove(0))
}

/// Loads a kernel module from an open `.ko` file (`finit_module(fd, "", 0)`).
pub fn finit_module(module: &File) -> io::Result<()> {
    // SAFETY: the fd is open and the parameter string is a valid, empty C
    // string; the flags are zero.
    let ret = unsafe { libc::syscall(libc::SYS_finit_module, module.as_raw_fd(), c"".as_ptr(), 0) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Makes this process a child subreaper: orphaned descendants are
/// reparented to it rather than to PID 1.
pub fn set_child_subreaper() -> io::Result<()> {
    // SAFETY: `PR_SET_CHILD_SUBREAPER` takes one integer argument.
    check(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) })?;
    Ok(())
}

/// Sets `IFF_UP` on the interface `name` (used for `lo`).
pub fn interface_up(name: &str) -> io::Result<()> {
    // SAFETY: `socket` takes plain integers.
    let fd = check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` was just returned by `socket` and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `ifreq` is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "an interface name is too long",
        ));
    }
    for (dst, &src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = src as libc::c_char;
    }
    // SAFETY: `req` is a valid `ifreq` the ioctl reads and writes.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) })?;
    // SAFETY: SIOCGIFFLAGS filled the `ifru_flags` member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    // SAFETY: as above.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) })?;
    Ok(())
}

/// Whether `fd` is open.
pub fn fd_is_open(fd: RawFd) -> bool {
    // SAFETY: F_GETFD only inspects the descriptor table.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    flags >= 0
}

/// Makes `fd` (0, 1 or 2) refer to `file`, leaving `file` open.
pub fn dup_onto(file: &File, fd: RawFd) -> io::Result<()> {
    // SAFETY: `file` is open; `dup2` onto a closed or standard descriptor.
    check(unsafe { libc::dup2(file.as_raw_fd(), fd) })?;
    Ok(())
}

/// A listening `AF_VSOCK` stream socket on `port`, any CID.
pub fn vsock_listen(port: u32) -> io::Result<OwnedFd> {
    // SAFETY: `socket` takes plain integers.
    let fd = check(unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` was just returned by `socket` and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let addr = libc::sockaddr_vm {
        svm_family: libc::AF_VSOCK as libc::sa_family_t,
        svm_reserved1: 0,
        svm_port: port,
        svm_cid: libc::VMADDR_CID_ANY,
        svm_zero: [0; 4],
    };
    // SAFETY: `addr` is a valid `sockaddr_vm` of the given length.
    check(unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    })?;
    // SAFETY: `sock` is a bound stream socket.
    check(unsafe { libc::listen(sock.as_raw_fd(), 128) })?;
    Ok(sock)
}

/// Accepts one connection on a listening socket (close-on-exec).
pub fn accept(listener: &OwnedFd) -> io::Result<OwnedFd> {
    loop {
        // SAFETY: `listener` is a listening socket; the address out-pointers
        // may be null.
        let fd = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd >= 0 {
            // SAFETY: `accept4` returned a new descriptor nobody else owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The pause program's loop (`k7d-agent pause`, a CRI pod sandbox's
/// process): reaps any child, and exits 0 on SIGINT or SIGTERM.
pub fn pause_until_terminated() -> ! {
    // SAFETY: an all-zero sigset_t is valid storage, which sigemptyset
    // then initialises; sigaddset and pthread_sigmask only read and write
    // the set given.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGCHLD] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    loop {
        let mut sig = 0;
        // SAFETY: `set` is an initialised signal set and `sig` a valid out-pointer.
        if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
            continue;
        }
        if sig != libc::SIGCHLD {
            std::process::exit(0);
        }
        // SAFETY: a null status pointer is allowed; WNOHANG never blocks.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
    }
}

/// Sets `O_NONBLOCK` on `fd`.
pub fn set_nonblocking(fd: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: F_GETFL on an open fd takes no argument.
    let flags = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    // SAFETY: F_SETFL on an open fd takes the flags as an integer.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    Ok(())
}

/// `poll(2)` on `fds` for at most `timeout` (rounded up to a millisecond);
/// how many have events. EINTR counts as none.
pub fn poll(fds: &mut [libc::pollfd], timeout: std::time::Duration) -> io::Result<usize> {
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid, writable array of `fds.len()` pollfds.
    match check(unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) }) {
        Ok(n) => Ok(n as usize),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(0),
        Err(e) => Err(e),
    }
}

/// `waitpid(pid, &status, 0)`: the raw status of child `pid` (tests feed
/// a threadless reaper with it).
#[cfg(test)]
pub fn wait_pid(pid: i32) -> io::Result<i32> {
    let mut status = 0;
    // SAFETY: `status` is a valid out-pointer.
    check(unsafe { libc::waitpid(pid, &mut status, 0) })?;
    Ok(status)
}

/// `waitpid(-1, &status, 0)`: the pid and raw status of an exited child.
pub fn wait_any() -> io::Result<(i32, i32)> {
    let mut status = 0;
    // SAFETY: `status` is a valid out-pointer.
    let pid = check(unsafe { libc::waitpid(-1, &mut status, 0) })?;
    Ok((pid, status))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    #[test]
    fn a_descriptor_passed_with_scm_rights_arrives_and_refers_to_the_same_file() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r, mut w) = std::io::pipe().unwrap();
        let fd = r.as_fd().as_raw_fd();
        let iov_data = b"/dev/pts/0";
        let mut iov = libc::iovec {
            iov_base: iov_data.as_ptr() as *mut _,
            iov_len: iov_data.len(),
        };
        let mut control = [0u64; 4];
        // SAFETY: test-only construction of an SCM_RIGHTS message.
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(4) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as _;
            libc::CMSG_DATA(c).cast::<i32>().write_unaligned(fd);
            assert!(libc::sendmsg(a.as_raw_fd(), &msg, 0) > 0);
        }
        drop(r);
        let got = recv_fd(&b).unwrap();
        w.write_all(b"x").unwrap();
        let mut f = File::from(got);
        let mut buf = [0u8; 1];
        std::io::Read::read_exact(&mut f, &mut buf).unwrap();
        assert_eq!(&buf, b"x");
        drop(a);
        assert!(recv_fd(&b).is_err());
    }

    #[test]
    fn the_kernel_release_is_not_empty() {
        assert!(!kernel_release().is_empty());
        assert_ne!(kernel_release(), "unknown");
    }
}
