//! Small safe wrappers around the system calls k7d needs. Every `unsafe` block
//! of the VMM that is not a KVM ioctl lives here.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, Ordering};

/// Creates an anonymous memory file (`memfd_create`, close-on-exec, seals
/// allowed: [`seal_against_writes`]) of `size` bytes.
pub fn memfd(name: &str, size: u64) -> io::Result<File> {
    let cname =
        CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "memfd name has a NUL byte"))?;
    // SAFETY: `cname` is a valid NUL-terminated string; the flags are valid.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)?;
    Ok(file)
}

/// The seals [`seal_against_writes`] adds.
pub const WRITE_SEALS: i32 = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// Seals the memfd `file` (held writable: the kernel adds seals only
/// through such a descriptor) against every write, shrink and growth
/// through any descriptor or shared mapping, its maker's included: a fork
/// source's frozen base and diverged pages, which its children map or
/// read, stay what they were at the fork instant. Fails if a writable
/// shared mapping of it exists, if it was made without seals allowed, or
/// if it is not sealed yet and `file` is read-only.
pub fn seal_against_writes(file: &impl AsRawFd) -> io::Result<()> {
    // Sealed at an earlier fork (a child's base, which it holds read-only,
    // is its source's).
    if seals_of(file)? & WRITE_SEALS == WRITE_SEALS {
        return Ok(());
    }
    // SAFETY: fcntl on a descriptor we hold, with an integer argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, WRITE_SEALS) } < 0 {
        return Err(io::Error::last_os_error());
    }
    match seals_of(file)? {
        s if s & WRITE_SEALS == WRITE_SEALS => Ok(()),
        s => Err(io::Error::other(format!("the seals read back as {s:#x}"))),
    }
}

/// The seals of memfd `file` (`F_GET_SEALS`).
pub fn seals_of(file: &impl AsRawFd) -> io::Result<i32> {
    // SAFETY: fcntl on a descriptor we hold, no argument.
    let s = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if s < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(s)
}

/// The real-time signal used to kick vCPU threads out of `KVM_RUN`.
pub fn kick_signal() -> i32 {
    vmm_sys_util::signal::SIGRTMIN() + 2
}

thread_local! {
    /// Points at this thread's `kvm_run.immediate_exit`, when the thread runs a vCPU.
    static IMMEDIATE_EXIT: AtomicPtr<u8> = const { AtomicPtr::new(std::ptr::null_mut()) };
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Async-signal-safe: a thread-local read and a volatile byte store.
    IMMEDIATE_EXIT.with(|p| {
        let ptr = p.load(Ordering::Relaxed);
        if !ptr.is_null() {
            // SAFETY: the pointer was registered by this very thread and points into its
            // vCPU's `kvm_run` mapping, which outlives the registration (see `VcpuKickGuard`).
            unsafe { std::ptr::write_volatile(ptr, 1) };
        }
    });
}

/// Installs the kick-signal handler once per process.
pub fn install_kick_handler() -> io::Result<()> {
    static DONE: OnceLock<Result<(), i32>> = OnceLock::new();
    let r = DONE
        .get_or_init(|| vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick).map_err(|e| e.errno()));
    r.map_err(io::Error::from_raw_os_error)
}

/// While alive, a kick signal to this thread sets `immediate_exit` in its `kvm_run`.
pub struct VcpuKickGuard(());

impl VcpuKickGuard {
    /// Registers `immediate_exit` (inside this thread's vCPU `kvm_run` mapping).
    ///
    /// # Safety
    /// `ptr` must stay valid for writes until the guard is dropped.
    pub unsafe fn register(ptr: *mut u8) -> Self {
        IMMEDIATE_EXIT.with(|p| p.store(ptr, Ordering::SeqCst));
        Self(())
    }
}

impl Drop for VcpuKickGuard {
    fn drop(&mut self) {
        IMMEDIATE_EXIT.with(|p| p.store(std::ptr::null_mut(), Ordering::SeqCst));
    }
}

