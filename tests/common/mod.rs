//! Helpers only the integration tests need: find the built plugin and `ferroce` tool, load the
//! plugin by path, and look at the process and the RDMA devices from outside. Everything that
//! drives the plugin (loader, driver, handle codec, child processes, waits) is the
//! `ferroce_tools` library, which the `ferroce` tool uses too.
#![allow(dead_code)] // each test target uses a different subset

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use ferroce_tools::loader::Library;

/// Serialises tests that change the process environment or the plugin's global state.
pub static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The start of a VM test that changes shared state (the environment, links, the plugin's
/// globals): it must run in the VM, and holds the SERIAL lock until the guard drops.
pub fn vm_serial() -> std::sync::MutexGuard<'static, ()> {
    require_vm();
    serial()
}

/// `target/<profile>`, found from the test executable (`target/<profile>/deps/<test>`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().and_then(|d| d.parent()).expect("target/<profile>").to_path_buf()
}

/// A directory holding the plugin under the name NCCL looks for, `libnccl-net-ferroce.so`.
///
/// `FERROCE_PLUGIN_DIR` names a prebuilt one (the VM tests, which must not run cargo). Otherwise
/// `cargo test` does not build the cdylib, so it is built here (a no-op when fresh) and copied.
pub fn plugin_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("FERROCE_PLUGIN_DIR") {
            let dir = PathBuf::from(dir);
            assert!(dir.join("libnccl-net-ferroce.so").exists(), "no plugin in {}", dir.display());
            return dir;
        }
        let built = cargo_build(&["--lib"], "libferroce.so");
        let dir = target_dir().join("nccl-plugin");
        std::fs::create_dir_all(&dir).expect("mkdir nccl-plugin");
        let tmp = dir.join(format!(".copy-{}", std::process::id()));
        std::fs::copy(&built, &tmp).expect("copy plugin");
        std::fs::rename(&tmp, dir.join("libnccl-net-ferroce.so")).expect("rename plugin");
        dir
    })
    .clone()
}

/// The `ferroce` tool. `FERROCE_PLUGIN_DIR` names the prebuilt one (the VM tests: `ci/build.sh`
/// puts it beside the plugin). Otherwise it is built here (a no-op when fresh): it belongs to
/// the `ferroce-tools` package, whose binaries cargo does not build for this package's tests.
pub fn ferroce_exe() -> PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        if let Some(dir) = std::env::var_os("FERROCE_PLUGIN_DIR") {
            let exe = Path::new(&dir).join("ferroce");
            assert!(exe.exists(), "no ferroce tool in {}", Path::new(&dir).display());
            return exe;
        }
        cargo_build(&["-p", "ferroce-tools", "--bin", "ferroce"], "ferroce")
    })
    .clone()
}

/// Runs `cargo build ARGS` in this workspace and returns the artifact named `file`.
fn cargo_build(args: &[&str], file: &str) -> PathBuf {
    let out = Command::new(env!("CARGO"))
        .arg("build")
        .args(args)
        .arg("--message-format=json")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo build");
    assert!(out.status.success(), "cargo build {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("\"compiler-artifact\""))
        .flat_map(|l| l.split('"'))
        .find(|s| s.ends_with(&format!("/{file}")))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("cargo build {args:?} reported no {file}"))
}

/// The plugin, opened by path (in-process tests cannot change `LD_LIBRARY_PATH`).
pub fn open_plugin() -> Library {
    let path = plugin_dir().join("libnccl-net-ferroce.so");
    Library::open(path.to_str().expect("utf-8 path")).expect("dlopen plugin")
}

use std::time::Duration;

use ferroce_tools::buffer::HostBuf;
use ferroce_tools::driver::{Close, Driver, Ptr};

/// Connects a send comm on `sdev` to a receive comm on `rdev`, driving both ends from this
/// thread, within 30 s.
pub fn pair(drv: &Driver, ctx: Ptr, rdev: i32, sdev: i32) -> Result<(Ptr, Ptr), String> {
    ferroce_tools::rank::pair(drv, ctx, rdev, sdev, Duration::from_secs(30))
}

/// Closes the two comms of a [`pair`].
pub fn close_both(drv: &Driver, send: Ptr, recv: Ptr) -> Result<(), String> {
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)
}

/// The frame of an in-process VM test that drives the plugin's tables itself: it must run in
/// the VM, and holds the SERIAL lock while `body` runs with the opened plugin (closed after it,
/// before the lock).
pub fn with_plugin(body: impl FnOnce(&Library)) {
    let _g = vm_serial();
    let lib = open_plugin();
    body(&lib);
}

/// The frame of an in-process VM test through the driver: as [`with_plugin`], with `env` set
/// before the plugin opens; `body` runs with the driver and a context initialised at v12 with
/// `comm_id`, which is finalized after.
pub fn in_vm(comm_id: u64, env: &[(&str, Option<&str>)], body: impl FnOnce(&Driver, Ptr)) {
    let _g = vm_serial();
    set_env(env);
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12).unwrap();
    let ctx = drv.init(comm_id).unwrap();
    body(&drv, ctx);
    drv.finalize(ctx).unwrap();
}

