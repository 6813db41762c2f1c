//! The test client: loads `libnccl-net-ferroce.so` with `dlopen` and drives it as NCCL's proxy
//! thread would, in two processes (a receiver and a sender), once per ABI version v6–v12, on
//! real verbs inside the Soft-RoCE VM.
//!
//! Without arguments it is the orchestrator: for each version it starts `netclient recv` on one
//! device, passes the 128-byte handle to `netclient send` on the other, and checks both exit 0.
//! Every byte received is verified against a per-transfer pattern, and every reported size.
//!
//! The schedule (same seed on both sides):
//! - A: sizes 0, 1, 4095, 4096, 65536, 1 MiB, 16 MiB, one at a time (with a flush each);
//! - B: 96 random sizes up to 256 KiB with 32 requests in flight, half of the receives
//!   carrying NCCL's optional-completion marker (those may complete before their data lands,
//!   so their data is awaited in the buffer, as NCCL's LL protocol does);
//! - C: 64 multi-receives of 1..=8 buffers with tags, the sender posting in reverse tag order.
//!
//! Built as a test target with its own `main` (`harness = false`) and not run by a plain
//! `cargo test` on the host: `ci/vm-tests.sh` runs it in the VM. Outside the VM it fails.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::time::{Duration, Instant};

use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::loader::{ECHO, Library};
use ferroce_tools::proc::Proc;
use ferroce_tools::rank::one_comm;
use ferroce_tools::rng::Rng;

const WINDOW: usize = 32;
const AREA: usize = 512 << 10; // per in-flight group: 8 buffers x 64 KiB, or one of 256 KiB
const ARENA: usize = 16 << 20;
const STEP: Duration = Duration::from_secs(120);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        None => orchestrate(),
        Some("recv") => role(false, &args[1..]),
        Some("send") => role(true, &args[1..]),
        Some(other) => Err(format!("unknown mode {other:?}")),
    };
    if let Err(e) = r {
        for (level, _, line) in ferroce_tools::loader::take_captured() {
            if level <= 2 {
                eprintln!("netclient: plugin WARN: {line}");
            }
        }
        eprintln!("netclient: FAILED: {e}");
        std::process::exit(1);
    }
}

// --- the schedule ------------------------------------------------------------------------------

/// One buffer of a (multi-)receive: what is sent, what is posted, its tag, where it lives.
#[derive(Clone, Copy, Debug)]
struct Item {
    size: usize,
    capacity: usize,
    tag: c_int,
    offset: usize,
}

struct Group {
    items: Vec<Item>,
    optional: bool,
    flush: bool,
}

fn schedule() -> Vec<Group> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::new();
    for (i, size) in [0usize, 1, 4095, 4096, 65536, 1 << 20, 16 << 20].into_iter().enumerate() {
        let capacity = if i % 2 == 0 { size } else { size + 17 };
        let capacity = capacity.min(ARENA);
        out.push(Group {
            items: vec![Item { size, capacity, tag: 7, offset: 0 }],
            optional: false,
            flush: true,
        });
    }
    for g in 0..96usize {
        let size = match rng.below(4) {
            0 => rng.below(64) as usize,
            1 => rng.below(4096) as usize,
            _ => rng.below(256 << 10) as usize,
        };
        let capacity = (size + rng.below(100) as usize).min(AREA);
        let offset = (g % WINDOW) * AREA;
        out.push(Group {
            items: vec![Item { size, capacity, tag: 1, offset }],
            optional: g % 2 == 1,
            flush: false,
        });
    }
    for g in 0..64usize {
        let n = 1 + g % 8;
        let items = (0..n)
            .map(|r| {
                let size = rng.below(64 << 10) as usize;
                Item {
                    size,
                    capacity: 64 << 10,
                    tag: 100 + r as c_int,
                    offset: (g % WINDOW) * AREA + r * (64 << 10),
                }
            })
            .collect();
        out.push(Group { items, optional: false, flush: false });
    }
    out
}

/// The byte pattern of buffer `r` of group `g`.
fn pattern(g: usize, r: usize, buf: &mut [u8]) {
    Rng(0x1234_5678 ^ ((g as u64) << 8) ^ r as u64 | 1).fill(buf);
}

// --- the two roles --------------------------------------------------------------------------------

fn arg(args: &[String], name: &str) -> Result<String, String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .ok_or_else(|| format!("missing {name}"))
}

fn until<T>(what: &str, f: impl FnMut() -> Result<Option<T>, String>) -> Result<T, String> {
    ferroce_tools::wait::until(what, STEP, f)
}

