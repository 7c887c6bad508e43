//! The protocol server: one thread per connection, `Hello` first, then one
//! response per request; an `Attach` turns its connection into a stdio
//! stream.

use crate::container::{Containers, Error};
use crate::sys;
use k7d_agent::proto::{self, FrameError, Reply, Request, Response};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The most connections served at once (each `Wait` and stdio stream takes one).
pub const MAX_CONNECTIONS: usize = 512;

/// Where connections come from.
pub enum Listener {
    /// `AF_VSOCK` (the pod VM).
    Vsock(OwnedFd),
    /// A unix socket (host-side tests).
    Unix(UnixListener),
}

impl Listener {
    /// Listens on vsock `port`, retrying every 50 ms for up to 10 s while
    /// the vsock transport module is still coming up.
    pub fn vsock(port: u32) -> io::Result<Listener> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match sys::vsock_listen(port) {
                Ok(fd) => return Ok(Listener::Vsock(fd)),
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Accepts one connection. A vsock stream is carried in a `UnixStream`:
    /// both are plain stream sockets for read, write and shutdown.
    pub fn accept(&self) -> io::Result<UnixStream> {
        match self {
            Listener::Vsock(fd) => Ok(UnixStream::from(sys::accept(fd)?)),
            Listener::Unix(l) => Ok(l.accept()?.0),
        }
    }
}

/// Serves `listener` forever.
pub fn serve(listener: Listener, agent: Arc<Containers>) {
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let mut conn = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                crate::log!("accepting a connection failed: {e}");
                // EMFILE and friends: do not spin.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::AcqRel);
            let _ = proto::write_frame(
                &mut conn,
                &err(format!("the agent is serving {MAX_CONNECTIONS} connections already")),
            );
            continue;
        }
        let (agent, done) = (Arc::clone(&agent), Arc::clone(&active));
        let spawned = std::thread::Builder::new()
            .name("conn".into())
            .stack_size(512 << 10)
            .spawn(move || {
                handle(conn, &agent);
                done.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            active.fetch_sub(1, Ordering::AcqRel);
            crate::log!("starting a connection thread failed: {e}");
        }
    }
}

fn err(message: String) -> Response {
    Response::Err {
        message,
        not_found: false,
    }
}

impl From<Error> for Response {
    fn from(e: Error) -> Response {
        Response::Err {
            message: e.message,
            not_found: e.not_found,
        }
    }
}

/// Serves one connection until it closes.
pub fn handle(mut conn: UnixStream, agent: &Containers) {
    match proto::read_frame::<_, Request>(&mut conn) {
        Ok(Request::Hello { version }) if version == proto::VERSION => {
            let hello = Reply::Hello {
                version: proto::VERSION,
                kernel: sys::kernel_release(),
            };
            if proto::write_frame(&mut conn, &Response::Ok(hello)).is_err() {
                return;
            }
        }
        Ok(Request::Hello { version }) => {
            let msg = format!("the agent speaks protocol version {}, not {version}", proto::VERSION);
            let _ = proto::write_frame(&mut conn, &err(msg));
            return;
        }
        Ok(_) => {
            let _ = proto::write_frame(&mut conn, &err("the first request must be hello".into()));
            return;
        }
        Err(FrameError::Closed) => return,
        Err(e) => {
            let _ = proto::write_frame(&mut conn, &err(format!("the hello frame was refused: {e}")));
            return;
        }
    }
    loop {
        let req = match proto::read_frame::<_, Request>(&mut conn) {
            Ok(r) => r,
            Err(FrameError::Closed) => return,
            // The whole frame was read: the connection is still in step.
            Err(FrameError::Json(e)) => {
                if proto::write_frame(&mut conn, &err(format!("the request is not valid protocol JSON: {e}"))).is_err()
                {
                    return;
                }
                continue;
            }
            Err(e) => {
                // Too large (its body is unread) or I/O: out of step; close.
                let _ = proto::write_frame(&mut conn, &err(format!("the connection is closed: {e}")));
                return;
            }
        };
        if let Request::Run(run) = req {
            // Its frames on this connection; back in step after, unless the
            // connection failed.
            if crate::vmrun::serve(&mut conn, agent.reaper(), run).is_err() {
                return;
            }
            continue;
        }
        if let Request::Attach { process, stream } = req {
            match agent.attach(&process, stream) {
                Ok(attach) => {
                    if proto::write_frame(&mut conn, &Response::Ok(Reply::Done)).is_ok() {
                        attach.relay(conn);
                    }
                    return;
                }
                Err(e) => {
                    if proto::write_frame(&mut conn, &Response::from(e)).is_err() {
                        return;
                    }
                    continue;
                }
            }
        }
        let resp = std::panic::catch_unwind(AssertUnwindSafe(|| dispatch(agent, req)))
            .unwrap_or_else(|_| err("the agent failed internally on this request (a bug); see its log".into()));
        if proto::write_frame(&mut conn, &resp).is_err() {
            return;
        }
    }
}

