//! The systemd units k7d ships for a node (`shim/systemd/`): every k7d
//! command they run, on any `Exec*=` line and inside a `sh -c` script, is
//! one this binary's parser accepts in full (required arguments, values,
//! no unknown options), and `systemd-analyze verify` finds nothing to say
//! about them.
//!
//! The parser is the `k7d` binary's own (its clap types are not in the
//! library), run without letting it act: see [`parses`].

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

mod common;
use common::{K7D, Scratch, text};

/// Where the units install k7d.
const INSTALLED: &str = "/usr/local/bin/k7d";

/// This package's directory in the checkout under test: cargo's
/// `CARGO_MANIFEST_DIR` at run time. The compile-time one names the
/// checkout the binary was built in, and cargo does not rebuild a crate
/// when only its checkout moved (a CI clone reusing another clone's build
/// products ran that clone's lab scenarios: CHALLENGES.md).
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The shipped unit files, by name.
fn units() -> Vec<(String, String)> {
    let dir = manifest_dir().join("../shim/systemd");
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

/// One k7d command line a unit runs.
#[derive(Debug)]
struct K7dRun {
    /// The key of the line it is on (`ExecStartPost`).
    key: String,
    /// Its arguments after the binary, specifiers resolved.
    args: Vec<String>,
    /// The unit's `Environment=` (clap reads some options from it).
    env: Vec<(String, String)>,
}

/// Every k7d command line the unit `unit` (an instance's name for a
/// template: `k7d-pool@shim.service`) runs, from `body`, its file: every
/// `Exec*=` line of `[Service]` (`ExecStartPre=`, `ExecStop=`, ..., with
/// their `-@:+!` prefixes), each of its `;`-separated commands, and the k7d
/// commands of a `sh -c` script. Anything naming k7d in a way this cannot
/// read (a wrapper such as `env`, an expansion, k7d from `PATH`) is an
/// error, never skipped.
fn k7d_runs(unit: &str, body: &str) -> Result<Vec<K7dRun>, String> {
    let lines = service_lines(body);
    let mut env = Vec::new();
    for (key, value) in &lines {
        match key.as_str() {
            // An empty `Environment=` resets the list.
            "Environment" if value.is_empty() => env.clear(),
            "Environment" => {
                for words in systemd_commands(value)? {
                    for w in words {
                        let w = resolve(&w, unit)?;
                        let (k, v) = w
                            .split_once('=')
                            .ok_or(format!("Environment={value}: `{w}` is no assignment"))?;
                        if k == STOP_VAR {
                            return Err(format!("Environment={value}: sets {STOP_VAR}, which this check needs"));
                        }
                        env.push((k.to_owned(), v.to_owned()));
                    }
                }
            }
            "EnvironmentFile" | "PassEnvironment" => {
                return Err(format!(
                    "{key}={value}: k7d's environment is then unknown to this check"
                ));
            }
            _ => {}
        }
    }
    let mut runs = Vec::new();
    for (key, value) in lines {
        // ExecPaths= and ExecSearchPath= list paths, not commands.
        if !key.starts_with("Exec") || key == "ExecPaths" || key == "ExecSearchPath" {
            continue;
        }
        let at = |e: String| format!("{key}={value}: {e}");
        for words in systemd_commands(&value).map_err(at)? {
            let words = words
                .iter()
                .map(|w| resolve(w, unit))
                .collect::<Result<Vec<_>, _>>()
                .map_err(at)?;
            for args in k7d_args(&words).map_err(at)? {
                runs.push(K7dRun {
                    key: key.clone(),
                    args,
                    env: env.clone(),
                });
            }
        }
    }
    Ok(runs)
}

/// The `key=value` lines of a unit file's `[Service]` section, continued
/// lines joined and comments left out, as systemd reads them.
fn service_lines(body: &str) -> Vec<(String, String)> {
    let (mut out, mut section, mut line) = (Vec::new(), String::new(), String::new());
    for raw in body.lines() {
        let raw = raw.trim();
        if raw.starts_with('#') || raw.starts_with(';') {
            continue;
        }
        // A line ending in a backslash goes on on the next one.
        if let Some(head) = raw.strip_suffix('\\') {
            line.push_str(head);
            line.push(' ');
            continue;
        }
        line.push_str(raw);
        let whole = std::mem::take(&mut line);
        if whole.starts_with('[') {
            section = whole;
        } else if let Some((k, v)) = whole.split_once('=')
            && section == "[Service]"
        {
            out.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    out
}

/// A command-line value split as systemd splits it (systemd.service(5),
/// "Command lines"): words at whitespace, quotes removed, backslash escapes
/// resolved, and a lone `;` between commands.
fn systemd_commands(value: &str) -> Result<Vec<Vec<String>>, String> {
    let mut cmds = vec![Vec::new()];
    let mut chars = value.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let (mut word, mut bare) = (String::new(), true);
        while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
            match c {
                '"' | '\'' => {
                    bare = false;
                    loop {
                        match chars.next() {
                            None => return Err(format!("an unclosed {c}")),
                            Some(q) if q == c => break,
                            Some('\\') => word.push(escaped(chars.next())?),
                            Some(x) => word.push(x),
                        }
                    }
                }
                '\\' => {
                    bare = false;
                    word.push(escaped(chars.next())?);
                }
                _ => word.push(c),
            }
        }
        if bare && word == ";" {
            cmds.push(Vec::new());
        } else {
            cmds.last_mut().unwrap().push(word);
        }
    }
    cmds.retain(|c| !c.is_empty());
    Ok(cmds)
}

/// The character a systemd backslash escape stands for (the ones a unit
/// would use; any other is an error rather than a guess).
fn escaped(c: Option<char>) -> Result<char, String> {
    match c {
        Some(c @ ('\\' | '"' | '\'' | ' ' | ';')) => Ok(c),
        Some('n') => Ok('\n'),
        Some('t') => Ok('\t'),
        Some(c) => Err(format!("the escape \\{c}, which this check does not read")),
        None => Err("a backslash at the end".into()),
    }
}

/// `word` with systemd's specifiers (systemd.unit(5), "Specifiers")
/// resolved as they are for the system service `unit` on a node (an
/// instance's name for a template: `k7d-pool@shim.service`); an unknown one
/// is an error, as it is to systemd.
fn resolve(word: &str, unit: &str) -> Result<String, String> {
    let stem = unit.rsplit_once('.').map_or(unit, |(s, _)| s);
    let (prefix, inst) = stem.split_once('@').unwrap_or((stem, ""));
    let file = if inst.is_empty() {
        unit.to_owned()
    } else {
        unit.replacen(&format!("@{inst}."), "@.", 1)
    };
    let last = prefix.rsplit('-').next().unwrap_or(prefix);
    let mut out = String::new();
    let mut chars = word.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let s = match chars.next() {
            Some('%') => "%".into(),
            Some('i') => inst.into(),
            Some('I') => unescape_name(inst),
            Some('n') => unit.into(),
            Some('N') => stem.into(),
            Some('p') => prefix.into(),
            Some('P') => unescape_name(prefix),
            Some('j') => last.into(),
            Some('J') => unescape_name(last),
            Some('f') => format!("/{}", unescape_name(if inst.is_empty() { prefix } else { inst })),
            Some('y') => format!("/etc/systemd/system/{file}"),
            Some('Y') => "/etc/systemd/system".into(),
            Some('d') => format!("/run/credentials/{unit}"),
            Some('E') => "/etc".into(),
            Some('S') => "/var/lib".into(),
            Some('C') => "/var/cache".into(),
            Some('L') => "/var/log".into(),
            Some('t') => "/run".into(),
            Some('T') => "/tmp".into(),
            Some('V') => "/var/tmp".into(),
            Some('h') => "/root".into(),
            Some('s') => "/bin/sh".into(),
            Some('u' | 'g') => "root".into(),
            Some('U' | 'G') => "0".into(),
            Some('H' | 'l' | 'q') => "node-1".into(),
            Some('m' | 'b') => "0123456789abcdef0123456789abcdef".into(),
            Some('v') => "6.12.0-k7d".into(),
            Some('a') => "x86-64".into(),
            Some(c) => return Err(format!("`{word}`: the specifier %{c}, unknown to this check")),
            None => return Err(format!("`{word}`: a lone % at the end")),
        };
        out.push_str(&s);
    }
    Ok(out)
}

