//! The API's `exec`: a command run in a running VM by its guest agent,
//! answered when it has ended (`docs/exec.md`, "In the daemon's API").
//!
//! It sends the agent one `Run` on a connection kept open between execs
//! (`agent_conns.rs`): one round trip to the guest per command. An agent
//! of before `Run` gets the calls of `k7d exec`
//! ([`crate::execcli::run_outcome`]) instead. Either runs on the request's
//! own connection thread, holding no lock of the daemon's or the VM's: a
//! command that runs for minutes holds up nothing else. One
//! line in, one line out, so it is buffered: stdin whole (at most
//! [`MAX_EXEC_STDIN`]), and the first [`MAX_EXEC_OUTPUT`] bytes of stdout
//! and of stderr kept, the rest counted, so a hostile guest costs the
//! daemon two such buffers per exec and no more.
// Without the agent's client (the fuzz build) only the refusal is left.
#![cfg_attr(not(feature = "shim"), allow(dead_code))]

use std::sync::{Arc, Mutex};

use super::Daemon;
#[cfg(feature = "shim")]
use super::api::MAX_EXEC_OUTPUT;
use super::api::{ApiError, ErrorCode, ExecArgs, Executed};
#[cfg(feature = "shim")]
use crate::vstate::vm::VmState;

/// One output stream of an exec: the first `keep` bytes, and how many came.
#[derive(Clone)]
pub(crate) struct Capture(Arc<Mutex<Captured>>);

#[derive(Default)]
struct Captured {
    kept: Vec<u8>,
    total: u64,
    keep: usize,
}

impl Capture {
    /// A stream that keeps its first `keep` bytes.
    pub(crate) fn new(keep: usize) -> Self {
        Self(Arc::new(Mutex::new(Captured {
            keep,
            ..Default::default()
        })))
    }

    /// Counts `n` bytes as having come, if more than came through it (the
    /// agent counts what it did not send past the limit).
    pub(crate) fn came(&self, n: u64) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        g.total = g.total.max(n);
    }

    /// What was kept, and how many bytes came in all; nothing is kept
    /// after.
    pub(crate) fn take(&self) -> (Vec<u8>, u64) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        g.keep = 0;
        (std::mem::take(&mut g.kept), g.total)
    }
}

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let room = g.keep.saturating_sub(g.kept.len());
        g.kept.extend_from_slice(&buf[..room.min(buf.len())]);
        g.total = g.total.saturating_add(buf.len() as u64);
        // All of it is taken: a stream past the limit is read to its end
        // (the command must not block on a full pipe), just not kept.
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `a` in its VM; what the command did, or why it did not run.
#[cfg(feature = "shim")]
pub(super) fn run(daemon: &Daemon, a: &ExecArgs, emit: Option<Emit<'_>>) -> Result<Executed, ApiError> {
    use base64::Engine as _;
    let t = std::time::Instant::now();
    if a.stream && emit.is_none() {
        return Err(ApiError::new(
            ErrorCode::InvalidArgument,
            "a streamed exec is answered only on a connection to the daemon's socket".to_string(),
        ));
    }
    let (state, uds) = target(daemon, &a.id)?;
    if state != VmState::Running {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("vm {} is {state}: a command runs only in a running VM", a.id),
        ));
    }
    let Some(uds) = uds else {
        return Err(ApiError::new(
            ErrorCode::InvalidArgument,
            format!(
                "vm {} has no vsock device, through which its guest agent is reached (create it with one)",
                a.id
            ),
        ));
    };
    let stdin = match &a.stdin {
        Some(s) => Some(super::api::decode_stdin(s).map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e))?),
        None => None,
    };
    // Streamed, nothing is kept: the counts only.
    let keep = if a.stream { 0 } else { MAX_EXEC_OUTPUT };
    let (out, err) = (Capture::new(keep), Capture::new(keep));
    let stdin_bytes = stdin.as_deref().unwrap_or_default();
    let outcome = match run_on_kept(
        &daemon.agent_conns,
        a,
        &uds,
        stdin_bytes,
        (&out, &err),
        emit,
        RUN_MARGIN,
    )? {
        Some(o) => o,
        None if a.stream => {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "vm {}: its guest agent predates streamed execs (its `run`); exec without stream",
                    a.id
                ),
            ));
        }
        // An agent of before `run` (a VM restored from an older snapshot):
        // the exec's five calls, on connections of their own.
        None => {
            let streams = crate::execcli::Streams::piped(
                Box::new(out.clone()),
                Box::new(err.clone()),
                stdin.map(|b| Box::new(std::io::Cursor::new(b)) as Box<dyn std::io::Read + Send>),
            );
            crate::execcli::run_outcome(&a.id, uds.clone(), &in_guest(a), streams).map_err(|e| {
                let code = match e.downcast_ref::<crate::execcli::NotRun>() {
                    Some(crate::execcli::NotRun::Refused(_)) => ErrorCode::InvalidArgument,
                    Some(crate::execcli::NotRun::NoAgent(_)) => ErrorCode::Conflict,
                    None => ErrorCode::Internal,
                };
                ApiError::new(code, format!("{e:#}"))
            })?
        }
    };
    let ((stdout, stdout_bytes), (stderr, stderr_bytes)) = (out.take(), err.take());
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    Ok(Executed {
        id: a.id.clone(),
        status: outcome.status,
        stdout: b64(&stdout),
        stderr: b64(&stderr),
        stdout_bytes,
        stderr_bytes,
        timed_out: outcome.timed_out.is_some(),
        error: outcome.not_started,
        exec_ms: super::ms(t.elapsed()),
    })
}