/// Sends the kick signal to a thread that has not been joined yet.
pub fn kick_thread(thread: libc::pthread_t) {
    // SAFETY: callers pass the pthread_t of a live, not yet joined thread (the
    // JoinHandle is held), so the id is valid; the signal has a handler installed.
    let rc = unsafe { libc::pthread_kill(thread, kick_signal()) };
    if rc != 0 {
        tracing::debug!(rc, "pthread_kill for a vCPU kick failed");
    }
}

/// Blocks `sig` in the calling thread; threads it spawns afterwards inherit
/// the mask. With the signal blocked everywhere, a process-directed `sig`
/// stays pending until [`wait_signal`] takes it: no handler runs, and no
/// thread (vCPU, worker) is interrupted.
pub fn block_signal(sig: i32) -> io::Result<()> {
    use vmm_sys_util::signal::Error;
    match vmm_sys_util::signal::block_signal(sig) {
        Ok(()) | Err(Error::SignalAlreadyBlocked(_)) => Ok(()),
        Err(e) => Err(io::Error::other(format!("cannot block signal {sig}: {e}"))),
    }
}

/// Waits until `sig` (blocked in every thread, see [`block_signal`]) is
/// delivered to this process, and consumes it.
pub fn wait_signal(sig: i32) -> io::Result<()> {
    let set = vmm_sys_util::signal::create_sigset(&[sig])
        .map_err(|e| io::Error::other(format!("cannot make a signal set of {sig}: {e}")))?;
    loop {
        // SAFETY: `set` is an initialized sigset_t; a null siginfo pointer is allowed.
        let rc = unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
        if rc == sig {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if rc < 0 && e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// An exclusive `flock` held until drop.
pub struct FileLock {
    file: File,
}

impl FileLock {
    /// The locked file.
    pub fn file(&self) -> &File {
        &self.file
    }
}

/// Takes an exclusive lock on `file` (blocking or not).
pub fn flock(file: File, blocking: bool) -> io::Result<FileLock> {
    k7d_sys::file::flock(&file, k7d_sys::file::Lock::Exclusive, blocking)?;
    Ok(FileLock { file })
}

/// Whether a process with this pid exists.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The host kernel's release as (major, minor), from
/// `/proc/sys/kernel/osrelease` ("6.18.0-1-amd64" → (6, 18)).
pub fn kernel_version() -> Option<(u32, u32)> {
    parse_kernel_release(&std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?)
}

/// "6.18.0-1-amd64\n" → (6, 18).
pub fn parse_kernel_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(['.', '-']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Raises this process's soft limit on open files to its hard limit (a
/// daemon holds a few fds per VM and per shell); returns the soft limit
/// now in force.
pub fn raise_nofile_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit the call fills in.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: `lim` is a valid rlimit; raising the soft limit up to the
        // hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(lim.rlim_cur)
}

/// Asks the kernel to back `[addr, addr + len)` with transparent huge pages
/// (`MADV_HUGEPAGE`). For a shared memfd mapping this takes effect when
/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` is `advise`,
/// `within_size` or `always`; with `never` it is accepted and does nothing.
pub fn advise_huge_pages(addr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: madvise(MADV_HUGEPAGE) only changes the kernel's page-size
    // policy for the range; it never changes its contents or mapping, and an
    // address that is not mapped by this process is an error (ENOMEM), not
    // undefined behaviour.
    let rc = unsafe { libc::madvise(addr.cast(), len, libc::MADV_HUGEPAGE) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Faults `[addr, addr + len)` in, writable, in one call
/// (`MADV_POPULATE_WRITE`, Linux 5.14): what a loader is about to write
/// costs one call instead of a page fault per 4 KiB page (a fault is dear
/// on these hosts: `benches/benches/vm_build.rs`). Returns whether the
/// kernel did it; when it cannot (an older kernel), the writes fault the
/// pages in as before.
pub fn populate_write(addr: *mut u8, len: usize) -> bool {
    // SAFETY: MADV_POPULATE_WRITE only allocates and maps the pages of the
    // range as a write fault would; it never changes what they hold, and an
    // address that is not mapped by this process is an error, not undefined
    // behaviour.
    unsafe { libc::madvise(addr.cast(), len, libc::MADV_POPULATE_WRITE) == 0 }
}

/// The host's policy for huge pages in shared memory (`shmem_enabled`, the
/// bracketed word), if the kernel has transparent huge pages.
pub fn shmem_thp_policy() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(text[start..end].to_string())
}

pub use k7d_sys::file::page_size;

/// Replaces the mapping at `[addr, addr + len)` by a private (copy-on-write)
/// mapping of `fd` at `offset`, at the same address (`MAP_FIXED`). Reads see
/// the file's contents; writes go to anonymous pages of this process and
/// never reach the file.
///
/// # Safety
/// `[addr, addr + len)` must be a mapping this process owns and no Rust
/// reference may assume its old contents stay put (the bytes are the same
/// only if the file holds what the old mapping showed, as for a shared
/// mapping of the same file).
pub unsafe fn remap_private(addr: *mut u8, len: usize, fd: &File, offset: u64) -> io::Result<()> {
    // SAFETY: the caller's guarantees are `remap_fixed`'s.
    unsafe { remap_fixed(addr, len, fd, offset, libc::MAP_PRIVATE) }
}

/// Maps `len` bytes of `fd` at `offset` over `[addr, addr + len)`
/// (`MAP_FIXED`), read-write, `flags` `MAP_SHARED` or `MAP_PRIVATE`, with
/// `MAP_NORESERVE`.
///
/// # Safety
/// `[addr, addr + len)` must be a mapping this process owns whose old
/// contents nobody relies on.
pub unsafe fn remap_fixed(addr: *mut u8, len: usize, fd: &File, offset: u64, flags: i32) -> io::Result<()> {
    let off = libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: the caller guarantees the range is ours; MAP_FIXED replaces it.
    let p = unsafe {
        libc::mmap(
            addr.cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags | libc::MAP_FIXED | libc::MAP_NORESERVE,
            fd.as_raw_fd(),
            off,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Who is at the other end of a unix socket, as the kernel recorded it when
/// the peer connected (`SO_PEERCRED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// The peer's pid (in this process's pid namespace; 0 if it has none here).
    pub pid: i32,
    /// Its effective uid at `connect` time.
    pub uid: u32,
    /// Its effective gid at `connect` time.
    pub gid: u32,
}

/// The credentials of the peer of the unix stream `sock`.
pub fn peer_cred(sock: &impl AsRawFd) -> io::Result<PeerCred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a live, writable ucred and `len` holds its size; the
    // kernel writes at most `len` bytes into it.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

pub use k7d_sys::fd::poll_readable;

/// Connects a unix stream socket to `path`, giving up after `timeout` (a
/// listener whose backlog is full fails with `TimedOut` rather than block
/// without limit). The stream it returns blocks.
pub fn connect_unix(
    path: &std::path::Path,
    timeout: std::time::Duration,
) -> io::Result<std::os::unix::net::UnixStream> {
    k7d_sys::socket::connect_with_timeout(path, timeout)
}

/// A pipe whose write end is non-blocking (a full pipe drops a record rather
/// than block a thread in a signal handler); both ends close-on-exec.
/// Returns (read end, write end).
pub fn pipe_nonblocking_writer() -> io::Result<(File, File)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two fds into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created by pipe2 and are owned by nobody else.
    let (rx, tx) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    k7d_sys::fd::set_nonblocking(&tx, true)?;
    Ok((rx, tx))
}

pub use k7d_sys::thread::gettid;

/// Writes `rec`'s bytes to `fd` with one `write(2)`, ignoring the outcome:
/// async-signal-safe (the SIGSYS report).
pub fn write_record<T: Copy>(fd: i32, rec: &T) {
    if fd < 0 {
        return;
    }
    // SAFETY: `rec` is a live value of `size_of::<T>()` bytes; write only reads them.
    let _ = unsafe { libc::write(fd, (rec as *const T).cast(), std::mem::size_of::<T>()) };
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

/// The calling thread's permitted capabilities, as a 64-bit mask.
pub fn permitted_capabilities() -> io::Result<u64> {
    let mut hdr = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes two data structs into the array we own, laid out
    // as the kernel's `__user_cap_data_struct`; the header is ours.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut hdr as *mut CapHeader, data.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u64::from(data[0].permitted) | (u64::from(data[1].permitted) << 32))
}

/// Sets the calling thread's effective and permitted capabilities to `mask`
/// (which must be within the permitted set) and its inheritable set to none.
/// With `no_new_privs` and no exec, nothing can bring the others back.
pub fn set_capabilities(mask: u64) -> io::Result<()> {
    let mut hdr = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let lo = (mask & 0xffff_ffff) as u32;
    let hi = (mask >> 32) as u32;
    let data = [
        CapData {
            effective: lo,
            permitted: lo,
            inheritable: 0,
        },
        CapData {
            effective: hi,
            permitted: hi,
            inheritable: 0,
        },
    ];
    // SAFETY: capset reads the header and two data structs, all ours and laid
    // out as the kernel's `__user_cap_header_struct`/`__user_cap_data_struct`.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut CapHeader, data.as_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Drops every capability of the calling thread.
pub fn drop_all_capabilities() -> io::Result<()> {
    set_capabilities(0)
}

/// `siginfo_t` as the kernel fills it for SIGSYS on x86_64 (`_sigsys`).
#[repr(C)]
struct SigsysInfo {
    signo: libc::c_int,
    errno: libc::c_int,
    code: libc::c_int,
    _pad: libc::c_int,
    call_addr: *mut libc::c_void,
    syscall: libc::c_int,
    arch: libc::c_uint,
}

/// `si_code` of a SIGSYS raised by a seccomp filter.
const SYS_SECCOMP: libc::c_int = 1;

static SIGSYS_HOOK: OnceLock<fn(i32)> = OnceLock::new();

extern "C" fn on_sigsys(_num: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    if info.is_null() {
        return;
    }
    // SAFETY: the kernel passed a SIGSYS siginfo, whose layout is `SigsysInfo`.
    let (code, nr) = unsafe {
        let s = &*(info as *const SigsysInfo);
        (s.code, s.syscall)
    };
    if code != SYS_SECCOMP {
        return;
    }
    if !ctx.is_null() {
        // SAFETY: with SA_SIGINFO the third argument is the interrupted
        // thread's ucontext; setting RAX makes the denied call return -EPERM.
        unsafe {
            let uc = ctx as *mut libc::ucontext_t;
            (*uc).uc_mcontext.gregs[libc::REG_RAX as usize] = -(libc::EPERM as i64);
        }
    }
    if let Some(hook) = SIGSYS_HOOK.get() {
        hook(nr);
    }
}

/// Installs the process's SIGSYS handler: a call denied by a seccomp filter
/// fails with `EPERM` and `hook` gets its number (in the signal handler:
/// `hook` must be async-signal-safe).
pub fn install_sigsys_handler(hook: fn(i32)) -> io::Result<()> {
    let _ = SIGSYS_HOOK.set(hook);
    vmm_sys_util::signal::register_signal_handler(libc::SIGSYS, on_sigsys)
        .map_err(|e| io::Error::from_raw_os_error(e.errno()))
}

/// Makes glibc's malloc read, now, the two files it otherwise reads lazily
/// from whichever thread first needs them (which may be a vCPU or device
/// worker whose seccomp filter denies `openat`; CHALLENGES.md):
/// - the arena limit: fixed with `M_ARENA_MAX` (glibc's default, 8 per CPU),
///   so `/sys/devices/system/cpu/online` and `/proc/stat` are never read;
/// - whether a thread's heap may shrink (`/proc/sys/vm/overcommit_memory`,
///   read once per process, the first time a non-main arena gives memory
///   back): the calling thread grows its arena's heap by 360 KiB and frees
///   it, which makes glibc trim that heap and cache the answer. The blocks
///   are allocated, never written: a handful of pages are touched, not 90
///   (a page fault is dear on these hosts; `benches/benches/seccomp.rs`).
///
/// Call before any seccomp filter, on a thread other than the main one (the
/// main thread's arena trims without reading the file).
pub fn prepare_malloc() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let arenas = libc::c_int::try_from(cpus.saturating_mul(8)).unwrap_or(libc::c_int::MAX);
    // SAFETY: mallopt only sets a malloc parameter; any value is accepted.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, arenas) };
    // Below the mmap threshold (128 KiB), so they come from the arena's heap;
    // freed from the last, they leave a top chunk above the trim threshold
    // and the top pad (128 KiB each), and glibc shrinks the heap.
    let blocks: Vec<Vec<u8>> = (0..3).map(|_| Vec::with_capacity(120 << 10)).collect();
    std::hint::black_box(&blocks);
    for b in blocks.into_iter().rev() {
        drop(b);
    }
}

// --- the jail's calls (`jail/`) ----------------------------------------------

/// `rc` of a libc call: `Err(errno)` when it is -1.
fn check_rc(rc: libc::c_int) -> io::Result<()> {
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The calling process's threads (`Threads:` in `/proc/self/status`).
pub fn thread_count() -> io::Result<u32> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| io::Error::other("/proc/self/status has no Threads: line"))
}

/// `unshare(2)` of the mount, pid (for the children), ipc, uts and network
/// namespaces.
pub fn unshare_namespaces() -> io::Result<()> {
    let flags = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWNET;
    // SAFETY: unshare takes flags only and changes the calling thread's
    // namespaces; the caller has one thread.
    check_rc(unsafe { libc::unshare(flags) })
}

/// `fork(2)` of a single-threaded process: `Some(child pid)` in the parent,
/// `None` in the child.
pub fn fork_process() -> io::Result<Option<u32>> {
    // SAFETY: the caller has one thread, so the child is a whole copy of it
    // (no lock held by another thread can be left locked in the child).
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(io::Error::last_os_error()),
        0 => Ok(None),
        p => Ok(Some(p as u32)),
    }
}

