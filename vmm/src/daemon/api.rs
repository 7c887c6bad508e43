//! The daemon's JSON API, version 1.
//!
//! Transport: a unix stream socket; one request per line, one response line
//! per request. A request is `{"v":1,"op":"<verb>","args":{...}}`; a response
//! is `{"v":1,"ok":true,"result":...}` or
//! `{"v":1,"ok":false,"error":{"code":"...","message":"..."}}`.
//! Unknown fields anywhere are refused, so a typo never silently does less.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::VmConfig;

/// Most children one `fork` request makes.
pub const MAX_FORKS: u32 = 64;

/// The API version this daemon speaks.
pub const API_VERSION: u32 = 1;

/// A parsed request.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// Build a VM (and start it when `start`).
    Create {
        /// The VM.
        config: VmConfig,
        /// Start it right away.
        start: bool,
    },
    /// Start a created VM.
    Start(String),
    /// Park a running VM's vCPUs.
    Pause(String),
    /// Unpark them.
    Resume(String),
    /// Stop the vCPUs (the VM stays listed until deleted).
    Stop(String),
    /// Stop if needed and remove the VM and its record.
    Delete(String),
    /// One VM's record and live state.
    Info(String),
    /// Pause a VM if needed, write a cold snapshot to a directory, resume it.
    Snapshot {
        /// VM.
        id: String,
        /// Target directory (created).
        dir: std::path::PathBuf,
    },
    /// Build and start a VM from a snapshot directory.
    Restore {
        /// Snapshot directory.
        dir: std::path::PathBuf,
        /// Id of the new VM (generated when absent).
        id: Option<String>,
    },
    /// Fork a VM `count` times copy-on-write; the children start running.
    Fork {
        /// Source VM.
        id: String,
        /// Number of children (1..=64).
        count: u32,
    },
    /// Read `count` little-endian u32 words of guest RAM at `addr` (debugging, tests).
    Peek {
        /// VM.
        id: String,
        /// Guest physical address.
        addr: u64,
        /// Words to read (1..=1024).
        count: u32,
    },
    /// Every VM.
    List,
    /// Daemon and API version.
    Version,
}

/// Machine-readable error class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Not JSON, or not a request.
    BadRequest,
    /// `v` is not a version this daemon speaks.
    UnsupportedVersion,
    /// A field value was refused.
    InvalidArgument,
    /// No such VM.
    NotFound,
    /// Duplicate id, or the VM is in the wrong state.
    Conflict,
    /// The host failed (KVM, memory, files).
    Internal,
}

/// An error as sent on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiError {
    /// Class.
    pub code: ErrorCode,
    /// One sentence.
    pub message: String,
}

impl ApiError {
    /// Builds an error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ApiError {}

/// A response line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    /// API version.
    pub v: u32,
    /// Success?
    pub ok: bool,
    /// The result on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// The error on failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
}

impl Response {
    /// A success.
    pub fn ok(result: Value) -> Self {
        Self {
            v: API_VERSION,
            ok: true,
            result: Some(result),
            error: None,
        }
    }

    /// A failure.
    pub fn err(e: ApiError) -> Self {
        Self {
            v: API_VERSION,
            ok: false,
            result: None,
            error: Some(e),
        }
    }