/// The VM's state (live) and its vsock socket: what an exec needs, and no
/// more (not `info`, which reads its record file too).
#[cfg(feature = "shim")]
fn target(daemon: &Daemon, id: &str) -> Result<(VmState, Option<std::path::PathBuf>), ApiError> {
    let uds = |c: &crate::config::VmConfig| c.devices.vsock.as_ref().map(|v| v.uds.clone());
    if let Some(r) = daemon.process(id) {
        let mut g = r.lock().unwrap_or_else(|p| p.into_inner());
        let at = uds(g.config());
        return Ok((g.status().state, at));
    }
    let vm = daemon.get(id)?;
    let g = super::lock_vm(&vm);
    Ok((g.state(), uds(g.config())))
}

/// Runs `a` with the agent's `Run` on a connection kept from an earlier
/// exec (or a new one, kept after): its output into `out` and `err`. `None`
/// when the agent does not know `Run` (its connection is kept all the same).
#[cfg(feature = "shim")]
fn run_on_kept(
    kept: &super::agent_conns::AgentConns,
    a: &ExecArgs,
    uds: &std::path::Path,
    stdin: &[u8],
    (out, err): (&Capture, &Capture),
    mut emit: Option<Emit<'_>>,
    margin: std::time::Duration,
) -> Result<Option<crate::execcli::Outcome>, ApiError> {
    use k7d_agent::proto::{Bytes, Run, Stream};
    use k7d_shim::agent::{Agent, CallError};
    use std::io::Write as _;
    let mut conn = match kept.take(&a.id, uds) {
        Some(c) => c,
        None => Agent::new(uds).connect(CONNECT_TIMEOUT).map_err(|e| {
            ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "the guest agent of vm {} does not answer (exec needs k7d-agent in the guest: docs/exec.md): {e:#}",
                    a.id
                ),
            )
        })?,
    };
    let timeout = a.timeout();
    // The agent kills the command at its timeout and answers at once; past
    // this margin the connection itself is given up: each read's limit,
    // and the whole run's (a hostile agent that never stops sending output
    // must not hold this thread).
    let deadline = std::time::Instant::now() + timeout + margin;
    let mut overran = false;
    conn.set_timeout(Some(timeout + margin))
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("vm {}: {e}", a.id)))?;
    let run = Run {
        spec: crate::execcli::process_spec(&in_guest(a)),
        stdin: Bytes(stdin.to_vec()),
        timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX).max(1),
        // Streamed, all of it goes on.
        max_output: if emit.is_some() {
            u64::MAX
        } else {
            MAX_EXEC_OUTPUT as u64
        },
    };
    let (mut o, mut e) = (out.clone(), err.clone());
    let mut output = |stream: Stream, data: &[u8]| {
        if std::time::Instant::now() > deadline {
            overran = true;
            return false;
        }
        let _ = match stream {
            Stream::Stderr => e.write_all(data),
            _ => o.write_all(data),
        };
        match emit.as_mut() {
            Some(emit) => emit(&output_line(stream, data)),
            None => true,
        }
    };
    match conn.run(&run, &mut output) {
        Ok(ran) => {
            kept.put(&a.id, uds, conn);
            out.came(ran.stdout_bytes);
            err.came(ran.stderr_bytes);
            Ok(Some(crate::execcli::Outcome {
                status: u8::try_from(ran.status).unwrap_or(255),
                timed_out: ran.timed_out.then_some(timeout),
                not_started: ran.error,
            }))
        }
        Err(CallError::Refused { message, .. }) => {
            kept.put(&a.id, uds, conn);
            if message.contains("unknown variant `run`") {
                return Ok(None);
            }
            Err(ApiError::new(
                ErrorCode::InvalidArgument,
                format!("vm {} refused the exec: the guest agent refused: {message}", a.id),
            ))
        }
        Err(_) if overran => Err(ApiError::new(
            ErrorCode::Conflict,
            format!(
                "vm {}: its guest agent was still sending output {} s past the exec's timeout; it was given up",
                a.id,
                margin.as_secs_f64()
            ),
        )),
        Err(lost @ CallError::Lost(_)) => Err(ApiError::new(ErrorCode::Conflict, format!("vm {}: {lost}", a.id))),
    }
}

