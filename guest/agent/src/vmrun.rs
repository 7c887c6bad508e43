//! `Run`: a command in the VM itself, run and answered on its request's
//! own connection (`proto`'s module documentation): its output as
//! `Output` frames while it runs, then one `Ran`. One request, one
//! connection and no exec table entry, against the five requests and four
//! connections of an added exec (`Exec`, three `Attach`es, `Wait`, `Start`,
//! `DeleteExec`): what the daemon's `exec` uses, on a connection it keeps.
//!
//! One thread serves it with `poll`: the command's stdout and stderr, its
//! stdin (written as the command reads it), its exit (the reaper writes a
//! byte to a pipe) and the client's connection, which must stay quiet: a
//! client that hangs up or speaks out of turn has the command killed. Past
//! its timeout the command is killed with SIGKILL (status 137); after its
//! exit, output still coming from a background process it left is read for
//! [`DRAIN`] and then cut off, as `k7d exec` does.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k7d_agent::proto::{self, Bytes, MAX_RUN_STDIN, MAX_RUN_TIMEOUT_MS, RUN_CHUNK, Ran, Reply, Response, Run, Stream};

use crate::reaper::Reaper;
use crate::sys;

/// How long output may keep coming after the command exited.
pub const DRAIN: Duration = Duration::from_secs(2);
/// How long a command killed past its timeout may take to be reported.
const KILL_WAIT: Duration = Duration::from_secs(10);

fn refuse(message: String) -> Response {
    crate::log!("{message}");
    Response::Err {
        message,
        not_found: false,
    }
}

/// Checks `run` and what it runs; the refusal's sentence otherwise.
fn check(run: &Run) -> Result<crate::vmexec::Plan, String> {
    if !(1..=MAX_RUN_TIMEOUT_MS).contains(&run.timeout_ms) {
        return Err(format!(
            "a run's timeout is 1 to {MAX_RUN_TIMEOUT_MS} ms, not {}",
            run.timeout_ms
        ));
    }
    if run.stdin.0.len() > MAX_RUN_STDIN {
        return Err(format!(
            "a run carries at most {MAX_RUN_STDIN} bytes of stdin, not {}",
            run.stdin.0.len()
        ));
    }
    let plan = crate::vmexec::plan(&run.spec, crate::init::PATH).map_err(|e| format!("a run in the VM: {e}"))?;
    if plan.terminal {
        return Err("a run has no terminal (k7d exec --tty adds an exec instead)".into());
    }
    Ok(plan)
}

/// One output stream of the command: its pipe while open, what was sent
/// back and what came.
struct Output {
    stream: Stream,
    pipe: Option<io::PipeReader>,
    sent: u64,
    total: u64,
}

