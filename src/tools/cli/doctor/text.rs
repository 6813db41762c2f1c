//! `ferroce doctor`'s text report: one screen per port, then the fusion, the limits and the
//! environment, the peer and the self-test, the advice and the findings.

use std::fmt::Write as _;

use ferroce::transport::gid;

use super::checks::Memlock;
use super::transfer::{PeerReport, SelfTest};
use super::{Report, gid_kind, knob_meaning, link_name, speed_of, state_name};
use crate::ports::{Port, PortFacts, meaning};

/// The whole report.
pub fn text(r: &Report) -> String {
    let Report { fusion, ports, findings, memlock, env, advice, selftest, peer } = *r;
    let mut o = String::new();
    let w = &mut o;
    let _ = writeln!(w, "ferroce doctor: {} RDMA port(s)", ports.len());
    for p in ports {
        port_text(w, p);
    }
    let _ = writeln!(w, "\n== NIC fusion");
    for l in fusion.lines() {
        let _ = writeln!(w, "  {l}");
    }
    let _ = writeln!(w, "\n== Limits and environment");
    let _ = writeln!(
        w,
        "  RLIMIT_MEMLOCK  soft {} / hard {} (memory a process may pin for RDMA){}",
        Memlock::show(memlock.soft),
        Memlock::show(memlock.hard),
        if memlock.ipc_lock { "; CAP_IPC_LOCK is held, so the limit does not apply" } else { "" }
    );
    if env.is_empty() {
        let _ = writeln!(w, "  no NCCL_* or FERROCE_* variable is set");
    }
    for (k, v) in env {
        let _ = writeln!(w, "  {k}={v}   ({})", knob_meaning(k));
    }
    if let Some(p) = peer {
        peer_text(w, p);
    }
    if let Some(s) = selftest {
        selftest_text(w, s);
    }
    let _ = writeln!(w, "\n== Advice");
    for a in advice {
        let _ = writeln!(w, "  {a}");
    }
    let _ = writeln!(w, "\n== Findings");
    if findings.is_empty() {
        let _ = writeln!(w, "  none: nothing blocks ferroce on this host");
    }
    for f in findings {
        let _ = writeln!(w, "{:<5} {}: {}", f.level.name(), f.about, f.what);
    }
    o
}

/// One port's screen.
fn port_text(w: &mut String, p: &Port) {
    let _ = writeln!(
        w,
        "\n== {} port {}{}",
        p.dev,
        p.port,
        if p.kept { "" } else { " (filtered out by NCCL_IB_HCA)" }
    );
    let (mbps, how) = speed_of(p);
    let _ = writeln!(w, "Port");
    let _ = writeln!(w, "  state        {} (only ACTIVE ports carry traffic)", state_name(p.state));
    let _ = writeln!(w, "  link layer   {}", link_name(p.link_layer));
    let _ = writeln!(
        w,
        "  speed        {mbps} Mb/s as NCCL is told: {how}{}",
        if p.software { " (nominal on a software device)" } else { "" }
    );
    match &p.nccl {
        Some(n) => {
            let _ = writeln!(
                w,
                "  NCCL sees    device {} {}: port {}, pciPath {}{}",
                n.index,
                n.name,
                n.port,
                n.pci_path.as_deref().unwrap_or("(none)"),
                if p.software { " (no PCI function: its sysfs dir)" } else { "" }
            );
        }
        None => {
            let _ = writeln!(w, "  NCCL sees    nothing (not a device the plugin offers)");
        }
    }
    let _ = writeln!(w, "  netdev       {}", p.netdev.as_deref().unwrap_or("(none)"));
    let _ = writeln!(
        w,
        "  MTU          netdev {} / active {} / max {} (bytes: the Ethernet MTU of the interface; the RoCE payload MTU the port uses now; the largest it supports)",
        p.netdev_mtu.map_or("?".into(), |m| m.to_string()),
        p.active_mtu,
        p.max_mtu
    );
    port_tables(w, p);
}

