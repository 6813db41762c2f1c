//! GPUDirect RDMA on Soft-RoCE: detection, `regMrDmaBuf`, `regMr` with `NCCL_PTR_CUDA`, the
//! flush, and bad input, driven through the C ABI inside the VM.
//!
//! rxe has neither peer memory nor dma-buf support, so two stand-ins make the GPU paths real:
//! - dma-buf: `tests/dmabuf_standin.c`, preloaded, turns rxe into a dma-buf-capable NIC (it
//!   registers its own mapping of the fd at the iova). The GPU buffer's pages are a sealed
//!   memfd, as rxe cannot pin vgem memory; a real vgem dma-buf is used for the failure path.
//! - peer memory: a private mount namespace makes `/sys/module/nvidia_peermem/version` appear,
//!   and the same preloaded stand-in resolves a registration of a "GPU address" to the pages
//!   behind it, as nvidia-peermem does for the NIC.
//!
//! Either way the address the plugin gets is one the CPU cannot touch, as a real GPU's: a
//! `PROT_NONE` reservation ([`GpuBuf`]). A CPU read or write of it by the plugin (inline data,
//! a copy, a peek) kills the process with SIGSEGV. The test fills and checks the bytes through
//! a third mapping, as the GPU would.
//!
//! Without arguments this is the orchestrator: it runs each scenario as a child process with
//! the environment it needs (preload, namespace, knobs) and fails if any fails. Built as a test
//! target with its own `main` (`harness = false`) and run by `ci/vm-tests.sh` in the VM.

mod common;

use std::ffi::c_int;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Command;

use common::{open_plugin, pair, require_vm};
use ferroce::ffi::abi::{NCCL_PTR_CUDA, NCCL_PTR_DMABUF, NCCL_PTR_HOST};
use ferroce_tools::driver::{Close, Driver, Ptr};
use ferroce_tools::loader::take_captured;
use ferroce_tools::rng::{Rng, mix};

const CUDA: c_int = NCCL_PTR_CUDA as c_int;
const HOST: c_int = NCCL_PTR_HOST as c_int;
const RO: u32 = 1 << 20; // IBV_ACCESS_RELAXED_ORDERING
const ACCESS: u32 = 7; // LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ
const HALF: usize = 4 << 20;
const ARENA: usize = 2 * HALF;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        None => orchestrate(),
        Some("plain") => plain(),
        Some("dmabuf") => dmabuf(args.get(1).and_then(|v| v.parse().ok()).unwrap_or(12)),
        Some("dmabuf-bad") => dmabuf_bad_input(),
        Some("peermem") => peermem(true),
        Some("peermem-noflush") => peermem(false),
        Some("memlock") => memlock(),
        Some(other) => Err(format!("unknown scenario {other:?}")),
    };
    if let Err(e) = r {
        eprintln!("gpudirect: FAILED: {e}");
        std::process::exit(1);
    }
}

// --- the orchestrator --------------------------------------------------------------------------

fn plugin_dir() -> PathBuf {
    PathBuf::from(std::env::var("FERROCE_PLUGIN_DIR").unwrap_or_default())
}

fn orchestrate() -> Result<(), String> {
    require_vm();
    let standin = plugin_dir().join("libferroce-dmabuf-standin.so");
    if !standin.exists() {
        return Err(format!("no dma-buf stand-in at {} (ci/test.sh builds it)", standin.display()));
    }
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let me = me.to_str().ok_or("non-UTF-8 path")?.to_string();
    let log = std::env::temp_dir().join(format!("standin-{}.log", std::process::id()));
    let preload = |c: &mut Command| {
        c.env("LD_PRELOAD", &standin).env("FERROCE_STANDIN_LOG", &log);
    };
    let mut runs: Vec<(String, Command)> = Vec::new();
    let mut plain = Command::new(&me);
    plain.arg("plain");
    runs.push(("plain rxe: HOST only, GPU types refused".into(), plain));
    for v in ferroce::ffi::VERSIONS.iter().rev() {
        let mut c = Command::new(&me);
        c.args(["dmabuf", &v.to_string()]);
        preload(&mut c);
        // Odd versions turn relaxed ordering off; the others keep the automatic choice.
        if v % 2 == 1 {
            c.env("NCCL_IB_PCI_RELAXED_ORDERING", "0");
        }
        runs.push((format!("dma-buf data path through v{v}"), c));
    }
    let mut bad = Command::new(&me);
    bad.arg("dmabuf-bad");
    preload(&mut bad);
    runs.push(("dma-buf bad input".into(), bad));
    for (mode, what) in
        [("peermem", "peer memory"), ("peermem-noflush", "NCCL_GDR_FLUSH_DISABLE=1")]
    {
        let mut c = Command::new("unshare");
        c.args(["-m", "--propagation", "private", "bash", "-c", PEERMEM_NS, "ns", &me, mode]);
        // The stand-in also makes dma-buf available; NCCL then uses regMr only with it off.
        preload(&mut c);
        c.env("NCCL_DMABUF_ENABLE", "0");
        if mode == "peermem-noflush" {
            c.env("NCCL_GDR_FLUSH_DISABLE", "1");
        }
        runs.push((format!("{what} (private mount namespace)"), c));
    }
    // A 1 MiB locked-memory limit that binds even root: CAP_IPC_LOCK dropped before exec.
    let mut low = Command::new("setpriv");
    low.args(["--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock"]);
    low.args(["prlimit", "--memlock=1048576:1048576", &me, "memlock"]);
    runs.push(("RLIMIT_MEMLOCK of 1 MiB".into(), low));
    let (mut passed, mut failed) = (0, 0);
    for (what, mut cmd) in runs {
        let _ = std::fs::remove_file(&log);
        eprintln!("gpudirect: --- {what}");
        let st = cmd.status().map_err(|e| format!("{what}: {e}"))?;
        if st.success() {
            passed += 1;
            eprintln!("gpudirect: passed: {what}");
        } else {
            failed += 1;
            eprintln!("gpudirect: FAILED: {what} ({st})");
        }
    }
    let _ = std::fs::remove_file(&log);
    println!("gpudirect: {passed} passed, {failed} failed");
    if failed > 0 { Err(format!("{failed} scenario(s) failed")) } else { Ok(()) }
}

