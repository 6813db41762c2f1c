//! `ferroce`: user-facing checks of the plugin, run through its C ABI exactly as NCCL uses it.
//!
//! - `ferroce load [NAME]`: opens the plugin the way `NCCL_NET_PLUGIN=NAME` does (default
//!   `ferroce`, so `libnccl-net-ferroce.so` on `LD_LIBRARY_PATH`) and checks every exported
//!   table `ncclNetPlugin_v6` … `_v12`.
//! - `ferroce info [NAME]`: also initialises it and describes each device NCCL would see.
//! - `ferroce perf`: the benchmark, on one host or between two ([`perf`]).
//! - `ferroce doctor`: this host's RoCE set-up explained, with what blocks NCCL ([`doctor`]).
//! - `ferroce knobs`: every knob, what it is here and where that came from ([`knobs`]).
//! - `ferroce collective allreduce|allgather|reducescatter`: ring collectives over N ranks with
//!   nccl-tests' table ([`collective`]).
//! - `ferroce core-bench`: the protocol core's cost per message on this host ([`corebench`]).
//! - `ferroce instructions`: a plugin's user-space instructions per call, under callgrind
//!   ([`instructions`]).
//! - `ferroce connections`: what a plugin holds per connection, at 1, 64 and 1,024 pairs
//!   ([`connections`]).
//! - `ferroce completions SHELL`: a completion script for bash, zsh, fish, elvish or PowerShell.
//! - `ferroce man`: the manual page, in roff.
//!
//! The command line is parsed by clap, so every subcommand has `--help` and its errors look
//! alike. Exit status 0 on success, 1 on any failure, a bad command line included (with the
//! reason on stderr): scripts and tests tell success from failure by that alone.
//!
//! No `unsafe` here: what needs it (opening and calling the plugin, its buffers, the few
//! system calls) is the `ferroce_tools` library's, behind safe functions.
#![forbid(unsafe_code)]

use std::io::Write;
use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, Subcommand};
use ferroce_tools::loader::Library;

mod collective;
mod connections;
mod corebench;
mod doctor;
mod info;
mod instructions;
mod knobs;
mod perf;
mod ports;
mod rank;

#[derive(Parser)]
#[command(
    name = "ferroce",
    version,
    about = "Checks, benchmarks and diagnoses the ferroce NCCL \
network plugin through its C ABI, as NCCL uses it"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Open the plugin as NCCL_NET_PLUGIN=NAME does and check ncclNetPlugin_v6..v12
    Load {
        /// The plugin as NCCL_NET_PLUGIN names it, or a path
        #[arg(default_value = "ferroce")]
        name: String,
    },
    /// Also initialise the plugin and describe each device NCCL would see
    Info {
        /// The plugin as NCCL_NET_PLUGIN names it, or a path
        #[arg(default_value = "ferroce")]
        name: String,
    },
    Perf(perf::Args),
    /// One rank of `ferroce perf`, driven over its stdin and stdout (not run by hand)
    #[command(hide = true)]
    PerfRank(rank::serve::RankArgs),
    Doctor(doctor::Args),
    /// Every knob the plugin reads: its value here, set by the environment or the default
    Knobs,
    Collective(collective::Args),
    CoreBench(corebench::Args),
    Instructions(instructions::Args),
    Connections(connections::Args),
    /// Print a completion script for SHELL on stdout
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff) on stdout: `ferroce man | man -l -`
    Man,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => return usage(e),
    };
    let result = match cli.cmd {
        Cmd::Load { name } => load(&name).map(drop),
        Cmd::Info { name } => load(&name).and_then(|lib| info::info(&lib)),
        Cmd::Perf(a) => match a.opts() {
            Ok(o) => perf::perf(&o),
            Err(e) => return usage(invalid("perf", e)),
        },
        Cmd::PerfRank(a) => rank::serve::rank(&a),
        Cmd::Doctor(a) => doctor::doctor(&a),
        Cmd::Knobs => knobs::knobs(),
        Cmd::Collective(a) => match a.check() {
            Ok(()) => collective::collective(&a),
            Err(e) => return usage(invalid("collective", e)),
        },
        Cmd::CoreBench(a) => corebench::core_bench(&a),
        Cmd::Instructions(a) => instructions::instructions(&a),
        Cmd::Connections(a) => connections::connections(&a),
        Cmd::Completions { shell } => {
            // Written whole, so that a closed pipe is an error here, not a panic in clap.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "ferroce", &mut script);
            std::io::stdout().write_all(&script).map_err(|e| format!("completions: {e}"))
        }
        Cmd::Man => {
            let mut page = Vec::new();
            let man = clap_mangen::Man::new(Cli::command());
            man.render(&mut page)
                .and_then(|()| std::io::stdout().write_all(&page))
                .map_err(|e| format!("man: {e}"))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferroce: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Prints clap's message: help and version on stdout with status 0, a bad command line on
/// stderr with status 1 (not clap's 2: every failure of `ferroce` is 1).
fn usage(e: clap::Error) -> ExitCode {
    let _ = e.print();
    if e.use_stderr() { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}

/// A rule of `sub`'s options that clap's own checks do not express, as clap reports its own:
/// the reason, then the subcommand's usage.
fn invalid(sub: &str, why: String) -> clap::Error {
    let mut cmd = Cli::command();
    cmd.build();
    match cmd.find_subcommand_mut(sub) {
        Some(sub) => sub.error(ErrorKind::ArgumentConflict, why),
        None => cmd.error(ErrorKind::ArgumentConflict, why),
    }
}

fn load(name: &str) -> Result<Library, String> {
    let lib = Library::open_like_nccl(name)?;
    println!("loaded {name:?} as {}", lib.opened_as);
    for &v in ferroce::ffi::VERSIONS {
        let sym = format!("ncclNetPlugin_v{v}");
        let n = lib.table_name(v).ok_or_else(|| format!("{} lacks {sym}", lib.opened_as))?;
        if n != "ferroce" {
            return Err(format!("{sym} has name {n:?}"));
        }
        println!("  {sym} name={n:?}");
    }
    Ok(lib)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }
}
