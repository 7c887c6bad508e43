//! The API's `exec`: a command run in a running VM by its guest agent,
//! answered when it has ended (`docs/exec.md`, "In the daemon's API").
//!
//! It runs the agent calls of `k7d exec` ([`crate::execcli::run_outcome`])
//! on the request's own connection thread, holding no lock of the daemon's
//! or the VM's: a command that runs for minutes holds up nothing else. One
//! line in, one line out, so it is buffered: stdin whole (at most
//! [`MAX_EXEC_STDIN`]), and the first [`MAX_EXEC_OUTPUT`] bytes of stdout
//! and of stderr kept, the rest counted, so a hostile guest costs the
//! daemon two such buffers per exec and no more.
// Without the agent's client (the fuzz build) only the refusal is left.
#![cfg_attr(not(feature = "shim"), allow(dead_code))]

use std::sync::{Arc, Mutex};

use super::Daemon;
use super::api::{ApiError, ErrorCode, ExecArgs, Executed};
#[cfg(feature = "shim")]
use super::api::{MAX_EXEC_OUTPUT, Reply, Request};
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
pub(super) fn run(daemon: &Daemon, a: &ExecArgs) -> Result<Executed, ApiError> {
    use base64::Engine as _;
    let t = std::time::Instant::now();
    let info = match daemon.handle(Request::Info(a.id.clone()))? {
        Reply::Vm(info) => info,
        other => {
            return Err(ApiError::new(
                ErrorCode::Internal,
                format!("vm {}: its info came back as {other:?}", a.id),
            ));
        }
    };
    if info.state != VmState::Running {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("vm {} is {}: a command runs only in a running VM", a.id, info.state),
        ));
    }
    let Some(vsock) = &info.config.devices.vsock else {
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
    let (out, err) = (Capture::new(MAX_EXEC_OUTPUT), Capture::new(MAX_EXEC_OUTPUT));
    let streams = crate::execcli::Streams::piped(
        Box::new(out.clone()),
        Box::new(err.clone()),
        stdin.map(|b| Box::new(std::io::Cursor::new(b)) as Box<dyn std::io::Read + Send>),
    );
    let args = crate::execcli::ExecArgs {
        env: a.env.clone(),
        cwd: a.cwd.clone(),
        user: a.uid.map(|u| (u, a.gid.unwrap_or(u))),
        timeout: Some(a.timeout()),
        ..crate::execcli::ExecArgs::in_vm(&a.id, a.command.clone())
    };
    let outcome = crate::execcli::run_outcome(&a.id, vsock.uds.clone(), &args, streams).map_err(|e| {
        let code = match e.downcast_ref::<crate::execcli::NotRun>() {
            Some(crate::execcli::NotRun::Refused(_)) => ErrorCode::InvalidArgument,
            Some(crate::execcli::NotRun::NoAgent(_)) => ErrorCode::Conflict,
            None => ErrorCode::Internal,
        };
        ApiError::new(code, format!("{e:#}"))
    })?;
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

/// Without the agent's client, nothing runs in a guest.
#[cfg(not(feature = "shim"))]
pub(super) fn run(_: &Daemon, a: &ExecArgs) -> Result<Executed, ApiError> {
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
}
