//! `ferroce doctor` inside the Soft-RoCE VM: the clean set-up passes with no WARN, and each
//! seeded misconfiguration is named (and exits 1 where it blocks): memlock at 64 KiB without
//! CAP_IPC_LOCK, veth MTUs of 9000 and 1500, an interface without IPv4 (no usable RoCE v2
//! GID), `NCCL_IB_GID_INDEX` at an empty (zero) entry, `NCCL_IB_HCA` matching nothing, a
//! malformed knob; and `--selftest` moves data and shows the counters that moved, between two
//! local devices or (`--peer`) to a `ferroce perf --listen` in another process, whose port
//! facts are shown beside ours and compared (veth MTUs of 1500 here and 9000 there).
//!
//! Tests that change the VM's network put it back (a guard, also on panic) and check the GID
//! table is as before, so the VM tests that run later see the set-up they expect.
//! `#[ignore]`d on the host; `ci/vm-tests.sh` runs them in the VM, each in its own process.
//! `ferroce knobs`, the knob table on demand, needs no device and is tested on any host.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{require_vm, run};
use ferroce_tools::proc::Proc;

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    fn lines(&self, level: &str) -> Vec<&str> {
        self.stdout.lines().filter(|l| l.starts_with(level)).collect()
    }
}

/// Runs `[prefix...] ferroce doctor args` with extra environment variables.
fn doctor_with(prefix: &[&str], args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut cmd = match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(common::ferroce_exe());
            c
        }
        None => Command::new(common::ferroce_exe()),
    };
    cmd.arg("doctor").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let o = cmd.output().expect("run ferroce doctor");
    let out = Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    };
    // The evidence, in the test log.
    println!("--- doctor {args:?} {env:?} exit {}\n{}{}", out.code, out.stdout, out.stderr);
    out
}

fn doctor(args: &[&str], env: &[(&str, &str)]) -> Out {
    doctor_with(&[], args, env)
}

/// The RoCE v2 GID index holding `ip` on `dev`, from sysfs.
fn gid_index_of(dev: &str, ip: &str) -> Option<u32> {
    let want = {
        let o: Vec<u8> = ip.split('.').map(|b| b.parse().unwrap()).collect();
        format!("0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}", o[0], o[1], o[2], o[3])
    };
    (0..16).find(|i| {
        let g = std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/1/gids/{i}"));
        g.is_ok_and(|g| g.trim() == want)
    })
}

fn active_mtu(dev: &str) -> String {
    let o = Command::new("ibv_devinfo").args(["-d", dev]).output().expect("ibv_devinfo");
    let s = String::from_utf8_lossy(&o.stdout).into_owned();
    s.lines().find(|l| l.contains("active_mtu")).unwrap_or("?").trim().to_string()
}

/// Polls `f` every 50 ms for at most 10 s.
fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < end, "{what}: not within 10 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `veth` at MTU 9000 (back to 1500 when the guard drops), once `rxe`'s active MTU is 4096.
fn jumbo(veth: &'static str, rxe: &str) -> Restore {
    let restore = Restore::new(vec![vec!["ip", "link", "set", veth, "mtu", "1500"]]);
    run("ip", &["link", "set", veth, "mtu", "9000"]);
    wait_for(&format!("{rxe} active_mtu 4096"), || active_mtu(rxe).contains("4096"));
    restore
}

/// Runs the commands on drop (also when the test panics), then checks both devices have their
/// IPv4 GIDs back at the indexes they had.
struct Restore {
    cmds: Vec<Vec<&'static str>>,
    gids: [Option<u32>; 2],
}

