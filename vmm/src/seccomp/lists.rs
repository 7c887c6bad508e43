//! Every system call k7d's threads may make, by thread kind, each with why.
//!
//! A thread inherits the filters of the thread that spawned it and adds its
//! own, and the kernel applies all of them: device workers are spawned by
//! vCPU threads (a guest's driver activates its device) or by control threads
//! (restore, fork, resume), vCPU threads by control threads. So the lists
//! nest: the vCPU list is the worker list plus [`VCPU_EXTRA`], the control
//! list is the vCPU list plus [`CONTROL_EXTRA`]. Argument-level rules are
//! kept for the calls whose arguments decide what they can do.
//!
//! A call not listed is denied: `SIGSYS`, reported with its number and the
//! thread, the call fails with `EPERM`, and a VM whose thread made it stops
//! (`docs/security.md`). `k7d --seccomp log` allows and audits instead, to
//! find what a new code path needs (`dmesg | grep type=1326`).

/// One allowed call: its number and why k7d makes it.
pub(super) type Allowed = (i64, &'static str);

/// Device worker threads (virtio-blk, virtio-net queues and control queue,
/// virtio-rng, virtio-vsock): move bytes between guest RAM (already mapped)
/// and the fds they were handed, wait on eventfds, signal interrupts.
pub(super) const WORKER: &[Allowed] = &[
    (
        libc::SYS_read,
        "eventfds, a tap's frames, a disk's sectors, the entropy source",
    ),
    (
        libc::SYS_write,
        "eventfds (interrupts, wakeups), the tap, log lines on stderr",
    ),
    (libc::SYS_readv, "a tap's frames into guest buffers"),
    (libc::SYS_writev, "guest buffers out to the tap; log lines"),
    (libc::SYS_pread64, "disk sectors into guest buffers"),
    (libc::SYS_pwrite64, "guest buffers to disk sectors"),
    (libc::SYS_preadv, "disk reads into several guest buffers"),
    (libc::SYS_pwritev, "disk writes from several guest buffers"),
    (libc::SYS_preadv2, "disk reads (flags)"),
    (libc::SYS_pwritev2, "disk writes (flags, e.g. RWF_DSYNC)"),
    (libc::SYS_fsync, "virtio-blk FLUSH"),
    (libc::SYS_fdatasync, "virtio-blk FLUSH"),
    (
        libc::SYS_fallocate,
        "virtio-blk DISCARD / WRITE_ZEROES (punch hole, zero range)",
    ),
    (libc::SYS_lseek, "SEEK_DATA/SEEK_HOLE on a disk's copy-on-write overlay"),
    (libc::SYS_fstat, "a disk's size"),
    (libc::SYS_epoll_create1, "a worker's own epoll set, made when it starts"),
    (
        libc::SYS_epoll_wait,
        "waiting for queue notifications, the tap, sockets, stop",
    ),
    (libc::SYS_epoll_pwait, "the same (glibc's epoll_wait)"),
    (
        libc::SYS_epoll_ctl,
        "watching a vsock connection's socket, or a tap only when needed",
    ),
    (libc::SYS_poll, "waiting on a few fds"),
    (libc::SYS_ppoll, "waiting on a few fds (glibc)"),
    (libc::SYS_close, "closing vsock connections and dropped fds"),
    (
        libc::SYS_socket,
        "virtio-vsock: a guest connect opens a Unix socket to the host side",
    ),
    (
        libc::SYS_connect,
        "virtio-vsock: that socket's connect to the configured uds path",
    ),
    (
        libc::SYS_accept4,
        "virtio-vsock: a host process connecting to the VM's vsock unix socket (the shim reaching the guest agent)",
    ),
    (libc::SYS_sendto, "virtio-vsock: bytes to the host socket"),
    (libc::SYS_recvfrom, "virtio-vsock: bytes from the host socket"),
    (libc::SYS_sendmsg, "virtio-vsock: bytes to the host socket"),
    (libc::SYS_recvmsg, "virtio-vsock: bytes from the host socket"),
    (libc::SYS_shutdown, "virtio-vsock: a guest shutdown of one direction"),
    (libc::SYS_getsockopt, "virtio-vsock: SO_ERROR of a non-blocking connect"),
    (libc::SYS_fcntl, "O_NONBLOCK on a new socket"),
    (libc::SYS_getrandom, "virtio-rng's entropy; std's hash seeds"),
    (libc::SYS_futex, "locks and condition variables"),
    (libc::SYS_sched_yield, "spin-then-yield in locks"),
    (libc::SYS_nanosleep, "short back-offs"),
    (libc::SYS_clock_nanosleep, "short back-offs (glibc)"),
    (libc::SYS_clock_gettime, "timestamps (when the vDSO cannot serve them)"),
    (libc::SYS_gettimeofday, "timestamps in log lines (vDSO fallback)"),
    (libc::SYS_mmap, "the allocator"),
    (libc::SYS_munmap, "the allocator; a thread's stack at exit"),
    (libc::SYS_mremap, "the allocator (growing buffers)"),
    (libc::SYS_mprotect, "the allocator (glibc arenas grow by mprotect)"),
    (
        libc::SYS_madvise,
        "the allocator; a thread's stack at exit (MADV_DONTNEED)",
    ),
    (libc::SYS_brk, "the allocator (main arena)"),
    (libc::SYS_rt_sigprocmask, "signal masks around thread exit"),
    (libc::SYS_rt_sigreturn, "returning from the kick and SIGSYS handlers"),
    (
        libc::SYS_sigaltstack,
        "a thread's signal stack, set up and freed by std",
    ),
    (libc::SYS_gettid, "thread ids for the state dump and the SIGSYS report"),
    (libc::SYS_getpid, "the process id in log lines"),
    (
        libc::SYS_restart_syscall,
        "the kernel's restart of a sleep or wait with a timeout that a stop interrupted (SIGSTOP and SIGCONT, a debugger's attach, the cgroup freezer): it resumes a call already allowed",
    ),
    (libc::SYS_exit, "the thread ends"),
    (libc::SYS_exit_group, "the process ends on a fatal error"),
];

/// The only `ioctl`s a device worker may make (on `ioctl`'s request, its
/// second argument): `(mask, value)` pairs, allowed when `request & mask ==
/// value`. vCPU and control threads may make any.
pub(super) const WORKER_IOCTLS: &[(u64, u64, &str)] = &[
    (
        0xff00,
        0xaf00,
        "vhost-net's (type 0xAF): the control queue worker starts and stops ring pairs in the kernel (VQ_PAIRS_SET)",
    ),
    (
        0xffff_ffff,
        libc::FIONBIO,
        "FIONBIO: virtio-vsock makes an accepted host stream non-blocking (std's set_nonblocking)",
    ),
    (
        0xffff_ffff,
        libc::TUNSETQUEUE,
        "TUNSETQUEUE: the control queue worker attaches and detaches a tap queue (VQ_PAIRS_SET)",
    ),
];

/// vCPU threads, in addition to [`WORKER`]: run the guest, emulate the port
/// and MMIO accesses it makes, and activate, reset and pause devices when
/// its drivers say so (which spawns and joins device workers and sets up
/// vhost-net on fds the daemon opened).
pub(super) const VCPU_EXTRA: &[Allowed] = &[
    (
        libc::SYS_ioctl,
        "KVM_RUN and the vCPU's registers; KVM_IRQFD, KVM_IOEVENTFD and KVM_SIGNAL_MSI on activation; vhost-net and tap setup on activation",
    ),
    (
        libc::SYS_eventfd2,
        "a device's stop and notification eventfds, made when the guest activates it",
    ),
    (
        libc::SYS_clone3,
        "spawning a device worker when the guest activates its device",
    ),
    (libc::SYS_clone, "the same (older glibc)"),
    (
        libc::SYS_set_robust_list,
        "a new thread's robust futex list (glibc, in the new thread before k7d's code)",
    ),
    (
        libc::SYS_rseq,
        "a new thread's restartable sequences area (glibc, the same)",
    ),
    (
        libc::SYS_prctl,
        "a new thread's name (PR_SET_NAME) and no_new_privs before its filter",
    ),
    (
        libc::SYS_seccomp,
        "a new device worker installs its own filter (a filter can only narrow)",
    ),
    (libc::SYS_capset, "vCPU and device threads drop every capability"),
    (libc::SYS_sched_getaffinity, "std, when a thread starts"),
    (libc::SYS_tgkill, "kicking the other vCPUs out of KVM_RUN (stop, pause)"),
];

/// Control threads (main, API, connections, signals, the state dump, the
/// record and report threads), in addition to [`WORKER`] and [`VCPU_EXTRA`]:
/// everything that builds, forks, snapshots, restores and tears down VMs,
/// serves the API and sets up networking. Denied to them, among others:
/// ptrace, module and kexec loading, reboot, swap, keyrings, perf events,
/// process_vm_*, personality, execve, and any uid/gid change.
pub(super) const CONTROL_EXTRA: &[Allowed] = &[
    (
        libc::SYS_openat,
        "guest images, kernels, state files, snapshots, /dev/kvm, /dev/net/tun, /dev/vhost-net, /proc",
    ),
    (libc::SYS_open, "the same (libc::open in the tap code)"),
    (libc::SYS_statx, "file metadata (std)"),
    (libc::SYS_newfstatat, "file metadata (lstat of snapshot entries)"),
    (libc::SYS_statfs, "is /sys/fs/bpf a bpf filesystem"),
    (libc::SYS_getdents64, "listing the state and runtime dirs"),
    (libc::SYS_mkdirat, "snapshot directories (relative to an opened parent)"),
    (libc::SYS_mkdir, "state and runtime directories"),
    (
        libc::SYS_unlinkat,
        "old snapshot files and temporary snapshot directories",
    ),
    (libc::SYS_unlink, "records, runtime files, the socket"),
    (libc::SYS_rmdir, "runtime directories"),
    (
        libc::SYS_renameat2,
        "atomic snapshot commits and replacements (RENAME_EXCHANGE)",
    ),
    (libc::SYS_rename, "atomic record writes"),
    (libc::SYS_readlink, "resolving paths in /proc"),
    (libc::SYS_fchmod, "modes of state and snapshot files"),
    (libc::SYS_chmod, "the socket's mode"),
    (libc::SYS_fchown, "the socket's group (--allow-gid)"),
    (libc::SYS_fchownat, "the same (std's chown)"),
    (libc::SYS_ftruncate, "sizing guest RAM memfds and snapshot files"),
    (libc::SYS_fsync, "records and snapshots reach the disk"),
    (libc::SYS_flock, "the state dir's and each record's lock"),
    (libc::SYS_memfd_create, "guest RAM"),
    (libc::SYS_copy_file_range, "sparse copies of disks"),
    (libc::SYS_sendfile, "file copies (std::io::copy)"),
    (libc::SYS_access, "checking device nodes"),
    (libc::SYS_faccessat2, "the same (newer glibc)"),
    (libc::SYS_pipe2, "the SIGSYS report pipe"),
    (
        libc::SYS_eventfd2,
        "the API's shutdown eventfd; devices' eventfds at build, restore and fork",
    ),
    (libc::SYS_epoll_create1, "epoll sets made while building devices"),
    (
        libc::SYS_dup,
        "sharing eventfds and fds between devices and their workers",
    ),
    (libc::SYS_dup3, "the same"),
    (libc::SYS_bind, "the API socket; netlink sockets"),
    (libc::SYS_listen, "the API socket"),
    (libc::SYS_accept4, "API connections"),
    (libc::SYS_setsockopt, "timeouts on API connections; netlink options"),
    (libc::SYS_getsockname, "netlink port ids"),
    (
        libc::SYS_bpf,
        "loading and attaching the tc-eBPF direct datapath, its maps",
    ),
    (
        libc::SYS_mount,
        "a bpf filesystem at /sys/fs/bpf when the node has none (direct datapath)",
    ),
    (
        libc::SYS_setns,
        "entering a pod's network namespace to create its tap (a helper thread)",
    ),
    (
        libc::SYS_kill,
        "is a process alive (signal 0): the state dir's previous owner",
    ),
    (
        libc::SYS_rt_sigaction,
        "signal handlers at start (SIGINT, SIGTERM, SIGSYS, the vCPU kick)",
    ),
    (libc::SYS_rt_sigtimedwait, "the signal threads (SIGUSR1 dump)"),
    (libc::SYS_uname, "the kernel release (eBPF loading)"),
    (libc::SYS_sysinfo, "host RAM for admission checks"),
    (libc::SYS_prlimit64, "the fd and memlock limits"),
    (libc::SYS_geteuid, "access checks and the default access model"),
    (
        libc::SYS_capget,
        "reading the process's capabilities before narrowing them",
    ),
    (libc::SYS_set_tid_address, "process start (glibc)"),
    (libc::SYS_arch_prctl, "process start (glibc)"),
    (
        libc::SYS_socketpair,
        "a VM process's channel (`--jail on`), handed to it through the spawner",
    ),
    (
        libc::SYS_pidfd_open,
        "watching a VM process's end, also one an earlier daemon started",
    ),
    (libc::SYS_waitid, "how a VM process ended (P_PIDFD), reaping it"),
    (
        libc::SYS_pidfd_send_signal,
        "killing a VM process that does not exit when stopped (never another process that reused its pid)",
    ),
];
