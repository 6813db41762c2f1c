//! `ferroce perf`: two ranks through the plugin's C ABI (v12, loaded with `dlopen` as NCCL does),
//! one thread each, on two RDMA devices; then perftest `ib_write_bw`/`ib_write_lat` between the
//! same devices in the same run, and the ratio per size.
//!
//! Bandwidth: the receiver keeps 32 receives posted and the sender 32 sends in flight, as NCCL's
//! proxy does; algbw = bytes / time. Latency: ping-pong over two connections (one each way),
//! half the round trip, median of the iterations (perftest's `t_typical`).

use std::ffi::c_int;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferroce::ffi::driver::{self, Close, Driver, Ptr};

/// How long one step may make no progress.
const STEP: Duration = Duration::from_secs(120);

fn until<T>(what: &str, f: impl FnMut() -> Result<Option<T>, String>) -> Result<T, String> {
    driver::until(what, STEP, f)
}
use ferroce::ffi::loader::{ECHO, Library};

const BW_SIZES: [usize; 5] = [8, 4096, 65536, 1 << 20, 8 << 20];
const LAT_SIZES: [usize; 2] = [8, 4096];
const LAT_ITERS: usize = 1000;
const WINDOW: usize = 32;
const MAX: usize = 8 << 20;

fn count_for(size: usize) -> usize {
    ((48 << 20) / size).clamp(8, 2000)
}

struct Opts {
    plugin: String,
    devs: (c_int, c_int),
    gids: (String, String),
    peer_ip: String,
    perftest: bool,
}

/// One rank: its plugin context, a send comm to the peer, a receive comm from it.
struct Rank<'a> {
    drv: Driver<'a>,
    ctx: Ptr,
    send: Ptr,
    recv: Ptr,
    buf: Vec<u8>,
    smh: Ptr,
    rmh: Ptr,
}

type Handle = [u8; 128];

fn rank<'a>(
    lib: &'a Library,
    dev: c_int,
    tx: mpsc::Sender<Handle>,
    rx: mpsc::Receiver<Handle>,
) -> Result<Rank<'a>, String> {
    let drv = Driver::new(lib, 12)?;
    let ctx = drv.init(dev as u64)?;
    let (handle, listen) = drv.listen(ctx, dev)?;
    tx.send(handle).map_err(|e| e.to_string())?;
    let mut peer = rx.recv_timeout(Duration::from_secs(60)).map_err(|e| e.to_string())?;
    let (send, recv) = drv.connect_both(ctx, dev, &mut peer, listen, STEP)?;
    drv.close(Close::Listen, listen)?;
    let mut buf = vec![0u8; 2 * MAX];
    let smh = drv.reg_mr(send, buf.as_mut_ptr(), MAX)?;
    // SAFETY: MAX < buf.len().
    let rmh = drv.reg_mr(recv, unsafe { buf.as_mut_ptr().add(MAX) }, MAX)?;
    Ok(Rank { drv, ctx, send, recv, buf, smh, rmh })
}