/// Runs in a fresh mount namespace: a tmpfs over /sys/module that keeps every real module
/// visible through bind mounts and adds `nvidia_peermem/version`, then the scenario.
const PEERMEM_NS: &str = r#"set -euo pipefail
orig=$(mktemp -d)
mount --bind /sys/module "$orig"
mount -t tmpfs ferroce-sysmodule /sys/module
for m in "$orig"/*; do
  n=${m##*/}; mkdir "/sys/module/$n"; mount --bind "$m" "/sys/module/$n"
done
mkdir /sys/module/nvidia_peermem
echo "1.0-ferroce-test" > /sys/module/nvidia_peermem/version
[[ -e /sys/module/rdma_rxe/initstate ]] || { echo "the bind mounts lost rdma_rxe" >&2; exit 1; }
exec "$1" "$2""#;

// --- helpers -----------------------------------------------------------------------------------

fn check(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(what()) }
}

/// The INFO and TRACE lines, and the WARN lines, since the last look.
fn lines() -> (Vec<String>, Vec<String>) {
    let all = take_captured();
    let get =
        |lvl: &[i32]| all.iter().filter(|l| lvl.contains(&l.0)).map(|l| l.2.clone()).collect();
    (get(&[3, 5]), get(&[2]))
}

/// A stand-in for a GPU allocation. Its pages are a sealed memfd. The plugin is given `dev`, a
/// `PROT_NONE` reservation of the same length that the CPU cannot read or write (as a GPU
/// virtual address); the NIC reaches the pages through the stand-in's own mapping of the fd;
/// the test reads and writes them through `ptr`, a third mapping, as a GPU kernel would.
struct GpuBuf {
    fd: OwnedFd,
    ptr: *mut u8,
    dev: *mut u8,
    len: usize,
}

impl GpuBuf {
    fn new(len: usize) -> Result<GpuBuf, String> {
        let os = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
        // SAFETY: plain syscalls on a fresh fd we own; the mappings are released in Drop.
        unsafe {
            let fd = libc::memfd_create(c"ferroce-gpu-standin".as_ptr(), libc::MFD_ALLOW_SEALING);
            if fd < 0 {
                return Err(os("memfd_create"));
            }
            let fd = OwnedFd::from_raw_fd(fd);
            if libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) != 0 {
                return Err(os("ftruncate"));
            }
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0 {
                return Err(os("F_ADD_SEALS"));
            }
            let prot = libc::PROT_READ | libc::PROT_WRITE;
            let p =
                libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0);
            if p == libc::MAP_FAILED {
                return Err(os("mmap"));
            }
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
            let dev = libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, flags, -1, 0);
            if dev == libc::MAP_FAILED {
                libc::munmap(p, len);
                return Err(os("mmap PROT_NONE"));
            }
            Ok(GpuBuf { fd, ptr: p.cast(), dev: dev.cast(), len })
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: a live shared mapping of len bytes, owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The test's view and the plugin's address of the buffer.
    fn mem(&mut self) -> Mem<'_> {
        let dev = self.dev;
        Mem { dev, host: self.bytes() }
    }

    /// A fresh fd for the same buffer, as `cuMemGetHandleForAddressRange` gives NCCL each time.
    fn export(&self) -> Result<c_int, String> {
        // SAFETY: dup of an fd we own.
        let fd = unsafe { libc::dup(self.fd.as_raw_fd()) };
        check(fd >= 0, || format!("dup: {}", std::io::Error::last_os_error()))?;
        Ok(fd)
    }

    /// Tells the preloaded stand-in that `dev` is GPU memory backed by the fd, so that a
    /// peer-memory registration of it reaches these pages (`forget`: no longer).
    fn declare_peer(&self, forget: bool) -> Result<(), String> {
        type Declare = unsafe extern "C" fn(*mut libc::c_void, usize, c_int) -> c_int;
        // SAFETY: dlsym in the global scope, where LD_PRELOAD put the stand-in.
        let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"ferroce_standin_gpu".as_ptr()) };
        check(!f.is_null(), || "the peer-memory stand-in is not preloaded".into())?;
        // SAFETY: the stand-in's function has exactly this C signature.
        let declare = unsafe { std::mem::transmute::<*mut libc::c_void, Declare>(f) };
        let len = if forget { 0 } else { self.len };
        // SAFETY: plain values; the stand-in maps the fd only while it is alive (ours).
        let rc = unsafe { declare(self.dev.cast(), len, self.fd.as_raw_fd()) };
        check(rc == 0, || "the stand-in's table of GPU allocations is full".into())
    }
}