/// A unit name part unescaped as systemd does (`-` is `/`, `\xNN` a byte).
fn unescape_name(s: &str) -> String {
    let (mut out, mut rest) = (Vec::new(), s.as_bytes());
    while let Some((&c, tail)) = rest.split_first() {
        rest = tail;
        let hex = |h: u8, l: u8| u8::from_str_radix(std::str::from_utf8(&[h, l]).ok()?, 16).ok();
        match (c, rest) {
            (b'-', _) => out.push(b'/'),
            (b'\\', &[b'x', h, l, ref tail @ ..]) if hex(h, l).is_some() => {
                out.extend(hex(h, l));
                rest = tail;
            }
            _ => out.push(c),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether a word names the k7d binary (installed, or looked up on `PATH`).
fn names_k7d(word: &str) -> bool {
    word == INSTALLED || word == "k7d"
}

/// The k7d argument lists one systemd command (its words, specifiers
/// resolved) runs: its own arguments when it is k7d, the k7d commands of its
/// script when it is `sh -c`, none when it does not name k7d.
fn k7d_args(words: &[String]) -> Result<Vec<Vec<String>>, String> {
    let exe = words[0].trim_start_matches(['-', '@', ':', '+', '!', '|']);
    // `@` gives the executable, then argv[0], then the arguments.
    let skip = if words[0][..words[0].len() - exe.len()].contains('@') {
        2
    } else {
        1
    };
    let args = words.get(skip..).ok_or("an `@` command without argv[0]")?;
    if names_k7d(exe) {
        if exe != INSTALLED {
            return Err(format!("runs `{exe}`, not {INSTALLED}"));
        }
        if let Some(a) = args.iter().find(|a| a.contains('$')) {
            return Err(format!("`{a}`: systemd substitutes it when the unit runs"));
        }
        return Ok(vec![args.to_vec()]);
    }
    // `sh [OPTIONS] -c SCRIPT` (or `-ec` and the like): its k7d commands.
    let shell = Path::new(exe)
        .file_name()
        .is_some_and(|n| ["sh", "bash", "dash"].iter().any(|s| n == *s));
    let (mut runs, mut script_at) = (Vec::new(), None);
    if shell
        && let Some(c) = args
            .iter()
            .position(|a| a.starts_with('-') && !a.starts_with("--") && a.contains('c'))
        && args[..c].iter().all(|a| a.starts_with('-'))
        && let Some(script) = args.get(c + 1)
    {
        script_at = Some(skip + c + 1);
        if script.contains("k7d") {
            runs = script_k7d_args(script)?;
        }
    }
    match words
        .iter()
        .enumerate()
        .find(|&(i, w)| Some(i) != script_at && (names_k7d(w) || w.contains(INSTALLED)))
    {
        Some((_, w)) => Err(format!("names `{w}` in a way this check cannot read")),
        None => Ok(runs),
    }
}

/// A token of a `sh -c` script.
enum Tok {
    /// A word, and whether it has an expansion (`$`, a backquote, a glob).
    Word(String, bool),
    /// What ends a simple command: `;`, `&`, `|`, `(`, `)`, a newline.
    End,
    /// A redirection operator (`>`, `2>&1`'s `>&`); the word after it is its target.
    Redirect,
}

/// The k7d argument lists a shell script runs: each simple command whose
/// command word (after `until`, `if`, `exec` and the like) is k7d, its words
/// up to the end of the command, redirections left out. A k7d argument with
/// an expansion, or k7d anywhere but as a command, is an error: its value is
/// known only when the script runs.
fn script_k7d_args(script: &str) -> Result<Vec<Vec<String>>, String> {
    let mut toks = shell_tokens(script)?.into_iter().peekable();
    let (mut runs, mut cmd) = (Vec::new(), Vec::new());
    loop {
        match toks.next() {
            Some(Tok::Word(w, dynamic)) => cmd.push((w, dynamic)),
            Some(Tok::Redirect) => {
                toks.next_if(|t| matches!(t, Tok::Word(..)));
            }
            Some(Tok::End) | None => {
                const LEADING: [&str; 10] = ["until", "while", "if", "elif", "then", "do", "else", "!", "{", "exec"];
                let start = cmd.iter().take_while(|(w, _)| LEADING.contains(&w.as_str())).count();
                let words = &cmd[start..];
                if let Some(((exe, _), args)) = words.split_first()
                    && names_k7d(exe)
                {
                    if exe != INSTALLED {
                        return Err(format!("the script runs `{exe}`, not {INSTALLED}"));
                    }
                    if let Some((a, _)) = args.iter().find(|(_, d)| *d) {
                        return Err(format!("`{a}`: the script expands it when it runs"));
                    }
                    runs.push(args.iter().map(|(w, _)| w.clone()).collect());
                } else if let Some((w, _)) = words.iter().find(|(w, _)| names_k7d(w) || w.contains(INSTALLED)) {
                    return Err(format!("the script names `{w}` where it is not the command"));
                }
                cmd.clear();
                if toks.peek().is_none() {
                    return Ok(runs);
                }
            }
        }
    }
}

/// A shell script as POSIX sh splits it, as far as [`script_k7d_args`] needs.
fn shell_tokens(script: &str) -> Result<Vec<Tok>, String> {
    let (mut toks, mut word): (Vec<Tok>, Option<(String, bool)>) = (Vec::new(), None);
    let mut chars = script.chars().peekable();
    let end_word = |word: &mut Option<(String, bool)>, toks: &mut Vec<Tok>| {
        if let Some((w, d)) = word.take() {
            toks.push(Tok::Word(w, d));
        }
    };
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' => end_word(&mut word, &mut toks),
            '\n' | ';' | '&' | '|' | '(' | ')' => {
                end_word(&mut word, &mut toks);
                toks.push(Tok::End);
            }
            '<' | '>' => {
                // The digits of `2>` are the descriptor, not a word.
                if word
                    .as_ref()
                    .is_some_and(|(w, _)| w.bytes().all(|b| b.is_ascii_digit()))
                {
                    word = None;
                }
                end_word(&mut word, &mut toks);
                while chars.next_if(|c| matches!(c, '<' | '>' | '&' | '|')).is_some() {}
                toks.push(Tok::Redirect);
            }
            '#' if word.is_none() => while chars.next_if(|c| *c != '\n').is_some() {},
            '\'' => {
                let w = word.get_or_insert_default();
                loop {
                    match chars.next() {
                        None => return Err("the script has an unclosed '".into()),
                        Some('\'') => break,
                        Some(x) => w.0.push(x),
                    }
                }
            }
            '"' => {
                let w = word.get_or_insert_default();
                loop {
                    match chars.next() {
                        None => return Err("the script has an unclosed \"".into()),
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(x @ ('"' | '\\' | '$' | '`')) => w.0.push(x),
                            Some('\n') => {}
                            Some(x) => w.0.extend(['\\', x]),
                            None => return Err("the script ends in a backslash".into()),
                        },
                        Some(x) => {
                            w.1 |= matches!(x, '$' | '`');
                            w.0.push(x);
                        }
                    }
                }
            }
            '\\' => match chars.next() {
                Some('\n') => {}
                Some(x) => word.get_or_insert_default().0.push(x),
                None => return Err("the script ends in a backslash".into()),
            },
            _ => {
                let w = word.get_or_insert_default();
                w.1 |= matches!(c, '$' | '`' | '*' | '?' | '[' | '~' | '{');
                w.0.push(c);
            }
        }
    }
    end_word(&mut word, &mut toks);
    Ok(toks)
}

