//! An exec in the VM itself (`proto::THE_VM`, `k7d exec`): the OCI
//! `process` object a client sent, checked as hostile input and turned
//! into a command run directly in the VM's own root and namespaces (no
//! container, no OCI runtime).
//!
//! Served: `args`, `env`, `cwd`, `user.uid`/`user.gid` (no supplementary
//! groups) and `terminal` (a pty of the agent's, the process's controlling
//! terminal: `k7d exec --tty`); any other key is refused with a sentence
//! rather than ignored. The program and the working directory are checked
//! before the process starts, so a missing one is the request's error, not
//! a failed exec in a forked child.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Most arguments, and most environment entries.
const MAX_ITEMS: usize = 4096;

/// What an exec in the VM runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The program, resolved (a path).
    pub program: PathBuf,
    /// `argv`, `argv[0]` as the client gave it.
    pub args: Vec<String>,
    /// `KEY=VALUE` pairs; `PATH` set to the agent's when the client set none.
    pub env: Vec<(String, String)>,
    /// The working directory (absolute).
    pub cwd: PathBuf,
    /// Who runs it.
    pub uid: u32,
    pub gid: u32,
    /// On a terminal: a pty's peer as its stdin, stdout and stderr, and its
    /// session's controlling terminal.
    pub terminal: bool,
}

fn strings(v: Option<&Value>, what: &str) -> Result<Vec<String>, String> {
    let Some(v) = v else {
        return Ok(Vec::new());
    };
    let a = v
        .as_array()
        .ok_or_else(|| format!("{what} is not an array of strings"))?;
    if a.len() > MAX_ITEMS {
        return Err(format!("{what} has {} entries, more than {MAX_ITEMS}", a.len()));
    }
    a.iter()
        .map(|s| match s.as_str() {
            Some(s) if !s.contains('\0') => Ok(s.to_owned()),
            Some(_) => Err(format!("an entry of {what} holds a NUL byte")),
            None => Err(format!("{what} is not an array of strings")),
        })
        .collect()
}

fn id(user: &Value, key: &str) -> Result<u32, String> {
    match user.get(key) {
        None => Ok(0),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|&n| n != u32::MAX)
            .ok_or_else(|| format!("user.{key} is not a uid/gid (0..4294967294)")),
    }
}

/// Checks `spec` (an OCI `process` object) and resolves its program in
/// the VM, on its own `PATH` or else `default_path`.
pub fn plan(spec: &Value, default_path: &str) -> Result<Plan, String> {
    let obj = spec.as_object().ok_or("the process is not a JSON object")?;
    if let Some(k) = obj
        .keys()
        .find(|k| !matches!(k.as_str(), "args" | "env" | "cwd" | "user" | "terminal"))
    {
        return Err(format!(
            "an exec in the VM itself takes args, env, cwd and user, not {k:.32}"
        ));
    }
    let terminal = match obj.get("terminal") {
        None => false,
        Some(t) => t.as_bool().ok_or("terminal is not true or false")?,
    };
    let args = strings(obj.get("args"), "args")?;
    let Some(arg0) = args.first().filter(|a| !a.is_empty()) else {
        return Err("an exec needs a program: args is empty".into());
    };
    let mut env = Vec::new();
    for e in strings(obj.get("env"), "env")? {
        match e.split_once('=') {
            Some((k, v)) if !k.is_empty() => env.push((k.to_owned(), v.to_owned())),
            _ => return Err(format!("the env entry {e:.64} is not KEY=VALUE")),
        }
    }
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), default_path.into()));
    }
    let cwd = match obj.get("cwd") {
        None => PathBuf::from("/"),
        Some(Value::String(s)) if s.starts_with('/') && !s.contains('\0') => PathBuf::from(s),
        Some(_) => return Err("cwd is not an absolute path".into()),
    };
    if !cwd.is_dir() {
        return Err(format!(
            "the working directory {} is not a directory in the VM",
            cwd.display()
        ));
    }
    let (uid, gid) = match obj.get("user") {
        None => (0, 0),
        Some(u) if u.is_object() => {
            if let Some(k) = u
                .as_object()
                .and_then(|o| o.keys().find(|k| !matches!(k.as_str(), "uid" | "gid")))
            {
                return Err(format!(
                    "an exec in the VM itself takes user.uid and user.gid, not user.{k:.32}"
                ));
            }
            (id(u, "uid")?, id(u, "gid")?)
        }
        Some(_) => return Err("user is not an object".into()),
    };
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map_or(default_path, |(_, v)| v.as_str());
    let program = resolve(arg0, path, &cwd)?;
    Ok(Plan {
        program,
        args,
        env,
        cwd,
        uid,
        gid,
        terminal,
    })
}

