//! The systemd units k7d ships for a node (`shim/systemd/`): every k7d
//! command they run is one this binary accepts, and `systemd-analyze
//! verify` finds nothing to say about them.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{K7D, Scratch, text};

/// Where the units install k7d.
const INSTALLED: &str = "/usr/local/bin/k7d";

/// The shipped unit files, by name.
fn units() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shim/systemd");
    let mut v: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(e.path()).unwrap())
        })
        .filter(|(n, _)| n.ends_with(".service"))
        .collect();
    v.sort();
    v
}

/// A template unit's file name with an instance (`k7d-pool@shim.service`).
fn instance(name: &str) -> String {
    name.replace("@.", "@shim.")
}

#[test]
fn the_units_run_k7d_commands_this_binary_accepts() {
    let units = units();
    let names: Vec<&str> = units.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["k7d-pool@.service", "k7d-template@.service", "k7d.service"]);
    let mut checked = 0;
    for (name, body) in &units {
        for line in body.lines() {
            let Some(cmd) = line.strip_prefix("ExecStart=") else {
                continue;
            };
            let words: Vec<String> = cmd.split_whitespace().map(|w| w.replace("%i", "shim")).collect();
            assert_eq!(words[0], INSTALLED, "{name}: {line}");
            // clap reads every argument before it answers --help: a wrong
            // subcommand or option is an error, not the help text.
            let mut args: Vec<&str> = words[1..].iter().map(String::as_str).collect();
            args.push("--help");
            let o = Command::new(K7D).args(&args).output().unwrap();
            let (out, err) = text(&o);
            assert!(o.status.success(), "{name}: `k7d {}`: {err}", args.join(" "));
            assert!(out.starts_with("Usage:") || out.contains("\nUsage:"), "{name}: {out}");
            checked += 1;
        }
    }
    assert_eq!(checked, 3, "one ExecStart per unit");
}

#[test]
fn systemd_analyze_finds_nothing_in_the_units() {
    let Some(analyze) = on_path("systemd-analyze") else {
        k7d_test_skip::skip(
            "systemd_analyze_finds_nothing_in_the_units",
            "systemd-analyze is not installed (Debian's systemd package has it)",
        );
        return;
    };
    let dir = Scratch::new("units");
    let mut files = Vec::new();
    for (name, body) in units() {
        let f = dir.0.join(instance(&name));
        std::fs::write(&f, body.replace(INSTALLED, K7D)).unwrap();
        files.push(f);
    }
    let o = Command::new(&analyze)
        .arg("verify")
        .arg("--man=no")
        .args(&files)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    // An unknown key or a bad value is only a warning to systemd: none.
    assert_eq!(format!("{out}{err}").trim(), "", "systemd-analyze verify");

    // And it would tell: a misspelt key is reported.
    let bad = dir.0.join("k7d-bad.service");
    std::fs::write(&bad, "[Service]\nTyp=oneshot\nExecStart=/bin/true\n").unwrap();
    let o = Command::new(&analyze)
        .args(["verify", "--man=no"])
        .arg(&bad)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(format!("{out}{err}").contains("Typ"), "{out}{err}");
}

/// `tool` on `PATH`, else in /usr/bin or /bin (cargo's test environment
/// may carry a short `PATH`).
fn on_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin".into(), "/bin".into()])
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}