/// The environment variable behind k7d's top-level `--timeout`, the stop of
/// [`parses`]'s first run.
const STOP_VAR: &str = "K7D_TIMEOUT";
/// Its value there: no number of seconds, so clap refuses it.
const STOP: &str = "k7d-units-parse-only";
/// The option [`parses`]'s second run appends: k7d has none of that name.
const PROBE: &str = "--k7d-units-probe";

/// `k7d ARGS` as a unit runs it (argv[0] the installed path, the unit's
/// environment and no other) but with `K7D_TIMEOUT` set to [`STOP`]: its
/// exit code and stderr.
fn k7d_stopped(args: &[String], env: &[(String, String)]) -> (Option<i32>, String) {
    let o = Command::new(K7D)
        .arg0(INSTALLED)
        .args(args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env(STOP_VAR, STOP)
        .output()
        .unwrap();
    (o.status.code(), text(&o).1)
}

/// Whether the `k7d` binary's clap parser accepts `args` in full (given
/// `env`, for the options it reads from there), without running the command.
///
/// k7d has no parse-only mode and its clap types are only in the binary, so
/// this runs it twice, each run ending in a clap error (exit 2), never in
/// the command:
/// 1. With `K7D_TIMEOUT` no number. clap reads the top level's environment
///    after it has parsed and validated the subcommand (every word read,
///    every value through its parser, required arguments, conflicts), so
///    this run's error is about `K7D_TIMEOUT` exactly when all of that
///    passed; any other error is the answer. The line must not give the
///    top-level `--timeout` itself (it would hide the stop).
/// 2. With [`PROBE`] appended, which the innermost command refuses: its
///    usage line says whether a command was chosen at all, the one rule of
///    the top level (it has no required options, conflicts or
///    requirements), which clap checks after reading `K7D_TIMEOUT`.
///
/// [`prove_the_stop`] shows both hold before any unit's command runs.
fn parses(args: &[String], env: &[(String, String)]) -> Result<(), String> {
    static PROVEN: OnceLock<()> = OnceLock::new();
    PROVEN.get_or_init(prove_the_stop);
    parse_run(args, env)
}

/// [`parses`] without its first-use proof.
fn parse_run(args: &[String], env: &[(String, String)]) -> Result<(), String> {
    if let Some(a) = args.iter().find(|a| *a == "--timeout" || a.starts_with("--timeout=")) {
        return Err(format!("`{a}`: this check cannot stop a command that gives --timeout"));
    }
    let (code, err) = k7d_stopped(args, env);
    let stop = format!("error: invalid value '{STOP}' for '--timeout ");
    if code != Some(2) || !err.starts_with(&stop) {
        return Err(format!("exit {code:?}: {}", err.trim()));
    }
    let mut probe = args.to_vec();
    probe.push(PROBE.into());
    let (code, err) = k7d_stopped(&probe, env);
    let usage = err.lines().find_map(|l| l.strip_prefix("Usage: ")).unwrap_or_default();
    let chosen = usage
        .split_whitespace()
        .nth(1)
        .is_some_and(|w| w.starts_with(|c: char| c.is_ascii_lowercase()));
    let refused = format!("error: unexpected argument '{PROBE}' found");
    if code != Some(2) || !err.starts_with(&refused) || !chosen || usage.contains("<COMMAND>") {
        return Err(format!("no command chosen (exit {code:?}): {}", err.trim()));
    }
    Ok(())
}

/// The two facts [`parses`] stands on, shown on this binary (and, before
/// a unit's command runs, a stop that holds): a whole command line ends at
/// the `K7D_TIMEOUT` error (had it not, `list` would only fail to connect to
/// a socket that is not there); a subcommand's missing argument is reported
/// before it; a line without a command is caught by the second run.
fn prove_the_stop() {
    let words = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
    let nowhere = "--socket /nonexistent/k7d-units.sock";
    assert_eq!(parse_run(&words(&format!("{nowhere} list")), &[]), Ok(()));
    let e = parse_run(&words("info"), &[]).unwrap_err();
    assert!(
        e.contains("required arguments were not provided") && e.contains("<ID>"),
        "{e}"
    );
    let e = parse_run(&words(nowhere), &[]).unwrap_err();
    assert!(e.starts_with("no command chosen") && e.contains("<COMMAND>"), "{e}");
}

/// Every k7d command line of a unit and clap's verdict on it.
fn verdicts(unit: &str, body: &str) -> Vec<(String, String, Result<(), String>)> {
    k7d_runs(unit, body)
        .unwrap_or_else(|e| panic!("{unit}: {e}"))
        .into_iter()
        .map(|r| {
            let v = parses(&r.args, &r.env);
            (r.key, r.args.join(" "), v)
        })
        .collect()
}

/// Every k7d command the shipped units run, on whichever `Exec*=` line and
/// in a `sh -c` script too, is one the binary's clap parser accepts in full
/// (specifiers resolved for the instance `shim`): what `k7d.service`,
/// `k7d-template@` and `k7d-pool@` run is found, all of it, and passes.
#[test]
fn the_units_run_k7d_commands_this_binary_accepts() {
    let units = units();
    let names: Vec<&str> = units.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["k7d-pool@.service", "k7d-template@.service", "k7d.service"]);
    let mut checked = Vec::new();
    for (name, body) in &units {
        for (key, line, verdict) in verdicts(&instance(name), body) {
            assert!(!line.contains('%'), "{name}: {key}: `k7d {line}`: a specifier left");
            if let Err(e) = verdict {
                panic!("{name}: {key}: `k7d {line}`: {e}");
            }
            checked.push(format!("{name} {key}"));
        }
    }
    assert_eq!(
        checked,
        [
            "k7d-pool@.service ExecStart",
            "k7d-template@.service ExecStart",
            "k7d.service ExecStart",
            // The readiness loop's `k7d --socket ... list`.
            "k7d.service ExecStartPost",
        ]
    );
}

