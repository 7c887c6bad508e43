//! The daemon's API is bounded (`docs/security.md`): a connection cap with a
//! refusal line, a timeout for a partial line and for an idle connection, a
//! CLI that waits a bounded time, a SIGTERM that ends the daemon within its
//! bound whatever a request does, peer credentials checked on every
//! connection, a `--socket` that replaces only a stale socket, and a restart
//! right after `kill -9`. Each test runs a real `k7d daemon` process.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{K7D, Scratch, text};

/// `nobody` on Debian: a uid and gid no test file belongs to.
const NOBODY: u32 = 65534;

/// A scratch directory other uids can enter (the peer-credential test must
/// reach the socket in it).
fn scratch(tag: &str) -> Scratch {
    let d = Scratch::new(&format!("bounds-{tag}"));
    std::fs::set_permissions(&d.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

fn sock(d: &Scratch) -> PathBuf {
    d.0.join("k7d.sock")
}

struct DaemonProc {
    child: Child,
}

impl DaemonProc {
    /// Spawns `k7d daemon` on `dir`'s state dir and socket with `extra` flags.
    fn spawn(dir: &Path, extra: &[&str]) -> Child {
        Command::new(K7D)
            .args(["daemon", "--jail", "off"])
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--socket")
            .arg(dir.join("k7d.sock"))
            .args(extra)
            .env_remove("K7D_SOCKET")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Starts a daemon and waits until it answers `version`.
    fn start(dir: &Path, extra: &[&str]) -> Self {
        let mut child = Self::spawn(dir, extra);
        let t = Instant::now();
        loop {
            if let Ok(mut c) =
                k7d_api::client::Client::connect_with_timeout(&dir.join("k7d.sock"), Duration::from_secs(2))
                && c.call(&k7d_api::api::Request::Version).is_ok()
            {
                break;
            }
            if let Some(st) = child.try_wait().unwrap() {
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("daemon exited early: {st}: {err}");
            }
            assert!(t.elapsed() < Duration::from_secs(15), "daemon did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self { child }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Names of the daemon's threads.
    fn threads(&self) -> Vec<String> {
        std::fs::read_dir(format!("/proc/{}/task", self.pid()))
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
            .map(|s| s.trim().to_string())
            .collect()
    }

    /// Waits until no connection thread is left (clients that hung up).
    fn settle(&self) {
        let t = Instant::now();
        while self.threads().iter().any(|n| n == "k7d-conn") {
            assert!(t.elapsed() < Duration::from_secs(5), "{:?}", self.threads());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) of our own child.
        unsafe { libc::kill(self.pid() as i32, sig) };
    }

    /// Waits for the daemon to exit (at most `limit`; then it is killed and
    /// the test fails) and returns how long that took, its exit code and stderr.
    fn wait_exit(mut self, limit: Duration) -> (Duration, Option<i32>, String) {
        let t = Instant::now();
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break Some(st);
            }
            if t.elapsed() > limit {
                self.signal(libc::SIGKILL);
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let took = t.elapsed();
        let mut err = String::new();
        let _ = self.child.stderr.take().unwrap().read_to_string(&mut err);
        let status = status.unwrap_or_else(|| panic!("the daemon did not exit within {limit:?}: {err}"));
        (took, status.code(), err)
    }

    /// SIGTERM and wait for a clean exit.
    fn stop(self) -> String {
        self.signal(libc::SIGTERM);
        let (_, code, err) = self.wait_exit(Duration::from_secs(20));
        assert_eq!(code, Some(0), "{err}");
        err
    }
}

impl Drop for DaemonProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: plain kill(2) of our own child.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
            let _ = self.child.wait();
        }
    }
}

fn cli(dir: &Path, args: &[&str]) -> Output {
    Command::new(K7D)
        .arg("--socket")
        .arg(dir.join("k7d.sock"))
        .args(args)
        .env_remove("K7D_TIMEOUT")
        .output()
        .unwrap()
}

/// Runs `cmd` to completion, killing it after `limit` (the test then fails).
fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    let mut c = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let t = Instant::now();
    while c.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            let _ = c.kill();
            let o = c.wait_with_output().unwrap();
            panic!("`{cmd:?}` still ran after {limit:?}: {:?}", text(&o));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    c.wait_with_output().unwrap()
}

/// Reads one line (at most `limit`): `None` at EOF or when nothing came.
fn read_line(s: &UnixStream, limit: Duration) -> Option<String> {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut line = String::new();
    match BufReader::new(s).read_line(&mut line) {
        Ok(n) if n > 0 => Some(line),
        _ => None,
    }
}

/// Whether the daemon closed `s` within `limit` (EOF, possibly after some lines).
fn closed_within(s: &UnixStream, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    let mut buf = [0u8; 4096];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match (&*s).read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

fn error_of(line: &str) -> (String, String) {
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    assert_eq!(v["v"], 1, "{line}");
    assert_eq!(v["ok"], false, "{line}");
    (
        v["error"]["code"].as_str().unwrap().to_string(),
        v["error"]["message"].as_str().unwrap().to_string(),
    )
}

fn ids(dir: &Path) -> Vec<String> {
    let o = cli(dir, &["--json", "list"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["vms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap().to_string())
        .collect()
}

/// `s` without the terminal colour sequences of the daemon's log.
fn plain(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ ... final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn list_line() -> &'static [u8] {
    b"{\"v\":1,\"op\":\"list\"}\n"
}

/// The connection after the cap gets one `busy` line and is closed; once a
/// connection ends, the next is served; the CLI waits for a free slot up to
/// its timeout and then says so.
#[test]
fn a_connection_over_the_cap_gets_one_refusal_line_and_is_closed() {
    let dir = scratch("cap");
    let d = DaemonProc::start(&dir.0, &["--max-connections", "4"]);
    d.settle();
    let held: Vec<UnixStream> = (0..4).map(|_| UnixStream::connect(sock(&dir)).unwrap()).collect();
    // Each held connection is served.
    for s in &held {
        (&*s).write_all(list_line()).unwrap();
        let line = read_line(s, Duration::from_secs(5)).expect("a held connection got no answer");
        assert!(line.contains("\"ok\":true"), "{line}");
    }
    let over = UnixStream::connect(sock(&dir)).unwrap();
    let line = read_line(&over, Duration::from_secs(5)).expect("no refusal line");
    let (code, msg) = error_of(&line);
    assert_eq!(code, "busy");
    assert_eq!(
        msg,
        "the daemon already serves its maximum of 4 connections; try again later"
    );
    assert!(
        closed_within(&over, Duration::from_secs(5)),
        "the refused connection stayed open"
    );

    // The CLI retries a busy daemon until its timeout, then says so.
    let t = Instant::now();
    let o = cli(&dir.0, &["--timeout", "1", "list"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(
        err.trim(),
        format!(
            "k7d: the k7d daemon at {} kept refusing connections for 1 s (--timeout): the daemon already serves its maximum of 4 connections; try again later",
            sock(&dir).display()
        )
    );
    // A slot frees when a connection ends: the CLI gets in.
    drop(held);
    let o = cli(&dir.0, &["--timeout", "10", "list"]);
    assert!(o.status.success(), "{:?}", text(&o));
    d.stop();
}

/// 340 idle connections: the daemon serves 16 of them (16 threads, not 340)
/// and refuses the others at once; the idle timeout closes the 16, so a new
/// `create` gets through within it.
#[test]
fn many_idle_connections_do_not_stop_a_new_create() {
    let dir = scratch("idleflood");
    let d = DaemonProc::start(&dir.0, &["--max-connections", "16", "--idle-timeout", "3"]);
    d.settle();
    let threads0 = d.threads().len();
    let conns: Vec<UnixStream> = (0..340).map(|_| UnixStream::connect(sock(&dir)).unwrap()).collect();
    let t_flood = Instant::now();
    // Refusal lines are read as they come (no fixed sleep), until all but
    // the cap's worth arrived or, short of the 3 s idle timeout, time is up.
    let mut refused = 0;
    let mut held: Vec<&UnixStream> = conns.iter().collect();
    while refused < conns.len() - 16 && t_flood.elapsed() < Duration::from_millis(2500) {
        std::thread::sleep(Duration::from_millis(50));
        held.retain(|s| {
            s.set_nonblocking(true).unwrap();
            let mut b = [0u8; 512];
            let got = match (&**s).read(&mut b) {
                Ok(n) if n > 0 => {
                    let (code, _) = error_of(String::from_utf8_lossy(&b[..n]).lines().next().unwrap());
                    assert_eq!(code, "busy");
                    refused += 1;
                    false
                }
                _ => true,
            };
            s.set_nonblocking(false).unwrap();
            got
        });
    }
    assert_eq!((held.len(), refused), (16, 324), "the cap is not 16");
    let threads = d.threads().len();
    assert!(
        threads <= threads0 + 16,
        "{threads} threads for 16 connections (from {threads0})"
    );
    // A create gets through as soon as the idle timeout frees the slots.
    let o = cli(
        &dir.0,
        &[
            "--timeout",
            "20",
            "create",
            "--id",
            "new",
            "--builtin",
            "idle",
            "--memory",
            "8",
            "--start",
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let took = t_flood.elapsed();
    assert!(took < Duration::from_secs(10), "the create waited {took:?}");
    for s in held {
        assert!(
            closed_within(s, Duration::from_secs(5)),
            "an idle connection stayed open"
        );
    }
    assert_eq!(ids(&dir.0), ["new"]);
    drop(conns);
    d.stop();
}

/// A request runs only once its whole line has arrived; a line not completed
/// within the line timeout (also one dribbled a byte at a time) gets one
/// `bad_request` line and the connection is closed, and nothing ran.
#[test]
fn a_partial_line_runs_nothing_and_is_dropped_after_the_line_timeout() {
    let dir = scratch("partial");
    let d = DaemonProc::start(&dir.0, &["--line-timeout", "3"]);
    let create = br#"{"v":1,"op":"create","args":{"config":{"id":"p","memory_mib":8,"guest":{"kind":"builtin","name":"idle"}},"start":false}}"#;

    // Completed in time: it runs once the newline arrives, not before.
    let s = UnixStream::connect(sock(&dir)).unwrap();
    (&s).write_all(&create[..40]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(ids(&dir.0).is_empty(), "a partial line ran");
    (&s).write_all(&create[40..]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(ids(&dir.0).is_empty(), "a line without its newline ran");
    (&s).write_all(b"\n").unwrap();
    let line = read_line(&s, Duration::from_secs(10)).expect("no answer");
    assert!(line.contains("\"ok\":true"), "{line}");
    assert_eq!(ids(&dir.0), ["p"]);
    drop(s);

    // Never completed: refused after the line timeout, nothing ran.
    let q = String::from_utf8_lossy(create).replace("\"p\"", "\"q\"");
    let s = UnixStream::connect(sock(&dir)).unwrap();
    let t = Instant::now();
    (&s).write_all(&q.as_bytes()[..60]).unwrap();
    let line = read_line(&s, Duration::from_secs(8)).expect("the partial line was held without an answer");
    let waited = t.elapsed();
    let (code, msg) = error_of(&line);
    assert_eq!(code, "bad_request");
    assert_eq!(
        msg,
        "the request line was not completed within 3 s, so the daemon closes this connection"
    );
    assert!(waited >= Duration::from_millis(2900), "cut after {waited:?}");
    assert!(closed_within(&s, Duration::from_secs(2)));

    // Dribbled a byte every 200 ms: the timeout counts from the line's first byte.
    let s = UnixStream::connect(sock(&dir)).unwrap();
    let t = Instant::now();
    let mut cut = None;
    for b in q.as_bytes() {
        if (&s).write_all(&[*b]).is_err() {
            cut = Some(t.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        if t.elapsed() > Duration::from_secs(8) {
            break;
        }
    }
    let cut = cut.unwrap_or_else(|| panic!("a dribbled line was still read after {:?}", t.elapsed()));
    assert!(cut < Duration::from_secs(5), "cut after {cut:?}");
    assert_eq!(ids(&dir.0), ["p"], "a timed-out line ran");
    d.stop();
}

/// A connection without requests is closed after the idle timeout (blank
/// lines do not count as requests); one with requests is not.
#[test]
fn an_idle_connection_is_closed() {
    let dir = scratch("idle");
    let d = DaemonProc::start(&dir.0, &["--idle-timeout", "1"]);
    // Requests keep it open past the timeout.
    let s = UnixStream::connect(sock(&dir)).unwrap();
    for _ in 0..6 {
        (&s).write_all(list_line()).unwrap();
        assert!(read_line(&s, Duration::from_secs(5)).is_some(), "closed while in use");
        std::thread::sleep(Duration::from_millis(400));
    }
    // Then, without one, it is closed after about a second.
    let t = Instant::now();
    assert!(
        closed_within(&s, Duration::from_secs(5)),
        "an idle connection stayed open"
    );
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(500), "closed after {took:?}");
    // Blank lines are no requests.
    let s = UnixStream::connect(sock(&dir)).unwrap();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if (&s).write_all(b"\n").is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "blank lines kept the connection open"
    );
    d.stop();
}

/// A line longer than the bound and a line that is not UTF-8 are refused
/// with one line each, and the connection is closed.
#[test]
fn an_overlong_or_non_utf8_line_is_refused() {
    let dir = scratch("long");
    let d = DaemonProc::start(&dir.0, &[]);
    let s = UnixStream::connect(sock(&dir)).unwrap();
    let writer = {
        let s = s.try_clone().unwrap();
        std::thread::spawn(move || {
            let chunk = vec![b'x'; 64 * 1024];
            for _ in 0..32 {
                if (&s).write_all(&chunk).is_err() {
                    break;
                }
            }
        })
    };
    let line = read_line(&s, Duration::from_secs(10)).expect("no refusal");
    assert_eq!(
        error_of(&line),
        (
            "bad_request".into(),
            format!(
                "the request is longer than {} bytes",
                k7d_vmm::daemon::server::MAX_REQUEST_BYTES
            )
        )
    );
    assert!(closed_within(&s, Duration::from_secs(5)));
    writer.join().unwrap();

    let s = UnixStream::connect(sock(&dir)).unwrap();
    (&s).write_all(b"{\"v\":1,\"op\":\"l\xffst\"}\n").unwrap();
    let line = read_line(&s, Duration::from_secs(5)).expect("no refusal");
    assert_eq!(
        error_of(&line),
        (
            "bad_request".into(),
            "the request could not be read: stream did not contain valid UTF-8".into()
        )
    );
    assert!(closed_within(&s, Duration::from_secs(5)));
    d.stop();
}

/// The CLI waits `--timeout` seconds for a daemon that never answers (and
/// for one that never accepts), then says what it waited for and where.
#[test]
fn the_cli_gives_up_on_a_listener_that_never_answers() {
    let dir = scratch("mute");
    let sock = sock(&dir);
    // Accepts, reads, never answers.
    let listener = UnixListener::bind(&sock).unwrap();
    let mute = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let mut b = [0u8; 4096];
        while matches!((&s).read(&mut b), Ok(n) if n > 0) {}
    });
    let t = Instant::now();
    let o = output_within(
        Command::new(K7D)
            .arg("--socket")
            .arg(&sock)
            .args(["--timeout", "1", "list"]),
        Duration::from_secs(10),
    );
    let took = t.elapsed();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(
        err.trim(),
        format!(
            "k7d: the k7d daemon at {} did not answer `list` within 1 s (--timeout); the request may still complete there",
            sock.display()
        )
    );
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "{took:?}"
    );
    drop(mute);

    // Never accepts, backlog full: connecting gives up too.
    let sock2 = dir.0.join("full.sock");
    let _listener = full_listener(&sock2);
    let t = Instant::now();
    let o = output_within(
        Command::new(K7D)
            .arg("--socket")
            .arg(&sock2)
            .args(["--timeout", "1", "list"]),
        Duration::from_secs(10),
    );
    let took = t.elapsed();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(
        err.trim(),
        format!(
            "k7d: the k7d daemon at {} did not accept the connection within 1 s (--timeout)",
            sock2.display()
        )
    );
    assert!(took < Duration::from_secs(5), "{took:?}");
}

/// A listening socket with a backlog of 0 that has one pending connection
/// already and accepts none: one more `connect` cannot complete.
fn full_listener(path: &Path) -> (UnixListener, Vec<UnixStream>) {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: socket(2) with constant arguments.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    // SAFETY: `fd` is a fresh socket owned by nobody else.
    let listener = unsafe { UnixListener::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_un is valid; family and path are set below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(path.as_os_str().as_bytes()) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: `addr` is an initialized sockaddr_un of `len` bytes; `fd` is open.
    let rc = unsafe { libc::bind(fd, (&raw const addr).cast(), len) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    // SAFETY: listen on a bound socket we own.
    let rc = unsafe { libc::listen(fd, 0) };
    assert_eq!(rc, 0);
    let mut pending = Vec::new();
    while let Ok(s) = k7d_vmm::sys::connect_unix(path, Duration::from_millis(50)) {
        pending.push(s);
        assert!(pending.len() < 64, "the backlog never filled");
    }
    (listener, pending)
}

/// SIGTERM while a request is stuck (it holds its VM and waits for the
/// record lock, which the test holds): the daemon still exits within its
/// `--shutdown-timeout`, says why, and removes its socket.
#[test]
fn sigterm_with_a_request_in_flight_exits_within_the_bound() {
    let dir = scratch("term");
    let d = DaemonProc::start(&dir.0, &["--shutdown-timeout", "2"]);
    let o = cli(
        &dir.0,
        &["create", "--id", "w", "--builtin", "idle", "--memory", "8", "--start"],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    let lock = std::fs::File::open(dir.0.join("state/vms/w.lock")).unwrap();
    let held = k7d_vmm::sys::flock(lock, true).unwrap();
    // `pause` parks the VM, then waits for the record lock holding the VM.
    let mut pause = Command::new(K7D)
        .arg("--socket")
        .arg(sock(&dir))
        .args(["pause", "w"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    assert!(pause.try_wait().unwrap().is_none(), "the pause was not stuck");
    d.signal(libc::SIGTERM);
    let (took, code, err) = d.wait_exit(Duration::from_secs(15));
    assert!(took < Duration::from_millis(3500), "exit took {took:?}: {err}");
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("shutdown did not finish within the bound"), "{err}");
    assert!(!sock(&dir).exists(), "the socket outlived the daemon");
    drop(held);
    let _ = pause.wait();
}

/// The accept thread is woken by an eventfd, not by connecting to the
/// socket file: a daemon whose socket was deleted still exits on SIGTERM.
#[test]
fn sigterm_exits_when_the_socket_file_is_gone() {
    let dir = scratch("nosock");
    let d = DaemonProc::start(&dir.0, &[]);
    std::fs::remove_file(sock(&dir)).unwrap();
    d.signal(libc::SIGTERM);
    let (took, code, err) = d.wait_exit(Duration::from_secs(10));
    assert_eq!(code, Some(0), "{err}");
    assert!(took < Duration::from_secs(3), "exit took {took:?}");
}

/// SO_PEERCRED on every connection: a client running as another uid is
/// refused with one line (even through a socket anyone may open) and the
/// daemon logs its pid, uid and gid; root is served; `--allow-uid` and
/// `--allow-gid` admit others.
#[test]
fn only_allowed_peers_are_served() {
    if k7d_vmm::sys::euid() != 0
        && k7d_test_skip::skip(
            "only_allowed_peers_are_served",
            "needs root to run a client as another uid",
        )
    {
        return;
    }
    let as_user_pid = |dir: &Path, uid: u32, gid: u32| {
        let c = Command::new(K7D)
            .arg("--socket")
            .arg(dir.join("k7d.sock"))
            .args(["--timeout", "5", "list"])
            .uid(uid)
            .gid(gid)
            .current_dir("/")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = c.id();
        (c.wait_with_output().unwrap(), pid)
    };
    let as_user = |dir: &Path, uid: u32, gid: u32| as_user_pid(dir, uid, gid).0;
    let dir = scratch("peer");
    let d = DaemonProc::start(&dir.0, &[]);
    let mode = std::fs::metadata(sock(&dir)).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the default socket is open to others");
    // The file mode stops other users first.
    let o = as_user(&dir.0, NOBODY, NOBODY);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "this user may not open the k7d daemon's socket {}",
            sock(&dir).display()
        )),
        "{err}"
    );
    // Open the file to everyone: the peer check alone must refuse.
    std::fs::set_permissions(sock(&dir), std::fs::Permissions::from_mode(0o666)).unwrap();
    let (o, pid) = as_user_pid(&dir.0, NOBODY, NOBODY);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(
        err.trim(),
        "k7d: uid 65534 (gid 65534) may not use this k7d daemon, which serves uids 0 (see `k7d daemon --allow-uid/--allow-gid`)"
    );
    let o = cli(&dir.0, &["list"]);
    assert!(o.status.success(), "root was refused: {:?}", text(&o));
    let log = plain(&d.stop());
    let refusal = log
        .lines()
        .find(|l| l.contains("API connection refused"))
        .unwrap_or_else(|| panic!("the refusal was not logged: {log}"));
    for field in [format!("pid={pid}"), "uid=65534".into(), "gid=65534".into()] {
        assert!(refusal.contains(&field), "{field} missing in {refusal}");
    }

    let dir = scratch("peer-allowed");
    let d = DaemonProc::start(&dir.0, &["--allow-uid", "65534", "--allow-gid", "65533"]);
    let o = as_user(&dir.0, NOBODY, NOBODY);
    assert!(o.status.success(), "--allow-uid 65534 was refused: {:?}", text(&o));
    let o = as_user(&dir.0, 65532, 65533);
    assert!(o.status.success(), "--allow-gid 65533 was refused: {:?}", text(&o));
    let o = as_user(&dir.0, 65532, 65532);
    assert_eq!(o.status.code(), Some(1), "uid 65532 was served: {:?}", text(&o));
    assert!(text(&o).1.contains("may not use this k7d daemon"), "{:?}", text(&o));
    d.stop();
}

/// `--socket` replaces only a stale socket: a regular file, a directory or
/// a symbolic link is refused and left as it is, and so is the socket of a
/// live daemon.
#[test]
fn only_a_stale_socket_is_replaced() {
    let refused = |dir: &Path, needle: &str| {
        let mut c = DaemonProc::spawn(dir, &[]);
        let t = Instant::now();
        let st = loop {
            if let Some(st) = c.try_wait().unwrap() {
                break st;
            }
            if t.elapsed() > Duration::from_secs(15) {
                let _ = c.kill();
                panic!("the daemon started on {needle}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut err = String::new();
        c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        assert_eq!(st.code(), Some(1), "{err}");
        assert!(err.contains(needle), "{needle:?} not in {err}");
    };
    let dir = scratch("sockpath");
    let sock = sock(&dir);
    std::fs::write(&sock, b"precious").unwrap();
    refused(
        &dir.0,
        &format!(
            "the socket path {} is a regular file, which k7d never removes",
            sock.display()
        ),
    );
    assert_eq!(std::fs::read(&sock).unwrap(), b"precious");
    std::fs::remove_file(&sock).unwrap();

    std::fs::create_dir(&sock).unwrap();
    std::fs::write(sock.join("inside"), b"x").unwrap();
    refused(&dir.0, "is a directory, which k7d never removes");
    assert!(sock.join("inside").exists());
    std::fs::remove_dir_all(&sock).unwrap();

    // A link to a stale socket is still a link: not followed, not removed.
    let stale = dir.0.join("stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    std::os::unix::fs::symlink(&stale, &sock).unwrap();
    refused(&dir.0, "is a symbolic link, which k7d never removes");
    assert!(std::fs::symlink_metadata(&sock).unwrap().file_type().is_symlink());
    assert!(stale.exists());
    std::fs::remove_file(&sock).unwrap();

    // A stale socket (nobody listens): removed, and the daemon starts.
    std::fs::rename(&stale, &sock).unwrap();
    let d = DaemonProc::start(&dir.0, &[]);
    assert!(cli(&dir.0, &["list"]).status.success());

    // A live daemon's socket: a second daemon (its own state dir) is refused
    // and the first one goes on serving.
    let other = scratch("sockpath-other");
    let mut c = Command::new(K7D)
        .args(["daemon", "--jail", "off"])
        .arg("--state-dir")
        .arg(other.0.join("state"))
        .arg("--socket")
        .arg(&sock)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let st = c.wait().unwrap();
    let mut err = String::new();
    c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("another daemon is listening on {}", sock.display())),
        "{err}"
    );
    assert!(
        cli(&dir.0, &["list"]).status.success(),
        "the first daemon lost its socket"
    );
    d.stop();
}

/// A daemon started right after `kill -9` of the previous one (which may
/// still hold the state directory while the kernel tears it down) waits for
/// the lock and starts; one that never gets it gives up after 5 s naming the
/// holder's pid.
#[test]
fn a_restart_right_after_kill_9_waits_for_the_state_dir() {
    let dir = scratch("restart");
    let d = DaemonProc::start(&dir.0, &[]);
    // A VM with populated RAM makes the teardown of the killed daemon take a while.
    let o = cli(
        &dir.0,
        &[
            "create",
            "--id",
            "big",
            "--builtin",
            "memwriter",
            "--memory",
            "512",
            "--arg",
            "100000",
            "--arg",
            "2097152",
            "--start",
        ],
    );
    assert!(o.status.success(), "{:?}", text(&o));
    std::thread::sleep(Duration::from_millis(500));
    d.signal(libc::SIGKILL);
    // No wait for the old process: start the next one at once.
    let d2 = DaemonProc::start(&dir.0, &[]);
    assert!(ids(&dir.0).is_empty());
    let err = d2.stop();
    assert!(err.contains("reconciled vm big"), "{err}");
    drop(d);

    // The lock held by someone else (this test) for a second: the daemon waits.
    let lock_path = dir.0.join("state/daemon.lock");
    let f = std::fs::OpenOptions::new().write(true).open(&lock_path).unwrap();
    let held = k7d_vmm::sys::flock(f, true).unwrap();
    std::fs::write(&lock_path, format!("{}\n", std::process::id())).unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        drop(held);
    });
    let d3 = DaemonProc::start(&dir.0, &[]);
    release.join().unwrap();
    d3.stop();

    // Held for good: refused after 5 s, naming this process.
    let f = std::fs::OpenOptions::new().write(true).open(&lock_path).unwrap();
    let _held = k7d_vmm::sys::flock(f, true).unwrap();
    std::fs::write(&lock_path, format!("{}\n", std::process::id())).unwrap();
    let t = Instant::now();
    let o = Command::new(K7D)
        .args(["daemon", "--jail", "off"])
        .arg("--state-dir")
        .arg(dir.0.join("state"))
        .arg("--socket")
        .arg(sock(&dir))
        .output()
        .unwrap();
    let took = t.elapsed();
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "another k7d daemon already uses the state directory {} (pid {}); waited 5 s for it to let go",
            dir.0.join("state").display(),
            std::process::id()
        )),
        "{err}"
    );
    assert!(
        took >= Duration::from_millis(4900) && took < Duration::from_secs(10),
        "{took:?}"
    );
}