impl Output {
    /// Reads what is there and sends it on (up to `max` in all); false
    /// when the connection failed.
    fn read(&mut self, conn: &mut UnixStream, max: u64, buf: &mut [u8]) -> bool {
        let Some(pipe) = self.pipe.as_mut() else {
            return true;
        };
        match pipe.read(buf) {
            Ok(0) => self.pipe = None,
            Ok(n) => {
                self.total += n as u64;
                let room = max.saturating_sub(self.sent).min(n as u64) as usize;
                if room > 0 {
                    self.sent += room as u64;
                    let frame = Response::Ok(Reply::Output {
                        stream: self.stream,
                        data: Bytes(buf[..room].to_vec()),
                    });
                    return proto::write_frame(conn, &frame).is_ok();
                }
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
            Err(_) => self.pipe = None,
        }
        true
    }
}

/// Serves `run` on `conn`: its frames, then the connection back in step.
/// An error is the connection's (failed, or the client hung up or spoke
/// out of turn): the caller closes it.
pub fn serve(conn: &mut UnixStream, reaper: &Reaper, run: Run) -> io::Result<()> {
    let plan = match check(&run) {
        Ok(p) => p,
        Err(e) => return write(conn, &refuse(e)),
    };
    let started = Instant::now();
    let (out_r, out_w) = io::pipe()?;
    let (err_r, err_w) = io::pipe()?;
    let (stdin_w, stdin) = if run.stdin.0.is_empty() {
        (None, Stdio::null())
    } else {
        let (r, w) = io::pipe()?;
        (Some(w), Stdio::from(r))
    };
    let (exit_r, mut exit_w) = io::pipe()?;
    for fd in [out_r.as_raw_fd(), err_r.as_raw_fd(), exit_r.as_raw_fd()] {
        sys::set_nonblocking(&fd)?;
    }
    if let Some(w) = &stdin_w {
        sys::set_nonblocking(w)?;
    }
    sys::set_nonblocking(&exit_w)?;
    let mut cmd = crate::vmexec::command(&plan);
    cmd.stdin(stdin).stdout(out_w).stderr(err_w);
    let pid = reaper.spawn(&mut cmd);
    // The agent's copies of the command's ends close here: EOF comes when
    // the command (and whatever it left holding them) is gone.
    drop(cmd);
    let pid = match pid {
        Ok(pid) => pid,
        Err(e) => {
            let ran = Ran {
                status: 127,
                timed_out: false,
                error: Some(format!("starting {} failed: {e}", plan.program.display())),
                stdout_bytes: 0,
                stderr_bytes: 0,
            };
            return write(conn, &Response::Ok(Reply::Ran(ran)));
        }
    };
    // Not logged: the agent's log is the VM's console, a serial port whose
    // every byte is a VM exit, dozens per line, each costly in a nested
    // guest. Refusals are logged.
    // Set by the reaper, under this lock, before the byte that wakes the poll.
    let status = Arc::new(Mutex::new(None::<u32>));
    let st = Arc::clone(&status);
    reaper.on_exit(pid, move |s| {
        *st.lock().unwrap_or_else(|p| p.into_inner()) = Some(s);
        let _ = exit_w.write(&[0]);
    });
    let mut outs = [
        Output {
            stream: Stream::Stdout,
            pipe: Some(out_r),
            sent: 0,
            total: 0,
        },
        Output {
            stream: Stream::Stderr,
            pipe: Some(err_r),
            sent: 0,
            total: 0,
        },
    ];
    let (mut stdin_w, mut stdin_at) = (stdin_w, 0usize);
    let mut deadline = started + Duration::from_millis(run.timeout_ms);
    let (mut exited, mut timed_out, mut killed_at) = (None::<u32>, false, None::<Instant>);
    let mut buf = vec![0u8; RUN_CHUNK];
    let result = loop {
        if exited.is_some() && outs.iter().all(|o| o.pipe.is_none()) {
            break Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            if exited.is_some() {
                // The drain is over: a background process keeps its output.
                break Ok(());
            }
            if killed_at.is_some() {
                break Err(format!(
                    "a run in the VM: pid {pid} did not end within {} s of its SIGKILL",
                    KILL_WAIT.as_secs()
                ));
            }
            kill(&status, pid);
            timed_out = true;
            killed_at = Some(now);
            deadline = now + KILL_WAIT;
            continue;
        }
        let mut fds = vec![pollfd(conn, libc::POLLIN)];
        // Its byte stays unread: once the exit is seen, the pipe would
        // wake every poll of the drain.
        if exited.is_none() {
            fds.push(pollfd(&exit_r, libc::POLLIN));
        }
        for o in &outs {
            if let Some(p) = &o.pipe {
                fds.push(pollfd(p, libc::POLLIN));
            }
        }
        if let Some(w) = &stdin_w {
            fds.push(pollfd(w, libc::POLLOUT));
        }
        sys::poll(&mut fds, deadline - now)?;
        let ready = |fd: i32| fds.iter().any(|p| p.fd == fd && p.revents != 0);
        if ready(conn.as_raw_fd()) {
            // Hung up or out of turn: nobody reads the answer.
            kill(&status, pid);
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the client hung up or spoke during a run",
            ));
        }
        if ready(exit_r.as_raw_fd()) && exited.is_none() {
            exited = *status.lock().unwrap_or_else(|p| p.into_inner());
            if exited.is_some() {
                deadline = Instant::now() + DRAIN;
                // Nobody reads what is left of its stdin.
                stdin_w = None;
            }
        }
        for o in &mut outs {
            if o.pipe.as_ref().is_some_and(|p| ready(p.as_raw_fd())) && !o.read(conn, run.max_output, &mut buf) {
                kill(&status, pid);
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the client's connection failed",
                ));
            }
        }
        if let Some(w) = stdin_w.as_mut().filter(|w| ready(w.as_raw_fd())) {
            match w.write(&run.stdin.0[stdin_at..]) {
                Ok(n) => stdin_at += n,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
                // EPIPE: the command closed its stdin.
                Err(_) => stdin_at = run.stdin.0.len(),
            }
            if stdin_at >= run.stdin.0.len() {
                // Its EOF.
                stdin_w = None;
            }
        }
    };
    let reply = match result {
        Err(e) => refuse(e),
        Ok(()) => Response::Ok(Reply::Ran(Ran {
            status: exited.unwrap_or(137),
            timed_out,
            error: None,
            stdout_bytes: outs[0].total,
            stderr_bytes: outs[1].total,
        })),
    };
    write(conn, &reply)
}