/// What the check stands on holds for this binary: clap's `K7D_TIMEOUT`
/// error comes only after it validated the command, and a line that
/// chooses no command is caught.
#[test]
fn the_parser_check_stops_k7d_only_after_clap_validated_the_line() {
    prove_the_stop();
}

/// The check reads every kind of command line: each `Exec*=` key, its
/// prefixes (`-`, `+`, `!!`, `:`, `@` with its argv[0]), continued lines,
/// quotes, `;`-separated commands and a `sh -c` script's k7d command, with
/// `%i`, `%I`, `%t` and `%E` resolved (`%I` unescaped); it leaves out
/// commands and keys that do not run k7d; and every line it found passes.
/// What it cannot read is an error, never a skip.
#[test]
fn every_kind_of_exec_line_is_read_with_its_specifiers_resolved() {
    let body = r#"[Unit]
Description=k7d %i
ExecStart=/usr/local/bin/k7d not-in-service

[Service]
ExecCondition=/usr/local/bin/k7d --socket %t/k7d/k7d.sock list
ExecStartPre=-/bin/mkdir -p %t/k7d
ExecStartPre=+/usr/local/bin/k7d check
# ExecStartPre=/usr/local/bin/k7d commented-out
ExecStart=@/usr/local/bin/k7d k7d pool-fill \
    --config "%E/k7d/%I.toml"
ExecStartPost=/bin/sh -c 'until /usr/local/bin/k7d --socket %t/k7d/k7d.sock info "pool %i" >/dev/null 2>&1; do sleep 1; done'
ExecReload=!!/usr/local/bin/k7d template-remove --config /etc/k7d/%i.toml ; /usr/local/bin/k7d template-make --config /etc/k7d/%i.toml
ExecStop=:/usr/local/bin/k7d pool-drain --config /etc/k7d/%i.toml
ExecStopPost=-/usr/local/bin/k7d --json list
ExecPaths=/usr/local/bin/k7d
"#;
    let runs = k7d_runs("k7d-pool@pools-gpu.service", body).unwrap();
    let got: Vec<(&str, String)> = runs.iter().map(|r| (r.key.as_str(), r.args.join(" "))).collect();
    let want = [
        ("ExecCondition", "--socket /run/k7d/k7d.sock list"),
        ("ExecStartPre", "check"),
        ("ExecStart", "pool-fill --config /etc/k7d/pools/gpu.toml"),
        ("ExecStartPost", "--socket /run/k7d/k7d.sock info pool pools-gpu"),
        ("ExecReload", "template-remove --config /etc/k7d/pools-gpu.toml"),
        ("ExecReload", "template-make --config /etc/k7d/pools-gpu.toml"),
        ("ExecStop", "pool-drain --config /etc/k7d/pools-gpu.toml"),
        ("ExecStopPost", "--json list"),
    ];
    assert_eq!(got, want.map(|(k, a)| (k, a.to_owned())));
    assert_eq!(runs[3].args[3], "pool pools-gpu", "a quoted word stays one");
    assert_eq!(unescape_name("pools-gpu\\x2dv2"), "pools/gpu-v2");
    for r in &runs {
        assert_eq!(parses(&r.args, &r.env), Ok(()), "{r:?}");
    }

    // A shell's other options do not hide its script.
    let line = "[Service]\nExecStart=/bin/bash --norc -ec '/usr/local/bin/k7d lisst'\n";
    let runs = k7d_runs("k7d.service", line).unwrap();
    assert_eq!(runs.iter().map(|r| r.args.clone()).collect::<Vec<_>>(), [["lisst"]]);
    let e = parses(&runs[0].args, &runs[0].env).unwrap_err();
    assert!(e.contains("unrecognized subcommand 'lisst'"), "{e}");

    // What it cannot read fails the check.
    for (line, why) in [
        ("ExecStart=/usr/bin/env /usr/local/bin/k7d list", "cannot read"),
        ("ExecStart=k7d list", "not /usr/local/bin/k7d"),
        ("ExecStart=/usr/local/bin/k7d info ${VM}", "substitutes"),
        ("ExecStart=/bin/sh -c '/usr/local/bin/k7d info $VM'", "expands"),
        ("ExecStart=/bin/sh -c 'test -x /usr/local/bin/k7d'", "not the command"),
        (
            "ExecStart=/bin/sh -c 'echo \"$(/usr/local/bin/k7d list)\"'",
            "not the command",
        ),
        (
            "ExecStart=/bin/sh -c 'exec \"$0\" list' /usr/local/bin/k7d",
            "cannot read",
        ),
        ("ExecStart=/usr/local/bin/k7d pool-fill --config /etc/k7d/%Q.toml", "%Q"),
        ("EnvironmentFile=/etc/default/k7d", "unknown"),
        ("Environment=K7D_TIMEOUT=5", "needs"),
    ] {
        let e = k7d_runs("k7d.service", &format!("[Service]\n{line}\n")).unwrap_err();
        assert!(e.contains(why), "{line}: {e}");
    }
}