impl Rank<'_> {
    fn sbuf(&mut self) -> *mut u8 {
        self.buf.as_mut_ptr()
    }
    fn rbuf(&mut self) -> *mut u8 {
        // SAFETY: MAX < buf.len().
        unsafe { self.buf.as_mut_ptr().add(MAX) }
    }

    fn post_recv(&mut self, size: usize) -> Result<Ptr, String> {
        let (d, mh) = (self.rbuf(), self.rmh);
        until("irecv", || self.drv.irecv(self.recv, &[d], &[size], &[0], &[mh], false))
    }

    fn stream_send(&mut self, size: usize, count: usize) -> Result<(), String> {
        let (d, mh) = (self.sbuf(), self.smh);
        let mut inflight = std::collections::VecDeque::new();
        for _ in 0..count {
            if inflight.len() == WINDOW {
                let q = inflight.pop_front().unwrap();
                until("test send", || self.drv.test(q))?;
            }
            inflight.push_back(until("isend", || self.drv.isend(self.send, d, size, 0, mh))?);
        }
        for q in inflight {
            until("test send", || self.drv.test(q))?;
        }
        Ok(())
    }

    fn stream_recv(&mut self, size: usize, count: usize) -> Result<(), String> {
        let mut inflight = std::collections::VecDeque::new();
        for _ in 0..count {
            if inflight.len() == WINDOW {
                let q = inflight.pop_front().unwrap();
                until("test recv", || self.drv.test(q))?;
            }
            inflight.push_back(self.post_recv(size)?);
        }
        for q in inflight {
            until("test recv", || self.drv.test(q))?;
        }
        Ok(())
    }

    fn send_one(&mut self, size: usize) -> Result<(), String> {
        let (d, mh) = (self.sbuf(), self.smh);
        let q = until("isend", || self.drv.isend(self.send, d, size, 0, mh))?;
        until("test send", || self.drv.test(q)).map(|_| ())
    }

    fn close(self) -> Result<(), String> {
        self.drv.dereg_mr(self.send, self.smh)?;
        self.drv.dereg_mr(self.recv, self.rmh)?;
        self.drv.close(Close::Send, self.send)?;
        self.drv.close(Close::Recv, self.recv)?;
        self.drv.finalize(self.ctx)
    }
}