    /// Into a Result.
    pub fn into_result(self) -> Result<Value, ApiError> {
        match (self.ok, self.result, self.error) {
            (true, r, _) => Ok(r.unwrap_or(Value::Null)),
            (false, _, Some(e)) => Err(e),
            (false, _, None) => Err(ApiError::new(
                ErrorCode::Internal,
                "the daemon failed without saying why",
            )),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    v: u32,
    op: String,
    #[serde(default)]
    args: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateArgs {
    config: VmConfig,
    #[serde(default)]
    start: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IdArgs {
    id: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotArgs {
    id: String,
    dir: std::path::PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RestoreArgs {
    dir: std::path::PathBuf,
    #[serde(default)]
    id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkArgs {
    id: String,
    #[serde(default = "one")]
    count: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PeekArgs {
    id: String,
    addr: u64,
    #[serde(default = "one")]
    count: u32,
}

fn one() -> u32 {
    1
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, msg)
}

/// Parses one request line.
pub fn parse_request(line: &str) -> Result<Request, ApiError> {
    let env: Envelope =
        serde_json::from_str(line).map_err(|e| bad(format!("the request is not a valid API envelope: {e}")))?;
    if env.v != API_VERSION {
        return Err(ApiError::new(
            ErrorCode::UnsupportedVersion,
            format!(
                "API version {} is not supported; this daemon speaks version {API_VERSION}",
                env.v
            ),
        ));
    }
    let args = env.args.unwrap_or(Value::Object(Default::default()));
    let op = env.op.as_str();
    let parse_err = |e: serde_json::Error| {
        let code = if e.classify() == serde_json::error::Category::Data {
            ErrorCode::InvalidArgument
        } else {
            ErrorCode::BadRequest
        };
        ApiError::new(code, format!("invalid arguments for `{op}`: {e}"))
    };
    let id = |args: Value| -> Result<String, ApiError> {
        let a: IdArgs = serde_json::from_value(args).map_err(parse_err)?;
        crate::config::validate_id(&a.id).map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.to_string()))?;
        Ok(a.id)
    };
    Ok(match op {
        "create" => {
            let a: CreateArgs = serde_json::from_value(args).map_err(parse_err)?;
            Request::Create {
                config: a.config,
                start: a.start,
            }
        }
        "start" => Request::Start(id(args)?),
        "pause" => Request::Pause(id(args)?),
        "resume" => Request::Resume(id(args)?),
        "stop" => Request::Stop(id(args)?),
        "delete" => Request::Delete(id(args)?),
        "info" => Request::Info(id(args)?),
        "snapshot" => {
            let a: SnapshotArgs = serde_json::from_value(args).map_err(parse_err)?;
            crate::config::validate_id(&a.id).map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.to_string()))?;
            Request::Snapshot { id: a.id, dir: a.dir }
        }
        "restore" => {
            let a: RestoreArgs = serde_json::from_value(args).map_err(parse_err)?;
            if let Some(id) = &a.id {
                crate::config::validate_id(id).map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.to_string()))?;
            }
            Request::Restore { dir: a.dir, id: a.id }
        }
        "fork" => {
            let a: ForkArgs = serde_json::from_value(args).map_err(parse_err)?;
            crate::config::validate_id(&a.id).map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.to_string()))?;
            if a.count == 0 || a.count > MAX_FORKS {
                return Err(ApiError::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "count = {} is out of range: fork makes 1 to {MAX_FORKS} children at a time",
                        a.count
                    ),
                ));
            }
            Request::Fork {
                id: a.id,
                count: a.count,
            }
        }
        "peek" => {
            let a: PeekArgs = serde_json::from_value(args).map_err(parse_err)?;
            crate::config::validate_id(&a.id).map_err(|e| ApiError::new(ErrorCode::InvalidArgument, e.to_string()))?;
            if a.count == 0 || a.count > 1024 {
                return Err(ApiError::new(
                    ErrorCode::InvalidArgument,
                    format!("count = {} is out of range: peek reads 1 to 1024 words", a.count),
                ));
            }
            Request::Peek {
                id: a.id,
                addr: a.addr,
                count: a.count,
            }
        }
        "list" | "version" => {
            if args.as_object().is_some_and(|o| !o.is_empty()) {
                return Err(ApiError::new(
                    ErrorCode::InvalidArgument,
                    format!("`{op}` takes no arguments"),
                ));
            }
            if op == "list" { Request::List } else { Request::Version }
        }
        other => {
            return Err(bad(format!(
                "unknown operation `{other}` (known: create, start, pause, resume, stop, delete, info, snapshot, restore, fork, peek, list, version)"
            )));
        }
    })
}

/// Serializes a request into its wire line (for the client).
pub fn request_line(req: &Request) -> String {
    let (op, args) = match req {
        Request::Create { config, start } => ("create", serde_json::json!({"config": config, "start": start})),
        Request::Start(id) => ("start", serde_json::json!({"id": id})),
        Request::Pause(id) => ("pause", serde_json::json!({"id": id})),
        Request::Resume(id) => ("resume", serde_json::json!({"id": id})),
        Request::Stop(id) => ("stop", serde_json::json!({"id": id})),
        Request::Delete(id) => ("delete", serde_json::json!({"id": id})),
        Request::Info(id) => ("info", serde_json::json!({"id": id})),
        Request::Snapshot { id, dir } => ("snapshot", serde_json::json!({"id": id, "dir": dir})),
        Request::Restore { dir, id } => ("restore", serde_json::json!({"dir": dir, "id": id})),
        Request::Fork { id, count } => ("fork", serde_json::json!({"id": id, "count": count})),
        Request::Peek { id, addr, count } => ("peek", serde_json::json!({"id": id, "addr": addr, "count": count})),
        Request::List => ("list", serde_json::json!({})),
        Request::Version => ("version", serde_json::json!({})),
    };
    serde_json::json!({"v": API_VERSION, "op": op, "args": args}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for r in [
            Request::List,
            Request::Info("a".into()),
            Request::Create {
                config: VmConfig::default(),
                start: true,
            },
        ] {
            assert_eq!(parse_request(&request_line(&r)).unwrap(), r);
        }
    }

    #[test]
    fn refusals() {
        let code = |l: &str| parse_request(l).unwrap_err().code;
        assert_eq!(code("{nope"), ErrorCode::BadRequest);
        assert_eq!(code(r#"{"v":2,"op":"list"}"#), ErrorCode::UnsupportedVersion);
        assert_eq!(code(r#"{"v":1,"op":"list","extra":1}"#), ErrorCode::BadRequest);
        assert_eq!(
            code(r#"{"v":1,"op":"info","args":{"id":"../x"}}"#),
            ErrorCode::InvalidArgument
        );
        assert_eq!(
            code(r#"{"v":1,"op":"info","args":{"id":"a","b":1}}"#),
            ErrorCode::InvalidArgument
        );
        assert_eq!(code(r#"{"v":1,"op":"explode"}"#), ErrorCode::BadRequest);
    }
}
