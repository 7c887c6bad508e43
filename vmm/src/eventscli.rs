//! `k7d events [--vm ID] [--follow]`: the daemon's event log
//! (`daemon/events.rs`), oldest first, read straight from the state
//! directory (no daemon needed: it answers after a crash too). `--json`
//! prints the lines as written; otherwise one line per event: its UTC
//! time, the event, its subject, and the rest as `key=value` (values as
//! JSON, so nothing a VM id or a reason holds reaches the terminal raw).

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::daemon::events::{FILE, concerns, rotated};

/// How often `--follow` looks for new events.
const FOLLOW_PERIOD: Duration = Duration::from_millis(200);

/// Longest line read as an event (longer ones are skipped, said once).
const MAX_LINE: usize = 1 << 20;

/// `YYYY-MM-DD HH:MM:SS.mmm` (UTC) of Unix seconds.
fn utc(ts: f64) -> String {
    let ms_total = (ts * 1000.0).round() as i64;
    let (secs, ms) = (ms_total.div_euclid(1000), ms_total.rem_euclid(1000));
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{ms:03}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// One event as a human reads it.
fn human(v: &Value) -> String {
    let mut out = format!(
        "{}  {}",
        v.get("ts")
            .and_then(Value::as_f64)
            .map(utc)
            .unwrap_or_else(|| "?".into()),
        v.get("event").and_then(Value::as_str).unwrap_or("?")
    );
    if let Some(obj) = v.as_object() {
        // The subject first, then the rest (by name).
        let subject = ["vm", "cluster"].into_iter().filter_map(|k| obj.get_key_value(k));
        let rest = obj
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "ts" | "event" | "daemon_pid" | "vm" | "cluster"));
        for (k, val) in subject.chain(rest) {
            let shown = match (k.as_str(), val) {
                ("vm" | "cluster", Value::String(s)) if s.chars().all(|c| c.is_ascii_graphic()) => s.clone(),
                _ => val.to_string(),
            };
            out.push_str(&format!("  {k}={shown}"));
        }
    }
    out
}

/// Prints the complete lines of `buf` that `vm` selects; returns how many
/// bytes it used (a trailing partial line is left for the next read).
fn print_lines(buf: &[u8], vm: Option<&str>, json: bool, out: &mut impl Write) -> Result<usize> {
    let mut used = 0;
    while let Some(nl) = buf[used..].iter().position(|&b| b == b'\n') {
        let line = &buf[used..used + nl];
        used += nl + 1;
        let Ok(v) = serde_json::from_slice::<Value>(line) else {
            tracing::warn!("skipped a line of the event log that is not JSON");
            continue;
        };
        if vm.is_some_and(|id| !concerns(&v, id)) {
            continue;
        }
        if json {
            writeln!(out, "{v}")?;
        } else {
            writeln!(out, "{}", human(&v))?;
        }
    }
    if used == 0 && buf.len() > MAX_LINE {
        tracing::warn!("skipped an event log line longer than {MAX_LINE} bytes");
        return Ok(buf.len());
    }
    Ok(used)
}

fn read_all(path: &Path, vm: Option<&str>, json: bool, out: &mut impl Write) -> Result<()> {
    match std::fs::read(path) {
        Ok(b) => {
            print_lines(&b, vm, json, out)?;
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot read the event log {}", path.display())),
    }
}

/// `k7d events`.
pub fn run(state_dir: &Path, vm: Option<&str>, follow: bool, json: bool) -> Result<ExitCode> {
    if let Some(id) = vm {
        crate::config::validate_id(id).map_err(|e| anyhow::anyhow!("--vm {id:?}: {e}"))?;
    }
    let path = state_dir.join(FILE);
    if !follow && !path.exists() && !rotated(&path).exists() {
        anyhow::bail!(
            "no event log at {}: no daemon has used this state directory yet (or --state-dir is not the daemon's)",
            path.display()
        );
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    read_all(&rotated(&path), vm, json, &mut out)?;
    if !follow {
        read_all(&path, vm, json, &mut out)?;
        return Ok(ExitCode::SUCCESS);
    }
    // Follow: the current file from its start, then what is appended; a
    // rotation (a new inode at the path) starts the new file from its start.
    let mut cur: Option<(std::fs::File, u64)> = None;
    let mut pending: Vec<u8> = Vec::new();
    loop {
        if cur.is_none()
            && let Ok(f) = std::fs::File::open(&path)
        {
            let ino = f.metadata().map(|m| m.ino()).unwrap_or(0);
            cur = Some((f, ino));
            pending.clear();
        }
        if let Some((f, ino)) = cur.as_mut() {
            let mut chunk = Vec::new();
            f.read_to_end(&mut chunk).context("cannot read the event log")?;
            pending.extend_from_slice(&chunk);
            let used = print_lines(&pending, vm, json, &mut out)?;
            pending.drain(..used);
            out.flush()?;
            let rotated_away = std::fs::metadata(&path).map(|m| m.ino() != *ino).unwrap_or(true);
            if rotated_away {
                // What the old file got after our last read, then the new one.
                let mut rest = Vec::new();
                let _ = f.read_to_end(&mut rest);
                pending.extend_from_slice(&rest);
                let used = print_lines(&pending, vm, json, &mut out)?;
                pending.drain(..used);
                cur = None;
                continue;
            }
        }
        std::thread::sleep(FOLLOW_PERIOD);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_utc_calendar_times() {
        assert_eq!(utc(0.0), "1970-01-01 00:00:00.000");
        assert_eq!(utc(951_782_400.5), "2000-02-29 00:00:00.500");
        assert_eq!(utc(1_796_500_000.123), "2026-12-05 19:46:40.123");
    }

    #[test]
    fn lines_are_filtered_by_vm_and_partial_lines_wait() {
        let buf = b"{\"ts\":1.0,\"event\":\"fork\",\"vm\":\"a\",\"children\":[\"a-f1\"]}\n{\"ts\":2.0,\"event\":\"delete\",\"vm\":\"b\"}\nnot json\n{\"ts\":3.0,\"ev";
        let mut out = Vec::new();
        let used = print_lines(buf, Some("a-f1"), false, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text, "1970-01-01 00:00:01.000  fork  vm=a  children=[\"a-f1\"]\n");
        assert_eq!(&buf[used..], b"{\"ts\":3.0,\"ev");
    }

    #[test]
    fn a_hostile_value_is_shown_as_json() {
        let v = serde_json::json!({"ts": 1.0, "event": "stopped", "vm": "a\u{1b}[2J", "reason": "x\ny"});
        let h = human(&v);
        assert!(!h.contains('\u{1b}') && !h.contains('\n'), "{h:?}");
    }
}
