//! The `NCCL_IB_HCA` device filter, with NCCL's full syntax:
//!
//! ```text
//! [^][=]name[:port[:rail[:plane]]][,name[:port...]]...
//! ```
//! - a leading `^` turns the list into an exclude list;
//! - a following `=` asks for exact names; without it a name matches by prefix (`mlx5_1` also
//!   matches `mlx5_10`);
//! - an empty or missing port matches every port; rail and plane tag the matching device.
//!
//! Pure logic: parsed once by `config`, applied by `transport::device` to each (device, port).
//! `NCCL_SOCKET_IFNAME` uses the same list syntax, with names only ([`HcaFilter::keeps`]).

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HcaEntry {
    pub name: String,
    pub port: Option<u32>,
    pub rail: Option<i16>,
    pub plane: Option<i16>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HcaFilter {
    /// The value as the user wrote it, for messages.
    pub raw: String,
    pub exclude: bool,
    pub exact: bool,
    pub entries: Vec<HcaEntry>,
}

/// Why a filter value could not be parsed.
#[derive(Debug, PartialEq, Eq)]
pub struct ParseError(pub String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl HcaFilter {
    /// Parses a value of `NCCL_IB_HCA`. An empty value keeps every device.
    pub fn parse(value: &str) -> Result<HcaFilter, ParseError> {
        let raw = value.trim().to_string();
        let mut rest = raw.as_str();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        if rest.starts_with('^') {
            return Err(ParseError("'^' must come before '='".into()));
        }
        let mut entries = Vec::new();
        for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let mut fields = item.split(':');
            let name = fields.next().unwrap_or("").trim().to_string();
            let port = parse_field(fields.next(), item, "port")?;
            let rail = parse_field(fields.next(), item, "rail")?;
            let plane = parse_field(fields.next(), item, "plane")?;
            if fields.next().is_some() {
                return Err(ParseError(format!(
                    "entry {item:?} has more than name:port:rail:plane"
                )));
            }
            if name.is_empty() {
                continue; // NCCL drops entries without a name
            }
            entries.push(HcaEntry { name, port, rail, plane });
        }
        if (exclude || exact) && entries.is_empty() {
            return Err(ParseError("no device names after '^' or '='".into()));
        }
        Ok(HcaFilter { raw, exclude, exact, entries })
    }

    /// True when the filter keeps every device.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether some port of device `dev` may be kept, decided by name alone, so devices the
    /// filter rules out are never opened (and never held open).
    pub fn may_keep(&self, dev: &str) -> bool {
        let name_ok =
            |e: &HcaEntry| if self.exact { dev == e.name } else { dev.starts_with(&e.name) };
        if self.entries.is_empty() {
            return true;
        }
        if self.exclude {
            !self.entries.iter().any(|e| name_ok(e) && e.port.is_none())
        } else {
            self.entries.iter().any(name_ok)
        }
    }

    /// Whether the name `name` (e.g. an interface) is kept, ports aside.
    pub fn keeps(&self, name: &str) -> bool {
        self.select(name, 0).is_some()
    }

    /// The entries that match none of `names`: a typo the user should hear about.
    pub fn unmatched<'a>(&'a self, names: &[&str]) -> Vec<&'a str> {
        let hits =
            |e: &HcaEntry, n: &str| if self.exact { n == e.name } else { n.starts_with(&e.name) };
        self.entries
            .iter()
            .filter(|e| !names.iter().any(|n| hits(e, n)))
            .map(|e| e.name.as_str())
            .collect()
    }

    /// Decides one (device, port): `None` if filtered out, else the matching entry (which is
    /// `None` for a device kept by an empty or exclude filter).
    pub fn select(&self, dev: &str, port: u32) -> Option<Option<&HcaEntry>> {
        if self.entries.is_empty() {
            return Some(None);
        }
        let hit = self.entries.iter().find(|e| {
            let name_ok = if self.exact { dev == e.name } else { dev.starts_with(&e.name) };
            name_ok && e.port.is_none_or(|p| p == port)
        });
        match (hit, self.exclude) {
            (Some(e), false) => Some(Some(e)),
            (None, true) => Some(None),
            _ => None,
        }
    }
}

