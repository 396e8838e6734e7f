//! Sizes on the command line: `4096`, `64K`, `256KiB`, `1MiB`, `4M`, `2GiB`, `1TiB` (binary
//! units; `b`, `kb`, `kib` and so on, any case).

/// Parse a positive size in bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("not a size: {s:?}"))?;
    let mul: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => {
            return Err(format!(
                "unknown size unit {u:?} in {s:?} (use KiB, MiB, GiB or TiB)"
            ));
        }
    };
    n.checked_mul(mul)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("size {s:?} must be positive and fit in 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_errors() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size(" 2MiB "), Ok(2 << 20));
        assert_eq!(parse_size("1tib"), Ok(1 << 40));
        assert!(parse_size("0").is_err());
        assert!(parse_size("1x").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("99999999999999TiB").is_err());
    }
}