/// `a` as `k7d exec`'s arguments (the process spec and the fallback's).
#[cfg(feature = "shim")]
fn in_guest(a: &ExecArgs) -> crate::execcli::ExecArgs {
    crate::execcli::ExecArgs {
        env: a.env.clone(),
        cwd: a.cwd.clone(),
        user: a.uid.map(|u| (u, a.gid.unwrap_or(u))),
        timeout: Some(a.timeout()),
        ..crate::execcli::ExecArgs::in_vm(&a.id, a.command.clone())
    }
}

/// Where a streamed exec's output lines go (the client's connection);
/// false when they can no longer be written.
pub(super) type Emit<'a> = &'a mut dyn FnMut(&str) -> bool;

/// One chunk of a streamed exec's output as its line (without the newline).
#[cfg(feature = "shim")]
fn output_line(stream: k7d_agent::proto::Stream, data: &[u8]) -> String {
    use base64::Engine as _;
    let name = match stream {
        k7d_agent::proto::Stream::Stderr => "stderr",
        _ => "stdout",
    };
    serde_json::json!({"output": {"stream": name, "data": base64::engine::general_purpose::STANDARD.encode(data)}})
        .to_string()
}

/// How long connecting to the agent may take.
#[cfg(feature = "shim")]
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long past a command's timeout its run's answer is waited for.
#[cfg(feature = "shim")]
const RUN_MARGIN: std::time::Duration = std::time::Duration::from_secs(30);

