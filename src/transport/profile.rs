//! Net profiler events (ABI v10+): one event per request per queue-pair post, as NCCL's own
//! transport reports them, so profiler plugins and Nsight see the network's work.
//!
//! The core journals what it posts ([`ferroce_core::data::Posted`]) only when a comm has a
//! profiler; the comm turns each entry into a start event keyed by the `phandle` NCCL gave the
//! request, and stops a request's events when `test` reports it done (or when the comm
//! closes). `ffi` implements [`Profiler`] over NCCL's callback.

use std::sync::Arc;

use ferroce_core::data::{MAX_RECVS, Posted, SLOTS};

/// `IBV_WR_RDMA_WRITE` and `IBV_WR_RDMA_WRITE_WITH_IMM`, the opcodes events report.
pub const WR_RDMA_WRITE: i32 = 0;
pub const WR_RDMA_WRITE_WITH_IMM: i32 = 1;

/// The most events a request starts: NCCL's own transport holds at most this many per request
/// (`MAX_QPS_PER_REQ`, asserted), and profiler plugins keep as many per step, unchecked. A
/// request split over more lanes, or with chunks sent again after a lane failed, reports its
/// first ones only.
pub const MAX_EVENTS: usize = 8;

/// What one event says: the member port, the work request, the queue pair, the request's
/// bytes in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpEvent {
    pub device: i32,
    pub wr_id: u64,
    pub opcode: i32,
    pub qpn: u32,
    pub length: u64,
}

/// Where events go. `phandle` is NCCL's opaque per-request handle (never NULL here); `start`
/// returns the event's handle, which `stop` gets back once.
pub trait Profiler: Send + Sync {
    fn start(&self, phandle: usize, e: &QpEvent) -> usize;
    fn stop(&self, event: usize);
}

/// A comm's events: each request's `phandle` (by key, `slot * MAX_RECVS + buffer`) and the
/// events it has open. The lists keep their capacity, so a steady run allocates nothing.
pub struct Events {
    profiler: Arc<dyn Profiler>,
    phandles: Vec<usize>,
    open: Vec<Vec<usize>>,
}

impl Events {
    pub fn new(profiler: Arc<dyn Profiler>) -> Events {
        let n = SLOTS * MAX_RECVS;
        Events { profiler, phandles: vec![0; n], open: vec![Vec::new(); n] }
    }

    /// Request key `key` was handed out with `phandle` (0: NCCL gave none, no events).
    pub fn handed(&mut self, key: usize, phandle: usize) {
        if let Some(p) = self.phandles.get_mut(key) {
            *p = phandle;
        }
    }

    /// A journal entry: the start of its event, on queue pair `qpn`.
    pub fn posted(&mut self, p: &Posted, qpn: u32, port: usize) {
        let Some(&phandle) = self.phandles.get(p.key) else { return };
        if phandle == 0 || self.open[p.key].len() >= MAX_EVENTS {
            return;
        }
        let opcode = if p.imm { WR_RDMA_WRITE_WITH_IMM } else { WR_RDMA_WRITE };
        let e = QpEvent { device: port as i32, wr_id: p.wr_id, opcode, qpn, length: p.len };
        let handle = self.profiler.start(phandle, &e);
        self.open[p.key].push(handle);
    }

    /// Request key `key` is done: its events stop, and its handle is forgotten (a row sent
    /// again after a lane failed may name a finished receive; NCCL may have freed its handle).
    pub fn done(&mut self, key: usize) {
        self.handed(key, 0);
        if let Some(open) = self.open.get_mut(key) {
            for h in open.drain(..) {
                self.profiler.stop(h);
            }
        }
    }
}

impl Drop for Events {
    /// A comm closed with requests NCCL never saw complete: their events stop with it.
    fn drop(&mut self) {
        for key in 0..self.open.len() {
            self.done(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records starts (phandle, event) and stops; event handles count from 1.
    #[derive(Default)]
    struct Recorder {
        starts: Mutex<Vec<(usize, QpEvent)>>,
        stops: Mutex<Vec<usize>>,
    }

    impl Profiler for Recorder {
        fn start(&self, phandle: usize, e: &QpEvent) -> usize {
            let mut s = self.starts.lock().unwrap();
            s.push((phandle, *e));
            s.len()
        }
        fn stop(&self, event: usize) {
            self.stops.lock().unwrap().push(event);
        }
    }

    fn posted(key: usize, len: u64, imm: bool) -> Posted {
        Posted { key, wr_id: 7, imm, lane: 1, len }
    }

    /// Events start only for requests NCCL gave a handle, stop once when the request is done
    /// (or when the comm closes), and never start again for a finished request.
    #[test]
    fn events_start_per_post_and_stop_once() {
        let rec = Arc::new(Recorder::default());
        let mut ev = Events::new(rec.clone());
        ev.handed(3, 0xa0);
        ev.handed(4, 0);
        ev.handed(9, 0xb0);
        ev.posted(&posted(3, 100, false), 0x11, 0);
        ev.posted(&posted(3, 28, true), 0x12, 0);
        ev.posted(&posted(4, 50, true), 0x11, 0); // no handle: no event
        ev.posted(&posted(9, 5, true), 0x11, 0);
        let starts = rec.starts.lock().unwrap().clone();
        let want = QpEvent { device: 0, wr_id: 7, opcode: WR_RDMA_WRITE, qpn: 0x11, length: 100 };
        assert_eq!(starts[0], (0xa0, want));
        assert_eq!(starts[1].1.opcode, WR_RDMA_WRITE_WITH_IMM);
        assert_eq!((starts.len(), starts[2].0), (3, 0xb0));
        ev.done(3);
        assert_eq!(*rec.stops.lock().unwrap(), vec![1, 2]);
        ev.done(3);
        ev.posted(&posted(3, 32, false), 0x11, 0); // after it ended: nothing
        assert_eq!((rec.starts.lock().unwrap().len(), rec.stops.lock().unwrap().len()), (3, 2));
        drop(ev);
        assert_eq!(*rec.stops.lock().unwrap(), vec![1, 2, 3], "the open one stops at close");
    }

    /// A request posted on more queue pairs than NCCL's profiler holds events for (split over
    /// 12 lanes) starts its first 8 only, and stops each of those once.
    #[test]
    fn a_request_starts_at_most_max_events() {
        let rec = Arc::new(Recorder::default());
        let mut ev = Events::new(rec.clone());
        ev.handed(5, 0xc0);
        for qp in 0..12 {
            ev.posted(&posted(5, 10, qp == 11), 0x20 + qp, 0);
        }
        assert_eq!(rec.starts.lock().unwrap().len(), MAX_EVENTS);
        ev.done(5);
        assert_eq!(*rec.stops.lock().unwrap(), (1..=MAX_EVENTS).collect::<Vec<_>>());
    }
}