impl Drop for GpuBuf {
    fn drop(&mut self) {
        // SAFETY: the mappings made in new.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
            libc::munmap(self.dev.cast(), self.len);
        }
    }
}

/// A buffer as a transfer sees it: `dev` is the address the plugin gets, `host` what the test
/// reads and writes (the same pages; for host memory, the same address).
struct Mem<'a> {
    dev: *mut u8,
    host: &'a mut [u8],
}

impl Mem<'_> {
    fn of(v: &mut [u8]) -> Mem<'_> {
        Mem { dev: v.as_mut_ptr(), host: v }
    }

    fn at(&self, off: usize) -> *mut u8 {
        self.dev.wrapping_add(off)
    }
}

/// NCCL's way: export, register, close the fd at once (which must succeed: the plugin must
/// neither keep nor close it).
fn reg_exported(
    drv: &Driver,
    comm: Ptr,
    g: &GpuBuf,
    offset: usize,
    len: usize,
) -> Result<(Ptr, c_int), String> {
    let fd = g.export()?;
    let data = g.dev.wrapping_add(offset);
    let mh = drv.reg_mr_dmabuf(comm, data, len, CUDA, offset as u64, fd);
    // SAFETY: closing the fd we exported.
    let closed = unsafe { libc::close(fd) };
    let mh = mh?;
    check(closed == 0, || format!("close of the exported fd {fd} failed: the plugin closed it"))?;
    Ok((mh, fd))
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// The number of MRs rxe0 and rxe1 hold, from `rdma resource show`.
fn rdma_mrs() -> Result<u64, String> {
    let out =
        Command::new("rdma").args(["resource", "show"]).output().map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut total = 0;
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let i = f.iter().position(|x| *x == "mr").ok_or(format!("no mr count in {l:?}"))?;
        total += f.get(i + 1).and_then(|v| v.parse::<u64>().ok()).ok_or("bad mr count")?;
    }
    Ok(total)
}

/// The bytes of buffer `r` of group `g`.
fn pattern(g: usize, r: usize, buf: &mut [u8]) {
    Rng(mix((g as u64) << 32 | r as u64)).fill(buf);
}

/// One group: a (multi-)receive of `(offset, size)` buffers, all inside one half of the arena.
fn schedule() -> Vec<Vec<(usize, usize)>> {
    let mut rng = Rng(0x0005_eed0_f9d0_u64);
    let mut out: Vec<Vec<(usize, usize)>> = Vec::new();
    // Singles across both halves, at odd offsets too.
    for (i, size) in [1usize, 4095, 4096, 65537, 1 << 20, (3 << 20) + 5].into_iter().enumerate() {
        let base = if i % 2 == 0 { 0 } else { HALF };
        out.push(vec![(base + 8 * (i % 3), size)]);
    }
    // Multi-receives of 1..=8 buffers until 16 MiB have moved in all.
    let mut total: usize = out.iter().flatten().map(|b| b.1).sum();
    let mut g = 0;
    while total < 16 << 20 {
        let n = 1 + g % 8;
        let base = if g % 2 == 0 { 0 } else { HALF };
        let items: Vec<_> =
            (0..n).map(|r| (base + r * (256 << 10), rng.below(256 << 10) as usize + 1)).collect();
        total += items.iter().map(|b| b.1).sum::<usize>();
        out.push(items);
        g += 1;
    }
    out
}

/// Small messages, where a plugin is tempted to let the CPU copy (inline data): every size
/// from 0 to 64 bytes, the edges around 128, 256 and 512, and multi-receives of 2..=8 buffers
/// below 600 bytes, at odd offsets in both halves.
fn small_schedule() -> Vec<Vec<(usize, usize)>> {
    let mut rng = Rng(0x5a11_u64);
    let mut sizes: Vec<usize> = (0..=64).collect();
    sizes.extend([127, 128, 129, 255, 256, 257, 300, 511, 512, 513, 1000, 4096]);
    let mut out: Vec<Vec<(usize, usize)>> = sizes
        .into_iter()
        .enumerate()
        .map(|(i, size)| vec![(if i % 2 == 0 { 0 } else { HALF } + 8 * (i % 5), size)])
        .collect();
    for g in 0..28 {
        let n = 2 + g % 7;
        let base = if g % 2 == 0 { 0 } else { HALF };
        out.push((0..n).map(|r| (base + r * 4096 + 3 * r, rng.below(600) as usize)).collect());
    }
    out
}

/// How a group's receive is posted and finished.
#[derive(Clone, Copy, PartialEq)]
enum Recv {
    /// Completed by the plugin, then flushed (`flush`: a flush request is expected).
    Normal { flush: bool },
    /// LL/LL128: NCCL asks for no completion and watches the data itself (single buffers).
    Optional,
}

