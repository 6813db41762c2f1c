//! perftest beside ferroce: `ib_write_bw`, `ib_send_bw`, `ib_write_lat` and `ib_send_lat` on
//! the same two devices, run under `timeout`, their result rows read back; and the check of
//! perftest's clock against the wall clock (see the [module docs](super)).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferroce_tools::out::{fixed, ratio};
use ferroce_tools::sys::terminate;

/// The two lengths of the perftest clock check, in iterations.
pub const CLOCK_ITERS: (usize, usize) = (500, 2500);

/// Where perftest finds a plugin device: its verbs name, RoCE v2 GID index and IP address, from
/// what ci/vm.sh exports (with its usual values as defaults).
pub struct Port {
    name: String,
    gid: String,
    ip: String,
}

pub fn port(name: &str) -> Result<Port, String> {
    let list = |k: &str, d: &str| -> Vec<String> {
        std::env::var(k).unwrap_or(d.into()).split_whitespace().map(str::to_string).collect()
    };
    let devs = list("FERROCE_VM_DEVS", "rxe0 rxe1");
    let i = devs.iter().position(|d| d == name).ok_or(format!(
        "perftest: device {name} is not in FERROCE_VM_DEVS ({devs:?}); use --no-perftest"
    ))?;
    let pick = |v: Vec<String>, what: &str| {
        v.get(i).cloned().ok_or(format!("perftest: no {what} for {name} (index {i})"))
    };
    Ok(Port {
        name: name.into(),
        gid: pick(list("FERROCE_VM_GIDX", "1 1"), "FERROCE_VM_GIDX")?,
        ip: pick(list("FERROCE_VM_IPS", "198.18.0.1 198.18.0.2"), "FERROCE_VM_IPS")?,
    })
}

/// One perftest pair: server on the receiving device, client on the sending one, each under
/// `timeout` (perftest's retry count 7 means "forever" on rxe). `label` names a column that
/// must be in the output, so a different layout is an error, not a wrong number.
pub struct Perftest<'a> {
    pub tx: &'a Port,
    pub rx: &'a Port,
    pub limit: u64,
    pub label: &'a str,
}

/// Columns of perftest's result rows: `#bytes #iterations BW-peak BW-average MsgRate` for
/// bandwidth, `#bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%` for latency.
pub const BW_AVERAGE: usize = 3;
pub const T_MIN: usize = 2;
pub const T_TYPICAL: usize = 4;
pub const T_AVG: usize = 5;

impl Perftest<'_> {
    /// Columns `cols` of the result row. A zero in the first (nothing completed while perftest
    /// sampled: rxe stalls now and then) gets one more try, then counts as no result (NaN).
    pub fn run(&self, tool: &str, extra: &[&str], cols: &[usize]) -> Result<Vec<f64>, String> {
        for _ in 0..2 {
            let (row, _) = self.once(tool, extra)?;
            let v = cols
                .iter()
                .map(|&c| row.get(c).copied().ok_or(format!("{tool}: no column {c} in {row:?}")))
                .collect::<Result<Vec<f64>, String>>()?;
            if v.first().is_some_and(|&x| x > 0.0) {
                return Ok(v);
            }
            eprintln!(
                "# {tool} {}: 0 measured (nothing completed while it sampled)",
                extra.join(" ")
            );
        }
        eprintln!("# {tool} {}: no result; left out of the statistics", extra.join(" "));
        Ok(vec![f64::NAN; cols.len()])
    }

    /// The result row, and how long the client ran by the wall clock.
    fn once(&self, tool: &str, extra: &[&str]) -> Result<(Vec<f64>, Duration), String> {
        let (limit, rx, tx) = (self.limit.to_string(), self.rx, self.tx);
        let cmd = |p: &Port| {
            let mut c = Command::new("timeout");
            c.args(["-k", "5", &limit, tool, "-d", &p.name, "-x", &p.gid, "-F"]).args(extra);
            c
        };
        let mut server = cmd(rx)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{tool}: {e}"))?;
        // The client must not connect before the server listens on perftest's TCP port.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match Command::new("ss").args(["-Hltn", "sport = :18515"]).output() {
                Ok(o) if !o.stdout.is_empty() => break,
                Ok(_) if Instant::now() < deadline && matches!(server.try_wait(), Ok(None)) => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Ok(_) => {
                    terminate(&mut server);
                    return Err(format!("{tool} server on {} did not listen on :18515", rx.name));
                }
                Err(e) => {
                    terminate(&mut server);
                    return Err(format!("ss: {e}"));
                }
            }
        }
        let t0 = Instant::now();
        let out = cmd(tx).arg(&rx.ip).output();
        let wall = t0.elapsed();
        terminate(&mut server);
        let out = out.map_err(|e| format!("{tool}: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let (t, r) = (&tx.name, &rx.name);
            return Err(format!("{tool} {t} -> {r} failed ({}): {text}{err}", out.status));
        }
        if !text.contains(self.label) {
            return Err(format!("{tool}: no {:?} column in its output: {text}", self.label));
        }
        let row = text
            .lines()
            .rev()
            .map(|l| l.split_whitespace().map_while(|w| w.parse::<f64>().ok()).collect::<Vec<_>>())
            .find(|v| v.len() >= 5)
            .ok_or_else(|| format!("no result row from {tool}: {text}"))?;
        Ok((row, wall))
    }
}

/// perftest's clock against the wall clock: what `ib_write_lat -s 8` reports for the extra
/// iterations of a longer run, and their wall time.
pub struct Clock {
    /// The client's wall time of each run, in seconds.
    pub walls: (f64, f64),
    /// t_avg of each run, in us.
    pub avgs: (f64, f64),
    /// The extra iterations' wall time, per iteration and one way, in us.
    pub wall_us: f64,
    /// What perftest reported for them: its total for the longer run minus its total for the
    /// shorter, per extra iteration, in us.
    pub reported_us: f64,
}

/// Times [`CLOCK_ITERS`] iterations of `ib_write_lat -s 8` (see the module docs). Setup and
/// teardown take the same time in both runs, so the difference is the extra iterations alone.
pub fn clock_check(tx: &Port, rx: &Port) -> Result<Clock, String> {
    let pt = Perftest { tx, rx, limit: 120, label: "t_avg" };
    let run = |n: usize| -> Result<(f64, f64), String> {
        let (row, wall) = pt.once("ib_write_lat", &["-s", "8", "-n", &n.to_string()])?;
        let avg = row.get(T_AVG).copied().ok_or(format!("ib_write_lat: no t_avg in {row:?}"))?;
        Ok((wall.as_secs_f64(), avg))
    };
    let (a, b) = CLOCK_ITERS;
    let ((wa, ta), (wb, tb)) = (run(a)?, run(b)?);
    let extra = (b - a) as f64;
    Ok(Clock {
        walls: (wa, wb),
        avgs: (ta, tb),
        // A client iteration is one round trip: half of it is one way, as t_avg is.
        wall_us: (wb - wa) * 1e6 / extra / 2.0,
        reported_us: (b as f64 * tb - a as f64 * ta) / extra,
    })
}

impl Clock {
    pub fn line(&self) -> String {
        let (a, b) = CLOCK_ITERS;
        // The ratio is wall / perftest: above 1, perftest's clock runs slow.
        format!(
            "# perftest clock check: ib_write_lat -n {b} minus -n {a}, one way per iteration: \
             wall {} us, perftest {} us, ratio {}",
            fixed(self.wall_us, 1),
            fixed(self.reported_us, 1),
            fixed(ratio(self.wall_us, self.reported_us), 3)
        )
    }
}