/// An executable regular file.
fn executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `name` as `execvp` would find it: a name with a slash as it is
/// (relative to `cwd`), else the first executable on `path`.
fn resolve(name: &str, path: &str, cwd: &Path) -> Result<PathBuf, String> {
    if name.contains('/') {
        let p = cwd.join(name);
        return if executable(&p) {
            Ok(p)
        } else {
            Err(format!("{name:.128}: no executable file in the VM"))
        };
    }
    path.split(':')
        .filter(|d| d.starts_with('/'))
        .map(|d| Path::new(d).join(name))
        .find(|p| executable(p))
        .ok_or_else(|| format!("{name:.128}: not found in the VM's PATH {path:.256}"))
}

/// The command for `plan`: its own session (no controlling terminal of
/// the agent's) or, when the agent already runs as its user, its own
/// process group; its user with no supplementary groups, its environment
/// and nothing else of the agent's.
pub fn command(plan: &Plan) -> Command {
    let mut cmd = Command::new(&plan.program);
    cmd.arg0(OsString::from_vec(plan.args[0].clone().into_bytes()))
        .args(&plan.args[1..])
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&plan.cwd);
    if !plan.terminal && crate::sys::runs_as(plan.uid, plan.gid) {
        // The agent is already who it runs as, with no supplementary
        // groups: no hook in the child, so std spawns it the vfork way
        // (posix_spawn) instead of copying the agent's page tables, which
        // in a nested guest is most of an exec's cost. It gets a process
        // group of its own, in the agent's session (which has no terminal).
        cmd.process_group(0);
    } else {
        crate::sys::as_user_in_new_session(&mut cmd, plan.uid, plan.gid, plan.terminal);
    }
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_process_is_checked_and_its_program_found_on_its_path() {
        let p = plan(
            &json!({"args": ["sh", "-c", "exit 3"], "env": ["A=b=c"], "cwd": "/tmp", "user": {"uid": 65534, "gid": 65534}, "terminal": false}),
            "/usr/bin:/bin",
        )
        .unwrap();
        assert!(p.program.ends_with("sh") && p.program.is_absolute(), "{p:?}");
        assert_eq!(p.args, ["sh", "-c", "exit 3"]);
        assert_eq!(
            p.env,
            [("A".into(), "b=c".into()), ("PATH".into(), "/usr/bin:/bin".into())]
        );
        assert_eq!((p.cwd.as_path(), p.uid, p.gid), (Path::new("/tmp"), 65534, 65534));
        // Defaults: root, /, the agent's PATH.
        let p = plan(&json!({"args": ["/bin/sh"]}), "/bin").unwrap();
        assert_eq!(
            (p.cwd.as_path(), p.uid, p.gid, p.terminal),
            (Path::new("/"), 0, 0, false)
        );
        assert!(
            plan(&json!({"args": ["/bin/sh"], "terminal": true}), "/bin")
                .unwrap()
                .terminal
        );
    }

    #[test]
    fn hostile_or_unserved_processes_are_refused_with_a_sentence() {
        for (spec, says) in [
            (json!([]), "not a JSON object"),
            (json!({"args": []}), "args is empty"),
            (json!({"args": [""]}), "args is empty"),
            (json!({"args": "sh"}), "args is not an array"),
            (json!({"args": ["sh\u{0}x"]}), "NUL"),
            (json!({"args": ["sh"], "env": ["NOEQUALS"]}), "not KEY=VALUE"),
            (json!({"args": ["sh"], "env": ["=x"]}), "not KEY=VALUE"),
            (json!({"args": ["sh"], "cwd": "tmp"}), "not an absolute path"),
            (json!({"args": ["sh"], "cwd": "/no/such/dir"}), "is not a directory"),
            (json!({"args": ["sh"], "user": {"uid": -1}}), "user.uid"),
            (json!({"args": ["sh"], "user": {"uid": 4294967295u64}}), "user.uid"),
            (
                json!({"args": ["sh"], "user": {"uid": 1, "additionalGids": [4]}}),
                "not user.additionalGids",
            ),
            (json!({"args": ["sh"], "capabilities": {}}), "not capabilities"),
            (
                json!({"args": ["sh"], "terminal": "yes"}),
                "terminal is not true or false",
            ),
            (json!({"args": ["no-such-program-k7d"]}), "not found in the VM's PATH"),
            (json!({"args": ["./no-such"], "cwd": "/"}), "no executable file"),
            (json!({"args": ["/dev/null"]}), "no executable file"),
            (json!({"args": ["/proc/self/status"]}), "no executable file"),
        ] {
            let e = plan(&spec, "/usr/bin:/bin").unwrap_err();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }

    #[test]
    fn too_many_arguments_are_refused() {
        let args: Vec<String> = std::iter::repeat_n("x".to_string(), MAX_ITEMS + 1).collect();
        let e = plan(&json!({ "args": args }), "/bin").unwrap_err();
        assert!(e.contains("more than 4096"), "{e}");
    }
}