/// A port's GID table (with the plugin's choice), congestion control, counters and GPUDirect.
fn port_tables(w: &mut String, p: &Port) {
    let _ = writeln!(w, "GID table (index, version, address, interface)");
    if p.gids.is_empty() {
        let _ = writeln!(w, "  (empty)");
    }
    for g in &p.gids {
        let mark = matches!(&p.choice, Ok(c) if c.index == g.index);
        let _ = writeln!(
            w,
            "  {} {:>3}  {:<8} {:<40} {}",
            if mark { "*" } else { " " },
            g.index,
            gid_kind(g.kind),
            gid::ip_of(&g.gid).to_string(),
            g.netdev.as_deref().unwrap_or("-")
        );
    }
    match &p.choice {
        Ok(c) => {
            let _ = writeln!(w, "  ferroce uses * index {}: {}", c.index, c.why);
        }
        Err(e) => {
            let _ = writeln!(w, "  ferroce has no GID here: {e}");
        }
    }
    let _ = writeln!(
        w,
        "Congestion control (read from /sys/class/net/{}/)",
        p.netdev.as_deref().unwrap_or("?")
    );
    if p.cc.is_empty() {
        let _ = writeln!(
            w,
            "  not exposed by this driver{}",
            if p.software {
                " (a software device: no NIC queues, no ECN marking, no PFC)"
            } else {
                ""
            }
        );
    }
    for (k, v) in &p.cc {
        let _ = writeln!(w, "  {k} = {v}");
    }
    let _ = writeln!(
        w,
        "Counters (since the device appeared; /sys/class/infiniband/{}/ports/{}/)",
        p.dev, p.port
    );
    if p.counters.is_empty() {
        let _ = writeln!(w, "  none exposed");
    }
    for c in &p.counters {
        let _ = writeln!(
            w,
            "  {:<11} {:<28} {:>14}  {}",
            c.group,
            c.name,
            c.value,
            meaning(&c.name).unwrap_or("")
        );
    }
    if let Some(n) = &p.nccl {
        let _ = writeln!(w, "GPUDirect\n  {}", n.gdr);
    }
}

/// The `--peer` section: the two ends side by side.
fn peer_text(w: &mut String, p: &PeerReport) {
    let _ = writeln!(
        w,
        "\n== Peer {} (a `ferroce perf --listen` there){}",
        p.addr,
        if p.connected { "; the plugin connected to it" } else { "" }
    );
    let side = |f: &Option<PortFacts>, what: &dyn Fn(&PortFacts) -> String| {
        f.as_ref().map_or("?".to_string(), what)
    };
    let opt = |v: Option<String>| v.unwrap_or_else(|| "?".into());
    type Fact = (&'static str, fn(&PortFacts) -> String);
    let rows: [Fact; 6] = [
        ("port", |f| f.port.clone()),
        ("netdev", |f| f.netdev.clone().unwrap_or_else(|| "?".into())),
        ("netdev MTU", |f| f.netdev_mtu.map_or("?".into(), |m| m.to_string())),
        ("active MTU", |f| f.active_mtu.to_string()),
        ("max MTU", |f| f.max_mtu.to_string()),
        ("GID", |f| f.gid.as_ref().map_or("none".into(), |(i, ip)| format!("index {i} {ip}"))),
    ];
    let _ = writeln!(w, "  {:<12} {:<28} peer", "", "here");
    for (label, f) in rows {
        let _ = writeln!(w, "  {label:<12} {:<28} {}", side(&p.here, &f), side(&p.there, &f));
    }
    if let (Some(h), Some(t)) = (&p.here, &p.there) {
        let _ = writeln!(
            w,
            "  path MTU     {} (the smaller active MTU: what a connection between the two uses; \
             frames up to the smaller netdev MTU, {}, cross)",
            h.active_mtu.min(t.active_mtu),
            opt(h.netdev_mtu.zip(t.netdev_mtu).map(|(a, b)| a.min(b).to_string()))
        );
    }
}

/// The self-test section: the transfer and the counters it moved.
fn selftest_text(w: &mut String, s: &SelfTest) {
    let _ = writeln!(w, "\n== Self-test");
    let mb = s.bytes() as f64 / 1e6;
    let _ = writeln!(
        w,
        "  {} -> {}: {} x {} MiB in {:.3} s = {:.1} MB/s ({:.2} Gb/s) through the plugin's C ABI",
        s.from,
        s.to,
        s.msgs,
        s.msg >> 20,
        s.seconds,
        mb / s.seconds,
        mb * 8.0 / 1000.0 / s.seconds
    );
    let _ = writeln!(w, "  data verified: {}", s.verified);
    for (port, k, d) in &s.deltas {
        let name = k.rsplit('/').next().unwrap_or(k);
        let _ = writeln!(w, "  {port:<8} {k:<36} +{d:<12} {}", meaning(name).unwrap_or(""));
    }
}