/// Makes every mount of the calling process's (new) mount namespace
/// private: nothing it mounts or unmounts reaches the host's, and back.
pub fn make_mounts_private() -> io::Result<()> {
    k7d_sys::mount::make_private()
}

/// How [`pivot_into`] made the new root the process's `/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootChange {
    /// `pivot_root`, the old root detached.
    Pivoted,
    /// `pivot_root` failed with `EINVAL`, as it does when the host's root
    /// is an initramfs (rootfs): the new root moved over `/` and `chroot`
    /// into it, as `runc --no-pivot` does. The old root (and the host's
    /// other mounts) stay hidden under it in the process's own mount
    /// namespace: mounted over, and no descriptor of the process refers to
    /// them. Weaker than a pivot: what a user namespace made inside could
    /// see of them is not ruled out (`docs/security.md`).
    MovedAndChrooted,
}

/// Makes the directory `root` the calling process's `/`: bind-mounted on
/// itself (pivot_root wants a mount point), `pivot_root(root, root)` (the
/// old root stacked under the new one), the old root detached, `chdir("/")`;
/// on a host whose root `pivot_root` cannot leave (an initramfs), moved
/// over `/` and chrooted into instead ([`RootChange`]).
pub fn pivot_into(root: &std::path::Path) -> io::Result<RootChange> {
    use std::os::unix::ffi::OsStrExt;
    let r = CString::new(root.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    k7d_sys::mount::mount(Some(&r), &r, None, libc::MS_BIND | libc::MS_REC, None)?;
    // SAFETY: `r` is NUL-terminated.
    check_rc(unsafe { libc::chdir(r.as_ptr()) })?;
    // SAFETY: pivot_root(".", ".") takes two NUL-terminated paths: the new
    // root becomes "/", the old one is stacked on it (the documented idiom).
    let rc = unsafe { libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) };
    if rc == -1 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e);
        }
        // rootfs: the bind mount of `root` (the current directory) moves
        // over "/", and the process chroots into it.
        k7d_sys::mount::mount(Some(c"."), c"/", None, libc::MS_MOVE, None)?;
        // SAFETY: a NUL-terminated literal.
        check_rc(unsafe { libc::chroot(c".".as_ptr()) })?;
        // SAFETY: a NUL-terminated literal.
        check_rc(unsafe { libc::chdir(c"/".as_ptr()) })?;
        return Ok(RootChange::MovedAndChrooted);
    }
    // "." is the old root stacked on the new one.
    k7d_sys::mount::unmount_detach(c".")?;
    // SAFETY: a NUL-terminated literal.
    check_rc(unsafe { libc::chdir(c"/".as_ptr()) })?;
    Ok(RootChange::Pivoted)
}

