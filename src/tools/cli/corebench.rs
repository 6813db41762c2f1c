//! `ferroce core-bench [MESSAGES] [normal|optional] [--depth N]`: the cost per message of the
//! data path's protocol core on this host, with no NIC: a send core and a receive core wired
//! back to back through an in-memory loopback that carries the CTS rows and the immediates
//! (data bytes are not copied). One message is an irecv, an isend, the completions and both
//! tests, with receives posted ahead as NCCL posts them: what the plugin does per message
//! besides the verbs calls themselves. Prints ns, doorbells (posts to a send queue, each a
//! system call on Soft-RoCE) and CTS writes per message; run it under
//! `valgrind --tool=callgrind` for instructions per message, which do not depend on the
//! machine's load.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ferroce::wr::{Completion, Op, SendWr};
use ferroce_core::data::{
    Buf, FIFO_AREA, MAX_MEMBERS, Params, Post, RecvCore, Remote, Repair, SIZE_AREA, SendCore, Words,
};

/// Regions, told apart by the top bits of their fake addresses.
const FIFO: u64 = 1 << 40;
const RECV_STAGE: u64 = 2 << 40;
const SEND_STAGE: u64 = 3 << 40;
const SIZES: u64 = 4 << 40;
const DATA: u64 = 5 << 40;

struct Region {
    base: u64,
    words: Vec<Cell<u64>>,
}

impl Region {
    fn new(base: u64, n: usize) -> Region {
        Region { base, words: (0..n).map(|_| Cell::new(0)).collect() }
    }
}

impl Words for Region {
    fn load(&self, w: usize) -> u64 {
        self.words[w].get()
    }
    fn store(&self, w: usize, v: u64) {
        self.words[w].set(v)
    }
    fn addr(&self, w: usize) -> u64 {
        self.base + 8 * w as u64
    }
    fn lkey(&self, _member: usize) -> u32 {
        1
    }
}

/// Executes work requests as they are posted: CTS rows land in the FIFO, size records in the
/// size area, immediates become the receiver's completions. Counts what the
/// NIC would see: each `send` call is one doorbell; a write into the FIFO is a CTS write.
struct Loopback<'a> {
    regions: [&'a Region; 4],
    cq: &'a RefCell<[VecDeque<Completion>; 2]>,
    rq: &'a RefCell<VecDeque<u64>>,
    side: usize,
    doorbells: u64,
    cts_writes: u64,
}

impl Loopback<'_> {
    fn copy(&self, from: u64, to: u64, len: u32) {
        let find = |a: u64| self.regions.iter().find(|r| a >> 40 == r.base >> 40).copied();
        if let (Some(src), Some(dst)) = (find(from), find(to)) {
            let (s, d) = (((from - src.base) / 8) as usize, ((to - dst.base) / 8) as usize);
            for i in 0..len as usize / 8 {
                dst.store(d + i, src.load(s + i));
            }
        }
    }
}

impl Post for Loopback<'_> {
    fn send(&mut self, _qp: usize, wrs: &[SendWr]) -> ferroce::error::Result<()> {
        self.doorbells += 1;
        let mut cq = self.cq.borrow_mut();
        for w in wrs {
            if let Some((addr, len, _)) = w.local {
                self.copy(addr, w.remote_addr, len);
                self.cts_writes += u64::from(w.remote_addr >> 40 == FIFO >> 40);
            }
            if let Op::WriteImm(imm) = w.op {
                let wr_id = self.rq.borrow_mut().pop_front().expect("a receive is posted");
                cq[1 - self.side].push_back(Completion {
                    wr_id,
                    imm: Some(imm),
                    ..Default::default()
                });
            }
            if w.signaled {
                cq[self.side].push_back(Completion { wr_id: w.wr_id, ..Default::default() });
            }
        }
        Ok(())
    }
    fn recv(&mut self, _qp: usize, wr_id: u64, n: usize) -> ferroce::error::Result<()> {
        self.rq.borrow_mut().extend(std::iter::repeat_n(wr_id, n));
        Ok(())
    }
    fn fresh(&mut self, qp: usize) -> ferroce::error::Result<u32> {
        Err(ferroce::error::Error::Internal(format!("core-bench has one lane, no repair of {qp}")))
    }
    fn join(&mut self, qp: usize, _peer: u32, _psns: (u32, u32)) -> ferroce::error::Result<()> {
        self.fresh(qp).map(|_| ())
    }
    fn fence(&mut self, qp: usize) -> ferroce::error::Result<()> {
        self.fresh(qp).map(|_| ())
    }
}

/// What `n` messages cost: the time, and per message the doorbells (send-queue posts) of
/// both ends and the CTS writes.
struct Cost {
    time: Duration,
    doorbells: f64,
    cts: f64,
}

