//! `k7d exec VM -- CMD ARGS...`: a command run in a VM by its guest agent
//! (`k7d-agent`, `docs/exec.md`), in the VM itself rather than in a
//! container (`k7d_agent::proto::THE_VM`). The daemon names the VM's vsock
//! socket (`info`); the agent is reached through it as the containerd shim
//! reaches a pod VM's (`k7d_shim::agent`). stdin is forwarded, stdout and
//! stderr come back on streams of their own, and the command's exit
//! status is `k7d exec`'s own (128 + N for a signal N; `--timeout` kills
//! it with SIGKILL: 137). With `--tty` the command runs on a pty of the
//! agent's (stdout and stderr both come through it) and k7d's own terminal,
//! if stdin is one, is raw for the command's life and gives it its size.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use clap::Args;
use k7d_agent::proto::{self, Exec, ProcessRef, Reply, Request, StdioSpec, Stream};
use k7d_shim::agent::{Agent, Conn};
use serde_json::json;

/// How long connecting to the agent may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the agent may take to report a command killed past `--timeout`.
const KILL_WAIT: Duration = Duration::from_secs(10);
/// How long the command's output streams may stay open after it exited (a
/// background process it left may hold them).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// `k7d exec`'s arguments.
#[derive(Clone, Debug, Args)]
pub struct ExecArgs {
    /// The VM (a fork child or a restored VM alike).
    #[arg(required_unless_present = "cluster", conflicts_with = "cluster")]
    pub vm: Option<String>,
    /// Run the command in every member of this cluster at once instead:
    /// each line of output prefixed with its member's id, no stdin (the
    /// command's is empty), and k7d exec's status the first non-zero
    /// member's, in member order.
    #[arg(long, value_name = "CLUSTER")]
    pub cluster: Option<String>,
    /// Run the command on a terminal in the guest (a pty, its controlling
    /// terminal: an interactive shell, `top`, a password prompt). Its stdout
    /// and stderr both come through it; k7d's own terminal, if its stdin is
    /// one, is put in raw mode until the command ends and gives the pty its
    /// size, and each resize of it after (SIGWINCH).
    #[arg(short = 't', long, conflicts_with = "cluster")]
    pub tty: bool,
    /// Run it through the daemon's `exec` op instead of the VM's own
    /// socket (for a user who may use the daemon's socket, `--allow-gid`,
    /// but not the VM's): stdin read whole first (at most 512 KiB; not
    /// read from a terminal), the first 4 MiB of stdout and of stderr
    /// written out when the command has ended.
    #[arg(long, conflicts_with_all = ["cluster", "tty"])]
    pub api: bool,
    /// An environment variable for the command, KEY=VALUE (repeatable);
    /// PATH is the agent's unless given.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// The working directory in the guest (default /).
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
    /// Run as UID[:GID] in the guest (default 0:0; GID defaults to UID).
    #[arg(long, value_name = "UID[:GID]", value_parser = parse_user)]
    pub user: Option<(u32, u32)>,
    /// Kill the command after this many seconds (exit status 137).
    #[arg(long, value_name = "S", value_parser = parse_timeout)]
    pub timeout: Option<Duration>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

fn parse_user(s: &str) -> Result<(u32, u32), String> {
    let n = |x: &str| x.parse::<u32>().map_err(|_| format!("{x:?} is not a numeric uid/gid"));
    match s.split_once(':') {
        Some((u, g)) => Ok((n(u)?, n(g)?)),
        None => n(s).map(|u| (u, u)),
    }
}

fn parse_timeout(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(t) if t > 0.0 && t <= 86_400.0 => Ok(Duration::from_secs_f64(t)),
        _ => Err(format!("{s:?} is not a number of seconds in (0, 86400]")),
    }
}

