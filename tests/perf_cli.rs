//! `ferroce perf` as an operator runs it: the two-host mode as two processes, one per device
//! (`--listen --dev rxe1` receiving, `--connect HOST:PORT --dev rxe0` sending), the single-host
//! mode, and the command line's errors. The runs are short (one round, 0.3 s per size); the
//! check is that every number is there and positive and that the header names both devices.
//! The VM tests are `#[ignore]`d on the host; `ci/vm-tests.sh` runs them in the VM. The
//! argument errors need no devices and run everywhere.

mod common;

use std::io::BufRead;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

/// Three bandwidth sizes (8 B, 4 KiB, 64 KiB), two latency sizes, 100 ping-pongs each.
const SHORT: &[&str] = &["--max-size", "65536", "--iters", "100"];

fn plugin() -> String {
    plugin_dir().join("libnccl-net-ferroce.so").to_string_lossy().into_owned()
}

/// Waits for `child` at most `secs`, killing it after; its output when it ended in time.
fn finish(mut child: Child, secs: u64, what: &str) -> Output {
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what}: still running after {secs} s; stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn perf(args: &[&str]) -> Child {
    Command::new(ferroce_exe())
        .arg("perf")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The numeric cells of the table rows (lines not starting with `#`), per table.
fn tables(out: &str) -> Vec<Vec<Vec<f64>>> {
    let mut t: Vec<Vec<Vec<f64>>> = vec![vec![]];
    for l in out.lines() {
        if l.trim().is_empty() {
            t.push(vec![]);
        } else if !l.starts_with('#') {
            let cells = l.split_whitespace().map(|c| c.parse().unwrap_or(f64::NAN)).collect();
            t.last_mut().unwrap().push(cells);
        }
    }
    t.retain(|x| !x.is_empty());
    t
}

/// Bandwidth (3 sizes) and latency (2 sizes) tables, each row's ferroce median positive.
fn check_tables(out: &str) {
    let t = tables(out);
    assert_eq!(t.len(), 2, "two tables expected:\n{out}");
    assert_eq!(t[0].len(), 3, "three bandwidth sizes expected:\n{out}");
    assert_eq!(t[1].len(), 2, "two latency sizes expected:\n{out}");
    for row in t.iter().flatten() {
        assert!(
            row[0] >= 8.0 && row[1] > 0.0,
            "size and a positive ferroce number: {row:?}\n{out}"
        );
    }
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn two_processes_one_device_each() {
    require_vm();
    let p = plugin();
    let mut listener = perf(&["--listen", "--dev", "rxe1", "--plugin", &p]);
    let (tx, rx) = mpsc::channel();
    let stdout = listener.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let first = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(l) => l,
        Err(e) => {
            let _ = listener.kill();
            let out = listener.wait_with_output().unwrap();
            panic!("no HANDLE from --listen ({e}): {}", String::from_utf8_lossy(&out.stderr));
        }
    };
    println!("listener: {first}");
    let w: Vec<&str> = first.split_whitespace().collect();
    assert!(matches!(w[..], ["HANDLE", _, "rxe1"]), "{first}");
    let addr = w[1].to_string();
    assert!(addr.starts_with("198.18.0.2:"), "the address of rxe1's netdev: {addr}");

    let t0 = Instant::now();
    let args = ["--connect", &addr, "--dev", "rxe0", "--plugin", &p, "--rounds", "1"];
    let connector = perf(&[&args[..], &["--seconds", "0.3"], SHORT].concat());
    let out = finish(connector, 180, "perf --connect");
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    eprintln!("{err}");
    assert!(out.status.success(), "perf --connect failed ({})", out.status);
    println!("two-process run: {:.1} s", t0.elapsed().as_secs_f64());
    assert!(text.contains("two hosts"), "{text}");
    assert!(text.contains("rank 0 sends on rxe0"), "{text}");
    assert!(text.contains(&format!("receives on rxe1 (dev 1, {addr})")), "{text}");
    assert!(text.contains("perftest: skipped"), "{text}");
    check_tables(&text);

    let rest = finish(listener, 30, "perf --listen after the run");
    let mut lines: Vec<String> = rx.try_iter().collect();
    lines.extend(String::from_utf8_lossy(&rest.stdout).lines().map(String::from));
    assert!(rest.status.success(), "perf --listen: {}", String::from_utf8_lossy(&rest.stderr));
    assert!(lines.iter().any(|l| l == "# done"), "{lines:?}");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn one_host_with_named_devices() {
    require_vm();
    let p = plugin();
    let args = ["--dev-send", "rxe1", "--dev-recv", "rxe0", "--no-perftest", "--json"];
    let out = finish(
        perf(&[&args[..], &["--plugin", &p, "--rounds", "1", "--seconds", "0.3"], SHORT].concat()),
        180,
        "perf (one host)",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains(r#""sender":{"dev":"1","name":"rxe1","host":"here"}"#), "{text}");
    assert!(text.contains(r#""receiver":{"dev":"0","name":"rxe0","host":"here"}"#), "{text}");
    assert_eq!(text.matches("ferroce_gbps_median").count(), 3, "{text}");
    for v in text.split("\"ferroce_gbps_median\":").skip(1) {
        let n: f64 = v.split([',', '}']).next().unwrap().parse().unwrap();
        assert!(n > 0.0, "{text}");
    }

    // A device the plugin does not offer is named as such.
    let out = finish(perf(&["--listen", "--dev", "rxe7", "--plugin", &p]), 60, "--dev rxe7");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("\"rxe7\" is not one device"), "{err}");
}

/// Errors of the command line: exit status 1, the reason and where the usage is. No devices
/// needed.
#[test]
fn bad_arguments_exit_non_zero_with_usage() {
    for (args, why) in [
        (&["--bogus"][..], "unexpected argument '--bogus'"),
        (&["--rounds"], "a value is required for '--rounds"),
        (&["--seconds", "--json"], "a value is required for '--seconds"),
        (&["--connect"], "a value is required for '--connect"),
        (&["--dev"], "a value is required for '--dev"),
        (&["--rounds", "x"], "invalid value 'x' for '--rounds"),
        (&["--max-size", "4"], "--max-size must be at least 8"),
        (&["--iters", "1"], "--iters must be from 10"),
        (&["--listen", "--rounds", "2"], "the --connect side runs the benchmark"),
        (&["--dev", "rxe0"], "--dev is for --listen/--connect"),
        (&["--listen", "--connect", "h:1"], "cannot be used with"),
    ] {
        let out = finish(perf(args), 30, &format!("perf {args:?}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "perf {args:?}: {err}");
        assert!(err.contains(why) && err.contains("try '--help'"), "perf {args:?}: {err}");
    }
    let out = finish(perf(&["--help"]), 30, "perf --help");
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("--connect HOST:PORT"));
}