fn role(sender: bool, args: &[String]) -> Result<(), String> {
    ECHO.store(
        std::env::var_os("NETCLIENT_VERBOSE").is_some(),
        std::sync::atomic::Ordering::Relaxed,
    );
    let version: u32 = arg(args, "--version")?.parse().map_err(|_| "bad --version")?;
    let dev: c_int = arg(args, "--dev")?.parse().map_err(|_| "bad --dev")?;
    let lib = Library::open(&arg(args, "--plugin")?)?;
    let drv = Driver::new(&lib, version)?;
    let ctx = drv.init(version as u64)?;
    let peer = if sender { Some(arg(args, "--handle")?) } else { None };
    let comm = one_comm(&drv, ctx, dev, peer.as_deref(), STEP)?;
    let mut arena = vec![0u8; ARENA + 4096];
    let base = arena.as_mut_ptr();
    let mh = drv.reg_mr(comm, base, arena.len())?;
    // A second registration of a sub-range shares the cached region and must be released.
    // SAFETY: 4096 < arena.len().
    let mh2 = drv.reg_mr(comm, unsafe { base.add(4096) }, 4096)?;
    drv.dereg_mr(comm, mh2)?;
    let groups = schedule();
    let start = Instant::now();
    let bytes = if sender {
        send_all(&drv, comm, mh, &mut arena, &groups)?
    } else {
        recv_all(&drv, comm, mh, &mut arena, &groups)?
    };
    let secs = start.elapsed().as_secs_f64();
    drv.dereg_mr(comm, mh)?;
    drv.close(if sender { Close::Send } else { Close::Recv }, comm)?;
    drv.finalize(ctx)?;
    eprintln!(
        "netclient: v{version} {} on dev {dev}: {} groups, {:.1} MiB {} in {secs:.2} s",
        if sender { "sender" } else { "receiver" },
        groups.len(),
        bytes as f64 / (1 << 20) as f64,
        if sender { "sent" } else { "received and verified" }
    );
    Ok(())
}

fn send_all(
    drv: &Driver,
    comm: Ptr,
    mh: Ptr,
    arena: &mut [u8],
    groups: &[Group],
) -> Result<usize, String> {
    let base = arena.as_mut_ptr();
    let mut inflight: VecDeque<(usize, Vec<Ptr>)> = VecDeque::new();
    let mut total = 0;
    let drain_one = |inflight: &mut VecDeque<(usize, Vec<Ptr>)>| -> Result<(), String> {
        let (g, reqs) = inflight.pop_front().expect("non-empty");
        for (r, req) in reqs.into_iter().enumerate() {
            let sizes = until(&format!("test of send group {g}"), || drv.test(req))?;
            let want = groups[g].items[groups[g].items.len() - 1 - r].size;
            if sizes[0] as usize != want {
                return Err(format!("group {g}: send reported {} bytes, sent {want}", sizes[0]));
            }
        }
        Ok(())
    };
    for (g, group) in groups.iter().enumerate() {
        if inflight.len() == WINDOW || (group.flush && !inflight.is_empty()) {
            while !inflight.is_empty() {
                drain_one(&mut inflight)?;
            }
        }
        let mut reqs = Vec::new();
        for (r, it) in group.items.iter().enumerate().rev() {
            pattern(g, r, &mut arena[it.offset..it.offset + it.size]);
            // SAFETY: offset + size lies in the arena.
            let p = unsafe { base.add(it.offset) };
            let req = until(&format!("isend of group {g} buffer {r}"), || {
                drv.isend(comm, p, it.size, it.tag, mh)
            })?;
            reqs.push(req);
            total += it.size;
        }
        inflight.push_back((g, reqs));
        if group.flush {
            drain_one(&mut inflight)?;
        }
    }
    while !inflight.is_empty() {
        drain_one(&mut inflight)?;
    }
    Ok(total)
}

