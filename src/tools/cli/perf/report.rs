//! What `ferroce perf` prints: the tables (each number the median over the rounds, with the
//! spread and the ratios to perftest) or one JSON object with every round's numbers.

use ferroce_tools::out::{self, Table, fixed, mean, median, ratio, spread};
use ferroce_tools::wait::NCCL_APPENDOP_FREQ;
use serde_json::json;

use super::perftest::{CLOCK_ITERS, Clock};
use super::{BwRow, LatRow, Mode, Plan, WINDOW_BYTES, window};
use crate::rank::MAX;

/// A rank's device: its name, index among the plugin's devices, and host.
pub struct Dev<'a> {
    pub name: &'a str,
    pub index: &'a str,
    pub host: &'a str,
}

/// What the tables and the JSON say about the run as a whole.
pub struct Header<'a> {
    pub plan: &'a Plan<'a>,
    pub tx: Dev<'a>,
    pub rx: Dev<'a>,
    pub clock: Option<Clock>,
}

/// `min-max` of `v`, or `-` where nothing was measured.
fn range(v: &[f64], prec: usize) -> String {
    let (a, b) = spread(v);
    if a.is_finite() { format!("{}-{}", fixed(a, prec), fixed(b, prec)) } else { "-".into() }
}

/// A heading over groups of a table's columns: each `(columns, name)` spans that many columns
/// (the gaps between them included), right-aligned.
fn groups(t: &Table, spans: &[(usize, &str)]) -> String {
    let mut widths = Vec::with_capacity(spans.len());
    let mut cols = t.widths.iter();
    for &(n, _) in spans {
        let w: usize = cols.by_ref().take(n).sum();
        widths.push(w + (n - 1) * t.gap);
    }
    let names: Vec<&str> = spans.iter().map(|&(_, name)| name).collect();
    Table { widths: &widths, gap: t.gap }.line('#', &names)
}

/// The tables: what was run and how, the bandwidth table, the latency table.
pub fn print_table(h: &Header, bw: &[BwRow], lat: &[LatRow]) {
    print_setup(h);
    print_bw(h, bw);
    println!();
    print_lat(h, lat);
    if let Some(v) = &h.plan.o.versus {
        println!();
        print_versus(v, bw, lat);
    }
}

/// The `--versus` plugin beside this one: bandwidth, then p50 latency, each a median over the
/// rounds, measured right after this plugin's in each round.
fn print_versus(versus: &str, bw: &[BwRow], lat: &[LatRow]) {
    println!("# versus {versus}: measured the same way, right after this plugin, size by size");
    let t = Table { widths: &[9, 11, 11, 7], gap: 2 };
    println!("{}", t.line('#', &["size", "this", "versus", "ratio"]));
    println!("{}", t.line('#', &["(B)", "(Gb/s)", "(Gb/s)", ""]));
    for r in bw {
        let (a, b) = (median(&r.ours), median(&r.versus));
        let cells = [r.size.to_string(), fixed(a, 4), fixed(b, 4), fixed(ratio(a, b), 2)];
        println!("{}", t.line(' ', &cells.each_ref().map(String::as_str)));
    }
    let t = Table { widths: &[9, 9, 9, 7, 9, 9, 7], gap: 2 };
    println!(
        "{}",
        t.line('#', &["size", "this p50", "versus", "ratio", "this LL", "versus", "ratio"])
    );
    println!("{}", t.line('#', &["(B)", "(us)", "(us)", "", "(us)", "(us)", ""]));
    for r in lat {
        let (a, b) = (median(&r.simple.p50), median(&r.versus.p50));
        let (c, d) = (median(&r.ll.p50), median(&r.versus_ll.p50));
        let cells = [
            r.size.to_string(),
            fixed(a, 1),
            fixed(b, 1),
            fixed(ratio(a, b), 2),
            fixed(c, 1),
            fixed(d, 1),
            fixed(ratio(c, d), 2),
        ];
        println!("{}", t.line(' ', &cells.each_ref().map(String::as_str)));
    }
}