/// The check fails a unit whose k7d command is wrong, and says why: each
/// case edits a shipped unit (the text it edits is asserted to be there)
/// and its check must report clap's error. Dropping a required argument
/// (the readiness loop's command, `list`; `--config`'s value), a misspelt
/// option or subcommand, a value out of range, an option set wrong through
/// `Environment=`, and a bad option on a new `ExecStop=-` line all fail,
/// where the old `--help` check passed the first and the last two.
#[test]
fn a_unit_with_a_wrong_k7d_command_fails_the_check() {
    let units = units();
    let unit = |name: &str| &units.iter().find(|(n, _)| n == name).unwrap().1;
    let cases = [
        ("k7d.service", "k7d.sock list", "k7d.sock", "<COMMAND>"),
        (
            "k7d-pool@.service",
            "--config /etc/k7d/%i.toml",
            "--config",
            "a value is required for '--config",
        ),
        (
            "k7d.service",
            "--state-dir",
            "--state-dri",
            "unexpected argument '--state-dri'",
        ),
        (
            "k7d-template@.service",
            "k7d template-make",
            "k7d template-mak",
            "unrecognized subcommand 'template-mak'",
        ),
        (
            "k7d-pool@.service",
            "pool-fill",
            "pool-fill --after-s 7200",
            "7200 is not in 0..=3600",
        ),
        (
            "k7d.service",
            "Type=exec\n",
            "Type=exec\nEnvironment=K7D_SECCOMP=strict\n",
            "invalid value 'strict' for '--seccomp",
        ),
        (
            "k7d-pool@.service",
            "TimeoutStartSec",
            "ExecStop=-/usr/local/bin/k7d pool-drain --confg /etc/k7d/%i.toml\nTimeoutStartSec",
            "unexpected argument '--confg'",
        ),
    ];
    for (name, from, to, why) in cases {
        let body = unit(name);
        assert!(body.contains(from), "{name} no longer has `{from}`");
        let bad = body.replacen(from, to, 1);
        let errors: Vec<String> = verdicts(&instance(name), &bad)
            .into_iter()
            .filter_map(|(key, line, v)| v.err().map(|e| format!("{key}: `k7d {line}`: {e}")))
            .collect();
        // (`Environment=` reaches both of k7d.service's commands.)
        assert!(
            !errors.is_empty() && errors.iter().all(|e| e.contains(why)),
            "{name} with `{to}`: {errors:?}"
        );
    }
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
    // The agent's, for a VM's image (its arguments are the agent's own
    // test's): an executable stands in for the agent.
    let agent = manifest_dir().join("../guest/agent/systemd/k7d-agent.service");
    let body = std::fs::read_to_string(&agent).unwrap_or_else(|e| panic!("{}: {e}", agent.display()));
    let f = dir.0.join("k7d-agent.service");
    std::fs::write(&f, body.replace("/usr/local/bin/k7d-agent", K7D)).unwrap();
    files.push(f);
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
