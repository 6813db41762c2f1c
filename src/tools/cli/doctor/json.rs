//! `ferroce doctor --json`: the same facts as the text report, as one object.

use ferroce::transport::gid;
use ferroce_tools::out::rounded;
use serde_json::{Value, json};

use super::transfer::PeerReport;
use super::{Level, Report, gid_kind, knob_meaning, link_name, speed_of, state_name};
use crate::ports::{Port, PortFacts, meaning};

/// The report as one JSON object (and a newline), the same facts as [`text`](super::text).
pub fn json(r: &Report) -> String {
    let Report { fusion, ports, findings, memlock, env, advice, selftest, peer } = *r;
    let blocking = findings.iter().any(|f| f.level == Level::Block);
    let findings: Vec<Value> = findings
        .iter()
        .map(|f| json!({"level": f.level.name(), "about": f.about, "what": f.what}))
        .collect();
    let env: serde_json::Map<String, Value> = env
        .iter()
        .map(|(k, v)| (k.clone(), json!({"value": v, "meaning": knob_meaning(k)})))
        .collect();
    let selftest = selftest.map(|s| {
        let deltas: Vec<Value> =
            s.deltas.iter().map(|(p, k, d)| json!({"port": p, "counter": k, "delta": d})).collect();
        json!({
            "from": s.from,
            "to": s.to,
            "messages": s.msgs,
            "message_bytes": s.msg,
            "bytes": s.bytes(),
            "seconds": rounded(s.seconds, 6),
            "mb_per_s": rounded(s.bytes() as f64 / 1e6 / s.seconds, 1),
            "verified": s.verified,
            "counter_deltas": deltas,
        })
    });
    let groups: Vec<Value> = fusion
        .groups
        .iter()
        .map(|g| json!(g.iter().map(|(i, n)| json!({"device": i, "name": n})).collect::<Vec<_>>()))
        .collect();
    let fusion = json!({
        "merge_level": fusion.level,
        "force_merge": fusion.force,
        "merge_nics": fusion.merge_nics,
        "groups": groups,
        "lines": fusion.lines(),
    });
    let v = json!({
        "ports": ports.iter().map(port_json).collect::<Vec<_>>(),
        "fusion": fusion,
        "memlock": {"soft": memlock.soft, "hard": memlock.hard, "cap_ipc_lock": memlock.ipc_lock},
        "env": env,
        "selftest": selftest,
        "peer": peer.map(peer_json),
        "advice": advice,
        "findings": findings,
        "blocking": blocking,
    });
    format!("{v}\n")
}

/// One port's screen as JSON.
fn port_json(p: &Port) -> Value {
    let gids: Vec<Value> = p
        .gids
        .iter()
        .map(|g| {
            let ip = gid::ip_of(&g.gid).to_string();
            json!({"index": g.index, "type": gid_kind(g.kind), "ip": ip, "netdev": g.netdev})
        })
        .collect();
    let choice = match &p.choice {
        Ok(c) => json!({"index": c.index, "ip": c.ip().to_string(), "why": c.why}),
        Err(e) => json!({"error": e}),
    };
    let cc: serde_json::Map<String, Value> =
        p.cc.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect();
    let (mbps, speed_from) = speed_of(p);
    let nccl = p.nccl.as_ref().map(
        |n| json!({"device": n.index, "name": n.name, "port": n.port, "pci_path": n.pci_path}),
    );
    let counters: Vec<Value> = p
        .counters
        .iter()
        .map(|c| {
            json!({"group": c.group, "name": c.name, "value": c.value, "meaning": meaning(&c.name)})
        })
        .collect();
    json!({
        "dev": p.dev,
        "port": p.port,
        "kept": p.kept,
        "state": state_name(p.state),
        "link_layer": link_name(p.link_layer),
        "speed_mbps": mbps,
        "speed_from": speed_from,
        "nccl": nccl,
        "netdev": p.netdev,
        "mtu": {"netdev": p.netdev_mtu, "active": p.active_mtu, "max": p.max_mtu},
        "gids": gids,
        "gid_choice": choice,
        "congestion_control": (!cc.is_empty()).then_some(cc),
        "software_device": p.software,
        "counters": counters,
        "gpudirect": p.nccl.as_ref().map(|n| &n.gdr),
    })
}

/// The `--peer` section as JSON.
fn peer_json(p: &PeerReport) -> Value {
    let facts = |f: &Option<PortFacts>| {
        f.as_ref().map(|f| {
            json!({
                "port": f.port,
                "netdev": f.netdev,
                "mtu": {"netdev": f.netdev_mtu, "active": f.active_mtu, "max": f.max_mtu},
                "gid": f.gid.as_ref().map(|(i, ip)| json!({"index": i, "ip": ip})),
            })
        })
    };
    let (path, same) = match (&p.here, &p.there) {
        (Some(h), Some(t)) => (
            Some(h.active_mtu.min(t.active_mtu)),
            Some(h.active_mtu == t.active_mtu && h.netdev_mtu == t.netdev_mtu),
        ),
        _ => (None, None),
    };
    json!({
        "addr": p.addr,
        "here": facts(&p.here),
        "peer": facts(&p.there),
        "path_mtu": path,
        "mtus_match": same,
        "connected": p.connected,
    })
}