/// Runs `n` messages of `size` bytes the way NCCL's proxy drives a channel: `depth` receives
/// posted ahead, and per message an isend, the completions of both ends (each followed by the
/// progress step a comm runs after draining its CQ), both tests, and the irecv that refills
/// the window. `optional`: the receives are optional (NCCL's LL), which go whole, as whole
/// messages do.
fn run(n: usize, size: u64, inline: u32, optional: bool, depth: usize) -> Result<Cost, String> {
    let fifo = Region::new(FIFO, FIFO_AREA);
    let rstage = Region::new(RECV_STAGE, FIFO_AREA);
    let sstage = Region::new(SEND_STAGE, SIZE_AREA);
    let sizes = Region::new(SIZES, SIZE_AREA);
    let regions = [&fifo, &rstage, &sstage, &sizes];
    let cq = RefCell::new([VecDeque::new(), VecDeque::new()]);
    let rq = RefCell::new(VecDeque::new());
    let params = Params {
        nqps: 1,
        split: false,
        max_msg: 1 << 23,
        inline: vec![inline],
        progress_timeout: Duration::from_secs(60),
        probe_interval: Duration::from_secs(60),
        mark: ferroce_core::data::MARK_BYTES,
        path_aware: true,
        timed_from: ferroce_core::data::TIMED_FROM,
        journal: false,
        failover: true,
        stall: None,
        members: Vec::new(),
        repair: Repair {
            attempts: 0,
            delay: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
        },
        path: Default::default(),
    };
    let mut send = SendCore::new(params.clone(), Remote { addr: SIZES, rkeys: [1; MAX_MEMBERS] });
    let mut recv = RecvCore::new(params, Remote { addr: FIFO, rkeys: [1; MAX_MEMBERS] });
    let lo = |side| Loopback { regions, cq: &cq, rq: &rq, side, doorbells: 0, cts_writes: 0 };
    let (mut sio, mut rio) = (lo(0), lo(1));
    let e = |e: ferroce::error::Error| e.to_string();
    let buf =
        Buf { addr: DATA, size, lkeys: [1; MAX_MEMBERS], rkeys: [1; MAX_MEMBERS], host: true };
    let mut got = [0u64; 8];
    let mut posted = VecDeque::with_capacity(depth);
    let t = Instant::now();
    for i in 0..n + depth {
        if i < n {
            let r = recv.irecv(&rstage, &mut rio, &[(buf, 0)], optional).map_err(e)?;
            posted.push_back(r.ok_or(format!("irecv {i} found no free slot"))?);
        }
        if i < depth {
            continue;
        }
        let m = i - depth;
        let s = send.isend(&fifo, &sstage, &mut sio, buf, 0).map_err(e)?;
        let s = s.ok_or(format!("isend {m} found no CTS"))?;
        while let Some(c) = cq.borrow_mut()[0].pop_front() {
            send.complete(&c);
        }
        send.idle(Duration::ZERO, None, &mut sio, (&fifo, &sstage)).map_err(e)?;
        while let Some(c) = cq.borrow_mut()[1].pop_front() {
            recv.complete(&c, &sizes);
        }
        recv.idle(Duration::ZERO, None, &mut rio, &rstage, &sizes).map_err(e)?;
        let r = posted.pop_front().ok_or("no receive posted")?;
        let done = send.test(s).map_err(e)?.zip(recv.test(r, &mut got).map_err(e)?);
        if done.is_none() || got[0] != size {
            return Err(format!("message {m} did not complete ({done:?}, size {})", got[0]));
        }
    }
    let per = |x: u64| x as f64 / n as f64;
    Ok(Cost {
        time: t.elapsed(),
        doorbells: per(sio.doorbells + rio.doorbells),
        cts: per(rio.cts_writes),
    })
}

/// The protocol core's cost per message on this host, with no NIC
///
/// Every configuration, or only 8-byte messages with normal or optional receives (one
/// instruction count each under callgrind).
#[derive(clap::Args)]
pub struct Args {
    /// Messages per configuration
    #[arg(default_value_t = 1_000_000)]
    messages: usize,
    /// Only 8-byte messages with this kind of receive
    #[arg(value_enum)]
    only: Option<Only>,
    /// With a kind of receive: the message size in bytes
    #[arg(long, default_value_t = 8, requires = "only")]
    size: u64,
    /// Receives posted ahead (NCCL's proxy: 8 steps per channel)
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=32))]
    depth: u16,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Only {
    Normal,
    Optional,
}

pub fn core_bench(a: &Args) -> Result<(), String> {
    let n = a.messages;
    let all =
        [(8, 512, false), (8, 512, true), (8, 0, false), (4096, 512, false), (1 << 20, 512, false)];
    let one = |optional| [(a.size, 512, optional)];
    let configs = match a.only {
        None => all.to_vec(),
        Some(Only::Normal) => one(false).to_vec(),
        Some(Only::Optional) => one(true).to_vec(),
    };
    let depth = usize::from(a.depth);
    println!(
        "protocol core, one message = irecv + isend + completions + both tests, {depth} receives \
         posted ahead ({n} messages)"
    );
    for (size, inline, optional) in configs {
        let c = run(n, size, inline, optional, depth)?;
        let kind = if optional { "optional" } else { "normal" };
        println!(
            "  {size:>8} B, inline {inline:>3}, {kind:>8} receive: {:>6.1} ns/message, \
             {:.3} doorbells/message, {:.3} CTS writes/message",
            c.time.as_nanos() as f64 / n as f64,
            c.doorbells,
            c.cts
        );
    }
    Ok(())
}
