//! `ferroce knobs`: the whole knob table as the plugin reads this environment, the one NCCL's
//! INFO log leaves out (at INFO a rank names only the knobs the environment set).

use std::io::Write;

use ferroce::config::{Config, KNOBS};

/// Prints the table (stops quietly when stdout closes, as under `head`).
pub fn knobs() -> Result<(), String> {
    let cfg = Config::from_env().map_err(|e| format!("the plugin's init would fail: {e}"))?;
    let mut out = std::io::stdout().lock();
    let width = KNOBS.iter().map(|k| k.name.len()).max().unwrap_or(0);
    for e in &cfg.effective {
        let meaning = KNOBS.iter().find(|k| k.name == e.name).map_or("", |k| k.meaning);
        let from = match &e.set {
            Some(raw) if *raw == e.value => "set".to_string(),
            Some(raw) => format!("set to {raw}"),
            None => "default".to_string(),
        };
        let line = format!("{:width$}  {} ({from})\n{:width$}  {meaning}", e.name, e.value, "");
        if writeln!(out, "{line}").is_err() {
            return Ok(());
        }
    }
    for w in &cfg.warnings {
        let _ = writeln!(out, "WARN {w}");
    }
    Ok(())
}
