//! `k7d-agent`: the pod VM's PID 1.
//!
//! As PID 1 it sets the VM up ([`init`]), starts the [`reaper`] and serves
//! the shim's protocol ([`k7d_agent::proto`]) on vsock port
//! [`k7d_agent::proto::PORT`]. For host-side tests,
//! `k7d-agent --listen-unix PATH` serves the same protocol on a unix socket
//! without the PID 1 setup, as a child subreaper so orphans still come to it.
//! `k7d-agent pause` is a CRI pod sandbox's process (`container`'s stand-in).
//!
//! Log lines go to stderr (the serial console as PID 1), prefixed
//! `k7d-agent: `.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Writes one log line to stderr; never panics (unlike `eprintln!`).
/// The line goes to the console in one write: `writeln!` on the unbuffered
/// stderr writes each piece of its format on its own, and another writer
/// on the console (a guest's program) can land between them (the lab saw
/// "k7d-agent: reseed: entropy LAB-GUEST wake n=3" and "64 bytes" apart).
macro_rules! log {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let line = format!("k7d-agent: {}\n", format_args!($($arg)*));
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }};
}
pub(crate) use log;

mod binds;
mod cgroup;
mod container;
mod disk;
mod handover;
mod identity;
mod init;
mod net;
mod newroot;
mod reaper;
mod rootdev;
mod server;
mod spec;
mod stdio;
mod sys;
mod sysctl;
mod vmexec;
mod vmrun;

/// Held by every test that has child processes: a reaper thread's
/// `waitpid(-1)` collects any child of the test binary.
#[cfg(test)]
pub(crate) fn test_children() -> MutexGuard<'static, ()> {
    static CHILDREN: Mutex<()> = Mutex::new(());
    lock(&CHILDREN)
}

/// Locks `m`, ignoring poisoning: a panicked request thread must not take
/// the agent down with it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

const USAGE: &str = "usage: k7d-agent (--vsock | --listen-unix PATH) [--state-dir DIR] [--runtime PATH] [--runtime-root DIR] [--sysfs DIR] [--dev DIR]";

/// Where an agent that is not PID 1 listens.
#[derive(Debug, PartialEq, Eq)]
enum Listen {
    /// vsock port 1024: the agent installed as a service in a VM's image
    /// (`k7d-agent.service`, `docs/exec.md`).
    Vsock,
    /// A unix socket (host-side tests).
    Unix(PathBuf),
}

fn main() {
    // A CRI pod sandbox's process (`container::Config::stand_in`).
    if std::process::id() != 1 && std::env::args_os().nth(1).is_some_and(|a| a == container::PAUSE_ARG) {
        sys::pause_until_terminated();
    }
    if std::process::id() == 1 {
        pid1();
    }
    match host_config(std::env::args().skip(1)) {
        Ok((listen, cfg)) => {
            if let Err(e) = run_host(listen, cfg) {
                log!("{e}");
                std::process::exit(1);
            }
        }
        Err(e) => {
            log!("{e}\n{USAGE}");
            std::process::exit(2);
        }
    }
}

/// PID 1: never returns (an exiting PID 1 panics the kernel).
fn pid1() -> ! {
    if let Some(h) = root_disk() {
        match handover::enter(&h) {
            Ok(()) => hand_over(&h),
            Err(why) => {
                log!("{why}: the agent serves from the initramfs instead");
                handover::unmount_api_filesystems();
            }
        }
    }
    let root = newroot::leave_initramfs();
    if root == newroot::Root::Tmpfs {
        log!("the root moved from the initramfs onto a tmpfs (runc can pivot_root)");
    }
    init::setup();
    serve_vm(|cfg| {
        cfg.no_pivot = root == newroot::Root::ChrootOnly || init::root_is_initramfs();
        if cfg.no_pivot {
            log!("the root is the initramfs: runc runs --no-pivot (containers confined by a chroot only)");
        }
    })
}