impl Restore {
    fn new(cmds: Vec<Vec<&'static str>>) -> Restore {
        let gids = [gid_index_of("rxe0", "198.18.0.1"), gid_index_of("rxe1", "198.18.0.2")];
        assert!(gids.iter().all(Option::is_some), "the VM's GIDs are not as expected: {gids:?}");
        Restore { cmds, gids }
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        for c in &self.cmds {
            let _ = Command::new(c[0]).args(&c[1..]).status();
        }
        let end = Instant::now() + Duration::from_secs(10);
        let now = || [gid_index_of("rxe0", "198.18.0.1"), gid_index_of("rxe1", "198.18.0.2")];
        while now() != self.gids && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(50));
        }
        if now() != self.gids && !std::thread::panicking() {
            panic!("the VM's GIDs were not restored: {:?}, were {:?}", now(), self.gids);
        }
    }
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_clean_setup_passes_without_a_warning() {
    require_vm();
    let o = doctor(&[], &[]);
    assert_eq!(o.code, 0, "clean set-up must pass");
    assert!(o.lines("WARN").is_empty() && o.lines("BLOCK").is_empty(), "{}", o.stdout);
    // The numbering NCCL will use: software devices have no PCI function, so name order.
    let order = "NCCL's device numbers, in PCI order, as NCCL numbers its own \
                 (NCCL_IB_DEVICE_PCI_ORDER=1): 0 rxe0, 1 rxe1";
    assert!(o.stdout.contains(order), "{}", o.stdout);
    for (dev, ip) in [("rxe0", "198.18.0.1"), ("rxe1", "198.18.0.2")] {
        let idx = gid_index_of(dev, ip).unwrap();
        assert!(o.stdout.contains(&format!("== {dev} port 1")), "{dev} has its screen");
        // What NCCL is told: the port and pciPath getProperties gives, and the speed's source.
        let n = &dev[3..];
        let dir = std::fs::canonicalize(format!("/sys/class/infiniband/{dev}")).unwrap();
        let sees =
            format!("NCCL sees    device {n} {dev}: port 1, pciPath {} ", dir.to_string_lossy());
        assert!(o.stdout.contains(&sees), "{dev}: no {sees:?} in\n{}", o.stdout);
        assert!(
            o.stdout.contains(&format!("*  {idx:>2}  RoCE v2  {ip} ")),
            "{dev}: the GID with {ip} (index {idx}) is marked as ferroce's choice"
        );
    }
    for must in [
        "speed        10000 Mb/s as NCCL is told: 10 Gb/s FDR10 x 1x from active_speed 8",
        "netdev 1500 / active 1024 / max 4096",
        "not exposed by this driver",
        "RLIMIT_MEMLOCK",
        "GPUDirect RDMA HOST",
        "export NCCL_IB_HCA==rxe0:1,rxe1:1",
        "out_of_seq_request",
        // Each rxe device is its own NIC (its own sysfs directory as pciPath): nothing fuses.
        "== NIC fusion\n  no two ports NCCL sees share a NIC: at NCCL_NET_MERGE_LEVEL=PORT",
    ] {
        assert!(o.stdout.contains(must), "missing {must:?}");
    }
    // The same as JSON, which must parse.
    let j = doctor(&["--json"], &[]);
    assert_eq!(j.code, 0);
    assert!(j.stdout.contains("\"blocking\":false"), "{}", j.stdout);
    let st = Command::new("python3")
        .args([
            "-c",
            "import json,sys; d=json.loads(sys.argv[1]); assert len(d['ports'])==2, d; \
             f=d['fusion']; assert f['groups']==[] and f['merge_nics'] and \
             f['merge_level']=='PORT', f",
        ])
        .arg(&j.stdout)
        .status()
        .expect("python3");
    assert!(st.success(), "--json output is not the expected JSON");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn memlock_of_64_kib_without_ipc_lock_blocks() {
    require_vm();
    let o = doctor_with(
        &[
            "setpriv",
            "--bounding-set",
            "-ipc_lock",
            "--inh-caps",
            "-ipc_lock",
            "prlimit",
            "--memlock=65536:65536",
        ],
        &[],
        &[],
    );
    assert_eq!(o.code, 1);
    let block = o.lines("BLOCK").join("\n");
    assert!(block.contains("memlock") && block.contains("64 KiB"), "{block}");
    assert!(o.stdout.contains("ulimit -l unlimited"), "the advice says what to do");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn veth_mtus_of_9000_and_1500_warn_of_the_mismatch() {
    require_vm();
    let _restore = jumbo("vethA", "rxe0");
    println!("rxe0: {}, rxe1: {}", active_mtu("rxe0"), active_mtu("rxe1"));
    let o = doctor(&[], &[]);
    assert_eq!(o.code, 0, "an MTU mismatch does not block: connections use the smaller");
    let warn = o.lines("WARN").join("\n");
    assert!(warn.contains("MTU mismatch"), "{warn}");
    assert!(warn.contains("rxe0:1 (active 4096, vethA MTU 9000)"), "{warn}");
    assert!(warn.contains("rxe1:1 (active 1024, vethB MTU 1500)"), "{warn}");
    assert!(o.stdout.contains("netdev 9000 / active 4096 / max 4096"));
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn an_interface_without_ipv4_has_no_usable_gid() {
    require_vm();
    let _restore = Restore::new(vec![vec!["ip", "addr", "add", "198.18.0.2/24", "dev", "vethB"]]);
    run("ip", &["addr", "del", "198.18.0.2/24", "dev", "vethB"]);
    wait_for("rxe1's IPv4 GID to go", || gid_index_of("rxe1", "198.18.0.2").is_none());
    let o = doctor(&[], &[]);
    assert_eq!(o.code, 1);
    let block = o.lines("BLOCK").join("\n");
    assert!(block.contains("rxe1:1: no usable GID") && block.contains("RoCE v2"), "{block}");
    assert!(!block.contains("rxe0"), "rxe0 is fine: {block}");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_gid_index_at_an_empty_entry_blocks() {
    require_vm();
    // rxe lists RoCE v2 GIDs only, so the v1 case is a unit test (`ferroce` binary); an unused
    // index reads as the zero GID.
    let zero = (0..16)
        .find(|i| {
            let g = std::fs::read_to_string(format!("/sys/class/infiniband/rxe0/ports/1/gids/{i}"));
            g.is_ok_and(|g| g.trim().chars().all(|c| c == '0' || c == ':'))
        })
        .expect("an empty GID entry");
    let z = zero.to_string();
    let o = doctor(&[], &[("NCCL_IB_GID_INDEX", &z)]);
    assert_eq!(o.code, 1);
    let block = o.lines("BLOCK").join("\n");
    let named =
        block.contains("NCCL_IB_GID_INDEX") && block.contains(&format!("no GID at index {z}"));
    assert!(named && block.contains("rxe0:1") && block.contains("rxe1:1"), "{block}");
    let o = doctor(&[], &[("FERROCE_GID_INDEX", &format!("rxe1:{z}"))]);
    assert_eq!(o.code, 1);
    let block = o.lines("BLOCK").join("\n");
    assert!(block.contains("FERROCE_GID_INDEX") && block.contains("rxe1:1"), "{block}");
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn nccl_ib_hca_matching_nothing_blocks() {
    require_vm();
    let o = doctor(&[], &[("NCCL_IB_HCA", "mlx5_9")]);
    assert_eq!(o.code, 1);
    let block = o.lines("BLOCK").join("\n");
    assert!(block.contains("NCCL_IB_HCA=mlx5_9") && block.contains("rxe0"), "{block}");
    // One entry that matches nothing beside one that does: a WARN, not a block.
    let o = doctor(&[], &[("NCCL_IB_HCA", "rxe0,mlx5_9")]);
    assert_eq!(o.code, 0);
    assert!(o.lines("WARN").join("\n").contains("\"mlx5_9\" matches no RDMA device"));
}

/// Runs `ferroce knobs` with no NCCL or ferroce variable but `env`.
fn knobs(env: &[(&str, &str)]) -> Out {
    let mut cmd = Command::new(common::ferroce_exe());
    cmd.arg("knobs");
    for (k, _) in std::env::vars() {
        if k.starts_with("NCCL_") || k.starts_with("FERROCE_") {
            cmd.env_remove(k);
        }
    }
    let o = cmd.envs(env.iter().copied()).output().expect("run ferroce knobs");
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into(),
        stderr: String::from_utf8_lossy(&o.stderr).into(),
    }
}

/// The whole table, which a rank's INFO log leaves out: every knob once, its value here and
/// where it came from; a replaced value with its WARN; a malformed one fails, naming it.
#[test]
fn knobs_shows_every_knob_and_where_its_value_came_from() {
    let o = knobs(&[("NCCL_IB_TIMEOUT", "0x14"), ("FERROCE_RNR_RETRY", "7")]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    for k in ferroce::config::KNOBS {
        let rows = o.stdout.lines().filter(|l| l.split_whitespace().next() == Some(k.name));
        assert_eq!(rows.count(), 1, "{} in\n{}", k.name, o.stdout);
    }
    for must in [
        "NCCL_IB_RETRY_CNT ",
        " 7 (default)",
        " 20 (set to 0x14)",
        " 6 (set to 7)",
        "WARN FERROCE_RNR_RETRY=7 retries forever",
    ] {
        assert!(o.stdout.contains(must), "missing {must:?} in\n{}", o.stdout);
    }
    let o = knobs(&[("NCCL_IB_QPS_PER_CONNECTION", "4")]);
    assert!(o.stdout.contains(" 4 (set)"), "{}", o.stdout);
    let o = knobs(&[("NCCL_IB_TIMEOUT", "fast")]);
    assert_eq!(o.code, 1);
    assert!(o.stderr.contains("NCCL_IB_TIMEOUT") && o.stderr.contains("fast"), "{}", o.stderr);
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn set_knobs_are_listed_and_a_malformed_one_or_a_bad_argument_named() {
    require_vm();
    let o = doctor(&[], &[("NCCL_IB_TIMEOUT", "fast")]);
    assert_eq!(o.code, 1);
    assert!(o.lines("BLOCK").join("\n").contains("NCCL_IB_TIMEOUT"), "{}", o.stdout);
    let o = doctor(&[], &[("NCCL_IB_TIMEOUT", "20")]);
    assert!(o.stdout.contains("NCCL_IB_TIMEOUT=20   ("), "a set knob is listed with its meaning");
    // The fusion knobs: ferroce's refusal, NCCL's wider merge level and forced groups.
    let env = [
        ("NCCL_IB_MERGE_NICS", "0"),
        ("NCCL_NET_MERGE_LEVEL", "PXB"),
        ("NCCL_NET_FORCE_MERGE", "rxe0,rxe1"),
    ];
    let o = doctor(&[], &env);
    for must in [
        "NCCL_IB_MERGE_NICS=0: ferroce refuses makeVDevice",
        "NCCL_NET_MERGE_LEVEL=PXB also fuses NICs",
        "NCCL_NET_FORCE_MERGE=rxe0,rxe1: NCCL fuses these groups as named",
    ] {
        assert!(o.stdout.contains(must), "missing {must:?} in\n{}", o.stdout);
    }
    // A group NCCL cannot match fails NCCL's init: doctor says so before NCCL does.
    let o = doctor(&[], &[("NCCL_NET_FORCE_MERGE", "rxe0,rxe9")]);
    let warn = o.lines("WARN").join("\n");
    assert!(warn.contains("group `rxe0,rxe9` matches 1 device(s) ([0]) for its 2"), "{}", o.stdout);
    let o = doctor(&["--frobnicate"], &[]);
    assert_eq!(o.code, 1);
    assert!(o.stderr.contains("unexpected argument") && o.stderr.contains("Usage"));
    let o = doctor(&["--dev", "rxe7"], &[]);
    assert_eq!(o.code, 1);
    assert!(o.lines("BLOCK").join("\n").contains("rxe7"));
    let o = doctor(&["--dev", "rxe1"], &[]);
    assert_eq!(o.code, 0);
    assert!(o.stdout.contains("== rxe1 port 1") && !o.stdout.contains("== rxe0"));
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn the_selftest_moves_data_and_shows_the_counters() {
    require_vm();
    let o = doctor(&["--selftest"], &[]);
    assert_eq!(o.code, 0);
    let s = o.stdout.split("== Self-test").nth(1).expect("a self-test section");
    assert!(s.contains("rxe0:1 -> rxe1:1: 8 x 4 MiB in") && s.contains("MB/s"), "{s}");
    assert!(s.contains("data verified"), "{s}");
    assert!(s.contains("hw_counters/sent_pkts") && s.contains("hw_counters/rcvd_pkts"), "{s}");
    // --dev picks the sender; the receiver is the next device NCCL sees.
    let o = doctor(&["--selftest", "--dev", "rxe1"], &[]);
    assert_eq!(o.code, 0);
    assert!(o.stdout.contains("rxe1:1 -> rxe0:1: 8 x 4 MiB in"), "{}", o.stdout);
    // One device and no peer: nothing to receive, said so.
    let o = doctor(&["--selftest"], &[("NCCL_IB_HCA", "=rxe0")]);
    assert_eq!(o.code, 1);
    let block = o.lines("BLOCK").join("\n");
    assert!(block.contains("needs a second one") && block.contains("--peer"), "{block}");
}

/// A `ferroce perf --listen --dev DEV` (the peer of `doctor --peer`) and its address; the rest
/// of its stdout stays in its lines.
fn listener(dev: &str) -> (Proc, String) {
    let mut cmd = Command::new(common::ferroce_exe());
    cmd.args(["perf", "--listen", "--dev", dev]);
    let p = Proc::spawn("perf --listen", cmd).expect("run ferroce perf --listen");
    let first = p.next(Duration::from_secs(60)).unwrap_or_else(|e| panic!("no HANDLE line: {e}"));
    println!("listener: {first}");
    let w: Vec<&str> = first.split_whitespace().collect();
    assert!(matches!(w[..], ["HANDLE", _, d] if d == dev), "{first}");
    let addr = w[1].to_string();
    (p, addr)
}

/// The listener ends by itself after the doctor's QUIT, successfully.
fn listener_done(mut p: Proc) {
    let st = p.finish(Duration::from_secs(30));
    // Its last lines may still be on their way from the pipe: read to its end.
    let end = Instant::now() + Duration::from_secs(5);
    let lines: Vec<String> = std::iter::from_fn(|| {
        p.lines.recv_timeout(end.saturating_duration_since(Instant::now())).ok()
    })
    .collect();
    assert!(st.is_some(), "perf --listen still running 30 s after the doctor finished");
    assert!(
        st.is_some_and(|s| s.success()) && lines.iter().any(|l| l == "# done"),
        "{st:?}: {lines:?}"
    );
}

/// `doctor --dev rxe0 --peer ADDR --selftest` against a listener on rxe1: exit 0, both ends'
/// facts shown, the data verified and the bandwidth measured; returns the doctor's output.
fn doctor_with_peer() -> (Out, String) {
    let (child, addr) = listener("rxe1");
    let o = doctor(&["--dev", "rxe0", "--peer", &addr, "--selftest"], &[]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    let peer = o.stdout.split("== Peer ").nth(1).expect("a peer section");
    assert!(peer.starts_with(&addr) && peer.contains("the plugin connected to it"), "{peer}");
    let row = |label: &str| {
        let l = peer.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or("");
        l.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    assert_eq!(row("port"), "port rxe0:1 rxe1:1");
    assert_eq!(row("netdev "), "netdev vethA vethB");
    assert!(row("GID").contains("198.18.0.1") && row("GID").contains("198.18.0.2"), "{peer}");
    let s = o.stdout.split("== Self-test").nth(1).expect("a self-test section");
    assert!(s.contains(&format!("rxe0:1 -> rxe1:1 at {addr}: 8 x 4 MiB in")), "{s}");
    assert!(s.contains("MB/s") && s.contains("Gb/s") && s.contains("data verified"), "{s}");
    assert!(s.contains("hw_counters/sent_pkts"), "our counters moved: {s}");
    listener_done(child);
    (o, addr)
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_peer_self_test_shows_both_ends_and_moves_verified_data() {
    require_vm();
    let (o, gone) = doctor_with_peer();
    assert!(o.lines("WARN").is_empty(), "equal MTUs: {}", o.stdout);
    // The listener served one doctor and ended: a peer that is not there blocks, named.
    let o = doctor(&["--peer", &gone], &[]);
    assert_eq!(o.code, 1);
    assert!(o.lines("BLOCK").join("\n").contains(&gone), "{}", o.stdout);
    assert!(o.stdout.contains("netdev MTU   1500"), "{}", o.stdout);
    // --json carries the peer's facts and the comparison.
    let (child, addr) = listener("rxe1");
    let j = doctor(&["--json", "--dev", "rxe0", "--peer", &addr], &[]);
    listener_done(child);
    assert_eq!(j.code, 0);
    let check = "import json,sys; p=json.loads(sys.argv[1])['peer']; \
                 assert p['peer']['port']=='rxe1:1' and p['here']['port']=='rxe0:1', p; \
                 assert p['mtus_match'] and p['path_mtu']==1024 and p['connected'], p";
    let st = Command::new("python3").args(["-c", check]).arg(&j.stdout).status().unwrap();
    assert!(st.success(), "--json peer: {}", j.stdout);
}

#[test]
#[ignore = "needs the Soft-RoCE VM: run ci/test.sh"]
fn a_peer_with_a_larger_mtu_is_named_in_a_warning() {
    require_vm();
    let _restore = jumbo("vethB", "rxe1");
    let (o, _) = doctor_with_peer();
    let warn = o.lines("WARN").join("\n");
    assert!(warn.contains("MTU mismatch between the two ends"), "{warn}");
    assert!(warn.contains("here rxe0:1 (active 1024, vethA MTU 1500)"), "{warn}");
    assert!(warn.contains("peer rxe1:1 (active 4096, vethB MTU 9000)"), "{warn}");
    assert!(warn.contains("path MTU is the smaller, 1024"), "{warn}");
    assert!(warn.contains("set vethA's MTU to 9000 here"), "{warn}");
}