/// The lines above the tables: the ranks, how they poll, perftest and the rounds.
fn print_setup(h: &Header) {
    let o = h.plan.o;
    let hosts = if o.mode == Mode::Local { "one host" } else { "two hosts" };
    println!("# ferroce perf: plugin {}, two processes, {hosts}", o.plugin);
    println!(
        "#   rank 0 sends on {} (dev {}, {}), rank 1 receives on {} (dev {}, {})",
        h.tx.name, h.tx.index, h.tx.host, h.rx.name, h.rx.index, h.rx.host
    );
    println!("#   every receive checked for its length, the last of each run byte for byte");
    println!(
        "#   polled as NCCL's proxy: {} receives posted ahead, one irecv each; a pass posts, \
         then tests the",
        o.depth
    );
    println!(
        "#   oldest request of each direction once; yield after an idle pass and after every \
         {NCCL_APPENDOP_FREQ}th busy one"
    );
    if o.mode != Mode::Local {
        println!("#   perftest: skipped with two hosts (it needs both devices on one host)");
    } else if !o.perftest {
        println!("#   perftest: skipped (--no-perftest)");
    } else {
        println!("#   each size: ferroce, then at once perftest on the same devices (-F)");
    }
    println!(
        "#   {} round(s); a number is the median over the rounds, min-max their spread; \
         ratio: ferroce / perftest",
        o.rounds
    );
    println!("#   --json: every round's numbers, and each one's median, mean, min and max");
}

/// The bandwidth table, with the lines that say how it was measured.
fn print_bw(h: &Header, bw: &[BwRow]) {
    let (plan, o) = (h.plan, h.plan.o);
    if let Some(c) = &h.clock {
        println!("{}", c.line());
    }
    println!(
        "#   bandwidth: algbw on the receiver's clock, {} s per size after {:.2} s warm-up \
         (mean: ferroce's over the rounds),",
        o.seconds, plan.warm
    );
    println!(
        "#   {} receives posted ahead and as many sends in flight (fewer where that passes {} MiB: \
         {} at 8 MiB);",
        o.depth,
        WINDOW_BYTES >> 20,
        window(MAX, o.depth)
    );
    println!("#   perftest -D {} --report_gbits, BW average", plan.pt_secs);
    let q = plan.lanes > 1;
    if q {
        println!(
            "#   the ranks use {} lanes (NCCL_IB_QPS_PER_CONNECTION): also ib_write_bw -q {} -t W/{} \
             (W: ferroce's window, so both have the same bytes in flight)",
            plan.lanes, plan.lanes, plan.lanes
        );
    }
    let widths: &[usize] = &[9, 9, 9, 15, 11, 15, 10, 5, 11, 6];
    let t = Table { widths: if q { widths } else { &widths[..8] }, gap: 2 };
    let qn = format!("-q {}", plan.lanes);
    println!(
        "{}",
        t.line(
            '#',
            &[
                "size",
                "ferroce",
                "mean",
                "min-max",
                "ib_write_bw",
                "min-max",
                "ib_send_bw",
                "ratio",
                "ib_write_bw",
                "ratio"
            ]
        )
    );
    let unit = "(Gb/s)";
    let units = ["(B)", unit, unit, unit, unit, unit, unit, "", &format!("{qn} {unit}"), &qn];
    println!("{}", t.line('#', &units).trim_end());
    for r in bw {
        let (m, w, wq) = (median(&r.ours), median(&r.write), median(&r.write_q));
        let cells = [
            r.size.to_string(),
            fixed(m, 4),
            fixed(mean(&r.ours), 4),
            range(&r.ours, 4),
            fixed(w, 4),
            range(&r.write, 4),
            fixed(median(&r.send), 4),
            fixed(ratio(m, w), 2),
            fixed(wq, 4),
            fixed(ratio(m, wq), 2),
        ];
        println!("{}", t.line(' ', &cells));
    }
}

