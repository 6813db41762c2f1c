//! A comm's statistics line: what it moved, over which UDP source ports, with how many failed
//! completions, and how the device's hardware counters moved over its life. Logged at INFO when
//! the comm closes, and every `FERROCE_STATS_INTERVAL_S` while it lives.

use std::fmt::Write;
use std::time::Duration;

use ferroce_core::data::Traffic;

/// The counters that grew between `before` and `after` (both sorted by name), with how much.
pub fn grown(before: &[(String, u64)], after: &[(String, u64)]) -> Vec<(String, u64)> {
    after
        .iter()
        .filter_map(|(name, now)| {
            let was = before.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v);
            (*now > was).then(|| (name.clone(), now - was))
        })
        .collect()
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// One line: `what` (e.g. "send comm to 198.18.0.2:4000"), its traffic over `life`, each QP's
/// source port, bytes, share and failed completions, and the device's counters that grew.
pub fn line(
    what: &str,
    t: &Traffic,
    sports: &[u16],
    life: Duration,
    device: &str,
    counters: &[(String, u64)],
) -> String {
    let total = t.total();
    let secs = life.as_secs_f64();
    let mut s = format!(
        "{what}: {} messages, {:.1} MiB in {secs:.1} s ({:.1} MiB/s)",
        t.messages,
        mib(total),
        if secs > 0.0 { mib(total) / secs } else { 0.0 }
    );
    let sent = t.sum(|l| l.bytes);
    for (q, l) in t.lanes.iter().enumerate() {
        let port = sports.get(q).copied().unwrap_or(0);
        let _ = write!(s, "; QP {q} sport {port}: ");
        // The sender's: bytes and share; the receiver cannot tell how a message was cut.
        if sent > 0 {
            let share = 100.0 * l.bytes as f64 / sent as f64;
            let _ = write!(s, "{:.1} MiB ({share:.1}%), ", mib(l.bytes));
        }
        let _ = write!(s, "{} failed completions, {} chunks", l.errors, l.chunks);
        if let Some(rate) = l.rate {
            let _ = write!(s, ", path {:.1} MiB/s", rate / f64::from(1 << 20));
        }
        for (n, what) in [(l.stalled, "stalled"), (l.fenced, "fenced"), (l.repaired, "repaired")] {
            if n > 0 {
                let _ = write!(s, ", {what} {n} time(s)");
            }
        }
        match (l.down, l.kept_out) {
            (true, true) => s.push_str(", out (failed; it stays out)"),
            (true, false) => s.push_str(", out (failed)"),
            _ => {}
        }
    }
    // The sender's shares per message size (with lanes to share): a lane starved at some
    // sizes shows here, where the totals would hide it.
    let classes = ["under 64 KiB", "64 KiB to 1 MiB", "1 MiB and up"];
    if t.lanes.len() > 1 {
        for (k, class) in classes.iter().enumerate() {
            let total = t.sum(|l| l.by_size[k]);
            if total == 0 {
                continue;
            }
            let shares = t.each(|l| format!("{:.1}", 100.0 * l.by_size[k] as f64 / total as f64));
            let _ = write!(s, "; messages {class}: {}% per QP", shares.join("/"));
        }
    }
    if counters.is_empty() {
        let _ = write!(s, "; {device} hw_counters: none moved (or none exposed)");
    } else {
        let list: Vec<String> = counters.iter().map(|(n, d)| format!("{n} +{d}")).collect();
        let _ = write!(s, "; {device} hw_counters over this time: {}", list.join(", "));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferroce_core::data::LaneTraffic;

    fn c(v: &[(&str, u64)]) -> Vec<(String, u64)> {
        v.iter().map(|(n, x)| (n.to_string(), *x)).collect()
    }

    #[test]
    fn only_counters_that_grew_are_kept_with_their_growth() {
        let before = c(&[("duplicate_request", 5), ("rcvd_seq_err", 2), ("retry_exceeded_err", 0)]);
        let after = c(&[("duplicate_request", 5), ("rcvd_seq_err", 9), ("new_counter", 3)]);
        assert_eq!(grown(&before, &after), c(&[("rcvd_seq_err", 7), ("new_counter", 3)]));
        assert!(grown(&after, &after).is_empty());
    }

    #[test]
    fn the_line_gives_each_qps_port_share_and_errors() {
        let t = Traffic {
            messages: 12,
            lanes: vec![
                LaneTraffic {
                    bytes: 3 << 20,
                    chunks: 9,
                    rate: Some(2.5 * f64::from(1 << 20)),
                    repaired: 1,
                    fenced: 1,
                    stalled: 1,
                    by_size: [1 << 20, 0, 2 << 20],
                    ..LaneTraffic::default()
                },
                LaneTraffic {
                    bytes: 1 << 20,
                    chunks: 3,
                    errors: 2,
                    down: true,
                    kept_out: true,
                    by_size: [1 << 20, 0, 0],
                    ..LaneTraffic::default()
                },
            ],
            ..Traffic::default()
        };
        let l = line(
            "send comm to 198.18.0.2:4000",
            &t,
            &[49152, 49153],
            Duration::from_secs(2),
            "rxe0",
            &c(&[("rcvd_seq_err", 4)]),
        );
        assert_eq!(
            l,
            "send comm to 198.18.0.2:4000: 12 messages, 4.0 MiB in 2.0 s (2.0 MiB/s); \
             QP 0 sport 49152: 3.0 MiB (75.0%), 0 failed completions, 9 chunks, path 2.5 MiB/s, \
             stalled 1 time(s), fenced 1 time(s), repaired 1 time(s); \
             QP 1 sport 49153: 1.0 MiB (25.0%), 2 failed completions, 3 chunks, out (failed; it \
             stays out); messages under 64 KiB: 50.0/50.0% per QP; messages 1 MiB and up: \
             100.0/0.0% per QP; \
             rxe0 hw_counters over this time: rcvd_seq_err +4"
        );
        // The receiver's: bytes delivered, and per QP the chunks that arrived on it.
        let lane = |chunks| LaneTraffic { chunks, ..LaneTraffic::default() };
        let t = Traffic { messages: 2, delivered: 3 << 20, lanes: vec![lane(2), lane(1)] };
        let l = line("receive comm from x", &t, &[7, 8], Duration::from_secs(1), "rxe1", &[]);
        assert!(
            l.contains("2 messages, 3.0 MiB in 1.0 s")
                && l.contains("QP 0 sport 7: 0 failed completions, 2 chunks; QP 1 sport 8: 0"),
            "{l}"
        );
        let idle = line("x", &Traffic::default(), &[], Duration::ZERO, "rxe1", &[]);
        assert!(idle.contains("0 messages, 0.0 MiB") && idle.contains("none moved"), "{idle}");
    }
}
