//! The transfers of `ferroce doctor`: `--selftest` between two local ports in this process, and
//! `--peer` through the ranks of `ferroce perf` ([`crate::rank`]) to a `ferroce perf --listen`
//! on another host. Both go through the plugin's C ABI, as NCCL would.

use std::collections::BTreeMap;
use std::time::Instant;

use ferroce_tools::buffer::HostBuf;
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::loader::{ECHO, Library, beside_me};
use ferroce_tools::rank::pair;
use ferroce_tools::wait::until;

use super::checks::check_peer_mtu;
use super::{Args, Level, SELFTEST_DEPTH, SELFTEST_LIMIT, SELFTEST_MSG, SELFTEST_MSGS};
use crate::ports::{Port, PortFacts, counter_map};
use crate::rank::pair::Pair;

/// What a self-test measured.
pub struct SelfTest {
    pub from: String,
    pub to: String,
    /// Messages and their size, timed in `seconds`.
    pub msgs: usize,
    pub msg: usize,
    pub seconds: f64,
    /// How the data was checked.
    pub verified: &'static str,
    /// (port, counter, delta) for every counter that moved.
    pub deltas: Vec<(String, String, u64)>,
}

impl SelfTest {
    pub fn bytes(&self) -> usize {
        self.msgs * self.msg
    }
}

/// The self-test's sender: the first NCCL device `--dev` names (a device or a `dev:port`),
/// else NCCL's device 0. An index into `nccl`.
pub fn sender(dev: Option<&str>, nccl: &[(String, String)]) -> Result<usize, String> {
    let keys: Vec<&str> = nccl.iter().map(|(k, _)| k.as_str()).collect();
    let Some(want) = dev else {
        return if keys.is_empty() { Err("the plugin offers no device".into()) } else { Ok(0) };
    };
    keys.iter()
        .position(|k| *k == want || k.rsplit_once(':').is_some_and(|(d, _)| d == want))
        .ok_or_else(|| format!("--dev {want}: not among the devices the plugin offers {keys:?}"))
}

/// Counter deltas of `key` (`dev:port`) since `before`.
fn deltas(key: &str, before: &BTreeMap<String, u64>) -> Vec<(String, String, u64)> {
    let mut out = Vec::new();
    for (k, v) in counter_map(key) {
        let was = before.get(&k).copied().unwrap_or(0);
        if v != was {
            out.push((key.to_string(), k, v.wrapping_sub(was)));
        }
    }
    out
}

/// Sends from NCCL's device `send_dev` to the next one NCCL sees, in this process.
pub fn local_selftest(
    plugin: &str,
    nccl: &[(String, String)],
    send_dev: usize,
) -> Result<SelfTest, String> {
    let lib = open_plugin(plugin)?;
    ECHO.store(false, std::sync::atomic::Ordering::Relaxed);
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(1)?;
    let n = drv.devices()?;
    let name = |d: i32| nccl.get(d as usize).map_or(format!("device {d}"), |(k, _)| k.clone());
    if n < 2 {
        drv.finalize(ctx)?;
        return Err(format!(
            "the plugin offers {n} device(s) ({}): a local self-test needs a second one to \
             receive; or run `ferroce perf --listen` on another host and pass --peer HOST:PORT",
            name(0)
        ));
    }
    let send_dev = send_dev as i32;
    let recv_dev = (send_dev + 1) % n;
    let before = [send_dev, recv_dev].map(|d| counter_map(&name(d)));
    let (send, recv) = pair(&drv, ctx, recv_dev, send_dev, SELFTEST_LIMIT)?;
    let (seconds, ok) = send_messages(&drv, send, recv)?;
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)?;
    drv.finalize(ctx)?;
    if !ok {
        return Err("self-test: the data arrived corrupted".into());
    }
    let mut deltas = deltas(&name(send_dev), &before[0]);
    deltas.extend(self::deltas(&name(recv_dev), &before[1]));
    Ok(SelfTest {
        from: name(send_dev),
        to: name(recv_dev),
        msgs: SELFTEST_MSGS,
        msg: SELFTEST_MSG,
        seconds,
        verified: "every byte received matches the bytes sent",
        deltas,
    })
}

