//! The other processes of a test or benchmark, talked to one line at a time: a child (usually
//! this program again, in another role) over its stdin and stdout, or the rank of `ferroce perf
//! --listen` on another host over TCP. Used by `ferroce perf`, `doctor --peer` and `collective`
//! and by the multi-process tests.
//!
//! Every read is bounded and a child is killed when its `Proc` drops, so no error path of the
//! caller leaves a rank behind or waits for one forever.

use std::io::{BufRead, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Lines from a pipe or socket, read by a thread so that the reader can poll for them inside a
/// busy loop and bound every wait.
pub fn lines_of(r: impl std::io::Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// One process at the other end of a line protocol.
pub struct Proc {
    /// How errors name it: "rank recv (rxe1)", "send".
    pub name: String,
    /// `None` for a peer reached over TCP.
    child: Option<Child>,
    /// Its stdin (when the command piped it) or the socket; `None` once hung up.
    input: Option<Box<dyn Write + Send>>,
    /// Its stdout lines, in order; disconnected at its end of file.
    pub lines: Receiver<String>,
}

impl Proc {
    /// This program, to be run again with `args` (another role of a test or tool).
    pub fn me(args: &[&str]) -> Command {
        let mut c = Command::new(std::env::current_exe().expect("current_exe"));
        c.args(args);
        c
    }

    /// Starts `cmd` with its stdout read line by line; its stdin is a pipe to [`Proc::tell`]
    /// through when the command sets `Stdio::piped()`.
    pub fn spawn(name: &str, mut cmd: Command) -> Result<Proc, String> {
        let mut child =
            cmd.stdout(Stdio::piped()).spawn().map_err(|e| format!("starting {name}: {e}"))?;
        let Some(out) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{name}: no stdout pipe"));
        };
        let input = child.stdin.take().map(|s| Box::new(s) as Box<dyn Write + Send>);
        Ok(Proc { name: name.into(), child: Some(child), input, lines: lines_of(out) })
    }

    /// The peer listening at `addr` (`HOST:PORT`), over TCP; every address it resolves to is
    /// tried, for 10 s each.
    pub fn connect(name: &str, addr: &str) -> Result<Proc, String> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| format!("{addr}: not an address (HOST:PORT): {e}"))?
            .collect();
        let mut err = format!("{addr}: no address");
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(10)) {
                Ok(s) => {
                    // Each line is a message the other side waits for.
                    let _ = s.set_nodelay(true);
                    let r = s.try_clone().map_err(|e| format!("{name}: {e}"))?;
                    let input = Some(Box::new(s) as Box<dyn Write + Send>);
                    return Ok(Proc { name: name.into(), child: None, input, lines: lines_of(r) });
                }
                Err(e) if a.to_string() == addr => err = format!("{addr}: {e}"),
                Err(e) => err = format!("{addr} ({a}): {e}"),
            }
        }
        Err(err)
    }

    /// Sends one line.
    pub fn tell(&mut self, line: &str) -> Result<(), String> {
        let input = self.input.as_mut().ok_or_else(|| format!("{}: no input", self.name))?;
        writeln!(input, "{line}")
            .and_then(|_| input.flush())
            .map_err(|e| format!("{}: writing {line:?}: {e}", self.name))
    }

    /// Closes its input (the end of its commands).
    pub fn hang_up(&mut self) {
        self.input = None;
    }

    /// The child's process id (`None` for a peer over TCP).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its exit status once it has exited; `None` while it runs (or for a peer over TCP).
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>, String> {
        match self.child.as_mut() {
            Some(c) => c.try_wait().map_err(|e| format!("{}: {e}", self.name)),
            None => Ok(None),
        }
    }

    /// The next line, within `limit`.
    pub fn next(&self, limit: Duration) -> Result<String, String> {
        self.lines
            .recv_timeout(limit)
            .map_err(|_| format!("{}: no output within {limit:?} (it failed or hung)", self.name))
    }

    /// The next line, which must start with `want`, within `limit`.
    pub fn expect(&self, want: &str, limit: Duration) -> Result<String, String> {
        match self.lines.recv_timeout(limit) {
            Ok(l) if l.starts_with(want) => Ok(l),
            Ok(l) => Err(format!("{}: expected {want:?}, got {l:?}", self.name)),
            Err(_) => {
                Err(format!("{}: no {want:?} within {limit:?} (it failed or hung)", self.name))
            }
        }
    }

    /// The handle, in hex, of its next line, which must be a [`crate::rank::handle_line`]
    /// (with any words after it), within `limit`: what to pass to the sending rank.
    pub fn handle(&self, limit: Duration) -> Result<String, String> {
        let line = self.expect("HANDLE ", limit)?;
        crate::rank::handle_in(&line).map_err(|e| format!("{}: {e}", self.name))?;
        Ok(line.split_whitespace().nth(1).unwrap_or_default().to_string())
    }

    /// The words after `word` in the next line that starts with it; other lines are passed on
    /// to stderr (they are its diagnostics, not answers). Fails as soon as `other` fails: this
    /// one might otherwise wait for a peer that is gone until its own limit.
    pub fn answer(
        &mut self,
        word: &str,
        limit: Duration,
        other: &mut Proc,
    ) -> Result<Vec<String>, String> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.min(Duration::from_millis(500))) {
                Ok(line) => {
                    let mut w = line.split_whitespace();
                    if w.next() == Some(word) {
                        return Ok(w.map(str::to_string).collect());
                    }
                    eprintln!("{}: {line}", self.name);
                }
                Err(RecvTimeoutError::Timeout) => {
                    // A rank that failed exits 1; one that finished its commands exits 0.
                    if let Ok(Some(st)) = other.try_wait()
                        && !st.success()
                    {
                        return Err(format!("{} exited ({st}); see above", other.name));
                    }
                    if left.is_zero() {
                        return Err(format!("{}: no {word} within {limit:?}", self.name));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let Some(child) = self.child.as_mut() else {
                        return Err(format!("{} closed the connection before {word}", self.name));
                    };
                    let st = child.wait().map_or_else(|e| e.to_string(), |s| s.to_string());
                    return Err(format!("{} exited ({st}) before {word}; see above", self.name));
                }
            }
        }
    }

    /// Kills it now (if it still runs) and reaps it: its exit status.
    pub fn kill(&mut self) -> Result<ExitStatus, String> {
        let child = self.child.as_mut().ok_or_else(|| format!("{}: not a child", self.name))?;
        let _ = child.kill();
        child.wait().map_err(|e| format!("{}: {e}", self.name))
    }

    /// Waits up to `limit` for it to exit, and kills it after that: its status, or `None` when
    /// it had to be killed (or is a peer over TCP).
    pub fn finish(&mut self, limit: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// Waits up to `limit` for it to exit, which must be with status 0.
    pub fn exits_ok(&mut self, limit: Duration) -> Result<(), String> {
        match self.finish(limit) {
            Some(st) if st.success() => Ok(()),
            Some(st) => Err(format!("{} exited with {st}", self.name)),
            None => Err(format!("{} did not exit within {limit:?}", self.name)),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}
