//! `k7d exec VM -- CMD ARGS...`: a command run in a VM by its guest agent
//! (`k7d-agent`, `docs/exec.md`), in the VM itself rather than in a
//! container (`k7d_agent::proto::THE_VM`). The daemon names the VM's vsock
//! socket (`info`); the agent is reached through it as the containerd shim
//! reaches a pod VM's (`k7d_shim::agent`). stdin is forwarded, stdout and
//! stderr come back on streams of their own, and the command's exit
//! status is `k7d exec`'s own (128 + N for a signal N; `--timeout` kills
//! it with SIGKILL: 137).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
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
    pub vm: String,
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

/// Runs the command in the VM whose vsock socket is `uds` (`vm` names it
/// in messages); the exit code is the command's.
pub fn run(vm: &str, uds: PathBuf, a: &ExecArgs) -> Result<ExitCode> {
    let agent = Agent::new(&uds);
    let connect = || {
        agent.connect(CONNECT_TIMEOUT).with_context(|| {
            format!("the guest agent of vm {vm} does not answer (k7d exec needs k7d-agent in the guest: docs/exec.md)")
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
            terminal: false,
            stdin: true,
            stdout: true,
            stderr: true,
        },
    }))
    .map_err(|e| refused(&format!("vm {vm} refused the exec"), e))?;
    let result = attach_and_run(vm, &connect, &mut ctl, &process, a.timeout);
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
) -> Result<ExitCode> {
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
    let stderr = attach(Stream::Stderr)?;
    let mut stdin = attach(Stream::Stdin)?;
    let mut waiter = connect()?;
    waiter.set_timeout(None)?;
    let (done_tx, done_rx) = mpsc::channel();
    let wait_ref = process.clone();
    std::thread::spawn(move || {
        let _ = done_tx.send(waiter.call(&Request::Wait(wait_ref)));
    });
    // Not locked for the stream's life: this thread's own messages go to
    // stderr too.
    let out = std::thread::spawn(move || pump(stdout, std::io::stdout()));
    let err = std::thread::spawn(move || pump(stderr, std::io::stderr()));
    match ctl.call(&Request::Start(process.clone())) {
        Ok(Reply::Pid(_)) => {}
        Ok(other) => bail!("vm {vm}: the agent answered the start with {other:?}"),
        Err(e) => {
            // The program was checked when the exec was added; what is
            // left is the start itself (as a shell says: 126/127).
            say(format_args!("k7d exec: vm {vm}: {e}"));
            return Ok(ExitCode::from(127));
        }
    }
    // stdin: forwarded until its EOF, which closes the command's stdin.
    // Not joined: a terminal's stdin may never end.
    std::thread::spawn(move || {
        pump(std::io::stdin(), &mut stdin);
        let _ = stdin.shutdown(std::net::Shutdown::Write);
    });
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
                say(format_args!(
                    "k7d exec: the command ran past --timeout {} s and was killed",
                    t.as_secs_f64()
                ));
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
    for h in [out, err] {
        let deadline = std::time::Instant::now() + DRAIN_TIMEOUT;
        while !h.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if h.is_finished() {
            let _ = h.join();
        }
    }
    Ok(ExitCode::from(u8::try_from(status).unwrap_or(255)))
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
            vm: "v".into(),
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
}