/// Sends `groups` from `src` into `dst` (offsets are the same in both), checks every byte and
/// size through the test's own view, and flushes each normal receive.
#[allow(clippy::too_many_arguments)]
fn traffic(
    drv: &Driver,
    send: Ptr,
    recv: Ptr,
    src: &mut Mem,
    dst: &mut Mem,
    smh: &dyn Fn(usize) -> Ptr,
    rmh: &dyn Fn(usize) -> Ptr,
    how: Recv,
    groups: &[Vec<(usize, usize)>],
) -> Result<usize, String> {
    let (mut bytes, mut flushes) = (0, 0);
    for (g, items) in groups.iter().enumerate() {
        if how == Recv::Optional && items.len() > 1 {
            continue;
        }
        dst.host.fill(0);
        for (r, &(off, size)) in items.iter().enumerate() {
            pattern(g, r, &mut src.host[off..off + size]);
        }
        let ptrs: Vec<*mut u8> = items.iter().map(|&(o, _)| dst.at(o)).collect();
        let sizes: Vec<usize> = items.iter().map(|&(_, s)| s).collect();
        let tags: Vec<c_int> = (0..items.len() as c_int).map(|t| 50 + t).collect();
        let mhs: Vec<Ptr> = items.iter().map(|&(o, _)| rmh(o)).collect();
        let optional = how == Recv::Optional;
        let rreq =
            common::until("irecv", || drv.irecv(recv, &ptrs, &sizes, &tags, &mhs, optional))?;
        let mut sreqs = Vec::new();
        for (r, &(off, size)) in items.iter().enumerate().rev() {
            let p = src.at(off);
            sreqs.push(common::until("isend", || drv.isend(send, p, size, tags[r], smh(off)))?);
        }
        for q in sreqs {
            common::until("test send", || drv.test(q))?;
        }
        // An optional receive completes as any other, once its data landed (its write with
        // immediate), with the size that landed.
        let got = common::until("test recv", || drv.test(rreq))?;
        for (r, &(off, size)) in items.iter().enumerate() {
            check(got[r] as usize == size, || format!("group {g} buffer {r}: size {}", got[r]))?;
            check(dst.host[off..off + size] == src.host[off..off + size], || {
                format!("group {g} buffer {r}: {size} bytes at offset {off} differ")
            })?;
        }
        let &(off, size) = items.last().expect("non-empty group");
        let last = ptrs[items.len() - 1];
        if let Recv::Normal { flush } = how {
            match (drv.iflush(recv, last, size as c_int, rmh(off))?, flush && size > 0) {
                (Some(q), true) => {
                    common::until("test flush", || drv.test(q))?;
                    flushes += 1;
                }
                (None, false) => {}
                (Some(_), false) => return Err("iflush returned a request; expected none".into()),
                (None, true) => return Err(format!("group {g}: iflush returned no request")),
            }
        }
        bytes += sizes.iter().sum::<usize>();
    }
    eprintln!("gpudirect: {bytes} bytes verified, {flushes} flushes completed");
    Ok(bytes)
}

/// The latency mode: one message at a time from `a` to `b` and back, as a ping-pong, at 8 B,
/// 256 B and 4 KiB; `a_mh`/`b_mh` are each side's registration on both of its comms
/// (`[send, recv]`). Every echo is checked through the test's views.
#[allow(clippy::too_many_arguments)]
fn ping_pong(
    drv: &Driver,
    ab: (Ptr, Ptr),
    ba: (Ptr, Ptr),
    a: &mut Mem,
    b: &mut Mem,
    a_mh: [Ptr; 2],
    b_mh: [Ptr; 2],
) -> Result<(), String> {
    let mut rounds = 0;
    for (i, size) in [8usize, 256, 4096].into_iter().enumerate() {
        for k in 0..20 {
            pattern(100 + i, k, &mut a.host[..size]);
            one_way(drv, ab, (a, a_mh[0]), (b, b_mh[1]), size)
                .map_err(|e| format!("ping {size} B round {k}: {e}"))?;
            one_way(drv, ba, (b, b_mh[0]), (a, a_mh[1]), size)
                .map_err(|e| format!("pong {size} B round {k}: {e}"))?;
            rounds += 1;
        }
    }
    eprintln!("gpudirect: {rounds} ping-pong rounds verified (8 B, 256 B, 4 KiB)");
    Ok(())
}

/// One message of `size` bytes from the start of `from` to the start of `to` over the pair
/// `(send, recv)`, each buffer with its registration on its comm; the bytes are checked.
fn one_way(
    drv: &Driver,
    (send, recv): (Ptr, Ptr),
    (from, smh): (&Mem, Ptr),
    (to, rmh): (&mut Mem, Ptr),
    size: usize,
) -> Result<(), String> {
    to.host[..size].fill(0);
    let rreq =
        common::until("irecv", || drv.irecv(recv, &[to.at(0)], &[size], &[7], &[rmh], false))?;
    let sreq = common::until("isend", || drv.isend(send, from.at(0), size, 7, smh))?;
    common::until("test send", || drv.test(sreq))?;
    common::until("test recv", || drv.test(rreq))?;
    check(to.host[..size] == from.host[..size], || "the bytes differ".into())
}