impl ExecArgs {
    /// `command` in `vm`, as root in `/` with the agent's PATH, no
    /// terminal and no timeout (the caller sets what it needs).
    pub fn in_vm(vm: &str, command: Vec<String>) -> Self {
        Self {
            vm: Some(vm.to_string()),
            cluster: None,
            tty: false,
            api: false,
            env: Vec::new(),
            cwd: None,
            user: None,
            timeout: None,
            command,
        }
    }
}

/// The OCI `process` object the agent runs.
pub fn process_spec(a: &ExecArgs) -> serde_json::Value {
    let mut spec = json!({ "args": a.command, "env": a.env });
    if let Some(cwd) = &a.cwd {
        spec["cwd"] = json!(cwd);
    }
    if let Some((uid, gid)) = a.user {
        spec["user"] = json!({ "uid": uid, "gid": gid });
    }
    spec
}

/// A fresh exec id (the agent's id grammar).
fn exec_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("k7d-exec-{}-{nanos}", std::process::id())
}

fn refused(what: &str, e: k7d_shim::agent::CallError) -> anyhow::Error {
    anyhow!("{what}: {e}")
}

/// Why a command did not run, where the caller answers each one its own
/// way (the daemon's `exec` op: its API codes).
#[derive(Debug)]
pub enum NotRun {
    /// The guest agent does not answer at the VM's socket.
    NoAgent(String),
    /// The agent refused the exec (its program, directory or user).
    Refused(String),
}

impl std::fmt::Display for NotRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoAgent(m) | Self::Refused(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for NotRun {}

/// How a command ended, said by nobody: [`run_with`] says it on stderr,
/// the daemon's `exec` op answers it.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Its exit status (128 + N for a signal N; 127 when it did not start).
    pub status: u8,
    /// It ran past this timeout and was killed (status 137).
    pub timed_out: Option<Duration>,
    /// Why it did not start, when it did not (status 127).
    pub not_started: Option<String>,
}