/// The root disk the kernel command line names (`root=`, `handover.rs`),
/// with the filesystems and modules mounting it needs; none (and `/proc`
/// unmounted again, so the initramfs is as the kernel left it) without
/// `root=` or with one the agent cannot take (said on the console).
fn root_disk() -> Option<handover::Handover> {
    let proc_fs = std::path::Path::new("/proc");
    let _ = std::fs::create_dir_all(proc_fs);
    if let Err(e) = sys::mount(std::ffi::OsStr::new("proc"), proc_fs, "proc", 0, None) {
        log!("mounting proc to read the kernel command line failed: {e}");
    }
    let wanted = std::fs::read_to_string("/proc/cmdline")
        .map_err(|e| format!("cannot read /proc/cmdline: {e}"))
        .and_then(|c| handover::wanted(&c));
    match wanted {
        Ok(Some(h)) => {
            handover::mount_api_filesystems();
            init::console();
            init::load_modules(std::path::Path::new(init::MODULES));
            return Some(h);
        }
        Ok(None) => {}
        Err(e) => log!("{e}: the agent serves from the initramfs"),
    }
    // The pod VM's path copies the initramfs: nothing may be mounted in it.
    if let Err(e) = sys::umount_detach(proc_fs) {
        log!("unmounting /proc failed: {e}");
    }
    None
}

/// PID 1 in the root disk: the agent goes on in a child of its own, in a
/// session of its own, and PID 1 becomes the image's init. Never returns.
fn hand_over(h: &handover::Handover) -> ! {
    log!(
        "the root is {} ({}); its {} takes PID 1, the agent serves from a child",
        h.root,
        if h.read_only { "ro" } else { "rw" },
        h.init.display()
    );
    if h.image_agent {
        // The image's own agent, a service of its init, serves.
        log!(
            "{}: the image's own k7d-agent serves",
            crate::handover::IMAGE_AGENT_PARAM
        );
        let why = handover::exec_init(h);
        log!("{why}; the agent serves on, the image's init does not run");
        serve_vm(|cfg| cfg.set_hostname = false)
    }
    match sys::fork_single_threaded() {
        Ok(0) => {
            if let Err(e) = sys::setsid() {
                log!("a session of its own for the agent failed: {e}");
            }
            serve_vm(|cfg| {
                // The image names itself; runc, in the initramfs, is gone.
                cfg.set_hostname = false;
                cfg.no_pivot = true;
            })
        }
        Ok(_) => {
            let why = handover::exec_init(h);
            log!("{why}; the agent serves on, the image's init does not run");
        }
        Err(e) => {
            log!("forking the agent failed: {e}; PID 1 serves, the image's init does not run");
            serve_vm(|cfg| cfg.set_hostname = false)
        }
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Serves the agent's protocol on vsock with the VM's configuration
/// (`adjust`ed), in PID 1 or the handover's child. Never returns.
fn serve_vm(adjust: impl FnOnce(&mut container::Config)) -> ! {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(), String> {
        let mut cfg = container::Config::guest();
        match std::fs::read_to_string("/proc/cmdline").map(|c| k7d_agent::proto::runc_timeout(&c)) {
            Ok(Ok(t)) => cfg.runc_timeout = t,
            Ok(Err(e)) => log!("{e}: runc commands keep the default limit"),
            Err(e) => log!("cannot read /proc/cmdline ({e}): runc commands keep the default limit"),
        }
        adjust(&mut cfg);
        let runtime = cfg.runc.clone();
        let reaper = reaper::Reaper::start().map_err(|e| format!("starting the reaper failed: {e}"))?;
        let agent = container::Containers::new(cfg, reaper)
            .map_err(|e| format!("making the agent's state directories failed: {e}"))?;
        let port = k7d_agent::proto::PORT;
        let listener =
            server::Listener::vsock(port).map_err(|e| format!("listening on vsock port {port} failed: {e}"))?;
        log!(
            "serving on vsock port {port} (kernel {}, OCI runtime {})",
            sys::kernel_release(),
            runtime.display()
        );
        server::serve(listener, Arc::new(agent));
        Ok(())
    }));
    match result {
        Ok(Ok(())) => log!("the server stopped"),
        Ok(Err(e)) => log!("{e}"),
        Err(_) => log!("the agent panicked"),
    }
    log!("PID 1 stays up but serves nothing");
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn host_config(mut args: impl Iterator<Item = String>) -> Result<(Listen, container::Config), String> {
    let mut cfg = container::Config::guest();
    cfg.set_hostname = false;
    let mut listen = None;
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        let mut listen_on = |l: Listen| match listen.replace(l) {
            Some(_) => Err("--vsock and --listen-unix are one choice, made once".to_string()),
            None => Ok(()),
        };
        match a.as_str() {
            "--vsock" => listen_on(Listen::Vsock)?,
            "--listen-unix" => {
                let path = PathBuf::from(value()?);
                listen_on(Listen::Unix(path))?
            }
            "--state-dir" => cfg.state_dir = value()?.into(),
            // --runc and --runc-root: the names before crun was taken too.
            "--runtime" | "--runc" => cfg.runc = value()?.into(),
            "--runtime-root" | "--runc-root" => cfg.runc_root = value()?.into(),
            "--sysfs" => cfg.sysfs = value()?.into(),
            "--dev" => cfg.dev = value()?.into(),
            _ => return Err(format!("unknown argument {a:?}")),
        }
    }
    let listen = listen.ok_or("--vsock or --listen-unix is required when not PID 1")?;
    if listen == Listen::Vsock {
        // A service in a user's image: what runs there is the image's.
        cfg.no_pivot = true;
    }
    Ok((listen, cfg))
}