// --- scenarios ---------------------------------------------------------------------------------

/// Plain rxe: HOST only with the reasons logged; CUDA and dma-buf registrations refused with
/// ncclInvalidArgument and one WARN each; host receives need no flush.
fn plain() -> Result<(), String> {
    require_vm();
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(1)?;
    let all = take_captured();
    let at = |lvl: i32| all.iter().filter(move |l| l.0 == lvl).map(|l| l.2.as_str());
    let warns: Vec<&str> = at(2).collect();
    check(warns.is_empty(), || format!("WARNs at init: {warns:?}"))?;
    for (dev, name) in [(0, "rxe0"), (1, "rxe1")] {
        let p = drv.properties(dev)?.ptr_support;
        check(p == HOST, || format!("{name}: ptrSupport {p:#x}, expected HOST only"))?;
        // At INFO the port's one line says what; at TRACE another says why.
        let brief = at(3).find(|l| l.contains(&format!("device {dev}: {name} port")));
        let brief = brief.ok_or(format!("no INFO line for {name}: {all:?}"))?;
        check(brief.contains("GPUDirect RDMA HOST (`ferroce doctor` says why)"), || {
            format!("{name}: {brief}")
        })?;
        let line = at(5).find(|l| l.contains(&format!("device {dev}: {name} GPUDirect")));
        let line = line.ok_or(format!("no GPUDirect TRACE line for {name}: {all:?}"))?;
        check(
            line.contains("GPUDirect RDMA HOST:")
                && line.contains("no peer memory")
                && line.contains("probe answered EOPNOTSUPP"),
            || format!("{name}: {line}"),
        )?;
        eprintln!("gpudirect: {line}");
    }
    // `ferroce info` shows each device's line too.
    let out = Command::new(common::ferroce_exe())
        .args(["info", "ferroce"])
        .env("LD_LIBRARY_PATH", plugin_dir())
        .output()
        .map_err(|e| format!("ferroce info: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let shown = text.matches("GPUDirect RDMA HOST: no peer memory").count();
    check(out.status.success() && shown == 2, || format!("ferroce info:\n{text}"))?;
    let (send, recv) = pair(&drv, ctx, 1, 0)?;
    let mut buf = vec![0u8; 4096];
    let e = drv.reg_mr_type(recv, buf.as_mut_ptr(), 4096, CUDA).err().unwrap_or_default();
    check(e.contains("ncclResult 4"), || format!("regMr CUDA on rxe: {e:?}"))?;
    let g = GpuBuf::new(4096)?;
    let e = reg_exported(&drv, recv, &g, 0, 4096).err().unwrap_or_default();
    check(e.contains("ncclResult 4"), || format!("regMrDmaBuf on rxe: {e:?}"))?;
    let (_, warns) = lines();
    check(
        warns.len() == 2
            && warns[0].contains("regMr")
            && warns[1].contains("regMrDmaBuf")
            && warns.iter().all(|w| w.contains("ptrSupport is HOST")),
        || format!("expected one WARN per refused registration: {warns:?}"),
    )?;
    // Host memory: data moves and iflush says there is nothing to flush.
    let mut src = vec![0u8; ARENA];
    let mut dst = vec![0u8; ARENA];
    let smh = drv.reg_mr(send, src.as_mut_ptr(), ARENA)?;
    let rmh = drv.reg_mr(recv, dst.as_mut_ptr(), ARENA)?;
    let (s, r) = (|_: usize| smh, |_: usize| rmh);
    let (mut src, mut dst) = (Mem::of(&mut src), Mem::of(&mut dst));
    let no_flush = Recv::Normal { flush: false };
    traffic(&drv, send, recv, &mut src, &mut dst, &s, &r, no_flush, &schedule()[..10])?;
    // Host memory may go inline: the small sizes and optional receives too.
    traffic(&drv, send, recv, &mut src, &mut dst, &s, &r, no_flush, &small_schedule())?;
    traffic(&drv, send, recv, &mut src, &mut dst, &s, &r, Recv::Optional, &small_schedule())?;
    drv.dereg_mr(send, smh)?;
    drv.dereg_mr(recv, rmh)?;
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)?;
    drv.finalize(ctx)
}

/// The stand-in's log lines.
fn standin_log() -> Vec<String> {
    let path = std::env::var("FERROCE_STANDIN_LOG").unwrap_or_default();
    std::fs::read_to_string(path).unwrap_or_default().lines().map(String::from).collect()
}

/// The dma-buf path end to end through ABI version `v`.
fn dmabuf(v: u32) -> Result<(), String> {
    require_vm();
    let lib = open_plugin();
    let drv = Driver::new(&lib, v)?;
    let ctx = drv.init(u64::from(v))?;
    let (info, _) = lines();
    for dev in 0..2 {
        let p = drv.properties(dev)?.ptr_support;
        check(p == HOST | NCCL_PTR_DMABUF as c_int, || {
            format!("v{v} dev {dev}: ptrSupport {p:#x}")
        })?;
    }
    let line = info.iter().find(|l| l.contains("device 1: rxe1 GPUDirect")).cloned();
    let line = line.ok_or("no GPUDirect line for rxe1")?;
    check(line.contains("HOST|DMABUF") && line.contains("answered EBADF"), || line.clone())?;
    let access = ACCESS | if line.contains("relaxed ordering on") { RO } else { 0 };
    let ro_knob = std::env::var("NCCL_IB_PCI_RELAXED_ORDERING").ok();
    check(ro_knob.as_deref() != Some("0") || access == ACCESS, || format!("RO=0 but {line}"))?;
    eprintln!("gpudirect: v{v}: {line}");

    let (send, recv) = pair(&drv, ctx, 1, 0)?;
    let mut sgpu = GpuBuf::new(ARENA)?;
    let mut rgpu = GpuBuf::new(ARENA)?;
    let (fds, mrs) = (fd_count(), rdma_mrs()?);
    // The receiver's arena in two registrations (the second at a non-zero offset); the
    // sender's in one.
    let (r0, fd0) = reg_exported(&drv, recv, &rgpu, 0, HALF)?;
    let (r1, fd1) = reg_exported(&drv, recv, &rgpu, HALF, ARENA - HALF)?;
    let (s0, fd2) = reg_exported(&drv, send, &sgpu, 0, ARENA)?;
    check(fd_count() == fds, || format!("fd count {} -> {}", fds, fd_count()))?;
    let (sp, rp) = (sgpu.dev as u64, rgpu.dev as u64);
    let rmh = move |off: usize| if off < HALF { r0 } else { r1 };
    let smh = move |_: usize| s0;
    // The reverse pair, for the ping-pong; the same buffers registered again on the same
    // devices are answered by the registration cache (no new registration below).
    let ba = pair(&drv, ctx, 0, 1)?;
    let back =
        [reg_exported(&drv, ba.1, &sgpu, 0, ARENA)?.0, reg_exported(&drv, ba.0, &rgpu, 0, HALF)?.0];
    let (mut src, mut dst) = (sgpu.mem(), rgpu.mem());
    let how = Recv::Normal { flush: true };
    let moved = traffic(&drv, send, recv, &mut src, &mut dst, &smh, &rmh, how, &schedule())?;
    check(moved >= 16 << 20, || format!("only {moved} bytes moved"))?;
    let ab = (send, recv);
    small_and_latency(&drv, ab, ba, (&smh, &rmh), back, &mut src, &mut dst, true)?;
    drv.dereg_mr(ba.1, back[0])?;
    drv.dereg_mr(ba.0, back[1])?;
    drv.close(Close::Send, ba.0)?;
    drv.close(Close::Recv, ba.1)?;
    for mh in [r0, r1] {
        drv.dereg_mr(recv, mh)?;
    }
    drv.dereg_mr(send, s0)?;
    check(fd_count() == fds, || format!("fd count {} -> {} after deregMr", fds, fd_count()))?;
    let after = rdma_mrs()?;
    check(after == mrs, || format!("rdma MRs {mrs} -> {after}: deregistration leaked"))?;

    // What the NIC was asked to do: exactly these three registrations, each released.
    let log = standin_log();
    let regs: Vec<&String> = log.iter().filter(|l| l.starts_with("reg ")).collect();
    let want =
        [(0, HALF, rp, fd0), (HALF, ARENA - HALF, rp + HALF as u64, fd1), (0, ARENA, sp, fd2)];
    check(regs.len() == want.len(), || format!("stand-in saw {regs:?}"))?;
    for (got, (off, len, iova, fd)) in regs.iter().zip(want) {
        let expect =
            format!("reg offset={off} len={len} iova={iova:#x} fd={fd} access={access:#x} -> mr ");
        check(got.starts_with(&expect), || format!("stand-in saw {got:?}, expected {expect:?}"))?;
    }
    let deregs = log.iter().filter(|l| l.starts_with("dereg ") && l.ends_with("-> 0")).count();
    check(deregs == 3, || format!("{deregs} dma-buf MRs released: {log:?}"))?;
    check(log.iter().filter(|l| l.starts_with("probe fd=-1")).count() == 2, || {
        format!("expected one probe per device: {log:?}")
    })?;
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)?;
    drv.finalize(ctx)?;
    let (_, warns) = lines();
    check(warns.is_empty(), || format!("WARNs: {warns:?}"))
}