/// Closes every descriptor of the process but `keep` (`close_range(2)`
/// over the gaps between them).
pub fn close_fds_except(keep: &[i32]) -> io::Result<()> {
    let mut keep: Vec<u32> = keep.iter().filter_map(|&f| u32::try_from(f).ok()).collect();
    keep.sort_unstable();
    keep.dedup();
    let mut from = 0u32;
    for k in keep.into_iter().chain(std::iter::once(u32::MAX)) {
        if k > from {
            // SAFETY: close_range takes integers; it closes descriptors only
            // this process holds, and the caller keeps none of them.
            let rc = unsafe { libc::syscall(libc::SYS_close_range, from, k - 1, 0u32) };
            if rc == -1 {
                return Err(io::Error::last_os_error());
            }
        }
        from = k.saturating_add(1);
    }
    Ok(())
}

/// Puts each `(from, to)` descriptor at number `to`, in a child between
/// fork and exec (async-signal-safe: `fcntl` and `dup2` only). Each is
/// first copied above every target, so no move clobbers a later source.
pub fn place_fds(moves: &[(i32, i32)]) -> io::Result<()> {
    let mut high = [0i32; 8];
    if moves.len() > high.len() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    for (i, &(from, _)) in moves.iter().enumerate() {
        // SAFETY: fcntl(F_DUPFD) takes integers; it copies a descriptor we hold.
        let fd = unsafe { libc::fcntl(from, libc::F_DUPFD, 100) };
        if fd == -1 {
            return Err(io::Error::last_os_error());
        }
        high[i] = fd;
    }
    for (i, &(_, to)) in moves.iter().enumerate() {
        // SAFETY: dup2 takes integers; the copy above is ours. The new
        // descriptor has no FD_CLOEXEC, so it survives the exec.
        check_rc(unsafe { libc::dup2(high[i], to) })?;
        // SAFETY: closes our own copy.
        unsafe { libc::close(high[i]) };
    }
    Ok(())
}