/// One line on stderr; never panics (unlike `eprintln!`, when stderr is closed).
fn say(line: std::fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Copies `from` to `to` until EOF; what it copied.
fn pump(mut from: impl Read, mut to: impl Write) -> u64 {
    let mut buf = vec![0u8; 64 << 10];
    let mut n = 0u64;
    loop {
        match from.read(&mut buf) {
            Ok(0) => return n,
            Ok(k) => {
                if to.write_all(&buf[..k]).and_then(|()| to.flush()).is_err() {
                    return n;
                }
                n += k as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return n,
        }
    }
}

/// The longest line a cluster member's output is held for before it is
/// written out without its end.
const MAX_LINE: usize = 64 << 10;

/// Where a command's output goes, and what its stdin is (none: empty).
pub struct Streams {
    out: Box<dyn Write + Send>,
    err: Box<dyn Write + Send>,
    stdin: Option<Box<dyn Read + Send>>,
}

impl Streams {
    /// k7d's own stdout and stderr, and its stdin forwarded.
    fn own() -> Self {
        Self {
            out: Box::new(std::io::stdout()),
            err: Box::new(std::io::stderr()),
            stdin: Some(Box::new(std::io::stdin())),
        }
    }

    /// One cluster member's: each line to k7d's stdout or stderr whole,
    /// after `vm: `; no stdin.
    fn member(vm: &str) -> Self {
        Self {
            out: Box::new(Prefixed::new(vm, false)),
            err: Box::new(Prefixed::new(vm, true)),
            stdin: None,
        }
    }

    /// Streams of a caller's own (`k7d cp`'s pipes, the daemon's buffers).
    pub fn piped(out: Box<dyn Write + Send>, err: Box<dyn Write + Send>, stdin: Option<Box<dyn Read + Send>>) -> Self {
        Self { out, err, stdin }
    }
}

/// Where [`Prefixed`] writes each whole line, in one call.
type LineSink = Box<dyn FnMut(&[u8]) -> std::io::Result<()> + Send>;

/// A writer that writes whole lines, each after a prefix, in one call of
/// `to` (k7d's stdout or stderr under its lock, so that the lines of
/// members running at once do not mix); a last line without its end gets
/// one when it is dropped.
struct Prefixed {
    prefix: Vec<u8>,
    line: Vec<u8>,
    to: LineSink,
}

impl Prefixed {
    fn new(vm: &str, to_stderr: bool) -> Self {
        let to: LineSink = if to_stderr {
            Box::new(|b| std::io::stderr().lock().write_all(b))
        } else {
            Box::new(|b| {
                let mut o = std::io::stdout().lock();
                o.write_all(b).and_then(|()| o.flush())
            })
        };
        Self::to(vm, to)
    }

    fn to(vm: &str, to: LineSink) -> Self {
        Self {
            prefix: format!("{vm}: ").into_bytes(),
            line: Vec::new(),
            to,
        }
    }

    fn emit(&mut self) -> std::io::Result<()> {
        let mut whole = Vec::with_capacity(self.prefix.len() + self.line.len() + 1);
        whole.extend_from_slice(&self.prefix);
        whole.append(&mut self.line);
        if !whole.ends_with(b"\n") {
            whole.push(b'\n');
        }
        (self.to)(&whole)
    }
}

impl Write for Prefixed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for piece in buf.split_inclusive(|&b| b == b'\n') {
            self.line.extend_from_slice(piece);
            if piece.ends_with(b"\n") || self.line.len() >= MAX_LINE {
                self.emit()?;
            }
        }
        Ok(buf.len())
    }

    /// A part of a line waits for its end.
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Prefixed {
    fn drop(&mut self) {
        if !self.line.is_empty() {
            let _ = self.emit();
        }
    }
}

/// Runs the command in the VM whose vsock socket is `uds` (`vm` names it
/// in messages); the exit code is the command's.
pub fn run(vm: &str, uds: PathBuf, a: &ExecArgs) -> Result<ExitCode> {
    // Restored when dropped, however the command ends.
    let raw = if a.tty { RawTerminal::enter() } else { None };
    // A terminal's resizes follow the command: SIGWINCH is blocked here,
    // before any other thread starts (each inherits the mask), and taken by
    // the one thread that waits for it (`follow_resizes`).
    if raw.is_some() {
        block_winch();
    }
    run_with(vm, uds, a, Streams::own()).map(ExitCode::from)
}

/// SIGWINCH as a set.
fn winch_set() -> libc::sigset_t {
    // SAFETY: an all-zero sigset_t is a valid value for sigemptyset to set.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a sigset_t, and a valid signal number.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGWINCH);
    }
    set
}

/// Blocks SIGWINCH in this thread (and the threads it starts after).
fn block_winch() {
    let set = winch_set();
    // SAFETY: a valid set; the old mask is not asked for.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Whether this thread has SIGWINCH blocked ([`run`] blocks it for a
/// terminal), so that a thread can wait for it.
fn winch_blocked() -> bool {
    // SAFETY: an all-zero sigset_t is valid to be overwritten.
    let mut now: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: a null new set only reads the mask into `now`.
    let ok = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut now) } == 0;
    // SAFETY: a valid set and signal number.
    ok && unsafe { libc::sigismember(&now, libc::SIGWINCH) } == 1
}

/// Passes each resize of k7d's terminal (SIGWINCH) on to the command's pty
/// in the guest, on a connection of its own, until the agent no longer
/// answers (the command and the process end it).
fn follow_resizes(vm: &str, uds: &std::path::Path, process: &ProcessRef) {
    let set = winch_set();
    loop {
        let mut sig = 0;
        // SAFETY: a valid set and a valid pointer for the signal taken.
        if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
            return;
        }
        let Some((width, height)) = terminal_size() else {
            continue;
        };
        let resized = Agent::new(uds).connect(CONNECT_TIMEOUT).map(|mut c| {
            c.call(&Request::ResizePty {
                process: process.clone(),
                width,
                height,
            })
        });
        match resized {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                say(format_args!(
                    "k7d exec: vm {vm}: the terminal's new size was not set: {e}"
                ));
                return;
            }
            Err(_) => return,
        }
    }
}