/// The small sizes, the optional receives and the latency mode: `smh`/`rmh` are the sender's
/// and receiver's registrations on `ab`, `back` the same buffers' on the reverse pair `ba`.
#[allow(clippy::too_many_arguments)]
fn small_and_latency(
    drv: &Driver,
    ab: (Ptr, Ptr),
    ba: (Ptr, Ptr),
    (smh, rmh): (&dyn Fn(usize) -> Ptr, &dyn Fn(usize) -> Ptr),
    back: [Ptr; 2],
    src: &mut Mem,
    dst: &mut Mem,
    flush: bool,
) -> Result<(), String> {
    let small = small_schedule();
    traffic(drv, ab.0, ab.1, src, dst, smh, rmh, Recv::Normal { flush }, &small)?;
    traffic(drv, ab.0, ab.1, src, dst, smh, rmh, Recv::Optional, &small)?;
    ping_pong(drv, ab, ba, src, dst, [smh(0), back[0]], [back[1], rmh(0)])
}

/// A dma-buf fd of vgem: real, but every mapping of it is VM_PFNMAP, which rxe cannot pin.
fn vgem_dmabuf(size: u32) -> Result<OwnedFd, String> {
    common::run("modprobe", &["vgem"]);
    let card = std::fs::read_dir("/sys/class/drm")
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            // vgem is a bare platform device: its cards live under /sys/devices/platform/vgem.
            let real = std::fs::canonicalize(p).unwrap_or_default();
            p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("card"))
                && real.to_string_lossy().contains("/platform/vgem/")
        })
        .ok_or("no vgem card under /sys/class/drm")?;
    let dev = format!("/dev/dri/{}", card.file_name().unwrap_or_default().to_string_lossy());
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&dev);
    let f = f.map_err(|e| format!("{dev}: {e}"))?;
    #[repr(C)]
    struct CreateDumb {
        height: u32,
        width: u32,
        bpp: u32,
        flags: u32,
        handle: u32,
        pitch: u32,
        size: u64,
    }
    #[repr(C)]
    struct PrimeHandle {
        handle: u32,
        flags: u32,
        fd: i32,
    }
    const CREATE_DUMB: libc::c_ulong = 0xC020_64B2; // DRM_IOWR(0xB2, 32 bytes)
    const HANDLE_TO_FD: libc::c_ulong = 0xC00C_642D; // DRM_IOWR(0x2d, 12 bytes)
    let mut c = CreateDumb {
        height: size / 4096,
        width: 1024,
        bpp: 32,
        flags: 0,
        handle: 0,
        pitch: 0,
        size: 0,
    };
    // SAFETY: the DRM ioctls with correctly laid-out argument structs.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), CREATE_DUMB, &mut c) };
    check(rc == 0, || format!("DRM_IOCTL_MODE_CREATE_DUMB: {}", std::io::Error::last_os_error()))?;
    let mut p =
        PrimeHandle { handle: c.handle, flags: (libc::O_CLOEXEC | libc::O_RDWR) as u32, fd: -1 };
    // SAFETY: as above.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), HANDLE_TO_FD, &mut p) };
    check(rc == 0 && p.fd >= 0, || {
        format!("PRIME_HANDLE_TO_FD: {}", std::io::Error::last_os_error())
    })?;
    // SAFETY: a fresh fd from the kernel, owned from here on (the GEM object lives with it).
    Ok(unsafe { OwnedFd::from_raw_fd(p.fd) })
}