/// Makes the calling process a child subreaper (`PR_SET_CHILD_SUBREAPER`):
/// an orphaned descendant (a jailed VM process whose first process exited)
/// becomes its child, so its exit can be waited for.
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    check_rc(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) })
}

/// How child `pid` ended, if it has (`waitid(P_PID)` with `WNOHANG`,
/// reaping it; not `waitpid`, whose `wait4` the control threads' seccomp
/// filter denies): `Some(Ok(code))` on an exit, `Some(Err(signal))` when
/// a signal killed it, `None` while it runs.
pub fn try_reap(pid: u32) -> io::Result<Option<Result<i32, i32>>> {
    // SAFETY: siginfo_t is plain data; zeroed is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid writes into our local siginfo_t; P_PID takes a pid.
    let rc = unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG) };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: waitid filled `info` (all zero, pid 0, while the child runs).
    let (child, code, status) = unsafe { (info.si_pid(), info.si_code, info.si_status()) };
    Ok(match (child, code) {
        (0, _) => None,
        (_, libc::CLD_EXITED) => Some(Ok(status)),
        _ => Some(Err(status)),
    })
}

/// Whether `fd` is an open descriptor of this process.
pub fn fd_is_open(fd: i32) -> bool {
    // SAFETY: fcntl(F_GETFD) takes integers and changes nothing.
    unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
}

