//! How the tools write their results: right-aligned tables in nccl-tests' style for people and
//! scripts that cut columns, and one JSON object per run (through `serde_json`) for programs.
//! Used by `ferroce perf`, `collective` and `doctor`.
//!
//! A number that could not be measured is NaN inside the tools; it is `-` in a table and
//! `null` in JSON (which `serde_json` does by itself), never a made-up zero. The statistics
//! here ([`median`], [`mean`], [`spread`]) pass over such numbers.

/// A table of right-aligned columns. Each line starts with a mark (`#` on headings, a space on
/// rows) that takes the first character of the first column, so headings and rows line up.
pub struct Table<'a> {
    /// Each column's width, the mark included in the first.
    pub widths: &'a [usize],
    /// Spaces between columns.
    pub gap: usize,
}

impl Table<'_> {
    /// One line: `mark`, then each cell right-aligned to its column.
    pub fn line<S: AsRef<str>>(&self, mark: char, cells: &[S]) -> String {
        let mut s = String::from(mark);
        for (i, (&w, c)) in self.widths.iter().zip(cells).enumerate() {
            let w = if i == 0 { w.saturating_sub(1) } else { w };
            let gap = if i == 0 { 0 } else { self.gap };
            s += &format!("{:gap$}{:>w$}", "", c.as_ref());
        }
        s
    }
}

/// `x` with `prec` decimals, or `-` when it is not a number.
pub fn fixed(x: f64, prec: usize) -> String {
    if x.is_finite() { format!("{x:.prec$}") } else { "-".into() }
}

/// `x` rounded to `decimals` places, for JSON numbers that should not claim more precision
/// than was measured.
pub fn rounded(x: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (x * scale).round() / scale
}

/// Prints `v` as one line of JSON on stdout.
pub fn print_json(v: &serde_json::Value) {
    println!("{v}");
}

/// The finite numbers of `v`: a NaN is a round with no result.
fn finite(v: &[f64]) -> impl Iterator<Item = f64> + Clone + '_ {
    v.iter().copied().filter(|x| x.is_finite())
}

/// The middle number (the mean of the two middle ones for an even count); NaN for none.
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = finite(v).collect();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// NaN for none.
pub fn mean(v: &[f64]) -> f64 {
    let n = finite(v).count();
    if n == 0 { f64::NAN } else { finite(v).sum::<f64>() / n as f64 }
}

/// The smallest and the largest number; NaN for both when there is none.
pub fn spread(v: &[f64]) -> (f64, f64) {
    let f = finite(v);
    match f.clone().next() {
        None => (f64::NAN, f64::NAN),
        Some(x) => (f.clone().fold(x, f64::min), f.fold(x, f64::max)),
    }
}

/// `a / b`, NaN where `b` is not a positive number.
pub fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_lines_align_headings_and_rows() {
        let t = Table { widths: &[12, 6], gap: 2 };
        assert_eq!(t.line('#', &["size", "ratio"]), "#       size   ratio");
        assert_eq!(t.line(' ', &["8", "0.50"]), "           8    0.50");
        let t = Table { widths: &[13, 4], gap: 1 };
        assert_eq!(t.line('#', &["(B)", "x"]), "#         (B)    x");
    }

    #[test]
    fn unmeasured_numbers_are_dashes_and_nulls() {
        assert_eq!(fixed(f64::NAN, 2), "-");
        assert_eq!(fixed(1.0 / 3.0, 2), "0.33");
        assert_eq!(rounded(2.345_678, 1), 2.3);
        assert_eq!(
            serde_json::json!({"a": f64::NAN, "b": 1.5}).to_string(),
            r#"{"a":null,"b":1.5}"#
        );
    }
}
