//! The API over a unix stream socket: one accept thread, one thread per
//! connection, line-delimited JSON.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::api::{ApiError, ErrorCode, Response};
use super::{Daemon, DaemonError};

/// Longest request line accepted (a config is a few hundred bytes).
pub const MAX_REQUEST_BYTES: u64 = 1 << 20;

/// Live connections by number: a clone of each stream, so shutdown can close
/// them. A connection thread removes its own entry when it ends, so no fd
/// outlives its connection.
type Conns = Arc<Mutex<HashMap<u64, UnixStream>>>;

/// A running API server.
pub struct Server {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    /// Binds `socket` (replacing a stale socket file) and serves `daemon`.
    pub fn start(daemon: Arc<Daemon>, socket: &Path) -> Result<Self, DaemonError> {
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir).map_err(|source| DaemonError::Io {
                what: format!("cannot create {}", dir.display()),
                source,
            })?;
        }
        if UnixStream::connect(socket).is_ok() {
            return Err(DaemonError::Io {
                what: format!("another daemon is listening on {}", socket.display()),
                source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
            });
        }
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket).map_err(|source| DaemonError::Io {
            what: format!("cannot listen on {}", socket.display()),
            source,
        })?;
        let _ = std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600));
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Conns = Arc::new(Mutex::new(HashMap::new()));
        let stop2 = stop.clone();
        let accept = std::thread::Builder::new()
            .name("k7d-api".into())
            .spawn(move || accept_loop(listener, daemon, stop2, conns))
            .map_err(|source| DaemonError::Io {
                what: "cannot spawn the API thread".into(),
                source,
            })?;
        tracing::info!(socket = %socket.display(), "API listening");
        Ok(Self {
            path: socket.to_path_buf(),
            stop,
            accept: Some(accept),
        })
    }

    /// Stops accepting, closes every connection, joins every thread, removes the socket.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept thread.
        let _ = UnixStream::connect(&self.path);
        // The accept thread closes every connection and joins their threads.
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.accept.is_some() {
            self.stop_all();
        }
    }
}

fn accept_loop(listener: UnixListener, daemon: Arc<Daemon>, stop: Arc<AtomicBool>, conns: Conns) {
    let mut handles: Vec<JoinHandle<()>> = Vec::new();
    let mut next: u64 = 0;
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                continue;
            }
        };
        handles.retain(|h| !h.is_finished());
        let Ok(peer) = stream.try_clone() else {
            continue;
        };
        let n = next;
        next += 1;
        conns.lock().unwrap_or_else(|p| p.into_inner()).insert(n, peer);
        let (d, c) = (daemon.clone(), conns.clone());
        let spawned = std::thread::Builder::new().name("k7d-conn".into()).spawn(move || {
            serve_conn(stream, &d);
            c.lock().unwrap_or_else(|p| p.into_inner()).remove(&n);
        });
        match spawned {
            Ok(h) => handles.push(h),
            Err(e) => {
                conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&n);
                tracing::warn!(error = %e, "cannot spawn a connection thread");
            }
        }
    }
    for (_, s) in conns.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    for h in handles {
        let _ = h.join();
    }
}

fn serve_conn(stream: UnixStream, daemon: &Daemon) {
    use std::io::Read;
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        let n = match (&mut reader).take(MAX_REQUEST_BYTES).read_line(&mut line) {
            Ok(n) => n,
            Err(e) => {
                // Not UTF-8, or the peer went away.
                let resp = Response::err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!("the request could not be read: {e}"),
                ));
                let _ = writeln!(out, "{}", resp.to_line());
                return;
            }
        };
        if n == 0 {
            return;
        }
        if !line.ends_with('\n') && n as u64 >= MAX_REQUEST_BYTES {
            let resp = Response::err(ApiError::new(
                ErrorCode::BadRequest,
                format!("the request is longer than {MAX_REQUEST_BYTES} bytes"),
            ));
            let _ = writeln!(out, "{}", resp.to_line());
            return;
        }
        if line.trim().is_empty() {
            continue;
        }
        let resp = daemon.handle_line(line.trim_end());
        if writeln!(out, "{resp}").is_err() {
            return;
        }
    }
}