/// `sethostname(2)` (in the process's own uts namespace).
pub fn set_hostname(name: &str) -> io::Result<()> {
    // SAFETY: reads `name.len()` bytes of a live &str.
    check_rc(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
}

/// Drops every capability from the bounding set (`PR_CAPBSET_DROP`): not
/// even an exec of a file with capabilities can bring one back.
pub fn drop_bounding_set() -> io::Result<()> {
    drop_bounding_set_except(0)
}

/// Drops every capability but those in `keep` (bit `n` for capability `n`)
/// from the bounding set: an exec, even as root, gets no others.
pub fn drop_bounding_set_except(keep: u64) -> io::Result<()> {
    let last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<libc::c_ulong>().ok())
        .unwrap_or(40);
    for cap in (0..=last).filter(|&c| c >= 64 || keep & (1u64 << c) == 0) {
        // SAFETY: prctl with integer arguments only.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
        if rc == -1 {
            let e = io::Error::last_os_error();
            // A capability this kernel does not know.
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
        }
    }
    Ok(())
}

/// No supplementary groups, then real, effective and saved gid and uid
/// (gid first: changing it needs the uid's privilege). Leaving uid 0
/// clears the permitted and effective capabilities.
pub fn set_ids(uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: setgroups with an empty list reads nothing.
    check_rc(unsafe { libc::setgroups(0, std::ptr::null()) })?;
    // SAFETY: integer arguments only (glibc applies them to every thread).
    check_rc(unsafe { libc::setresgid(gid, gid, gid) })?;
    // SAFETY: as above.
    check_rc(unsafe { libc::setresuid(uid, uid, uid) })
}

