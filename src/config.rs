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

use std::time::Duration;

use crate::error::{Error, Result};
use hca::HcaFilter;

/// A documented knob: its environment variable, default and meaning.
pub struct Knob {
    pub name: &'static str,
    pub default: &'static str,
    pub meaning: &'static str,
}

pub const KNOBS: &[Knob] = &[
    Knob {
        name: "NCCL_IB_HCA",
        default: "(all devices)",
        meaning: "device/port filter, NCCL syntax: [^][=]name[:port[:rail[:plane]]],...",
    },
    Knob {
        name: "NCCL_IB_GID_INDEX",
        default: "-1",
        meaning: "GID index for every device; -1 picks a RoCEv2 IPv4 GID automatically",
    },
    Knob {
        name: "NCCL_IB_TIMEOUT",
        default: "20",
        meaning: "QP ACK timeout exponent: 4.096 us x 2^value per attempt (1..=31)",
    },
    Knob { name: "NCCL_IB_RETRY_CNT", default: "7", meaning: "QP transport retry count (0..=7)" },
    Knob {
        name: "NCCL_SOCKET_IFNAME",
        default: "(the GID's interface)",
        meaning: "interface whose address the connection-setup listener binds",
    },
    Knob {
        name: "FERROCE_SETUP_TIMEOUT_MS",
        default: "120000",
        meaning: "deadline of each connection-setup step (TCP connect, each handshake message)",
    },
    Knob {
        name: "FERROCE_FORCE_FLUSH",
        default: "0",
        meaning: "1: iflush issues the GPUDirect RDMA-read flush even for host memory (testing)",
    },
];

/// The parsed configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub ib_hca: HcaFilter,
    pub gid_index: Option<u8>,
    pub ib_timeout: u8,
    pub ib_retry_cnt: u8,
    pub socket_ifname: Option<String>,
    pub setup_timeout: Duration,
    pub force_flush: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config::from_lookup(|_| None).expect("defaults are valid")
    }
}

/// Parses an integer knob within `range`, or returns `default` when unset.
fn int<T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy>(
    get: &impl Fn(&str) -> Option<String>,
    knob: &'static str,
    default: T,
    range: std::ops::RangeInclusive<T>,
) -> Result<T> {
    let Some(raw) = get(knob) else { return Ok(default) };
    let v: T = raw.trim().parse().map_err(|_| Error::config(knob, &raw, "not an integer"))?;
    if !range.contains(&v) {
        let why = format!("must be in {}..={}", range.start(), range.end());
        return Err(Error::config(knob, &raw, why));
    }
    Ok(v)
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
        let gid_index = int(&get, "NCCL_IB_GID_INDEX", -1i32, -1..=255)?;
        Ok(Config {
            ib_hca,
            gid_index: u8::try_from(gid_index).ok(),
            ib_timeout: int(&get, "NCCL_IB_TIMEOUT", 20, 1..=31)?,
            ib_retry_cnt: int(&get, "NCCL_IB_RETRY_CNT", 7, 0..=7)?,
            socket_ifname: get("NCCL_SOCKET_IFNAME").filter(|s| !s.trim().is_empty()),
            setup_timeout: Duration::from_millis(int(
                &get,
                "FERROCE_SETUP_TIMEOUT_MS",
                120_000u64,
                1..=86_400_000,
            )?),
            force_flush: int(&get, "FERROCE_FORCE_FLUSH", 0u8, 0..=1)? == 1,
        })
    }

    /// One INFO line per knob with its effective value.
    pub fn log(&self) {
        for knob in KNOBS {
            let value = match knob.name {
                "NCCL_IB_HCA" if !self.ib_hca.is_empty() => self.ib_hca.raw.clone(),
                "NCCL_IB_GID_INDEX" => self.gid_index.map_or("-1".into(), |g| g.to_string()),
                "NCCL_IB_TIMEOUT" => self.ib_timeout.to_string(),
                "NCCL_IB_RETRY_CNT" => self.ib_retry_cnt.to_string(),
                "NCCL_SOCKET_IFNAME" if self.socket_ifname.is_some() => {
                    self.socket_ifname.clone().unwrap_or_default()
                }
                "FERROCE_SETUP_TIMEOUT_MS" => self.setup_timeout.as_millis().to_string(),
                "FERROCE_FORCE_FLUSH" => u8::from(self.force_flush).to_string(),
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

    fn with(knob: &'static str, value: &'static str) -> Result<Config> {
        Config::from_lookup(move |k| (k == knob).then(|| value.to_string()))
    }

    #[test]
    fn integer_knobs_parse_and_check_ranges() {
        let d = Config::default();
        assert_eq!(
            (d.ib_timeout, d.ib_retry_cnt, d.gid_index, d.force_flush),
            (20, 7, None, false)
        );
        assert_eq!(d.setup_timeout, Duration::from_secs(120));
        assert_eq!(with("NCCL_IB_TIMEOUT", " 14 ").unwrap().ib_timeout, 14);
        assert_eq!(with("NCCL_IB_GID_INDEX", "3").unwrap().gid_index, Some(3));
        assert_eq!(with("NCCL_IB_GID_INDEX", "-1").unwrap().gid_index, None);
        assert_eq!(
            with("FERROCE_SETUP_TIMEOUT_MS", "1500").unwrap().setup_timeout.as_millis(),
            1500
        );
        for (k, v) in [
            ("NCCL_IB_TIMEOUT", "0"),
            ("NCCL_IB_TIMEOUT", "32"),
            ("NCCL_IB_TIMEOUT", "ten"),
            ("NCCL_IB_RETRY_CNT", "8"),
            ("NCCL_IB_GID_INDEX", "256"),
            ("FERROCE_SETUP_TIMEOUT_MS", "0"),
            ("FERROCE_FORCE_FLUSH", "yes"),
        ] {
            let e = with(k, v).unwrap_err().to_string();
            assert!(e.contains(k) && e.contains(v), "{k}={v}: {e}");
        }
    }

    #[test]
    fn every_knob_is_documented() {
        for k in KNOBS {
            assert!(k.name.starts_with("NCCL_") || k.name.starts_with("FERROCE_"), "{}", k.name);
            assert!(!k.meaning.is_empty() && !k.default.is_empty());
        }
    }
}