/// `k7d exec --api`: the command through the daemon's `exec` op; its
/// output written out as the daemon kept it, its status k7d's own.
pub fn run_through_daemon(socket: &std::path::Path, vm: &str, a: &ExecArgs) -> Result<ExitCode> {
    use anyhow::Context as _;
    use base64::Engine as _;
    use k7d_api::api::{ApiError, ExecArgs as ApiExecArgs, MAX_EXEC_STDIN, Reply, Request};
    use k7d_api::client::Client;
    use std::io::IsTerminal;
    // stdin whole, unless it is a terminal (which would wait for ^D).
    let stdin = if std::io::stdin().is_terminal() {
        None
    } else {
        let mut b = Vec::new();
        std::io::stdin()
            .take(MAX_EXEC_STDIN as u64 + 1)
            .read_to_end(&mut b)
            .context("cannot read stdin")?;
        if b.len() > MAX_EXEC_STDIN {
            bail!(
                "k7d exec --api carries at most {MAX_EXEC_STDIN} bytes of stdin (without --api it streams any amount)"
            );
        }
        (!b.is_empty()).then(|| base64::engine::general_purpose::STANDARD.encode(&b))
    };
    let args = ApiExecArgs {
        id: vm.to_string(),
        command: a.command.clone(),
        env: a.env.clone(),
        cwd: a.cwd.clone(),
        uid: a.user.map(|u| u.0),
        gid: a.user.map(|u| u.1),
        stdin,
        timeout_s: a.timeout.map(|t| t.as_secs_f64()),
        stream: false,
    };
    // The daemon answers when the command has ended: wait past its timeout.
    let (timeout, wait) = (args.timeout(), args.timeout() + Duration::from_secs(30));
    let mut client = Client::connect_with_timeout(socket, wait).map_err(|e: ApiError| anyhow!("{e}"))?;
    let req = Request::Exec(args);
    let Reply::Executed(x) = client.request(&req).map_err(|e| anyhow!("{e}"))? else {
        bail!("the daemon's answer to `exec` is not its result");
    };
    let decode = |s: &str| base64::engine::general_purpose::STANDARD.decode(s);
    let (out, err) = (
        decode(&x.stdout).context("the daemon's stdout is not base64")?,
        decode(&x.stderr).context("the daemon's stderr is not base64")?,
    );
    let _ = std::io::stdout()
        .write_all(&out)
        .and_then(|()| std::io::stdout().flush());
    let _ = std::io::stderr().write_all(&err);
    let say = |line: String| {
        let _ = writeln!(std::io::stderr(), "k7d exec: vm {vm}: {line}");
    };
    for (name, kept, all) in [
        ("stdout", out.len(), x.stdout_bytes),
        ("stderr", err.len(), x.stderr_bytes),
    ] {
        if (kept as u64) < all {
            say(format!("its {name} was {all} bytes; the daemon kept the first {kept}"));
        }
    }
    if let Some(e) = &x.error {
        say(e.clone());
    }
    if x.timed_out {
        say(format!(
            "the command ran past its timeout ({} s) and was killed",
            timeout.as_secs_f64()
        ));
    }
    Ok(ExitCode::from(x.status))
}

/// k7d's own terminal (its stdin) in raw mode: keys go to the guest's pty
/// as typed (^C is the guest's to interpret), and the guest's pty does the
/// echo and line endings. Put back as it was when dropped.
struct RawTerminal {
    saved: libc::termios,
}