/// The WARN lines the plugin logged since the last look (the capture is emptied).
pub fn warnings() -> Vec<String> {
    ferroce_tools::loader::take_captured().into_iter().filter(|l| l.0 == 2).map(|l| l.2).collect()
}

/// Runs a system command that must succeed (ip, tc, ...).
pub fn run(cmd: &str, args: &[&str]) {
    let st = Command::new(cmd).args(args).status().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(st.success(), "{cmd} {args:?}: {st}");
}

/// Polls `f` until it yields, for at most 30 s.
pub fn until<T>(what: &str, f: impl FnMut() -> Result<Option<T>, String>) -> Result<T, String> {
    ferroce_tools::wait::until(what, Duration::from_secs(30), f)
}

/// Fails loudly unless this runs inside the test VM.
pub fn require_vm() {
    assert_eq!(
        std::env::var("FERROCE_IN_VM").as_deref(),
        Ok("1"),
        "this test must run inside the Soft-RoCE VM (ci/vm.sh); it cannot pass elsewhere"
    );
}

/// Sends `size` bytes over a connected pair and checks they arrive intact.
pub fn transfer(drv: &Driver, send: Ptr, recv: Ptr, size: usize, seed: u8) -> Result<(), String> {
    let (src, dst) = (HostBuf::patterned(size, seed), HostBuf::new(size));
    let smh = drv.reg_mr(send, src.ptr(), size.max(1))?;
    let rmh = drv.reg_mr(recv, dst.ptr(), size.max(1))?;
    let rreq = until("irecv", || drv.irecv(recv, &[dst.ptr()], &[size], &[0], &[rmh], false))?;
    let sreq = until("isend", || drv.isend(send, src.ptr(), size, 0, smh))?;
    let ss = until("test send", || drv.test(sreq))?;
    let rs = until("test recv", || drv.test(rreq))?;
    drv.dereg_mr(send, smh)?;
    drv.dereg_mr(recv, rmh)?;
    if ss[0] as usize != size || rs[0] as usize != size {
        return Err(format!("sizes: sent {} received {}, expected {size}", ss[0], rs[0]));
    }
    dst.check(0..size, seed)
}

/// A running `tcpdump` writing RoCEv2 packets (UDP 4791) of one interface to a file.
pub struct Capture {
    child: std::process::Child,
    path: PathBuf,
}

/// One captured RoCEv2 packet.
#[derive(Clone, Copy, Debug)]
pub struct Packet {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub tos: u8,
    pub sport: u16,
    pub udp_len: u16,
    pub opcode: u8,
}

impl Capture {
    pub fn start(iface: &str) -> Capture {
        use std::io::BufRead;
        let path = PathBuf::from(format!("/tmp/ferroce-{}-{iface}.pcap", std::process::id()));
        let mut child = Command::new("tcpdump")
            .args(["-Z", "root", "-U", "--immediate-mode", "-i", iface, "-n", "-s", "128", "-w"])
            .arg(&path)
            .arg("udp port 4791")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run tcpdump");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        loop {
            let line =
                rx.recv_timeout(Duration::from_secs(20)).expect("tcpdump did not start listening");
            if line.contains("listening on") {
                break;
            }
        }
        Capture { child, path }
    }

    /// Stops the capture (SIGINT, so the file is complete) and parses it.
    pub fn stop(mut self) -> Vec<Packet> {
        // Immediate mode and -U write each packet as it arrives (otherwise the last ring block
        // is lost at exit); give the last ones a moment, then stop it.
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: plain kill(2) of our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let st = self.child.wait().expect("wait tcpdump");
        assert!(st.success() || st.code().is_none(), "tcpdump: {st}");
        let data = std::fs::read(&self.path).expect("read pcap");
        let _ = std::fs::remove_file(&self.path);
        let pkts = parse_pcap(&data);
        eprintln!("capture: {} bytes of pcap, {} RoCEv2 packets", data.len(), pkts.len());
        pkts
    }
}