/// Answers one request (not `Hello` or `Attach`).
pub fn dispatch(agent: &Containers, req: Request) -> Response {
    let r: Result<Reply, Error> = match req {
        Request::Hello { .. } => Err(Error {
            message: "hello was already said".into(),
            not_found: false,
        }),
        Request::Attach { .. } | Request::Run(_) => Err(Error {
            message: "attach and run are handled by the connection".into(),
            not_found: false,
        }),
        Request::CreateContainer(c) => agent.create(c).map(Reply::Pid),
        Request::Start(p) => agent.start(&p).map(Reply::Pid),
        Request::Exec(e) => agent.exec(e).map(|()| Reply::Done),
        Request::Wait(p) => agent.wait(&p).map(Reply::Exited),
        Request::Signal { process, signal, all } => agent.signal(&process, signal, all).map(|()| Reply::Done),
        Request::State(p) => agent.state(&p).map(Reply::State),
        Request::Pids { container } => agent.pids(&container).map(Reply::Pids),
        Request::ResizePty { process, width, height } => agent.resize(&process, width, height).map(|()| Reply::Done),
        Request::CloseStdin(p) => agent.close_stdin(&p).map(|()| Reply::Done),
        Request::Stats { container } => agent.stats(&container).map(Reply::Stats),
        Request::Update { container, resources } => agent.update(&container, &resources).map(|()| Reply::Done),
        Request::DeleteExec(p) => agent.delete_exec(&p).map(|()| Reply::Done),
        Request::DeleteContainer { container } => agent.delete(&container).map(|()| Reply::Done),
        Request::Network(n) => agent.network(&n).map(|()| Reply::Done),
        Request::Identity(i) => agent.identity(&i).map(|()| Reply::Done),
        Request::Reseed { entropy } => agent.reseed(&entropy).map(|()| Reply::Done),
    };
    match r {
        Ok(reply) => Response::Ok(reply),
        Err(e) => {
            crate::log!("{}", e.message);
            e.into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::container::Config;
    use crate::reaper::Reaper;
    use k7d_agent::proto::{ProcessRef, Stream};
    use std::io::Write;

    fn agent() -> (Arc<Containers>, std::path::PathBuf) {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("k7d-agent-srv-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = Config::for_tests(&dir, Duration::from_millis(10));
        (Arc::new(Containers::new(cfg, Reaper::new()).unwrap()), dir)
    }

    fn connect(agent: &Arc<Containers>) -> UnixStream {
        let (a, b) = UnixStream::pair().unwrap();
        let agent = Arc::clone(agent);
        std::thread::spawn(move || handle(a, &agent));
        b
    }

    fn call(c: &mut UnixStream, req: &Request) -> Response {
        proto::write_frame(c, req).unwrap();
        proto::read_frame(c).unwrap()
    }

    #[test]
    fn hello_first_then_requests_and_errors_keep_the_connection() {
        let (agent, dir) = agent();
        let mut c = connect(&agent);
        match call(
            &mut c,
            &Request::Hello {
                version: proto::VERSION,
            },
        ) {
            Response::Ok(Reply::Hello { version, kernel }) => {
                assert_eq!(version, proto::VERSION);
                assert!(!kernel.is_empty());
            }
            other => panic!("{other:?}"),
        }
        let state = Request::State(ProcessRef {
            container: "c1".into(),
            exec_id: None,
        });
        assert!(matches!(call(&mut c, &state), Response::Err { not_found: true, .. }));
        // A frame that is not a request is answered and the connection goes on.
        let body = br#"{"op":"launch_missiles"}"#;
        c.write_all(&(body.len() as u32).to_be_bytes()).unwrap();
        c.write_all(body).unwrap();
        let r: Response = proto::read_frame(&mut c).unwrap();
        assert!(matches!(r, Response::Err { not_found: false, .. }), "{r:?}");
        let sig = Request::Signal {
            process: ProcessRef {
                container: "c1".into(),
                exec_id: None,
            },
            signal: 99,
            all: false,
        };
        assert!(matches!(call(&mut c, &sig), Response::Err { not_found: false, .. }));
        let attach = Request::Attach {
            process: ProcessRef {
                container: "c1".into(),
                exec_id: None,
            },
            stream: Stream::Stdout,
        };
        assert!(matches!(call(&mut c, &attach), Response::Err { not_found: true, .. }));
        assert!(matches!(
            call(
                &mut c,
                &Request::Pids {
                    container: "bad/id".into()
                }
            ),
            Response::Err { not_found: false, .. }
        ));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_reseed_is_checked_then_reaches_the_kernel() {
        let (agent, dir) = agent();
        let mut c = connect(&agent);
        let hello = Request::Hello {
            version: proto::VERSION,
        };
        assert!(matches!(call(&mut c, &hello), Response::Ok(Reply::Hello { .. })));
        for n in [0, 31, 513] {
            match call(&mut c, &Request::Reseed { entropy: vec![1; n] }) {
                Response::Err { message, not_found } => {
                    assert!(
                        !not_found && message.contains(&format!("{n} entropy bytes")),
                        "{message}"
                    );
                }
                other => panic!("{n} bytes: {other:?}"),
            }
        }
        // The credit and the reseed take CAP_SYS_ADMIN: as root they are
        // done (the VM's agent runs as root), else refused with the reason.
        let r = call(&mut c, &Request::Reseed { entropy: vec![7; 64] });
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert!(matches!(r, Response::Ok(Reply::Done)), "{r:?}");
        } else {
            assert!(
                matches!(&r, Response::Err { message, .. } if message.contains("entropy") || message.contains("/dev/random")),
                "{r:?}"
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_wrong_version_or_a_missing_hello_closes_the_connection() {
        let (agent, _dir) = agent();
        let mut c = connect(&agent);
        assert!(matches!(
            call(&mut c, &Request::Hello { version: 99 }),
            Response::Err { .. }
        ));
        assert!(matches!(
            proto::read_frame::<_, Response>(&mut c),
            Err(FrameError::Closed)
        ));
        let mut c = connect(&agent);
        assert!(matches!(
            call(&mut c, &Request::Pids { container: "x".into() }),
            Response::Err { .. }
        ));
        assert!(matches!(
            proto::read_frame::<_, Response>(&mut c),
            Err(FrameError::Closed)
        ));
        // An oversized length prefix: answered, then closed.
        let mut c = connect(&agent);
        call(
            &mut c,
            &Request::Hello {
                version: proto::VERSION,
            },
        );
        c.write_all(&u32::MAX.to_be_bytes()).unwrap();
        assert!(matches!(
            proto::read_frame::<_, Response>(&mut c).unwrap(),
            Response::Err { .. }
        ));
        assert!(matches!(
            proto::read_frame::<_, Response>(&mut c),
            Err(FrameError::Closed)
        ));
    }
}