fn run_host(listen: Listen, cfg: container::Config) -> Result<(), String> {
    sys::set_child_subreaper().map_err(|e| format!("becoming a child subreaper failed: {e}"))?;
    let reaper = reaper::Reaper::start().map_err(|e| format!("starting the reaper failed: {e}"))?;
    let agent =
        container::Containers::new(cfg, reaper).map_err(|e| format!("making the state directories failed: {e}"))?;
    let listener = match listen {
        Listen::Vsock => {
            let port = k7d_agent::proto::PORT;
            let l = server::Listener::vsock(port).map_err(|e| format!("listening on vsock port {port} failed: {e}"))?;
            log!("serving on vsock port {port} (kernel {})", sys::kernel_release());
            l
        }
        Listen::Unix(path) => {
            let _ = std::fs::remove_file(&path);
            let l = std::os::unix::net::UnixListener::bind(&path)
                .map_err(|e| format!("listening on {} failed: {e}", path.display()))?;
            log!("serving on {}", path.display());
            server::Listener::Unix(l)
        }
    };
    server::serve(listener, Arc::new(agent));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> impl Iterator<Item = String> {
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>().into_iter()
    }

    #[test]
    fn the_service_unit_runs_what_the_agent_parses_and_bad_arguments_are_refused() {
        let unit = include_str!("../systemd/k7d-agent.service");
        let exec = unit
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .expect("the unit has an ExecStart=");
        let mut words = exec.split_whitespace();
        assert_eq!(words.next(), Some("/usr/local/bin/k7d-agent"));
        let (listen, cfg) = host_config(words.map(str::to_string)).unwrap();
        assert_eq!(listen, Listen::Vsock);
        assert!(cfg.no_pivot && !cfg.set_hostname);
        let (listen, cfg) = host_config(args(&["--listen-unix", "/x.sock", "--state-dir", "/s"])).unwrap();
        assert_eq!(
            (listen, cfg.state_dir),
            (Listen::Unix("/x.sock".into()), PathBuf::from("/s"))
        );
        for (bad, says) in [
            (&["--vsock", "--listen-unix", "/x"][..], "one choice"),
            (&["--vsock", "--vsock"][..], "one choice"),
            (&[][..], "is required"),
            (&["--vsock", "--bogus"][..], "unknown argument"),
            (&["--listen-unix"][..], "needs a value"),
        ] {
            let e = host_config(args(bad)).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
