//! Every knob ferroce reads, in one place: typed, documented, parsed once per initialisation
//! and logged once at INFO.
//!
//! NCCL's own `NCCL_IB_*` names are honoured where the meaning matches, so users can switch
//! plugins without relearning; ferroce's own knobs start with `FERROCE_`. A malformed value is
//! an [`Error::Config`] naming the knob, never a silent default. The README's knob table is
//! written from [`KNOBS`].
//!
//! Callers: `transport` (at init), the tools in `src/bin`.

pub mod hca;

use crate::error::{Error, Result};
use hca::HcaFilter;

/// A documented knob: its environment variable, default and meaning.
pub struct Knob {
    pub name: &'static str,
    pub default: &'static str,
    pub meaning: &'static str,
}

pub const KNOBS: &[Knob] = &[Knob {
    name: "NCCL_IB_HCA",
    default: "(all devices)",
    meaning: "device/port filter, NCCL syntax: [^][=]name[:port[:rail[:plane]]],...",
}];

/// The parsed configuration.
#[derive(Clone, Debug, Default)]
pub struct Config {
    pub ib_hca: HcaFilter,
}

impl Config {
    /// Reads the process environment.
    pub fn from_env() -> Result<Config> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads knobs through `get`, so tests need not touch the process environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let ib_hca = match get("NCCL_IB_HCA") {
            None => HcaFilter::default(),
            Some(v) => HcaFilter::parse(&v).map_err(|e| Error::config("NCCL_IB_HCA", &v, e.0))?,
        };
        Ok(Config { ib_hca })
    }

    /// One INFO line per knob with its effective value.
    pub fn log(&self) {
        for knob in KNOBS {
            let value = match knob.name {
                "NCCL_IB_HCA" if !self.ib_hca.is_empty() => self.ib_hca.raw.clone(),
                _ => knob.default.to_string(),
            };
            log::info!("knob {}={} ({})", knob.name, value, knob.meaning);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_when_unset() {
        let c = Config::from_lookup(|_| None).unwrap();
        assert!(c.ib_hca.is_empty());
    }

    #[test]
    fn malformed_hca_names_the_knob() {
        let err = Config::from_lookup(|k| (k == "NCCL_IB_HCA").then(|| "rxe0:x".into()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("NCCL_IB_HCA") && err.contains("rxe0:x"), "{err}");
    }

    #[test]
    fn every_knob_is_documented() {
        for k in KNOBS {
            assert!(k.name.starts_with("NCCL_") || k.name.starts_with("FERROCE_"), "{}", k.name);
            assert!(!k.meaning.is_empty() && !k.default.is_empty());
        }
    }
}
