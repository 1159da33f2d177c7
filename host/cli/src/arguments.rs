//! The values command-line options take, each parsed to its range or refused in one
//! line that names the value and the range (clap prints it and exits 2).

use allocbox::CompileBound;
use anyhow::{Context, Result, bail};

pub(crate) fn parse_compile_bound(s: &str) -> Result<(CompileBound, u64)> {
    let (name, value) = parse_key_value(s)?;
    let Some(bound) = CompileBound::named(&name) else {
        let names: Vec<&str> = CompileBound::ALL.iter().map(|b| b.name()).collect();
        bail!(
            "no compile bound is called `{name}`; the bounds are {}",
            names.join(", ")
        );
    };
    let value = value
        .parse()
        .with_context(|| format!("`{value}` is not a whole number for `{name}`"))?;
    Ok((bound, value))
}

/// One `--grant` name.
pub(crate) fn kind_grant(s: &str) -> Result<allocbox::mapped::KindGrant> {
    Ok(s.parse()?)
}

/// A count that must be 1 or more: a check of 0 cases or 0 threads checks nothing.
pub(crate) fn at_least_one<T>(s: &str) -> Result<T>
where
    T: std::str::FromStr + PartialOrd + From<u8>,
{
    match s.parse::<T>() {
        Ok(n) if n >= T::from(1) => Ok(n),
        _ => bail!("`{s}` is not a whole number of at least 1"),
    }
}

/// A whole number from `lo` to `hi`, or one line naming the range.
fn whole_in<T>(s: &str, lo: T, hi: T, what: &str) -> Result<T>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display,
{
    match s.trim().parse::<T>() {
        Ok(n) if n >= lo && n <= hi => Ok(n),
        _ => bail!("`{s}` is not {what}: give a whole number from {lo} to {hi}"),
    }
}

/// `--call-time-ms`: 1 ms to an hour (a deadline past that is no bound on a call).
pub(crate) fn call_time_ms(s: &str) -> Result<u64> {
    whole_in(s, 1, 3_600_000, "a call limit in ms")
}

/// `--batch-limit`: 1 to 2^20 blocks in one batch call.
pub(crate) fn batch_limit(s: &str) -> Result<u32> {
    whole_in(s, 1, 1 << 20, "a batch limit")
}

/// `--max-ops`: 1 to 100,000 operations in one case.
pub(crate) fn max_ops(s: &str) -> Result<usize> {
    whole_in(s, 1, 100_000, "a number of operations per case")
}

/// `--guest-memory`: a size up to 4 GiB, all a 32-bit wasm memory can address.
pub(crate) fn guest_memory(s: &str) -> Result<u64> {
    let bytes = byte_size(s)?;
    match bytes <= 4 << 30 {
        true => Ok(bytes),
        false => bail!("`{s}` is more than a policy's memory can be: give at most 4 GiB"),
    }
}

/// `--device-memory`: a GPU's memory, from 1 MiB to 1 PiB.
pub(crate) fn device_memory(s: &str) -> Result<u64> {
    let bytes = byte_size(s)?;
    match bytes {
        0..0x10_0000 => bail!("`{s}` is less than any GPU has: give at least 1 MiB"),
        0x10_0000..=0x4_0000_0000_0000 => Ok(bytes),
        _ => bail!("`{s}` is more memory than any GPU has: give at most 1 PiB"),
    }
}

/// `--overhead`: a size up to 1 PiB.
pub(crate) fn overhead(s: &str) -> Result<u64> {
    let bytes = byte_size(s)?;
    match bytes <= 1 << 50 {
        true => Ok(bytes),
        false => bail!("`{s}` is more overhead than any machine holds: give at most 1 PiB"),
    }
}

/// The longest `check --time`: a week.
const MOST_CHECK_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// Seconds a check may run: a number above 0, at most a week (so that no time budget
/// is one that runs no case, or overflows a deadline).
pub(crate) fn check_seconds(s: &str) -> Result<f64> {
    match s.parse::<f64>() {
        Ok(secs) if secs > 0.0 && secs <= MOST_CHECK_SECONDS => Ok(secs),
        _ => bail!(
            "`{s}` is not a time a check can run for: give seconds above 0 and at most \
             {MOST_CHECK_SECONDS} (a week)"
        ),
    }
}

/// Client threads: 1 to the most a script can name.
pub(crate) fn client_threads(s: &str) -> Result<usize> {
    whole_in(s, 1, 256, "a number of client threads")
}

/// Bytes, written as a number with an optional unit: `B`, `KiB`, `MiB`, `GiB`, `TiB`,
/// `PiB` (and `K`, `M`, `G`, `T`, `P` for the same), `KB`, `MB`, `GB`, `TB`, `PB`
/// (powers of 1000); a space may stand between. Every bound a message names ("at most
/// 1 PiB") is written in a unit this takes.
pub(crate) fn byte_size(s: &str) -> Result<u64> {
    let text = s.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        "P" | "PiB" => 1 << 50,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        "PB" => 1_000_000_000_000_000,
        other => {
            bail!("`{other}` is not a unit of bytes in `{s}`: use B, KiB, MiB, GiB, TiB or PiB")
        }
    };
    let n = number
        .parse::<u64>()
        .ok()
        .filter(|&n| n > 0)
        .with_context(|| format!("`{s}` is not a size of at least 1 byte"))?;
    n.checked_mul(scale)
        .with_context(|| format!("`{s}` is more bytes than can be counted: give a smaller size"))
}

pub(crate) fn parse_key_value(s: &str) -> Result<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => bail!("expected KEY=VALUE, got `{s}`"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 72: "give at most 1 PiB" while `1PiB` was no unit the option took.
    #[test]
    fn the_bound_a_message_names_is_a_size_the_option_takes() {
        assert_eq!(overhead("1PiB").unwrap(), 1 << 50);
        assert_eq!(device_memory("1 PiB").unwrap(), 1 << 50);
        assert_eq!(byte_size("2P").unwrap(), 2 << 50);
        assert_eq!(byte_size("1PB").unwrap(), 1_000_000_000_000_000);
        let error = overhead("1025TiB").unwrap_err().to_string();
        assert!(error.ends_with("give at most 1 PiB"), "{error}");
        assert!(byte_size("1EiB").unwrap_err().to_string().contains("PiB"));
    }
}
