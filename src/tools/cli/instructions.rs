//! `ferroce instructions`: what a plugin costs per call, counted in user-space instructions
//! under callgrind rather than timed. Under emulation, or on a busy machine, times drift from
//! run to run; instruction counts do not, so two plugins (`--plugin`, any ncclNet plugin) or
//! two builds compare exactly.
//!
//! Two ranks run as two processes, as in NCCL, each under `valgrind --tool=callgrind` with
//! collection on only inside the wrappers of [`crate::rank`]'s `cost` module: every counted
//! plugin call runs inside one, so a wrapper's inclusive count is what the plugin spent in
//! those calls (the plugin's own threads are not counted). The orchestrator keeps the ranks in
//! lockstep, one message at a time, so a `test` mostly finds its request complete; the calls
//! that found nothing are counted, shown, and priced at the idle cost measured on its own.
//!
//! What it measures, on each end:
//! - a message of 8 B, 4 KiB and 1 MiB: `isend` (or `irecv`) and the `test` calls that
//!   complete it;
//! - an empty `test` (a receive whose message has not been sent) and an `isend` that finds no
//!   receive posted (NCCL calls it again): the cost of polling;
//! - connecting: `listen`, then `connect` and `accept` until both comms exist (each rank
//!   connects to the other), and closing the three.

use std::collections::HashMap;
use std::time::Duration;

use crate::rank::pair::{LocalPair, Pair};

/// The message sizes counted, with the suffix of their wrappers' names.
const SIZES: [(&str, usize, &str); 3] =
    [("8 B", 8, "8"), ("4 KiB", 4 << 10, "4k"), ("1 MiB", 1 << 20, "1m")];
/// The part of every wrapper's name that callgrind toggles collection on.
const MARKER: &str = "rank::cost::counted::";
/// Messages of each size sent uncounted first: what a plugin does once (the first use of a
/// size, a lane, a cache) is not a message's cost.
const WARM: u64 = 3;
/// How long one lockstep command may take under callgrind.
const LIMIT: Duration = Duration::from_secs(300);

/// Counts a plugin's instructions per call under callgrind: per message (8 B, 4 KiB, 1 MiB),
/// per empty test, per connection
///
/// Two rank processes, each under valgrind --tool=callgrind, drive the plugin through its C ABI
/// as NCCL does; only the plugin calls are counted. Needs valgrind; one host, two devices.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    ranks: LocalPair,
    /// Messages counted per size
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    messages: u64,
    /// Empty polls counted (0: none)
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    polls: u64,
    /// Connections counted (0: none)
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u64).range(0..=1000))]
    pairs: u64,
    /// Keep the two callgrind profiles in this folder (for callgrind_annotate)
    #[arg(long, value_name = "DIR")]
    keep: Option<std::path::PathBuf>,
    /// The valgrind to run
    #[arg(long, value_name = "PATH", default_value = "valgrind")]
    valgrind: String,
}

/// One rank's profile: per wrapper (its name less [`MARKER`]), the calls into it and their
/// inclusive instructions.
type Profile = HashMap<String, (u64, u64)>;

/// The calls that found nothing, per end, in a run.
#[derive(Default)]
struct Empty {
    send: HashMap<&'static str, u64>,
    recv: HashMap<&'static str, u64>,
}

pub fn instructions(a: &Args) -> Result<(), String> {
    let plugin = a.ranks.plugin();
    let version = std::process::Command::new(&a.valgrind).arg("--version").output();
    let version = match version {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => return Err(format!("{} not found: install valgrind (it has callgrind)", a.valgrind)),
    };
    let temp = std::env::temp_dir().join(format!("ferroce-instructions-{}", std::process::id()));
    let dir = a.keep.clone().unwrap_or(temp);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let out = |role: &str| dir.join(format!("{role}.callgrind"));
    let under = |role: &str| -> Vec<String> {
        vec![
            a.valgrind.clone(),
            "--tool=callgrind".into(),
            "--collect-atstart=no".into(),
            format!("--toggle-collect=*{MARKER}*"),
            format!("--callgrind-out-file={}", out(role).display()),
        ]
    };
    let mut pair = a.ranks.open(under)?;
    eprintln!("# {version}: {plugin}, {} -> {}", pair.tx.name, pair.rx.name);
    pair.connect()?;
    let empty = run(&mut pair, a)?;
    pair.quit_and_wait(LIMIT)?;
    let read = |role: &str| {
        std::fs::read_to_string(out(role)).map_err(|e| format!("{}: {e}", out(role).display()))
    };
    let (send, recv) = (inclusive(&read("send")?, MARKER), inclusive(&read("recv")?, MARKER));
    if a.keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    print_table(a, &plugin, (&pair.tx.name, &pair.rx.name), (&send, &recv), &empty);
    Ok(())
}