/// The measurements of one side (rank 0 measures; rank 1 serves).
fn run_rank(
    plugin: &str,
    dev: c_int,
    leader: bool,
    tx: mpsc::Sender<Handle>,
    rx: mpsc::Receiver<Handle>,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    let lib = Library::open(plugin)?;
    let mut r = rank(&lib, dev, tx, rx)?;
    let mut bw = Vec::new();
    for size in BW_SIZES {
        let n = count_for(size);
        // Warm-up, then the timed run. Rank 0 sends, rank 1 receives.
        if leader {
            r.stream_send(size, WINDOW)?;
            let t = Instant::now();
            r.stream_send(size, n)?;
            bw.push((size * n) as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9);
        } else {
            r.stream_recv(size, WINDOW)?;
            r.stream_recv(size, n)?;
        }
    }
    let mut lat = Vec::new();
    for size in LAT_SIZES {
        let mut samples = Vec::with_capacity(LAT_ITERS);
        let mut pending = r.post_recv(size)?;
        for i in 0..LAT_ITERS + 50 {
            let t = Instant::now();
            if leader {
                r.send_one(size)?;
                until("test pong", || r.drv.test(pending))?;
                pending = r.post_recv(size)?;
            } else {
                until("test ping", || r.drv.test(pending))?;
                pending = r.post_recv(size)?;
                r.send_one(size)?;
            }
            if i >= 50 {
                samples.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        }
        // One more exchange answers the receive each side still has posted.
        if leader {
            r.send_one(size)?;
            until("test last pong", || r.drv.test(pending))?;
        } else {
            until("test last ping", || r.drv.test(pending))?;
            r.send_one(size)?;
        }
        samples.sort_by(f64::total_cmp);
        lat.push(samples[samples.len() / 2]);
    }
    r.close()?;
    Ok((bw, lat))
}

/// Runs one perftest pair (server on the second device, client on the first) and returns the
/// client's last result line.
fn perftest(tool: &str, o: &Opts, extra: &[String]) -> Result<Vec<f64>, String> {
    let common = |dev: c_int, gid: &str| {
        let mut c = Command::new("timeout");
        c.args(["60", tool, "-d", &format!("rxe{dev}"), "-x", gid, "-F"]).args(extra);
        c
    };
    let mut server = common(o.devs.1, &o.gids.1)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("{tool}: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ss = Command::new("ss")
            .args(["-Hltn", "sport = :18515"])
            .output()
            .map_err(|e| e.to_string())?;
        if !ss.stdout.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            let _ = server.kill();
            return Err(format!("{tool} server did not listen"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = common(o.devs.0, &o.gids.0).arg(&o.peer_ip).output().map_err(|e| e.to_string())?;
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!("{tool} failed: {text}{}", String::from_utf8_lossy(&out.stderr)));
    }
    text.lines()
        .rev()
        .map(|l| l.split_whitespace().filter_map(|w| w.parse::<f64>().ok()).collect::<Vec<_>>())
        .find(|v| v.len() >= 4)
        .ok_or_else(|| format!("no result line from {tool}: {text}"))
}

pub fn perf(args: &[String]) -> Result<(), String> {
    let get = |k: &str, d: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_else(|| d.to_string())
    };
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let gids: Vec<String> =
        env("FERROCE_VM_GIDX", "1 1").split_whitespace().map(str::to_string).collect();
    let ips: Vec<String> = env("FERROCE_VM_IPS", "198.18.0.1 198.18.0.2")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let exe_dir = std::env::current_exe()
        .map_err(|e| e.to_string())?
        .parent()
        .map(|p| p.to_path_buf())
        .unwrap_or_default();
    let o = Opts {
        plugin: get("--plugin", &exe_dir.join("libnccl-net-ferroce.so").to_string_lossy()),
        devs: (0, 1),
        gids: (
            gids.first().cloned().unwrap_or("1".into()),
            gids.get(1).cloned().unwrap_or("1".into()),
        ),
        peer_ip: ips.get(1).cloned().unwrap_or("198.18.0.2".into()),
        perftest: !args.iter().any(|a| a == "--no-perftest"),
    };
    ECHO.store(false, std::sync::atomic::Ordering::Relaxed);
    println!(
        "# ferroce perf: rank 0 on rxe{} -> rank 1 on rxe{}, plugin {} (ncclNet v12)",
        o.devs.0, o.devs.1, o.plugin
    );
    let (tx0, rx1) = mpsc::channel();
    let (tx1, rx0) = mpsc::channel();
    let p1 = o.plugin.clone();
    let dev1 = o.devs.1;
    let peer = std::thread::spawn(move || run_rank(&p1, dev1, false, tx1, rx1));
    let mine = run_rank(&o.plugin, o.devs.0, true, tx0, rx0);
    let theirs = peer.join().map_err(|_| "rank 1 panicked".to_string())?;
    let (bw, lat) = mine?;
    theirs?;

    println!();
    println!(
        "#  bandwidth: {WINDOW} messages in flight; perftest ib_write_bw -D 2 on the same devices"
    );
    println!(
        "#       size    count   time(us)  algbw(GB/s)  ferroce(Gb/s)  perftest(Gb/s)   ratio"
    );
    for (i, size) in BW_SIZES.into_iter().enumerate() {
        let n = count_for(size);
        let gbps = bw[i];
        let time_us = size as f64 * 8.0 / (gbps * 1e9) * 1e6;
        let pt = if o.perftest {
            perftest(
                "ib_write_bw",
                &o,
                &["-s".into(), size.to_string(), "-D".into(), "2".into(), "--report_gbits".into()],
            )?
            .get(3)
            .copied()
        } else {
            None
        };
        let (pts, ratio) = match pt {
            Some(p) if p > 0.0 => (format!("{p:14.3}"), format!("{:7.2}", gbps / p)),
            _ => (format!("{:>14}", "-"), format!("{:>7}", "-")),
        };
        println!(
            "{size:>12} {n:>8} {time_us:>10.1} {:>12.4} {gbps:>14.3} {pts}  {ratio}",
            gbps / 8.0
        );
    }
    println!();
    println!(
        "#  latency: ping-pong, half round trip, median; perftest ib_write_lat -n {LAT_ITERS} t_typical"
    );
    println!("#       size   ferroce(us)  perftest(us)   ratio");
    for (i, size) in LAT_SIZES.into_iter().enumerate() {
        let pt = if o.perftest {
            perftest(
                "ib_write_lat",
                &o,
                &["-s".into(), size.to_string(), "-n".into(), LAT_ITERS.to_string()],
            )?
            .get(4)
            .copied()
        } else {
            None
        };
        let (pts, ratio) = match pt {
            Some(p) if p > 0.0 => (format!("{p:13.1}"), format!("{:7.2}", lat[i] / p)),
            _ => (format!("{:>13}", "-"), format!("{:>7}", "-")),
        };
        println!("{size:>12} {:>13.1} {pts}  {ratio}", lat[i]);
    }
    Ok(())
}
