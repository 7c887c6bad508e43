//! The scrape endpoint (`k7d daemon --metrics-listen ADDR`): `GET /metrics`
//! over HTTP/1.x on a TCP address, answered with [`Daemon::render_metrics`].
//!
//! Whoever reaches the address may scrape (it says what the node runs, it
//! changes nothing), so it is off by default and meant for loopback or a
//! node-local network. A client is treated as hostile: one connection at a
//! time on the endpoint's own thread, a request head of at most
//! [`MAX_HEAD`] bytes read within [`IO_TIMEOUT`], the answer written within
//! it too, then the connection is closed. A slow client costs scrapes
//! that long, never the API. (`tiny_http` and `hyper` serve connections on
//! threads of their own without such bounds; this endpoint needs none of
//! what they add.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use super::{Daemon, DaemonError};

/// Longest request head read (a scrape's is a few hundred bytes).
pub const MAX_HEAD: usize = 8 * 1024;

/// Time a client has to send its request head, and to take the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// A running scrape endpoint.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    /// The VM processes' memory, read for the scrapes in the background.
    _memory: super::process_memory::MemoryReader,
}

impl MetricsServer {
    /// Listens on `addr` (port 0: any free one, [`MetricsServer::addr`]
    /// says which) and serves scrapes of `daemon` until shut down.
    pub fn start(daemon: Arc<Daemon>, addr: SocketAddr) -> Result<Self, DaemonError> {
        let listener = TcpListener::bind(addr).map_err(|source| DaemonError::Io {
            what: format!("cannot listen for metrics scrapes on {addr}"),
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| DaemonError::Io {
            what: "cannot read the metrics endpoint's address".into(),
            source,
        })?;
        let wake =
            Arc::new(
                EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(|source| DaemonError::Io {
                    what: "cannot create the metrics thread's wake-up eventfd".into(),
                    source,
                })?,
            );
        let memory = super::process_memory::MemoryReader::start(&daemon, super::process_memory::MEMORY_PERIOD)
            .map_err(|source| DaemonError::Io {
                what: "cannot spawn the VM memory thread".into(),
                source,
            })?;
        let stop = Arc::new(AtomicBool::new(false));
        let (stop2, wake2) = (stop.clone(), wake.clone());
        let thread = std::thread::Builder::new()
            .name("k7d-metrics".into())
            .spawn(move || serve(&listener, &daemon, &stop2, &wake2))
            .map_err(|source| DaemonError::Io {
                what: "cannot spawn the metrics thread".into(),
                source,
            })?;
        tracing::info!(%addr, "metrics endpoint listening (GET /metrics)");
        Ok(Self {
            addr,
            stop,
            wake,
            thread: Some(thread),
            _memory: memory,
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Err(e) = self.wake.write(1) {
            tracing::error!(error = %e, "cannot wake the metrics thread");
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(listener: &TcpListener, daemon: &Daemon, stop: &AtomicBool, wake: &EventFd) {
    while !stop.load(Ordering::SeqCst) {
        match k7d_sys::fd::poll_readable(&[listener, wake], None) {
            Ok(ready) if ready.first() == Some(&true) => {}
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!(error = %e, "the metrics endpoint cannot wait for scrapes; it stops");
                return;
            }
        }
        if stop.load(Ordering::SeqCst) {
            return;
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                if let Err(e) = answer(stream, daemon) {
                    tracing::debug!(%peer, error = %e, "metrics scrape not answered");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot accept a metrics scrape"),
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Asked {
    Metrics,
    NotFound,
    WrongMethod,
    Malformed,
}

/// Reads the request line of `head` (the bytes up to the blank line).
fn parse_head(head: &[u8]) -> Asked {
    let Some(line) = head.split(|&b| b == b'\n').next() else {
        return Asked::Malformed;
    };
    let Ok(line) = std::str::from_utf8(line) else {
        return Asked::Malformed;
    };
    let mut words = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) = (words.next(), words.next(), words.next(), words.next())
    else {
        return Asked::Malformed;
    };
    if !version.starts_with("HTTP/1.") {
        return Asked::Malformed;
    }
    if method != "GET" && method != "HEAD" {
        return Asked::WrongMethod;
    }
    // A query (Prometheus adds none; others may) does not change the answer.
    match target.split('?').next() {
        Some("/metrics") => Asked::Metrics,
        _ => Asked::NotFound,
    }
}

/// Reads the request head within [`IO_TIMEOUT`] and [`MAX_HEAD`].
fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let deadline = Instant::now() + IO_TIMEOUT;
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        stream.set_read_timeout(Some(left))?;
        let n = match stream.read(&mut chunk) {
            Ok(0) => return Ok(None),
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        head.extend_from_slice(&chunk[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            return Ok(Some(head));
        }
        if head.len() > MAX_HEAD {
            return Ok(Some(Vec::new()));
        }
    }
}

fn answer(mut stream: TcpStream, daemon: &Daemon) -> std::io::Result<()> {
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let Some(head) = read_head(&mut stream)? else {
        return Ok(());
    };
    let head_only = head.starts_with(b"HEAD ");
    let (status, body, ctype) = match parse_head(&head) {
        Asked::Metrics => ("200 OK", daemon.render_metrics(), super::metrics::CONTENT_TYPE),
        Asked::NotFound => (
            "404 Not Found",
            "only /metrics is served here\n".to_string(),
            "text/plain",
        ),
        Asked::WrongMethod => (
            "405 Method Not Allowed",
            "only GET and HEAD are served here\n".to_string(),
            "text/plain",
        ),
        Asked::Malformed => ("400 Bad Request", "not an HTTP/1 request\n".to_string(), "text/plain"),
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    stream.write_all(&out)?;
    let _ = stream.shutdown(std::net::Shutdown::Both);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_get_of_metrics_is_a_scrape() {
        assert_eq!(parse_head(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), Asked::Metrics);
        assert_eq!(parse_head(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), Asked::Metrics);
        assert_eq!(parse_head(b"HEAD /metrics HTTP/1.1\r\n\r\n"), Asked::Metrics);
        assert_eq!(parse_head(b"GET / HTTP/1.1\r\n\r\n"), Asked::NotFound);
        assert_eq!(parse_head(b"GET /metrics/../x HTTP/1.1\r\n\r\n"), Asked::NotFound);
        assert_eq!(parse_head(b"POST /metrics HTTP/1.1\r\n\r\n"), Asked::WrongMethod);
        assert_eq!(parse_head(b"GET /metrics\r\n\r\n"), Asked::Malformed);
        assert_eq!(parse_head(b"GET /metrics SPDY/3\r\n\r\n"), Asked::Malformed);
        assert_eq!(parse_head(b"\xff\xfe /metrics HTTP/1.1\r\n\r\n"), Asked::Malformed);
        assert_eq!(parse_head(b""), Asked::Malformed);
    }
}