/// The lockstep commands (see `rank::cost`): the calls that found nothing, per wrapper.
fn run(pair: &mut Pair, a: &Args) -> Result<Empty, String> {
    let mut empty = Empty::default();
    let word = |r: &[String], what: &str| crate::rank::num::<u64>(what, r.first().map(|s| &s[..]));
    for (_, size, suffix) in SIZES {
        let test = test_name(suffix);
        for i in 0..WARM + a.messages {
            let warm = if i < WARM { " warm" } else { "" };
            pair.ask(false, &format!("C-POST {size}{warm}"), "POSTED", LIMIT)?;
            let s = pair.ask(true, &format!("C-SEND {size}{warm}"), "SENT", LIMIT)?;
            let r = pair.ask(false, &format!("C-DONE {size}{warm}"), "DONE", LIMIT)?;
            if i >= WARM {
                *empty.send.entry(test).or_default() += word(&s, "SENT")?;
                *empty.recv.entry(test).or_default() += word(&r, "DONE")?;
            }
        }
    }
    let n = a.polls;
    if n > 0 {
        pair.ask(true, &format!("C-IDLE {n}"), "IDLE", LIMIT)?;
        pair.ask(false, &format!("C-IDLE {n}"), "IDLE", LIMIT)?;
        pair.ask(true, "C-FINISH", "IDLE", LIMIT)?;
        pair.ask(false, "C-FINISH", "IDLE", LIMIT)?;
    }
    for _ in 0..a.pairs {
        let (s, r) = pair.ask_both(("C-LISTEN", "C-LISTEN"), "CHANDLE", LIMIT)?;
        let handle = |v: &[String]| v.first().cloned().ok_or("CHANDLE without a handle");
        let (s, r) = (handle(&s)?, handle(&r)?);
        let cmds = (format!("C-CONNECT {r}"), format!("C-CONNECT {s}"));
        pair.ask_both((&cmds.0, &cmds.1), "CONNECTED", LIMIT)?;
    }
    Ok(empty)
}

/// The test wrapper of a size suffix.
fn test_name(suffix: &str) -> &'static str {
    match suffix {
        "8" => "test_8",
        "4k" => "test_4k",
        _ => "test_1m",
    }
}