/// The RoCEv2-over-IPv4 packets of a pcap file (Ethernet or Linux cooked link type).
pub fn parse_pcap(d: &[u8]) -> Vec<Packet> {
    assert!(d.len() >= 24, "pcap too short");
    let le = u32::from_le_bytes(d[0..4].try_into().unwrap()) == 0xa1b2_c3d4;
    let u32at = |b: &[u8], o: usize| {
        let v: [u8; 4] = b[o..o + 4].try_into().unwrap();
        if le { u32::from_le_bytes(v) } else { u32::from_be_bytes(v) }
    };
    let link = u32at(d, 20);
    let l3 = match link {
        1 => 14,
        113 => 16,
        other => panic!("unexpected pcap link type {other}"),
    };
    let mut out = Vec::new();
    let mut off = 24;
    while off + 16 <= d.len() {
        let incl = u32at(d, off + 8) as usize;
        let pkt = &d[off + 16..(off + 16 + incl).min(d.len())];
        off += 16 + incl;
        if pkt.len() < l3 + 20 || u16::from_be_bytes([pkt[l3 - 2], pkt[l3 - 1]]) != 0x0800 {
            continue;
        }
        let ip = &pkt[l3..];
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        if ip[9] != 17 || ip.len() < ihl + 9 {
            continue;
        }
        let udp = &ip[ihl..];
        if u16::from_be_bytes([udp[2], udp[3]]) != 4791 {
            continue;
        }
        out.push(Packet {
            src: ip[12..16].try_into().unwrap(),
            dst: ip[16..20].try_into().unwrap(),
            tos: ip[1],
            sport: u16::from_be_bytes([udp[0], udp[1]]),
            udp_len: u16::from_be_bytes([udp[4], udp[5]]),
            opcode: udp[8],
        });
    }
    out
}

/// Sets (or removes) environment variables for this process; tests hold the SERIAL lock.
pub fn set_env(vars: &[(&str, Option<&str>)]) {
    for (k, v) in vars {
        // SAFETY: tests that change the environment hold the SERIAL lock.
        unsafe {
            match v {
                Some(v) => std::env::set_var(k, v),
                None => std::env::remove_var(k),
            }
        }
    }
}

/// Open file descriptors and threads of this process (`/proc/self/fd`, `/proc/self/task`).
/// ThreadSanitizer's runtime starts a thread of its own with the process's first thread: one
/// thread is started and joined before the first count (and given up to 1 s to be gone), so
/// that the sanitizer's is in every count.
pub fn fds_threads() -> (usize, usize) {
    let n = |d: &str| std::fs::read_dir(d).map(|d| d.count()).unwrap_or(0);
    static FIRST: std::sync::Once = std::sync::Once::new();
    FIRST.call_once(|| {
        let before = n("/proc/self/task");
        std::thread::spawn(|| ()).join().expect("a thread that does nothing");
        settle(&before, Duration::from_secs(1), || n("/proc/self/task"));
    });
    (n("/proc/self/fd"), n("/proc/self/task"))
}

/// Anonymous resident memory of this process in bytes (`RssAnon` of `/proc/self/status`),
/// after handing the memory malloc keeps free back to the system: what a leak grows. File-backed
/// pages (library code paged in as new paths run) and the allocator's cache of freed 1 MiB
/// buffers otherwise swing RSS by up to 2 MiB from one sample to the next.
pub fn rss_bytes() -> u64 {
    // SAFETY: malloc_trim only releases free heap memory; it has no preconditions.
    unsafe { libc::malloc_trim(0) };
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("/proc/self/status has RssAnon");
    kib << 10
}

/// The RDMA devices' resource counts (QP, CQ, MR, PD, ... per device), as `rdma resource show`
/// prints them, one device per `; `-separated entry.
pub fn rdma_resources() -> Result<String, String> {
    let out =
        Command::new("rdma").args(["resource", "show"]).output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("rdma resource show: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).lines().collect::<Vec<_>>().join("; "))
}

/// Waits (at most `limit`) until `now()` equals `base`: the kernel releases some resources a
/// moment after their owner let go (a reaped child's QPs, a joined thread's task entry).
/// Returns the last value seen, so the caller can report a difference.
pub fn settle<T: PartialEq>(base: &T, limit: Duration, mut now: impl FnMut() -> T) -> T {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let v = now();
        if v == *base || std::time::Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Makes closing `s` send a reset (as a killed peer with unread data does), not a FIN.
pub fn reset_on_close(s: &std::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid socket and a linger struct of the size passed.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const l).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
}

/// Ends a test program with its own `main`: on an error, the plugin's WARNs, then
/// `PROG: FAILED: why`, and exit status 1.
pub fn exit_on_error(prog: &str, r: Result<(), String>) {
    if let Err(e) = r {
        for w in warnings() {
            eprintln!("{prog}: plugin WARN: {w}");
        }
        eprintln!("{prog}: FAILED: {e}");
        std::process::exit(1);
    }
}

/// The number after the flag `name` in a test program's arguments, or `default` without it.
pub fn num_arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Result<T, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{name} needs a number")),
    }
}

/// A value shared by the threads of one test process: the driver (the plugin's function table)
/// and the plugin's handles.
#[derive(Clone, Copy)]
pub struct Shared<T>(pub T);
// SAFETY: the ncclNet contract lets threads call the plugin at once: each comm's data path is
// driven by one thread at a time, and registration may come from another thread at the same
// time. The driver only holds the library's (immutable) function table, and the pointers are
// handles into the plugin, never dereferenced by the tests.
unsafe impl<T> Sync for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Send for Shared<T> {}

impl<T> Shared<T> {
    /// By value, so a closure captures the whole wrapper (not its non-`Send` fields).
    pub fn get(self) -> T {
        self.0
    }
}