/// SIGKILL to `pid` unless its exit was recorded (under the lock the
/// reaper records it with).
fn kill(status: &Mutex<Option<u32>>, pid: i32) {
    let g = status.lock().unwrap_or_else(|p| p.into_inner());
    if g.is_none() {
        let _ = sys::kill(pid, libc::SIGKILL);
    }
}

fn pollfd(fd: &impl AsRawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    }
}

fn write(conn: &mut UnixStream, r: &Response) -> io::Result<()> {
    proto::write_frame(conn, r).map_err(|e| io::Error::other(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k7d_agent::proto::FrameError;
    use serde_json::json;

    /// The tests' children: one test at a time, each with a reaper of its
    /// own that is asleep (out of `waitpid(-1)`) when the test ends.
    struct Children {
        _g: std::sync::MutexGuard<'static, ()>,
        reaper: Arc<Reaper>,
    }

    impl Children {
        fn new() -> Self {
            let _g = crate::test_children();
            Self {
                _g,
                reaper: Reaper::start().unwrap(),
            }
        }
    }

    impl Drop for Children {
        fn drop(&mut self) {
            let until = Instant::now() + Duration::from_secs(30);
            while !self.reaper.parked() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn run(spec: serde_json::Value, stdin: &[u8], timeout_ms: u64, max_output: u64) -> Run {
        Run {
            spec,
            stdin: Bytes(stdin.to_vec()),
            timeout_ms,
            max_output,
        }
    }

    /// Serves `r` on one end of a pair and reads the other's frames up to
    /// the last: (stdout, stderr, the last response).
    fn served(reaper: &Arc<Reaper>, r: Run) -> (Vec<u8>, Vec<u8>, Response) {
        let (out, err, last, _) = served_timed(reaper, r);
        (out, err, last)
    }

    /// [`served`], and the CPU time the serving thread took.
    fn served_timed(reaper: &Arc<Reaper>, r: Run) -> (Vec<u8>, Vec<u8>, Response, Duration) {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let reaper = Arc::clone(reaper);
        let t = std::thread::spawn(move || {
            let served = serve(&mut a, &reaper, r).map(|()| a);
            (served, thread_cpu())
        });
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let last = loop {
            match proto::read_frame::<_, Response>(&mut b).unwrap() {
                Response::Ok(Reply::Output { stream, data }) => match stream {
                    Stream::Stdout => out.extend_from_slice(&data.0),
                    _ => err.extend_from_slice(&data.0),
                },
                other => break other,
            }
        };
        let (served, cpu) = t.join().unwrap();
        served.unwrap();
        (out, err, last, cpu)
    }

    /// This thread's CPU time, user and system.
    fn thread_cpu() -> Duration {
        // SAFETY: an all-zero rusage is a valid value to be overwritten.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: RUSAGE_THREAD fills the valid rusage pointed to.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
        let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
        tv(u.ru_utime) + tv(u.ru_stime)
    }

    fn ran(r: &Response) -> &Ran {
        match r {
            Response::Ok(Reply::Ran(ran)) => ran,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_run_answers_its_output_apart_and_its_status() {
        let c = Children::new();
        let reaper = &c.reaper;
        let spec = json!({"args": ["sh", "-c", "echo out; echo err >&2; exit 7"]});
        let (out, err, last) = served(reaper, run(spec, b"", 10_000, 1 << 20));
        assert_eq!((out.as_slice(), err.as_slice()), (&b"out\n"[..], &b"err\n"[..]));
        let r = ran(&last);
        assert_eq!(
            (r.status, r.timed_out, r.stdout_bytes, r.stderr_bytes),
            (7, false, 4, 4)
        );
    }

    #[test]
    fn stdin_is_fed_whole_and_output_past_its_limit_is_counted_not_sent() {
        let c = Children::new();
        let reaper = &c.reaper;
        let input: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let (out, _, last) = served(reaper, run(json!({"args": ["cat"]}), &input, 10_000, 1000));
        assert_eq!(out, input[..1000]);
        assert_eq!(ran(&last).stdout_bytes, input.len() as u64);
        // A command that never reads its stdin still ends.
        let (_, _, last) = served(reaper, run(json!({"args": ["true"]}), &input, 10_000, 10));
        assert_eq!(ran(&last).status, 0);
    }

    #[test]
    fn a_run_past_its_timeout_is_killed_and_a_background_process_does_not_hold_the_answer() {
        let c = Children::new();
        let reaper = &c.reaper;
        let t = Instant::now();
        let (_, _, last) = served(reaper, run(json!({"args": ["sleep", "30"]}), b"", 300, 10));
        let r = ran(&last);
        assert_eq!((r.status, r.timed_out), (137, true));
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // Exits at once, leaving a sleeper holding stdout: answered after the drain.
        let t = Instant::now();
        let (out, _, last, cpu) = served_timed(
            reaper,
            run(
                json!({"args": ["sh", "-c", "echo hi; sleep 20 & exit 0"]}),
                b"",
                10_000,
                10,
            ),
        );
        assert_eq!((out.as_slice(), ran(&last).status), (&b"hi\n"[..], 0));
        let took = t.elapsed();
        assert!(took >= DRAIN && took < DRAIN + Duration::from_secs(3), "{took:?}");
        // The drain waits; it does not spin on the exit it has seen.
        assert!(cpu < Duration::from_millis(500), "the drain took {cpu:?} of CPU");
    }

    #[test]
    fn bad_runs_are_refused_with_a_sentence_and_the_connection_stays_in_step() {
        let c = Children::new();
        let reaper = &c.reaper;
        for (r, says) in [
            (run(json!({"args": ["true"]}), b"", 0, 1), "timeout is 1 to"),
            (
                run(json!({"args": ["true"]}), b"", MAX_RUN_TIMEOUT_MS + 1, 1),
                "timeout is 1 to",
            ),
            (run(json!({"args": ["no-such-program-k7d"]}), b"", 1000, 1), "not found"),
            (
                run(json!({"args": ["true"], "terminal": true}), b"", 1000, 1),
                "no terminal",
            ),
            (
                run(json!({"args": ["true"]}), &vec![0; MAX_RUN_STDIN + 1], 1000, 1),
                "at most 524288 bytes",
            ),
        ] {
            match served(reaper, r).2 {
                Response::Err { message, .. } => assert!(message.contains(says), "{message}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_client_that_hangs_up_has_its_command_killed() {
        let c = Children::new();
        let reaper = &c.reaper;
        let (mut a, b) = UnixStream::pair().unwrap();
        let dir = std::env::temp_dir().join(format!("k7d-vmrun-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mark = dir.join("mark");
        let script = format!("sleep 3; touch {}", mark.display());
        let r2 = Arc::clone(reaper);
        let t =
            std::thread::spawn(move || serve(&mut a, &r2, run(json!({"args": ["sh", "-c", script]}), b"", 60_000, 10)));
        std::thread::sleep(Duration::from_millis(300));
        drop(b);
        let e = t.join().unwrap().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
        std::thread::sleep(Duration::from_secs(4));
        assert!(!mark.exists(), "the command ran on after its client left");
        let _ = std::fs::remove_dir_all(&dir);
        // The frame types round trip.
        let frame = Response::Ok(Reply::Output {
            stream: Stream::Stderr,
            data: Bytes(vec![0, 255, 10]),
        });
        let mut buf = Vec::new();
        proto::write_frame(&mut buf, &frame).unwrap();
        assert_eq!(proto::read_frame::<_, Response>(&mut buf.as_slice()).unwrap(), frame);
        let bad = br#"{"ok":{"output":{"stream":"stdout","data":"!!"}}}"#;
        let mut buf = (bad.len() as u32).to_be_bytes().to_vec();
        buf.extend_from_slice(bad);
        assert!(matches!(
            proto::read_frame::<_, Response>(&mut buf.as_slice()),
            Err(FrameError::Json(_))
        ));
    }
}