/// `PR_SET_NO_NEW_PRIVS`: no exec can grant privileges from now on.
pub fn set_no_new_privs() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    check_rc(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })
}

/// A connected pair of `AF_UNIX` `SOCK_SEQPACKET` sockets (close-on-exec):
/// each send is one message, read whole, and a closed peer reads as 0
/// bytes. (Wrapped as `UnixStream`s, which read and write them unchanged.)
pub fn seqpacket_pair() -> io::Result<(std::os::unix::net::UnixStream, std::os::unix::net::UnixStream)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0i32; 2];
    // SAFETY: socketpair writes two descriptors into our local array.
    check_rc(unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    })?;
    // SAFETY: both descriptors were just made and are owned by nothing else.
    Ok(unsafe {
        (
            std::os::unix::net::UnixStream::from_raw_fd(fds[0]),
            std::os::unix::net::UnixStream::from_raw_fd(fds[1]),
        )
    })
}

/// Sets `FD_CLOEXEC` on `fd` (a descriptor received over a socket).
pub fn set_cloexec(fd: i32) -> io::Result<()> {
    // SAFETY: fcntl with integer arguments on a descriptor we hold.
    check_rc(unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) })
}

/// A pidfd for process `pid` (`pidfd_open(2)`): it reads ready when the
/// process ends, whoever its parent is.
pub fn pidfd_open(pid: u32) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes integers and returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor owned by nothing else.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Waits until the process behind `pidfd` ends, then how it ended when it
/// is this process's child (reaped: `Some(Ok(code))` or `Some(Err(signal))`);
/// `None` when it ended but was another process's child.
pub fn pidfd_wait(pidfd: &std::os::fd::OwnedFd) -> io::Result<Option<Result<i32, i32>>> {
    use std::os::fd::AsRawFd;
    loop {
        let mut p = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll reads and writes our one local pollfd.
        let rc = unsafe { libc::poll(&mut p, 1, -1) };
        if rc == -1 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if rc == 1 {
            break;
        }
    }
    // SAFETY: siginfo_t is plain data; zeroed is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid writes into our local siginfo_t. P_PIDFD (3) takes
    // the pidfd as its id.
    let rc = unsafe {
        libc::waitid(
            3 as libc::idtype_t,
            pidfd.as_raw_fd() as libc::id_t,
            &mut info,
            libc::WEXITED,
        )
    };
    if rc == -1 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ECHILD) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    // SAFETY: waitid filled `info` for an exited child.
    let (code, status) = unsafe { (info.si_code, info.si_status()) };
    Ok(Some(if code == libc::CLD_EXITED {
        Ok(status)
    } else {
        Err(status)
    }))
}