/// Bad dma-buf input: each is an error with one WARN naming the device, the errno and what to
/// check; none crashes or leaks an MR.
fn dmabuf_bad_input() -> Result<(), String> {
    require_vm();
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(1)?;
    let (send, recv) = pair(&drv, ctx, 1, 0)?;
    lines();
    let g = GpuBuf::new(1 << 20)?;
    let mrs = rdma_mrs()?;
    let expect_one_warn = |what: &str, r: Result<Ptr, String>, errno: &str| -> Result<(), String> {
        let e = r.err().ok_or(format!("{what}: registration succeeded"))?;
        check(e.contains("ncclResult 2"), || format!("{what}: {e} (expected ncclSystemError)"))?;
        let (_, warns) = lines();
        check(warns.len() == 1, || format!("{what}: expected one WARN: {warns:?}"))?;
        let w = &warns[0];
        check(
            w.contains("regMrDmaBuf")
                && w.contains("ibv_reg_dmabuf_mr")
                && w.contains("rxe1")
                && w.contains(errno)
                && w.contains("NCCL_DMABUF_ENABLE=0")
                && w.contains("5.12"),
            || format!("{what}: WARN lacks device, errno or advice: {w}"),
        )?;
        eprintln!("gpudirect: {what}: {w}");
        Ok(())
    };
    // A closed fd.
    let fd = g.export()?;
    // SAFETY: closing our own fd before the call.
    unsafe { libc::close(fd) };
    expect_one_warn("closed fd", drv.reg_mr_dmabuf(recv, g.dev, 4096, CUDA, 0, fd), "errno 9")?;
    // A length past the buffer's end.
    let fd = g.export()?;
    let r = drv.reg_mr_dmabuf(recv, g.dev, 2 << 20, CUDA, 0, fd);
    // SAFETY: our fd.
    unsafe { libc::close(fd) };
    expect_one_warn("length past the end", r, "errno 14")?;
    // A real vgem dma-buf that rxe cannot pin.
    let vgem = vgem_dmabuf(1 << 20)?;
    let r = drv.reg_mr_dmabuf(recv, 0x7000_0000 as *mut u8, 1 << 20, CUDA, 0, vgem.as_raw_fd());
    expect_one_warn("vgem dma-buf", r, "errno 14")?;
    drop(vgem);
    let after = rdma_mrs()?;
    check(after == mrs, || format!("rdma MRs {mrs} -> {after} after failed registrations"))?;
    let pinned = standin_log().iter().filter(|l| l.contains("-> mr ")).count();
    check(pinned == 0, || format!("{pinned} stand-in registrations succeeded"))?;
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)?;
    drv.finalize(ctx)
}