/// Sends [`SELFTEST_MSGS`] messages from `send` to `recv`, up to [`SELFTEST_DEPTH`] in flight
/// as NCCL keeps several (receives posted first): the seconds taken, and whether the data
/// arrived intact. One thread drives both comms as NCCL's proxy does: each pass posts what it
/// can, then tests; a send whose receive's CTS row is not out yet waits while the receiving
/// comm is tested (ferroce writes CTS rows in batches when the receiver is progressed).
fn send_messages(drv: &Driver, send: Ptr, recv: Ptr) -> Result<(f64, bool), String> {
    let (src, dst) = (HostBuf::patterned(SELFTEST_MSG, 0), HostBuf::new(SELFTEST_MSG));
    let smh = drv.reg_mr(send, src.ptr(), SELFTEST_MSG)?;
    let rmh = drv.reg_mr(recv, dst.ptr(), SELFTEST_MSG)?;
    let t0 = Instant::now();
    let deadline = t0 + SELFTEST_LIMIT;
    let (mut posted, mut done) = (0, 0);
    let mut flight = std::collections::VecDeque::new();
    // A receive posted whose send the plugin has not taken yet.
    let mut unsent = None;
    while done < SELFTEST_MSGS {
        if Instant::now() > deadline {
            return Err(format!(
                "self-test: {done} of {SELFTEST_MSGS} messages within {SELFTEST_LIMIT:?}"
            ));
        }
        if unsent.is_none() && posted < SELFTEST_MSGS && flight.len() < SELFTEST_DEPTH {
            unsent = Some(until("irecv", SELFTEST_LIMIT, || {
                drv.irecv(recv, &[dst.ptr()], &[SELFTEST_MSG], &[0], &[rmh], false)
            })?);
        }
        if let Some(r) = unsent {
            match drv.isend(send, src.ptr(), SELFTEST_MSG, 0, smh)? {
                Some(s) => {
                    flight.push_back((Some(s), Some(r)));
                    posted += 1;
                    unsent = None;
                }
                // Its row is not out yet: progress the receiving comm (the receive cannot be
                // complete before its send).
                None if drv.test(r)?.is_some() => {
                    return Err("self-test: a receive completed before its send".into());
                }
                None => {}
            }
        }
        if let Some((s, r)) = flight.front_mut() {
            for q in [s, r] {
                if let Some(req) = *q
                    && drv.test(req)?.is_some()
                {
                    *q = None;
                }
            }
            if flight.front().is_some_and(|(s, r)| s.is_none() && r.is_none()) {
                flight.pop_front();
                done += 1;
            }
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    let ok = dst.check(0..SELFTEST_MSG, 0).is_ok();
    drv.dereg_mr(send, smh)?;
    drv.dereg_mr(recv, rmh)?;
    Ok((seconds, ok))
}

/// What `--peer` learnt: the two ends' facts (each missing where it could not be read).
pub struct PeerReport {
    pub addr: String,
    pub here: Option<PortFacts>,
    pub there: Option<PortFacts>,
    /// The plugin connected the two ends.
    pub connected: bool,
}

/// `--peer`: the peer's facts beside ours, their comparison, a connection through the plugin
/// and (with `--selftest`) a verified transfer to it, by perf's ranks and control connection.
pub fn with_peer(
    addr: &str,
    opts: &Args,
    (key, name): &(String, String),
    ports: &[Port],
    add: &mut impl FnMut(Level, &str, String),
) -> (PeerReport, Option<SelfTest>) {
    let here = ports.iter().find(|p| &p.key() == key).map(PortFacts::of);
    let mut rep = PeerReport { addr: addr.into(), here, there: None, connected: false };
    let before = counter_map(key);
    let plugin = plugin_path(&opts.plugin);
    let r = (|| {
        let mut pair = Pair::to_peer(addr, &plugin, name)?;
        let there = rep.there.insert(PortFacts::decode(&pair.port()?)?);
        if let Some(here) = &rep.here {
            check_peer_mtu(here, there, addr, add);
        }
        pair.connect()?;
        rep.connected = true;
        let bw = if opts.selftest {
            let msgs = Some(SELFTEST_MSGS as u64);
            let secs = SELFTEST_LIMIT.as_secs_f64();
            Some(pair.bw(SELFTEST_MSG, SELFTEST_DEPTH, secs, 0.0, msgs)?)
        } else {
            None
        };
        pair.quit()?;
        Ok::<_, String>(bw.map(|(bytes, seconds)| SelfTest {
            from: key.clone(),
            to: format!("{} at {addr}", rep.there.as_ref().map_or(name, |t| &t.port)),
            msgs: (bytes / SELFTEST_MSG as f64).round() as usize,
            msg: SELFTEST_MSG,
            seconds,
            verified: "every receive's length checked, the last message byte for byte (by the peer)",
            deltas: deltas(key, &before),
        }))
    })();
    match r {
        Ok(s) => (rep, s),
        Err(e) => {
            add(Level::Block, "peer", e);
            (rep, None)
        }
    }
}

/// The plugin as NCCL would open it, else (a bare name) `libnccl-net-NAME.so` beside this
/// binary, where `ci/build.sh` puts it.
fn open_plugin(name: &str) -> Result<Library, String> {
    Library::open_like_nccl(&plugin_path(name))
}

/// What [`open_plugin`] opens: `name` where NCCL's way finds it, else the path beside this
/// binary (for the ranks of `--peer`, which open the plugin themselves).
fn plugin_path(name: &str) -> String {
    if name.contains('/') || Library::open_like_nccl(name).is_ok() {
        return name.into();
    }
    beside_me(&format!("libnccl-net-{name}.so")).unwrap_or_else(|| name.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selftest_sender_is_the_dev_one_or_the_first() {
        let nccl: Vec<(String, String)> = [("rxe0:1", "rxe0"), ("mlx5_0:1", "mlx5_0:1")]
            .iter()
            .map(|(k, n)| (k.to_string(), n.to_string()))
            .collect();
        assert_eq!(sender(None, &nccl), Ok(0));
        assert_eq!(sender(Some("mlx5_0"), &nccl), Ok(1));
        assert_eq!(sender(Some("rxe0:1"), &nccl), Ok(0));
        assert!(sender(Some("rxe9"), &nccl).unwrap_err().contains("rxe9"));
        assert!(sender(None, &[]).is_err());
    }
}