/// The latency table, with the lines that say how it was measured.
fn print_lat(h: &Header, lat: &[LatRow]) {
    let o = h.plan.o;
    println!(
        "#   latency: ping-pong, half the round trip; {} iterations after {} warm-up, {} \
         receives posted ahead;",
        o.iters,
        o.iters / 10,
        o.depth
    );
    println!(
        "#   Simple: receives complete through the plugin; LL: optional receives, arrival seen \
         by a flag in the data"
    );
    println!(
        "#   p50 and mean: of a round's samples (perftest -n {}: t_typical and t_avg); min: the \
         fastest of all rounds",
        o.iters
    );
    let t = Table { widths: &[7, 7, 7, 11, 6, 7, 7, 7, 7, 7, 7, 5, 5, 6, 7], gap: 1 };
    let spans = [
        (1, ""),
        (4, "ferroce Simple"),
        (2, "ferroce LL"),
        (2, "ib_write_lat"),
        (2, "ib_send_lat"),
        (4, "ratio vs ib_write_lat"),
    ];
    println!("{}", groups(&t, &spans));
    let head = [
        "size",
        "p50",
        "mean",
        "p50 min-max",
        "min",
        "p50",
        "mean",
        "p50",
        "mean",
        "p50",
        "mean",
        "p50",
        "mean",
        "LL p50",
        "LL mean",
    ];
    println!("{}", t.line('#', &head));
    let us = "(us)";
    let units = ["(B)", us, us, us, us, us, us, us, us, us, us, "", "", "", ""];
    println!("{}", t.line('#', &units).trim_end());
    for r in lat {
        let (p, a) = (median(&r.simple.p50), median(&r.simple.avg));
        let (lp, la) = (median(&r.ll.p50), median(&r.ll.avg));
        let (wp, wa) = (median(&r.write.p50), median(&r.write.avg));
        let cells = [
            r.size.to_string(),
            fixed(p, 1),
            fixed(a, 1),
            range(&r.simple.p50, 1),
            fixed(spread(&r.simple.min).0, 1),
            fixed(lp, 1),
            fixed(la, 1),
            fixed(wp, 1),
            fixed(wa, 1),
            fixed(median(&r.send.p50), 1),
            fixed(median(&r.send.avg), 1),
            fixed(ratio(p, wp), 2),
            fixed(ratio(a, wa), 2),
            fixed(ratio(lp, wp), 2),
            fixed(ratio(la, wa), 2),
        ];
        println!("{}", t.line(' ', &cells));
    }
}

/// `key`: every round's numbers; `key_median`, `key_mean`, `key_min`, `key_max`: over them.
fn put(m: &mut serde_json::Map<String, serde_json::Value>, key: &str, v: &[f64]) {
    let (lo, hi) = spread(v);
    m.insert(key.into(), json!(v));
    for (stat, x) in [("median", median(v)), ("mean", mean(v)), ("min", lo), ("max", hi)] {
        m.insert(format!("{key}_{stat}"), json!(x));
    }
}