/// Without the agent's client, nothing runs in a guest.
#[cfg(not(feature = "shim"))]
pub(super) fn run(_: &Daemon, a: &ExecArgs, _: Option<Emit<'_>>) -> Result<Executed, ApiError> {
    Err(ApiError::new(
        ErrorCode::InvalidArgument,
        format!("vm {}: this k7d is built without the guest agent's client", a.id),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn an_output_is_kept_up_to_its_limit_and_counted_past_it() {
        let c = Capture::new(10);
        let mut w = c.clone();
        assert_eq!(w.write(b"0123456").unwrap(), 7);
        assert_eq!(
            w.write(b"789abcdef").unwrap(),
            9,
            "all taken, so the command never blocks"
        );
        w.write_all(&[b'x'; 1000]).unwrap();
        let (kept, total) = c.take();
        assert_eq!(kept, b"0123456789");
        assert_eq!(total, 1016);
        w.write_all(b"late").unwrap();
        assert_eq!(c.take(), (Vec::new(), 1020), "nothing kept after the take");
    }

    #[cfg(feature = "shim")]
    #[test]
    fn a_run_is_answered_on_a_kept_connection_and_an_older_agent_is_told_apart() {
        use crate::execcli::fake_agent_frames;
        use k7d_agent::proto::{Bytes, Ran, Reply, Request, Response, Stream};
        use std::sync::atomic::{AtomicUsize, Ordering};
        let dir = std::env::temp_dir().join(format!("k7d-exec-run-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let a = |command: &[&str]| ExecArgs {
            id: "v".into(),
            command: command.iter().map(|s| s.to_string()).collect(),
            env: vec![],
            cwd: None,
            uid: Some(5),
            gid: None,
            stdin: None,
            timeout_s: Some(3.0),
            stream: false,
        };
        // An agent that knows `Run`: it echoes stdin to stdout, says its
        // program on stderr and exits with the stdin's length.
        let runs = Arc::new(AtomicUsize::new(0));
        let uds = dir.join("new.vsock");
        let seen = Arc::clone(&runs);
        fake_agent_frames(&uds, move |req| match req {
            Request::Run(r) => {
                seen.fetch_add(1, Ordering::SeqCst);
                assert_eq!((r.timeout_ms, r.spec["user"]["gid"].as_u64()), (3000, Some(5)));
                vec![
                    Response::Ok(Reply::Output {
                        stream: Stream::Stdout,
                        data: r.stdin.clone(),
                    }),
                    Response::Ok(Reply::Output {
                        stream: Stream::Stderr,
                        data: Bytes(r.spec["args"][0].as_str().unwrap().as_bytes().to_vec()),
                    }),
                    // It wrote more than it sent back (past max_output).
                    Response::Ok(Reply::Ran(Ran {
                        status: r.stdin.0.len() as u32,
                        timed_out: false,
                        error: None,
                        stdout_bytes: 1 << 20,
                        stderr_bytes: 2,
                    })),
                ]
            }
            other => panic!("{other:?}"),
        });
        let kept = super::super::agent_conns::AgentConns::default();
        for i in 0..3 {
            let (out, err) = (Capture::new(100), Capture::new(100));
            let o = run_on_kept(&kept, &a(&["wc"]), &uds, b"abc", (&out, &err), None, RUN_MARGIN)
                .unwrap()
                .unwrap();
            assert_eq!((o.status, o.timed_out, o.not_started), (3, None, None));
            assert_eq!(
                (out.take(), err.take()),
                ((b"abc".to_vec(), 1 << 20), (b"wc".to_vec(), 2)),
                "what came is the agent's count, not what it sent"
            );
            assert_eq!(kept.kept("v"), 1, "run {i}: one connection, kept");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        // An agent of before `Run` answers it as a frame it cannot read: the
        // caller falls back to the exec's calls.
        let old = dir.join("old.vsock");
        fake_agent_frames(&old, |req| {
            assert!(matches!(req, Request::Run(_)));
            vec![Response::Err {
                message: "the request is not valid protocol JSON: unknown variant `run`, expected one of `hello`"
                    .into(),
                not_found: false,
            }]
        });
        let kept = super::super::agent_conns::AgentConns::default();
        let (out, err) = (Capture::new(10), Capture::new(10));
        assert!(
            run_on_kept(&kept, &a(&["true"]), &old, b"", (&out, &err), None, RUN_MARGIN)
                .unwrap()
                .is_none()
        );
        // A refusal is the request's error; nobody answering is a conflict.
        let refusing = dir.join("refusing.vsock");
        fake_agent_frames(&refusing, |_| {
            vec![Response::Err {
                message: "a run in the VM: x: not found in the VM's PATH".into(),
                not_found: false,
            }]
        });
        let e = run_on_kept(&kept, &a(&["x"]), &refusing, b"", (&out, &err), None, RUN_MARGIN).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument);
        assert!(
            e.message.contains("vm v refused the exec") && e.message.contains("not found"),
            "{}",
            e.message
        );
        let e = run_on_kept(
            &kept,
            &a(&["x"]),
            &dir.join("nobody.vsock"),
            b"",
            (&out, &err),
            None,
            RUN_MARGIN,
        )
        .unwrap_err();
        assert_eq!(e.code, ErrorCode::Conflict);
        assert!(e.message.contains("does not answer"), "{}", e.message);
        // A hostile agent that never stops sending output is given up past
        // the exec's timeout and the margin (here 0.3 s each).
        let endless = dir.join("endless.vsock");
        let l = std::os::unix::net::UnixListener::bind(&endless).unwrap();
        std::thread::spawn(move || {
            use std::io::{BufRead, Write};
            let (mut s, _) = l.accept().unwrap();
            let mut line = String::new();
            std::io::BufReader::new(s.try_clone().unwrap())
                .read_line(&mut line)
                .unwrap();
            s.write_all(b"OK 1\n").unwrap();
            let _: Request = k7d_agent::proto::read_frame(&mut s).unwrap();
            let hello = Reply::Hello {
                version: k7d_agent::proto::VERSION,
                kernel: "x".into(),
            };
            k7d_agent::proto::write_frame(&mut s, &Response::Ok(hello)).unwrap();
            let _: Request = k7d_agent::proto::read_frame(&mut s).unwrap();
            let chunk = Response::Ok(Reply::Output {
                stream: Stream::Stdout,
                data: Bytes(vec![b'y'; 64]),
            });
            // 5 s of it, then gone: without the deadline the call fails on
            // the closed connection, not on the overrun.
            for _ in 0..1000 {
                if k7d_agent::proto::write_frame(&mut s, &chunk).is_err() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        let mut args = a(&["yes"]);
        args.timeout_s = Some(0.3);
        let t = std::time::Instant::now();
        let margin = std::time::Duration::from_millis(300);
        let e = run_on_kept(&kept, &args, &endless, b"", (&out, &err), None, margin).unwrap_err();
        assert_eq!(e.code, ErrorCode::Conflict);
        assert!(e.message.contains("still sending output"), "{}", e.message);
        assert!(t.elapsed() < std::time::Duration::from_secs(3), "{:?}", t.elapsed());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