impl RawTerminal {
    /// Raw mode on stdin, if it is a terminal; none otherwise.
    fn enter() -> Option<RawTerminal> {
        // SAFETY: an all-zero termios is a valid value to be overwritten.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd 0 and a valid pointer to a termios; fails (ENOTTY)
        // when stdin is not a terminal.
        if unsafe { libc::tcgetattr(0, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        // SAFETY: `raw` is a valid termios.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: fd 0 and a valid termios.
        if unsafe { libc::tcsetattr(0, libc::TCSANOW, &raw) } != 0 {
            return None;
        }
        Some(RawTerminal { saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        // SAFETY: fd 0 and the termios read from it.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &self.saved) };
    }
}

/// k7d's own terminal's size (columns, rows), if stdin or stdout is one.
fn terminal_size() -> Option<(u32, u32)> {
    [0, 1].into_iter().find_map(|fd| {
        // SAFETY: an all-zero winsize is a valid value to be overwritten.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: TIOCGWINSZ writes one winsize through the valid pointer.
        let ok = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0;
        (ok && ws.ws_col > 0 && ws.ws_row > 0).then(|| (u32::from(ws.ws_col), u32::from(ws.ws_row)))
    })
}

/// Runs the command in every VM of `members` (id, vsock socket) at once
/// (`k7d exec --cluster`): each one's lines after its id, no stdin. The
/// exit code is the first non-zero status in member order (a member whose
/// command could not run counts as 255, its sentence on stderr).
pub fn run_cluster(members: &[(String, PathBuf)], a: &ExecArgs) -> ExitCode {
    let statuses: Vec<u8> = std::thread::scope(|s| {
        let handles: Vec<_> = members
            .iter()
            .map(|(vm, uds)| s.spawn(move || (vm, run_with(vm, uds.clone(), a, Streams::member(vm)))))
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok((_, Ok(status))) => status,
                Ok((vm, Err(e))) => {
                    say(format_args!("k7d exec: vm {vm}: {e:#}"));
                    255
                }
                Err(_) => 255,
            })
            .collect()
    });
    for ((vm, _), st) in members.iter().zip(&statuses) {
        if *st != 0 {
            say(format_args!("k7d exec: vm {vm} exited {st}"));
        }
    }
    ExitCode::from(statuses.into_iter().find(|s| *s != 0).unwrap_or(0))
}

/// Runs the command in the VM whose vsock socket is `uds` with `streams`;
/// its exit status (128 + N for a signal N), and what k7d exec says of it
/// on stderr.
pub(crate) fn run_with(vm: &str, uds: PathBuf, a: &ExecArgs, streams: Streams) -> Result<u8> {
    let o = run_outcome(vm, uds, a, streams)?;
    if let Some(e) = &o.not_started {
        say(format_args!("k7d exec: vm {vm}: {e}"));
    }
    if let Some(t) = o.timed_out {
        say(format_args!(
            "k7d exec: vm {vm}: the command ran past --timeout {} s and was killed",
            t.as_secs_f64()
        ));
    }
    Ok(o.status)
}

/// Runs the command in the VM whose vsock socket is `uds` with `streams`
/// and says nothing: how it ended. An error that is a [`NotRun`] (see
/// `downcast_ref`) says why it did not run.
pub fn run_outcome(vm: &str, uds: PathBuf, a: &ExecArgs, streams: Streams) -> Result<Outcome> {
    let agent = Agent::new(&uds);
    let connect = || {
        agent.connect(CONNECT_TIMEOUT).map_err(|e| {
            anyhow::Error::new(NotRun::NoAgent(format!(
                "the guest agent of vm {vm} does not answer (k7d exec needs k7d-agent in the guest: docs/exec.md): {e:#}"
            )))
        })
    };
    let mut ctl = connect()?;
    let process = ProcessRef {
        container: proto::THE_VM.into(),
        exec_id: Some(exec_id()),
    };
    ctl.call(&Request::Exec(Exec {
        process: process.clone(),
        spec: process_spec(a),
        stdio: StdioSpec {
            terminal: a.tty,
            stdin: streams.stdin.is_some(),
            stdout: true,
            // On a terminal, stderr is the pty too.
            stderr: !a.tty,
        },
    }))
    .map_err(|e| anyhow::Error::new(NotRun::Refused(format!("vm {vm} refused the exec: {e}"))))?;
    if a.tty
        && let Some((width, height)) = terminal_size()
        && let Err(e) = ctl.call(&Request::ResizePty {
            process: process.clone(),
            width,
            height,
        })
    {
        say(format_args!("k7d exec: vm {vm}: the terminal's size was not set: {e}"));
    }
    if a.tty && winch_blocked() {
        let (vm, uds, process) = (vm.to_string(), uds.clone(), process.clone());
        std::thread::spawn(move || follow_resizes(&vm, &uds, &process));
    }
    let result = attach_and_run(vm, &connect, &mut ctl, &process, a.timeout, a.tty, streams);
    // Forgotten whatever happened (a running one is killed first).
    if result.is_err() {
        let _ = ctl.call(&Request::Signal {
            process: process.clone(),
            signal: libc::SIGKILL,
            all: false,
        });
    }
    let _ = ctl.call(&Request::DeleteExec(process));
    result
}

fn attach_and_run(
    vm: &str,
    connect: &dyn Fn() -> Result<Conn>,
    ctl: &mut Conn,
    process: &ProcessRef,
    timeout: Option<Duration>,
    tty: bool,
    streams: Streams,
) -> Result<Outcome> {
    let attach = |stream: Stream| -> Result<std::os::unix::net::UnixStream> {
        let mut c = connect()?;
        c.call(&Request::Attach {
            process: process.clone(),
            stream,
        })
        .map_err(|e| refused(&format!("vm {vm}: attaching the command's {stream:?}"), e))?;
        c.into_stream()
    };
    let stdout = attach(Stream::Stdout)?;
    // A command on a terminal has no stderr of its own (the pty is both).
    let stderr = if tty { None } else { Some(attach(Stream::Stderr)?) };
    // Kept to cut the output streams off after the drain (below).
    let stdin = match streams.stdin {
        Some(from) => Some((from, attach(Stream::Stdin)?)),
        None => None,
    };
    // stdin's too: a command that never reads it leaves its pump blocked on
    // a full socket (in the daemon's `exec`, a thread per such exec).
    let held: Vec<std::os::unix::net::UnixStream> = std::iter::once(&stdout)
        .chain(stderr.as_ref())
        .chain(stdin.as_ref().map(|(_, s)| s))
        .filter_map(|s| s.try_clone().ok())
        .collect();
    let mut waiter = connect()?;
    waiter.set_timeout(None)?;
    let (done_tx, done_rx) = mpsc::channel();
    let wait_ref = process.clone();
    std::thread::spawn(move || {
        let _ = done_tx.send(waiter.call(&Request::Wait(wait_ref)));
    });
    // Not locked for the stream's life: this thread's own messages go to
    // stderr too.
    let Streams {
        out: to_out,
        err: to_err,
        ..
    } = streams;
    // Each stream is shut down when its pump ends, whatever ended it: a
    // reader that stopped (`k7d cp` past its --max-size) closes the stream
    // as dropping it used to, though `held` keeps a descriptor of it.
    let relay = |s: std::os::unix::net::UnixStream, to: Box<dyn Write + Send>| {
        std::thread::spawn(move || {
            let n = pump(&s, to);
            let _ = s.shutdown(std::net::Shutdown::Both);
            n
        })
    };
    let out = relay(stdout, to_out);
    let err = stderr.map(|s| relay(s, to_err));
    match ctl.call(&Request::Start(process.clone())) {
        Ok(Reply::Pid(_)) => {}
        Ok(other) => bail!("vm {vm}: the agent answered the start with {other:?}"),
        Err(e) => {
            // The program was checked when the exec was added; what is
            // left is the start itself (as a shell says: 126/127).
            return Ok(Outcome {
                status: 127,
                timed_out: None,
                not_started: Some(e.to_string()),
            });
        }
    }
    // stdin: forwarded until its EOF, which closes the command's stdin.
    // Not joined: a terminal's stdin may never end.
    if let Some((from, mut stdin)) = stdin {
        std::thread::spawn(move || {
            pump(from, &mut stdin);
            let _ = stdin.shutdown(std::net::Shutdown::Write);
        });
    }
    let mut timed_out = None;
    let waited = match timeout {
        None => done_rx
            .recv()
            .map_err(|_| anyhow!("vm {vm}: the wait for the command ended unanswered"))?,
        Some(t) => match done_rx.recv_timeout(t) {
            Ok(w) => w,
            Err(_) => {
                ctl.call(&Request::Signal {
                    process: process.clone(),
                    signal: libc::SIGKILL,
                    all: false,
                })
                .map_err(|e| refused(&format!("vm {vm}: killing the command past its --timeout"), e))?;
                timed_out = Some(t);
                // Bounded: an agent that never reports the kill must not
                // hang k7d exec past its own --timeout.
                done_rx.recv_timeout(KILL_WAIT).map_err(|_| {
                    anyhow!(
                        "vm {vm}: the guest agent did not report the killed command's end within {} s",
                        KILL_WAIT.as_secs()
                    )
                })?
            }
        },
    };
    let status = match waited {
        Ok(Reply::Exited(x)) => x.exit_status,
        Ok(other) => bail!("vm {vm}: the agent answered the wait with {other:?}"),
        Err(e) => return Err(refused(&format!("vm {vm}: waiting for the command"), e)),
    };
    // Its output, to the end (bounded: a background process it left may
    // keep the streams open).
    for h in std::iter::once(out).chain(err) {
        let deadline = std::time::Instant::now() + DRAIN_TIMEOUT;
        while !h.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if h.is_finished() {
            let _ = h.join();
        }
    }
    // What a background process left holding the streams is cut off, so no
    // pump thread outlives the command by more than the drain (in the
    // daemon's `exec`, a thread and its buffer per exec otherwise).
    for s in &held {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    Ok(Outcome {
        status: u8::try_from(status).unwrap_or(255),
        timed_out,
        not_started: None,
    })
}

/// A VM's vsock socket with a guest agent behind it, for tests: it takes
/// `CONNECT <port>` as the VMM's socket does and greets as the agent does
/// (`Hello`); every other request is answered by `answer`.
#[cfg(test)]
pub(crate) fn fake_agent(
    uds: &std::path::Path,
    answer: impl Fn(Request) -> k7d_agent::proto::Response + Send + 'static,
) {
    fake_agent_frames(uds, move |req| vec![answer(req)]);
}

/// [`fake_agent`] whose answer to a request may be several frames (a
/// `Run`'s output, then its end).
#[cfg(test)]
pub(crate) fn fake_agent_frames(
    uds: &std::path::Path,
    answer: impl Fn(Request) -> Vec<k7d_agent::proto::Response> + Send + 'static,
) {
    use k7d_agent::proto::Response;
    use std::io::BufRead;
    let l = std::os::unix::net::UnixListener::bind(uds).unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let mut s = s.unwrap();
            let mut line = String::new();
            std::io::BufReader::new(s.try_clone().unwrap())
                .read_line(&mut line)
                .unwrap();
            assert_eq!(line, format!("CONNECT {}\n", proto::PORT));
            s.write_all(b"OK 1073741824\n").unwrap();
            while let Ok(req) = proto::read_frame::<_, Request>(&mut s) {
                let frames = match req {
                    Request::Hello { version } => vec![Response::Ok(Reply::Hello {
                        version,
                        kernel: "6.1.0-57-cloud-amd64".into(),
                    })],
                    other => answer(other),
                };
                for f in frames {
                    proto::write_frame(&mut s, &f).unwrap();
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_and_timeouts_are_parsed_or_refused() {
        assert_eq!(parse_user("1000"), Ok((1000, 1000)));
        assert_eq!(parse_user("1000:5"), Ok((1000, 5)));
        assert!(parse_user("root").unwrap_err().contains("not a numeric"));
        assert!(parse_user("1:x").is_err());
        assert_eq!(parse_timeout("1.5"), Ok(Duration::from_millis(1500)));
        for bad in ["0", "-1", "nan", "inf", "100000", "x"] {
            assert!(parse_timeout(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_process_spec_carries_what_was_asked_and_nothing_else() {
        let a = ExecArgs {
            vm: Some("v".into()),
            cluster: None,
            tty: false,
            api: false,
            env: vec!["A=1".into()],
            cwd: Some("/tmp".into()),
            user: Some((7, 8)),
            timeout: None,
            command: vec!["sh".into(), "-c".into(), "echo hi".into()],
        };
        assert_eq!(
            process_spec(&a),
            json!({"args": ["sh", "-c", "echo hi"], "env": ["A=1"], "cwd": "/tmp", "user": {"uid": 7, "gid": 8}})
        );
        assert!(exec_id().len() <= 76 && proto::valid_id(&exec_id()));
    }

    #[test]
    fn why_a_command_did_not_run_is_told_apart() {
        let dir = std::env::temp_dir().join(format!("k7d-execcli-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let a = ExecArgs::in_vm("v", vec!["nope".into()]);
        let streams = || Streams::piped(Box::new(std::io::sink()), Box::new(std::io::sink()), None);
        let e = run_outcome("v", dir.join("none.sock"), &a, streams()).unwrap_err();
        assert!(
            matches!(e.downcast_ref::<NotRun>(), Some(NotRun::NoAgent(m)) if m.contains("guest agent of vm v does not answer")),
            "{e:#}"
        );
        let uds = dir.join("v.sock");
        fake_agent(&uds, |_| k7d_agent::proto::Response::Err {
            message: "nope: not found in the VM's PATH /bin".into(),
            not_found: false,
        });
        let e = run_outcome("v", uds, &a, streams()).unwrap_err();
        assert!(
            matches!(e.downcast_ref::<NotRun>(), Some(NotRun::Refused(m)) if m.starts_with("vm v refused the exec: ") && m.contains("not found in the VM's PATH")),
            "{e:#}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_members_output_comes_in_whole_lines_after_its_id() {
        use std::sync::{Arc, Mutex};
        let got = Arc::new(Mutex::new(Vec::<Vec<u8>>::new()));
        let sink = got.clone();
        let mut p = Prefixed::to(
            "cl-f1-a",
            Box::new(move |b| {
                sink.lock().unwrap().push(b.to_vec());
                Ok(())
            }),
        );
        // Pieces as the agent's stream cuts them, flushed after each (as pump does).
        for piece in [&b"one\ntw"[..], b"o", b"\nthree\nfou", b"r"] {
            p.write_all(piece).unwrap();
            p.flush().unwrap();
        }
        let long = vec![b'x'; MAX_LINE + 10];
        p.write_all(&long).unwrap();
        drop(p);
        let got = got.lock().unwrap();
        let text: Vec<String> = got.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
        assert_eq!(
            text[..3],
            ["cl-f1-a: one\n", "cl-f1-a: two\n", "cl-f1-a: three\n"],
            "each call one whole line"
        );
        assert_eq!(
            text[3],
            format!("cl-f1-a: four{}\n", "x".repeat(MAX_LINE + 10)),
            "a line without its end is held up to MAX_LINE (one read past it), then written ended"
        );
        assert_eq!(text.len(), 4, "nothing held back at the drop");
    }
}