fn recv_all(
    drv: &Driver,
    comm: Ptr,
    mh: Ptr,
    arena: &mut [u8],
    groups: &[Group],
) -> Result<usize, String> {
    let base = arena.as_mut_ptr();
    let force_flush = std::env::var("FERROCE_FORCE_FLUSH").as_deref() == Ok("1");
    let mut inflight: VecDeque<(usize, Ptr)> = VecDeque::new();
    let mut total = 0;
    let mut expected = vec![0u8; 16 << 20];
    let mut finish =
        |inflight: &mut VecDeque<(usize, Ptr)>, arena: &mut [u8]| -> Result<(), String> {
            let (g, req) = inflight.pop_front().expect("non-empty");
            let sizes = until(&format!("test of receive group {g}"), || drv.test(req))?;
            for (r, it) in groups[g].items.iter().enumerate() {
                // An optional receive completes as any other, with the size that landed (NCCL
                // watches its data itself and may ignore the size).
                let size = it.size;
                if sizes[r] as usize != size {
                    return Err(format!(
                        "group {g} buffer {r}: test reported {} bytes, expected {size}",
                        sizes[r]
                    ));
                }
                let want = &mut expected[..it.size];
                pattern(g, r, want);
                if groups[g].optional {
                    // As NCCL's LL protocol does: watch the buffer until the data is there.
                    let at = arena[it.offset..].as_ptr();
                    until(&format!("data of optional group {g}"), || {
                        // SAFETY: it.size bytes at `at` lie in the arena; the NIC writes them.
                        let landed = (0..it.size)
                            .all(|i| unsafe { std::ptr::read_volatile(at.add(i)) } == want[i]);
                        Ok(landed.then_some(()))
                    })?;
                }
                let got = &arena[it.offset..it.offset + it.size];
                if let Some(bad) = got.iter().zip(want.iter()).position(|(a, b)| a != b) {
                    return Err(format!(
                        "group {g} buffer {r} ({} bytes): first wrong byte at {bad}",
                        it.size
                    ));
                }
                total += it.size;
            }
            if groups[g].flush {
                let it = groups[g].items[0];
                // SAFETY: offset lies in the arena.
                let f = drv.iflush(comm, unsafe { base.add(it.offset) }, it.size as c_int, mh)?;
                match (f, force_flush && it.size > 0) {
                    (Some(q), true) => {
                        until("test flush", || drv.test(q))?;
                    }
                    (None, false) => {}
                    (got, want) => {
                        return Err(format!("iflush gave {got:?}, expected a request: {want}"));
                    }
                }
            }
            Ok(())
        };
    for (g, group) in groups.iter().enumerate() {
        if inflight.len() == WINDOW || (group.flush && !inflight.is_empty()) {
            while !inflight.is_empty() {
                finish(&mut inflight, arena)?;
            }
        }
        let data: Vec<*mut u8> =
            group.items.iter().map(|it| base.wrapping_add(it.offset)).collect();
        let caps: Vec<usize> = group.items.iter().map(|it| it.capacity).collect();
        let tags: Vec<c_int> = group.items.iter().map(|it| it.tag).collect();
        let mhs = vec![mh; group.items.len()];
        for it in &group.items {
            arena[it.offset..it.offset + it.capacity].fill(0xee);
        }
        let req = until(&format!("irecv of group {g}"), || {
            drv.irecv(comm, &data, &caps, &tags, &mhs, group.optional)
        })?;
        inflight.push_back((g, req));
        if group.flush {
            finish(&mut inflight, arena)?;
        }
    }
    while !inflight.is_empty() {
        finish(&mut inflight, arena)?;
    }
    Ok(total)
}

// --- the orchestrator -----------------------------------------------------------------------------

fn run_pair(
    plugin: &str,
    version: u32,
    recv_dev: u32,
    send_dev: u32,
    flush: bool,
) -> Result<(), String> {
    let (version, plugin) = (version.to_string(), plugin.to_string());
    let role = |mode: &str, dev: u32| {
        Proc::me(&[mode, "--version", &version, "--dev", &dev.to_string(), "--plugin", &plugin])
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut rc = role("recv", recv_dev);
    if flush {
        rc.env("FERROCE_FORCE_FLUSH", "1");
    }
    let mut recv = Proc::spawn("receiver", rc)?;
    let handle = recv.handle(Duration::from_secs(60))?;
    let mut sc = role("send", send_dev);
    sc.args(["--handle", &handle]);
    let mut send = Proc::spawn("sender", sc)?;
    let left = || deadline.saturating_duration_since(Instant::now());
    let r1 = send.exits_ok(left());
    let r2 = recv.exits_ok(left());
    r1.and(r2)
}

fn orchestrate() -> Result<(), String> {
    if std::env::var("FERROCE_IN_VM").as_deref() != Ok("1") {
        return Err(
            "the test client must run inside the Soft-RoCE VM (ci/vm.sh ci/vm-tests.sh ...)".into(),
        );
    }
    let dir = std::env::var("FERROCE_PLUGIN_DIR").map_err(|_| "FERROCE_PLUGIN_DIR is not set")?;
    let plugin = format!("{dir}/libnccl-net-ferroce.so");
    let mut runs: Vec<(u32, u32, u32, bool)> =
        ferroce::ffi::VERSIONS.iter().rev().map(|&v| (v, 1, 0, v % 2 == 0)).collect();
    runs.push((12, 0, 0, false)); // both ends on one device
    runs.push((6, 1, 1, true));
    if let Ok(only) = std::env::var("NETCLIENT_VERSIONS") {
        runs.retain(|r| only.split(',').any(|v| v == r.0.to_string()));
    }
    for (v, rdev, sdev, flush) in runs {
        let t = Instant::now();
        run_pair(&plugin, v, rdev, sdev, flush)
            .map_err(|e| format!("v{v} rxe{sdev} -> rxe{rdev}: {e}"))?;
        println!(
            "netclient: v{v} rxe{sdev} -> rxe{rdev}{}: OK in {:.1} s",
            if flush { " (forced flush)" } else { "" },
            t.elapsed().as_secs_f64()
        );
    }
    println!("netclient: all ABI versions passed");
    Ok(())
}
