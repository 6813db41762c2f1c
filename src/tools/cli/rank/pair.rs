//! The orchestrator's side of the two ranks (see the [module docs](super)): start them or reach
//! them, relay their handles, and turn each measurement into its commands and replies. Used by
//! `ferroce perf` and `ferroce doctor --peer`.

use std::process::Stdio;
use std::time::Duration;

use ferroce_tools::proc::Proc;

use super::{Lat, Proto, STEP, num};

/// A rank of this host: `ferroce perf-rank` as a child (killed when its [`Proc`] drops, so no
/// error path leaves one behind).
pub fn spawn_rank(role: &str, plugin: &str, dev: &str) -> Result<Proc, String> {
    spawn_rank_under(&[], role, plugin, dev)
}

/// [`spawn_rank`] run by `prefix` (a program and its arguments, e.g. valgrind), if any.
pub fn spawn_rank_under(
    prefix: &[String],
    role: &str,
    plugin: &str,
    dev: &str,
) -> Result<Proc, String> {
    let args = ["perf-rank", role, plugin, dev];
    let mut cmd = match prefix.split_first() {
        None => Proc::me(&args),
        Some((program, rest)) => {
            let me = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
            let mut c = std::process::Command::new(program);
            c.args(rest).arg(me).args(args);
            c
        }
    };
    cmd.stdin(Stdio::piped());
    Proc::spawn(&format!("rank {role} ({dev})"), cmd)
}

/// The plugin and the two devices of a pair of ranks on this host, as `ferroce instructions`
/// and `ferroce connections` take them.
#[derive(clap::Args)]
pub struct LocalPair {
    /// The plugin as NCCL_NET_PLUGIN names it, or a path [default: libnccl-net-ferroce.so next
    /// to this program, else `ferroce`]
    #[arg(long, value_name = "NAME_OR_PATH")]
    plugin: Option<String>,
    /// Device of rank 0, the sender [default: the first device the plugin offers]
    #[arg(long, value_name = "D", default_value = "0")]
    dev_send: String,
    /// Device of rank 1, the receiver [default: the second device]
    #[arg(long, value_name = "D", default_value = "1")]
    dev_recv: String,
}

impl LocalPair {
    /// The plugin as given, or the default one.
    pub fn plugin(&self) -> String {
        self.plugin.clone().unwrap_or_else(ferroce_tools::loader::default_plugin)
    }

    /// Starts the two ranks, each run by `prefix(role)` (see [`spawn_rank_under`]), past their
    /// `HANDLE` lines.
    pub fn open(&self, prefix: impl Fn(&str) -> Vec<String>) -> Result<Pair, String> {
        let plugin = self.plugin();
        let recv = spawn_rank_under(&prefix("recv"), "recv", &plugin, &self.dev_recv)?;
        Pair::open(recv, spawn_rank_under(&prefix("send"), "send", &plugin, &self.dev_send)?)
    }
}

/// The receiving rank on another host: the `ferroce perf --listen` at `addr` (`HOST:PORT`).
pub fn remote_rank(addr: &str) -> Result<Proc, String> {
    Proc::connect(&format!("rank recv at {addr}"), addr)
}

/// One rank as its `HANDLE` line describes it.
pub struct RankInfo {
    /// The plugin's handle, in hex, for the other rank's `PEER`.
    handle: String,
    /// The device as the plugin names it (`rxe0`, `mlx5_0:1`).
    pub name: String,
    /// Its index among the devices the plugin offers on that rank's host.
    pub index: String,
}

/// The orchestrator's side of the two ranks, past their `HANDLE` lines: what `ferroce perf`
/// and `ferroce doctor --peer` share. Dropping it kills a child rank that is still running.
pub struct Pair {
    recv: Proc,
    send: Proc,
    pub tx: RankInfo,
    pub rx: RankInfo,
}

/// How long the orchestrator waits for one reply; a rank gives up on a step after [`STEP`].
const LIMIT: Duration = Duration::from_secs(STEP.as_secs() + 60);

impl Pair {
    pub fn open(mut recv: Proc, mut send: Proc) -> Result<Pair, String> {
        let handle = |p: &mut Proc, other: &mut Proc| match &p.answer("HANDLE", LIMIT, other)?[..] {
            [handle, name, index] => {
                Ok(RankInfo { handle: handle.clone(), name: name.clone(), index: index.clone() })
            }
            w => Err(format!("{}: bad HANDLE line {w:?}", p.name)),
        };
        let rx = handle(&mut recv, &mut send)?;
        let tx = handle(&mut send, &mut recv)?;
        Ok(Pair { recv, send, tx, rx })
    }

    /// `ferroce doctor --peer`: a sending rank on this host's `dev`, and the `ferroce perf
    /// --listen` at `addr` as the receiving one.
    pub fn to_peer(addr: &str, plugin: &str, dev: &str) -> Result<Pair, String> {
        Pair::open(remote_rank(addr)?, spawn_rank("send", plugin, dev)?)
    }