/// Every function whose name contains `marker`, by the rest of its name: the calls into it
/// and their inclusive instructions, summed over its callers' call records in a callgrind
/// output file (format version 1, the one event `Ir`, names possibly compressed as `(id)`).
fn inclusive(text: &str, marker: &str) -> Profile {
    let mut names: HashMap<String, String> = HashMap::new();
    let mut callee = String::new();
    let mut call: Option<u64> = None;
    let mut out = Profile::new();
    for line in text.lines() {
        if let Some(calls) = call.take() {
            // The line after `calls=` holds the call's position and inclusive cost.
            if let Some(at) = callee.find(marker) {
                let ir = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
                let e = out.entry(callee[at + marker.len()..].to_string()).or_default();
                *e = (e.0 + calls, e.1 + ir);
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("fn=").or_else(|| line.strip_prefix("cfn=")) {
            let name = match rest.strip_prefix('(').and_then(|r| r.split_once(')')) {
                Some((id, "")) => names.get(id).cloned().unwrap_or_default(),
                Some((id, name)) => {
                    names.insert(id.to_string(), name.trim().to_string());
                    name.trim().to_string()
                }
                None => rest.to_string(),
            };
            if line.starts_with("cfn=") {
                callee = name;
            }
        } else if let Some(rest) = line.strip_prefix("calls=") {
            call = Some(rest.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0));
        }
    }
    out
}

/// Instructions per call of `name` in `counts`, less `empty` calls priced at `idle` each,
/// over `n` calls; `None` when it was never called.
fn per(counts: &Profile, name: &str, empty: u64, idle: f64, n: u64) -> f64 {
    let ir = counts.get(name).map_or(0, |c| c.1) as f64;
    (ir - empty as f64 * idle).max(0.0) / n.max(1) as f64
}

fn print_table(
    a: &Args,
    plugin: &str,
    (tx, rx): (&str, &str),
    (send, recv): (&Profile, &Profile),
    empty: &Empty,
) {
    let idle_test = per(recv, "idle_test", 0, 0.0, a.polls);
    let idle_isend = per(send, "idle_isend", 0, 0.0, a.polls);
    println!("# ferroce instructions: {plugin}, {tx} -> {rx}; user-space instructions per call");
    println!("| what | sender | receiver | both | calls that found nothing (sender, receiver) |");
    println!("|---|---|---|---|---|");
    for (words, _, suffix) in SIZES {
        let test = test_name(suffix);
        let post = format!("post_{suffix}");
        let (es, er) = (empty.send.get(test).copied(), empty.recv.get(test).copied());
        let (es, er) = (es.unwrap_or(0), er.unwrap_or(0));
        // Each part rounded first, so that a cell's total is the sum of the parts it shows.
        let part =
            |m: &Profile, name: &str, e: u64, idle: f64| per(m, name, e, idle, a.messages).round();
        let s = (part(send, &post, 0, 0.0), part(send, test, es, idle_test));
        let r = (part(recv, &post, 0, 0.0), part(recv, test, er, idle_test));
        let (st, rt) = (s.0 + s.1, r.0 + r.1);
        println!(
            "| message of {words}: isend or irecv + its tests | {st} ({} + {}) | {rt} ({} + {}) | \
             {} | {es}, {er} |",
            s.0,
            s.1,
            r.0,
            r.1,
            st + rt
        );
    }
    println!("| empty test (a receive not yet sent) | | {idle_test:.0} | | |");
    println!("| isend with no receive posted | {idle_isend:.0} | | | |");
    let calls = |m: &Profile, n: &str| m.get(n).map_or(0, |c| c.0);
    let conn = |m: &Profile| {
        ["listen", "connect", "accept"].iter().map(|n| per(m, n, 0, 0.0, a.pairs)).sum::<f64>()
    };
    let polls = |m: &Profile| (calls(m, "connect") + calls(m, "accept")) as f64 / a.pairs as f64;
    let (cs, cr) = (conn(send), conn(recv));
    println!(
        "| connecting: listen, connect and accept until both exist | {cs:.0} | {cr:.0} | {:.0} | \
         {:.1}, {:.1} calls each |",
        cs + cr,
        polls(send),
        polls(recv)
    );
    let (xs, xr) = (per(send, "close", 0, 0.0, a.pairs), per(recv, "close", 0, 0.0, a.pairs));
    println!("| closing the two comms and the listener | {xs:.0} | {xr:.0} | {:.0} | |", xs + xr);
    println!(
        "# {} messages per size, {} empty polls, {} connections; each rank connects to the other",
        a.messages, a.polls, a.pairs
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inclusive_costs_come_from_the_callers_call_records() {
        let text = "\
events: Ir
fn=(1) main
cfn=(2) ferroce::rank::cost::counted::post_8
calls=2 3
11 270
cfn=(3) other::thing
calls=1 5
12 1000
cfn=(2)
calls=1 3
13 30
fn=(2)
3 10
";
        let got = inclusive(text, MARKER);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got["post_8"], (3, 300));
        assert_eq!(per(&got, "post_8", 1, 60.0, 3), 80.0);
        assert_eq!(per(&got, "test_8", 0, 0.0, 3), 0.0);
    }
}