/// Peer memory (in the private namespace): CUDA registrations work, data is verified, and
/// each GPU receive is flushed, unless NCCL_GDR_FLUSH_DISABLE=1. Host memory needs no flush.
fn peermem(flush: bool) -> Result<(), String> {
    require_vm();
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(1)?;
    let (info, _) = lines();
    for dev in 0..2 {
        let p = drv.properties(dev)?.ptr_support;
        check(p == HOST | CUDA, || format!("dev {dev}: ptrSupport {p:#x}, expected HOST|CUDA"))?;
    }
    let line = info.iter().find(|l| l.contains("device 1: rxe1 GPUDirect")).cloned();
    let line = line.ok_or("no GPUDirect line")?;
    check(line.contains("/sys/module/nvidia_peermem/version exists"), || line.clone())?;
    let want =
        if flush { "flush: RDMA read after each GPU receive" } else { "NCCL_GDR_FLUSH_DISABLE=1" };
    check(line.contains(want), || format!("expected {want:?}: {line}"))?;
    eprintln!("gpudirect: {line}");
    let (send, recv) = pair(&drv, ctx, 1, 0)?;
    let ba = pair(&drv, ctx, 0, 1)?;
    // GPU memory the CPU cannot touch, registered as NCCL_PTR_CUDA: the stand-in resolves the
    // reserved addresses to the pages behind them, as nvidia-peermem does for the NIC.
    let (mut sgpu, mut rgpu) = (GpuBuf::new(ARENA)?, GpuBuf::new(ARENA)?);
    sgpu.declare_peer(false)?;
    rgpu.declare_peer(false)?;
    let smh = drv.reg_mr_type(send, sgpu.dev, ARENA, CUDA)?;
    let rmh = drv.reg_mr_type(recv, rgpu.dev, ARENA, CUDA)?;
    let back = [
        drv.reg_mr_type(ba.1, sgpu.dev, ARENA, CUDA)?,
        drv.reg_mr_type(ba.0, rgpu.dev, ARENA, CUDA)?,
    ];
    let peer_regs = standin_log().iter().filter(|l| l.starts_with("peer ")).count();
    check(peer_regs == 2, || format!("the stand-in saw {peer_regs} peer registrations, not 2"))?;
    let (s, r) = (|_: usize| smh, |_: usize| rmh);
    let (mut src, mut dst) = (sgpu.mem(), rgpu.mem());
    let how = Recv::Normal { flush };
    traffic(&drv, send, recv, &mut src, &mut dst, &s, &r, how, &schedule()[..12])?;
    small_and_latency(&drv, (send, recv), ba, (&s, &r), back, &mut src, &mut dst, flush)?;
    drv.dereg_mr(recv, rmh)?;
    drv.dereg_mr(ba.1, back[0])?;
    drv.dereg_mr(ba.0, back[1])?;
    // Host memory never needs the flush.
    let mut host = vec![0u8; ARENA];
    let hmh = drv.reg_mr_type(recv, host.as_mut_ptr(), ARENA, HOST)?;
    let (s, r) = (|_: usize| smh, |_: usize| hmh);
    let no_flush = Recv::Normal { flush: false };
    traffic(
        &drv,
        send,
        recv,
        &mut src,
        &mut Mem::of(&mut host),
        &s,
        &r,
        no_flush,
        &schedule()[..8],
    )?;
    drv.dereg_mr(recv, hmh)?;
    drv.dereg_mr(send, smh)?;
    drv.close(Close::Send, ba.0)?;
    drv.close(Close::Recv, ba.1)?;
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)?;
    drv.finalize(ctx)?;
    let (_, warns) = lines();
    check(warns.is_empty(), || format!("WARNs: {warns:?}"))
}

/// A low RLIMIT_MEMLOCK: a WARN at init naming the value and the fixes, and a registration that
/// runs into it fails with ENOMEM and says the same.
fn memlock() -> Result<(), String> {
    require_vm();
    let lib = open_plugin();
    let drv = Driver::new(&lib, 12)?;
    let ctx = drv.init(1)?;
    let (_, warns) = lines();
    check(
        warns.len() == 1
            && warns[0].contains("RLIMIT_MEMLOCK is 1024 KiB")
            && warns[0].contains("ulimit -l")
            && warns[0].contains("--ulimit memlock=-1"),
        || format!("expected one memlock WARN at init: {warns:?}"),
    )?;
    let (send, recv) = pair(&drv, ctx, 1, 0)?;
    let mut big = vec![0u8; 8 << 20];
    let e = drv.reg_mr(recv, big.as_mut_ptr(), big.len()).err().unwrap_or_default();
    check(e.contains("ncclResult 2"), || format!("regMr past the limit: {e:?}"))?;
    let (_, warns) = lines();
    check(
        warns.len() == 1
            && warns[0].contains("errno 12")
            && warns[0].contains("RLIMIT_MEMLOCK is 1024 KiB")
            && warns[0].contains("ulimit -l"),
        || format!("expected one WARN naming ENOMEM and the limit: {warns:?}"),
    )?;
    eprintln!("gpudirect: {}", warns[0]);
    drv.close(Close::Send, send)?;
    drv.close(Close::Recv, recv)?;
    drv.finalize(ctx)
}