    /// The receiving rank's port facts (`doctor::port_facts`); only before [`Pair::connect`].
    pub fn port(&mut self) -> Result<String, String> {
        self.recv.tell("PORT")?;
        Ok(self.recv.answer("PORT", LIMIT, &mut self.send)?.join(" "))
    }

    /// Connects each rank to the other through the plugin.
    pub fn connect(&mut self) -> Result<(), String> {
        self.recv.tell(&format!("PEER {}", self.tx.handle))?;
        self.send.tell(&format!("PEER {}", self.rx.handle))?;
        self.recv.answer("READY", LIMIT, &mut self.send)?;
        self.send.answer("READY", LIMIT, &mut self.recv)?;
        Ok(())
    }

    /// One bandwidth run of `size`-byte messages, `window` in flight, for `secs` after `warm`
    /// or (given) `msgs` timed messages: the bytes and seconds the receiver timed.
    pub fn bw(
        &mut self,
        size: usize,
        window: usize,
        secs: f64,
        warm: f64,
        msgs: Option<u64>,
    ) -> Result<(f64, f64), String> {
        let cap = msgs.map_or(String::new(), |m| format!(" {m}"));
        self.recv.tell(&format!("BW {size} {window} {secs} {warm}{cap}"))?;
        self.send.tell(&format!("BW {size} {window}"))?;
        let posted =
            self.recv.answer("POSTED", LIMIT + Duration::from_secs_f64(secs), &mut self.send)?;
        self.send.tell(&format!("STOP {}", posted.first().ok_or("POSTED without a count")?))?;
        self.send.answer("SENT", LIMIT, &mut self.recv)?;
        let r = self.recv.answer("BW", LIMIT, &mut self.send)?;
        let bytes = num("BW bytes", r.first().map(String::as_str))?;
        Ok((bytes, num("BW seconds", r.get(1).map(String::as_str))?))
    }

    /// One ping-pong run with `depth` receives posted ahead: the median, the mean and the
    /// minimum half round trip, in us.
    pub fn lat(
        &mut self,
        size: usize,
        (iters, warm): (usize, usize),
        depth: usize,
        proto: Proto,
    ) -> Result<Lat, String> {
        let cmd = format!("LAT {size} {iters} {warm} {depth} {}", proto.word());
        self.recv.tell(&cmd)?;
        self.send.tell(&cmd)?;
        let r = self.send.answer("LAT", LIMIT, &mut self.recv)?;
        self.recv.answer("LAT", LIMIT, &mut self.send)?;
        let word = |i: usize, what: &str| num(what, r.get(i).map(String::as_str));
        Ok(Lat { p50: word(0, "LAT p50")?, avg: word(1, "LAT mean")?, min: word(2, "LAT min")? })
    }

    /// The process ids of the two ranks (sender, receiver), where both are children here.
    pub fn pids(&self) -> Option<(u32, u32)> {
        self.send.pid().zip(self.recv.pid())
    }

    /// Tells one rank (the sender, or the receiver) `cmd` and waits up to `limit` for its
    /// reply `word`: the reply's other words.
    pub fn ask(
        &mut self,
        sender: bool,
        cmd: &str,
        word: &str,
        limit: Duration,
    ) -> Result<Vec<String>, String> {
        let (one, other) = if sender {
            (&mut self.send, &mut self.recv)
        } else {
            (&mut self.recv, &mut self.send)
        };
        one.tell(cmd)?;
        one.answer(word, limit, other)
    }

    /// Tells both ranks their command, then waits for both replies `word`: (the sender's, the
    /// receiver's).
    pub fn ask_both(
        &mut self,
        (to_send, to_recv): (&str, &str),
        word: &str,
        limit: Duration,
    ) -> Result<(Vec<String>, Vec<String>), String> {
        self.send.tell(to_send)?;
        self.recv.tell(to_recv)?;
        let s = self.send.answer(word, limit, &mut self.recv)?;
        Ok((s, self.recv.answer(word, limit, &mut self.send)?))
    }

    /// Ends both ranks, each saying `BYE`, and waits up to `limit` for both to exit cleanly.
    pub fn quit_and_wait(&mut self, limit: Duration) -> Result<(), String> {
        self.quit()?;
        self.send.exits_ok(limit)?;
        self.recv.exits_ok(limit)
    }

    /// Ends both ranks, each saying `BYE`.
    pub fn quit(&mut self) -> Result<(), String> {
        self.recv.tell("QUIT")?;
        self.send.tell("QUIT")?;
        self.recv.answer("BYE", LIMIT, &mut self.send)?;
        self.send.answer("BYE", LIMIT, &mut self.recv)?;
        Ok(())
    }
}
