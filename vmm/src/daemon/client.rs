//! The CLI side of the API.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde_json::Value;

use super::api::{self, ApiError, ErrorCode, Reply, Request, Response};

/// A connection to a daemon.
pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Client {
    /// Connects to the daemon's socket.
    pub fn connect(socket: &Path) -> Result<Self, ApiError> {
        let s = UnixStream::connect(socket).map_err(|e| {
            ApiError::new(
                ErrorCode::Internal,
                format!(
                    "cannot reach the k7d daemon at {} ({e}); start it with `k7d daemon`",
                    socket.display()
                ),
            )
        })?;
        let writer = s
            .try_clone()
            .map_err(|e| ApiError::new(ErrorCode::Internal, format!("socket clone failed: {e}")))?;
        Ok(Self {
            reader: BufReader::new(s),
            writer,
        })
    }

    /// Sends one request and returns its result as the daemon wrote it.
    pub fn call(&mut self, req: &Request) -> Result<Value, ApiError> {
        let line = api::request_line(req).map_err(|e| {
            ApiError::new(
                ErrorCode::InvalidArgument,
                format!("the `{}` request cannot be written as JSON: {e}", req.op()),
            )
        })?;
        self.call_raw(&line)?.into_result()
    }

    /// Sends one request and reads its result as the type its op defines.
    pub fn request(&mut self, req: &Request) -> Result<Reply, ApiError> {
        let result = self.call(req)?;
        Reply::from_result(req, result).map_err(|e| {
            ApiError::new(
                ErrorCode::Internal,
                format!("the daemon's answer to `{}` is not its result: {e}", req.op()),
            )
        })
    }

    /// Sends a raw line (tests use this for malformed input).
    pub fn call_raw(&mut self, line: &str) -> Result<Response, ApiError> {
        let io = |e: std::io::Error| ApiError::new(ErrorCode::Internal, format!("daemon connection failed: {e}"));
        self.writer.write_all(line.as_bytes()).map_err(io)?;
        self.writer.write_all(b"\n").map_err(io)?;
        let mut resp = String::new();
        if self.reader.read_line(&mut resp).map_err(io)? == 0 {
            return Err(ApiError::new(ErrorCode::Internal, "the daemon closed the connection"));
        }
        serde_json::from_str(&resp)
            .map_err(|e| ApiError::new(ErrorCode::Internal, format!("the daemon sent an invalid response: {e}")))
    }
}