fn parse_field<T: std::str::FromStr>(
    field: Option<&str>,
    item: &str,
    what: &str,
) -> Result<Option<T>, ParseError> {
    match field.map(str::trim) {
        None | Some("") => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| ParseError(format!("{what} {s:?} in entry {item:?} is not a number"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keeps(filter: &str, dev: &str, port: u32) -> bool {
        HcaFilter::parse(filter).unwrap().select(dev, port).is_some()
    }

    #[test]
    fn entries_that_match_no_name_are_reported() {
        let names = ["mlx5_0", "mlx5_1", "rxe0"];
        let f = HcaFilter::parse("mlx5,mlx6_0:1,rxe").unwrap();
        assert_eq!(f.unmatched(&names), vec!["mlx6_0"]);
        let f = HcaFilter::parse("=mlx5,rxe0").unwrap();
        assert_eq!(f.unmatched(&names), vec!["mlx5"]);
        let f = HcaFilter::parse("^rxe9").unwrap();
        assert_eq!(f.unmatched(&names), vec!["rxe9"]);
        assert!(HcaFilter::default().unmatched(&names).is_empty());
    }

    #[test]
    fn empty_keeps_everything() {
        for v in ["", "  ", ","] {
            assert!(keeps(v, "rxe0", 1), "{v:?}");
            assert!(HcaFilter::parse(v).unwrap().is_empty());
        }
    }

    #[test]
    fn prefix_match_by_default() {
        assert!(keeps("mlx5_1", "mlx5_1", 1));
        assert!(keeps("mlx5_1", "mlx5_10", 1));
        assert!(!keeps("mlx5_1", "mlx5_2", 1));
        assert!(keeps("rxe", "rxe1", 1));
    }

    #[test]
    fn exact_match_with_equals() {
        assert!(keeps("=mlx5_1", "mlx5_1", 1));
        assert!(!keeps("=mlx5_1", "mlx5_10", 1));
        assert!(keeps("=rxe1", "rxe1", 1));
        assert!(!keeps("=rxe1", "rxe0", 1));
    }

    #[test]
    fn exclude_inverts() {
        assert!(!keeps("^rxe0", "rxe0", 1));
        assert!(keeps("^rxe0", "rxe1", 1));
        assert!(!keeps("^mlx5_1", "mlx5_12", 1));
        assert!(keeps("^=mlx5_1", "mlx5_12", 1));
        assert!(!keeps("^=mlx5_1", "mlx5_1", 1));
        assert!(!keeps("^rxe0:1", "rxe0", 1));
        assert!(keeps("^rxe0:1", "rxe0", 2));
    }

    #[test]
    fn may_keep_agrees_with_select_on_names() {
        for (f, dev, want) in [
            ("", "rxe0", true),
            ("rxe1", "rxe0", false),
            ("rxe", "rxe0", true),
            ("=rxe", "rxe0", false),
            ("^rxe0", "rxe0", false),
            ("^rxe0:1", "rxe0", true), // port 2 might still be kept
            ("^rxe0", "rxe1", true),
            ("rxe0:1", "rxe0", true),
        ] {
            assert_eq!(HcaFilter::parse(f).unwrap().may_keep(dev), want, "{f:?} {dev}");
        }
    }

    #[test]
    fn port_selects_one_port() {
        assert!(keeps("rxe0:1", "rxe0", 1));
        assert!(!keeps("rxe0:1", "rxe0", 2));
        assert!(!keeps("rxe0:1", "rxe1", 1));
        assert!(keeps("mlx5_0:,mlx5_1:2", "mlx5_0", 7));
        assert!(keeps("mlx5_0:,mlx5_1:2", "mlx5_1", 2));
        assert!(!keeps("mlx5_0:,mlx5_1:2", "mlx5_1", 1));
    }

    #[test]
    fn rail_and_plane_are_carried() {
        let f = HcaFilter::parse("mlx5_0::3:1,mlx5_1").unwrap();
        let e = f.select("mlx5_0", 1).unwrap().unwrap();
        assert_eq!((e.port, e.rail, e.plane), (None, Some(3), Some(1)));
        let e = f.select("mlx5_1", 1).unwrap().unwrap();
        assert_eq!((e.rail, e.plane), (None, None));
    }

    #[test]
    fn list_with_spaces_and_empty_names() {
        let f = HcaFilter::parse(" rxe0 , :1, rxe1:1 ").unwrap();
        assert_eq!(f.entries.len(), 2);
        assert_eq!(
            f.entries[1],
            HcaEntry { name: "rxe1".into(), port: Some(1), rail: None, plane: None }
        );
    }

    #[test]
    fn malformed_values_are_errors() {
        for bad in [
            "rxe0:x",
            "rxe0:1:a",
            "rxe0:1:2:b",
            "rxe0:1:2:3:4",
            "=^rxe0",
            "^",
            "=",
            "^=",
            "rxe0:-1",
        ] {
            assert!(HcaFilter::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