/// Waits for this process's child `pid` to exit and reaps it, through
/// `waitid(P_PID)`: the one wait call the control threads' seccomp filter
/// allows (`std::process::Child::wait` makes `wait4`, which it does not).
pub fn reap_child(pid: u32) -> io::Result<()> {
    // SAFETY: siginfo_t is plain data; zeroed is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waitid writes into our local siginfo_t; P_PID takes a pid.
        let rc = unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// When process `pid` started, in clock ticks after boot (`/proc/<pid>/stat`
/// field 22): with the pid, what names one process across pid reuse.
pub fn process_start_ticks(pid: u32) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let after = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .ok_or_else(|| io::Error::other("unreadable /proc stat"))?;
    after
        .split_whitespace()
        .nth(19)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::other("no start time in /proc stat"))
}

/// Sends `SIGKILL` to the process behind `pidfd` (`pidfd_send_signal(2)`:
/// never to a later process that reused its pid).
pub fn pidfd_kill(pidfd: &std::os::fd::OwnedFd) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal takes a descriptor we hold, a signal number
    // and a null siginfo.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `log` this process's standard error (descriptor 2), replacing
/// whatever was there.
pub fn redirect_stderr(log: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: dup3 takes two descriptor numbers and a flag word; `log` is
    // open for the call's duration and descriptor 2 is only replaced.
    if unsafe { libc::dup3(log.as_raw_fd(), libc::STDERR_FILENO, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Ends the whole process at once with `code` (`exit_group`, no atexit
/// handlers, no unwinding, no locks taken).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit takes an integer and does not return.
    unsafe { libc::_exit(code) }
}

#[cfg(test)]
mod tests {
    use super::parse_kernel_release;

    /// What a child's end reads as, through `waitid` (the one wait call
    /// the daemon's control threads may make): running, an exit code, a
    /// signal; `reap_child` waits for and reaps one.
    #[test]
    // Every child is reaped, by the calls under test, which clippy cannot see.
    #[allow(clippy::zombie_processes)]
    fn a_childs_end_reads_as_its_exit_code_or_signal() {
        use std::process::Command;
        let until = |pid: u32| {
            let t = std::time::Instant::now();
            loop {
                if let Some(end) = super::try_reap(pid).unwrap() {
                    return end;
                }
                assert!(
                    t.elapsed() < std::time::Duration::from_secs(10),
                    "child {pid} never ended"
                );
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        let c = Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        assert_eq!(until(c.id()), Ok(3));
        let c = Command::new("sleep").arg("10").spawn().unwrap();
        assert_eq!(super::try_reap(c.id()).unwrap(), None);
        // SAFETY: kill takes integers; the child is this test's.
        assert_eq!(unsafe { libc::kill(c.id() as i32, libc::SIGKILL) }, 0);
        assert_eq!(until(c.id()), Err(libc::SIGKILL));
        let c = Command::new("sh").args(["-c", "exit 0"]).spawn().unwrap();
        super::reap_child(c.id()).unwrap();
        assert!(super::try_reap(c.id()).is_err(), "reaped twice");
    }

    #[test]
    fn kernel_release_parses() {
        assert_eq!(parse_kernel_release("6.18.0-1-amd64\n"), Some((6, 18)));
        assert_eq!(parse_kernel_release("6.1.0-28-cloud-amd64"), Some((6, 1)));
        assert_eq!(parse_kernel_release("5.15-rc1"), Some((5, 15)));
        assert_eq!(parse_kernel_release("6"), None);
        assert_eq!(parse_kernel_release("x.y"), None);
    }
}