/// Every round's numbers, as one JSON object; a number that was not measured is `null`.
pub fn print_json(h: &Header, bw: &[BwRow], lat: &[LatRow]) {
    let (plan, o) = (h.plan, h.plan.o);
    let bw: Vec<_> = bw
        .iter()
        .map(|r| {
            let mut m = serde_json::Map::new();
            m.insert("size".into(), json!(r.size));
            m.insert("window".into(), json!(r.window));
            put(&mut m, "ferroce_gbps", &r.ours);
            m.insert("ferroce_bytes".into(), json!(r.bytes));
            m.insert("ferroce_seconds".into(), json!(r.secs));
            put(&mut m, "ib_write_bw_gbps", &r.write);
            put(&mut m, "ib_send_bw_gbps", &r.send);
            let ours = median(&r.ours);
            m.insert("ratio".into(), json!(ratio(ours, median(&r.write))));
            if plan.lanes > 1 {
                put(&mut m, "ib_write_bw_q_gbps", &r.write_q);
                m.insert("ratio_q".into(), json!(ratio(ours, median(&r.write_q))));
            }
            if o.versus.is_some() {
                put(&mut m, "versus_gbps", &r.versus);
            }
            serde_json::Value::Object(m)
        })
        .collect();
    let lat: Vec<_> = lat
        .iter()
        .map(|r| {
            let mut m = serde_json::Map::new();
            m.insert("size".into(), json!(r.size));
            let series = [
                ("ferroce", &r.simple),
                ("ferroce_ll", &r.ll),
                ("ib_write_lat", &r.write),
                ("ib_send_lat", &r.send),
            ];
            let versus = [("versus", &r.versus), ("versus_ll", &r.versus_ll)];
            let versus = if o.versus.is_some() { &versus[..] } else { &[] };
            for (name, s) in series.into_iter().chain(versus.iter().copied()) {
                put(&mut m, &format!("{name}_p50_us"), &s.p50);
                put(&mut m, &format!("{name}_mean_us"), &s.avg);
                put(&mut m, &format!("{name}_min_us"), &s.min);
            }
            let (wp, wa) = (median(&r.write.p50), median(&r.write.avg));
            for (name, s) in [("ratio", &r.simple), ("ll_ratio", &r.ll)] {
                m.insert(format!("{name}_p50"), json!(ratio(median(&s.p50), wp)));
                m.insert(format!("{name}_mean"), json!(ratio(median(&s.avg), wa)));
            }
            serde_json::Value::Object(m)
        })
        .collect();
    let clock = h.clock.as_ref().map(|c| {
        json!({
            "tool": "ib_write_lat -s 8",
            "iters": [CLOCK_ITERS.0, CLOCK_ITERS.1],
            "wall_seconds": [c.walls.0, c.walls.1],
            "t_avg_us": [c.avgs.0, c.avgs.1],
            "wall_us_per_iter": c.wall_us,
            "perftest_us_per_iter": c.reported_us,
            "ratio": ratio(c.wall_us, c.reported_us),
        })
    });
    let dev = |d: &Dev| json!({"dev": d.index, "name": d.name, "host": d.host});
    out::print_json(&json!({
        "plugin": o.plugin,
        "versus": o.versus,
        "sender": dev(&h.tx),
        "receiver": dev(&h.rx),
        "rounds": o.rounds,
        "depth": o.depth,
        "lanes": plan.lanes,
        "yield_busy_every": NCCL_APPENDOP_FREQ,
        "seconds": o.seconds,
        "warmup_seconds": plan.warm,
        "perftest": o.perftest,
        "perftest_seconds": plan.pt_secs,
        "clock_check": clock,
        "lat_iters": o.iters,
        "lat_warmup": o.iters / 10,
        "bandwidth": bw,
        "latency": lat,
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[f64::NAN, 1.0]), 1.0);
        assert!(median(&[]).is_nan());
        assert_eq!(mean(&[1.0, 2.0, 6.0]), 3.0);
        assert_eq!(mean(&[f64::NAN, 4.0, 2.0]), 3.0);
        assert!(mean(&[f64::NAN]).is_nan());
        assert_eq!(spread(&[2.0, f64::NAN, 5.0, 1.0]), (1.0, 5.0));
        assert!(spread(&[f64::NAN]).0.is_nan());
        assert_eq!(range(&[], 1), "-");
        assert_eq!(range(&[2.25, 1.0], 1), "1.0-2.2");
        assert!(ratio(1.0, 0.0).is_nan());
        assert_eq!(ratio(3.0, 2.0), 1.5);
    }

    #[test]
    fn group_headings_span_their_columns() {
        let t = Table { widths: &[4, 3, 3, 5], gap: 1 };
        let g = groups(&t, &[(1, ""), (2, "ab"), (1, "c")]);
        assert_eq!(g, "#         ab     c");
        assert_eq!(g.len(), t.line(' ', &["1", "2", "3", "4"]).len());
    }

    #[test]
    fn json_series_carry_rounds_and_their_statistics() {
        let mut m = serde_json::Map::new();
        put(&mut m, "x", &[3.0, f64::NAN, 1.0]);
        let v = serde_json::Value::Object(m).to_string();
        assert_eq!(
            v,
            r#"{"x":[3.0,null,1.0],"x_median":2.0,"x_mean":2.0,"x_min":1.0,"x_max":3.0}"#
        );
        let mut m = serde_json::Map::new();
        put(&mut m, "y", &[]);
        let v = serde_json::Value::Object(m).to_string();
        assert_eq!(v, r#"{"y":[],"y_median":null,"y_mean":null,"y_min":null,"y_max":null}"#);
    }
}
