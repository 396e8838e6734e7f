//! Request traces in the Mooncake format: one JSON object per line with `timestamp` (ms),
//! `input_length`, `output_length` and `hash_ids` (one id per 512-token block; equal ids at
//! equal positions mean a shared, reusable prefix).

use std::path::Path;

use kvx_core::BlockKey;
use serde_json::Value;

use super::error::ReplayError;

/// Tokens per block of a Mooncake trace's `hash_ids`.
pub const TRACE_BLOCK_TOKENS: u64 = 512;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Arrival time in milliseconds since the first request.
    pub timestamp_ms: f64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Prefix-block hashes, one per 512-token block (the last one may be partial).
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// Full blocks of the prompt: only those are cached (an engine caches full blocks only).
    pub fn full_blocks(&self) -> usize {
        let full = (self.input_length / TRACE_BLOCK_TOKENS) as usize;
        full.min(self.hash_ids.len())
    }

    /// Block keys of the full blocks, chained over the ids so that equal prefixes share keys.
    pub fn keys(&self) -> Vec<BlockKey> {
        let mut parent = None;
        self.hash_ids[..self.full_blocks()]
            .iter()
            .map(|id| {
                let k = BlockKey::chain(parent, &id.to_le_bytes());
                parent = Some(k);
                k
            })
            .collect()
    }

    /// The request as one trace line.
    pub fn to_json_line(&self) -> String {
        serde_json::json!({
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": self.hash_ids,
        })
        .to_string()
    }
}

/// A trace read from a file, with the lines that were skipped.
#[derive(Debug, Default)]
pub struct Trace {
    /// Requests in file order.
    pub requests: Vec<TraceRequest>,
    /// Lines skipped with `--skip-bad-lines`: (line number, reason).
    pub skipped: Vec<(usize, String)>,
}

/// Read a trace file. A malformed line is an error naming its line number, unless
/// `skip_bad_lines`; at most `limit` requests are taken.
pub fn read_trace(
    path: &Path,
    skip_bad_lines: bool,
    limit: Option<usize>,
) -> Result<Trace, ReplayError> {
    let text = std::fs::read_to_string(path).map_err(|source| ReplayError::TraceRead {
        path: path.to_owned(),
        source,
    })?;
    let mut trace = Trace::default();
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|n| trace.requests.len() >= n) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        match parse_line(line) {
            Ok(r) => trace.requests.push(r),
            Err(reason) if skip_bad_lines => trace.skipped.push((i + 1, reason)),
            Err(reason) => {
                return Err(ReplayError::TraceLine {
                    path: path.to_owned(),
                    line: i + 1,
                    reason,
                });
            }
        }
    }
    if trace.requests.is_empty() {
        return Err(ReplayError::TraceEmpty {
            path: path.to_owned(),
        });
    }
    Ok(trace)
}

fn non_negative(obj: &serde_json::Map<String, Value>, field: &str) -> Result<u64, String> {
    let v = obj
        .get(field)
        .ok_or_else(|| format!("missing field `{field}`"))?;
    if let Some(n) = v.as_u64() {
        return Ok(n);
    }
    match v.as_f64() {
        Some(x) if x < 0.0 => Err(format!("`{field}` is negative ({v})")),
        Some(x) if x.fract() == 0.0 && x <= u64::MAX as f64 => Ok(x as u64),
        Some(_) => Err(format!("`{field}` is not a whole number ({v})")),
        None => Err(format!("`{field}` must be a number, got {}", kind(v))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Parse one trace line; the error says what is wrong with it.
pub fn parse_line(line: &str) -> Result<TraceRequest, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"))?;
    let Value::Object(obj) = &v else {
        return Err(format!("expected a JSON object, got {}", kind(&v)));
    };
    let ts = obj
        .get("timestamp")
        .ok_or("missing field `timestamp`")?
        .as_f64()
        .ok_or("`timestamp` must be a number")?;
    if !ts.is_finite() || ts < 0.0 {
        return Err(format!("`timestamp` is negative or not finite ({ts})"));
    }
    let input_length = non_negative(obj, "input_length")?;
    let output_length = non_negative(obj, "output_length")?;
    let ids = obj.get("hash_ids").ok_or("missing field `hash_ids`")?;
    let Value::Array(ids) = ids else {
        return Err(format!(
            "`hash_ids` must be a list of block ids, got {}",
            kind(ids)
        ));
    };
    let hash_ids = ids
        .iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64()
                .ok_or_else(|| format!("`hash_ids`[{i}] must be a non-negative integer, got {x}"))
        })
        .collect::<Result<Vec<u64>, String>>()?;
    Ok(TraceRequest {
        timestamp_ms: ts,
        input_length,
        output_length,
        hash_ids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_mooncake_line_and_chains_keys() {
        let r = parse_line(
            r#"{"timestamp": 27, "input_length": 1100, "output_length": 5, "hash_ids": [4, 9, 12]}"#,
        )
        .unwrap();
        assert_eq!(r.timestamp_ms, 27.0);
        assert_eq!(r.full_blocks(), 2, "the partial third block is not cached");
        let k = r.keys();
        let other = parse_line(
            r#"{"timestamp": 30, "input_length": 2048, "output_length": 5, "hash_ids": [4, 9, 13, 14]}"#,
        )
        .unwrap();
        assert_eq!(other.keys()[..2], k[..], "a shared prefix shares keys");
        let moved = parse_line(
            r#"{"timestamp": 30, "input_length": 2048, "output_length": 5, "hash_ids": [5, 9]}"#,
        )
        .unwrap();
        assert_ne!(
            moved.keys()[1],
            k[1],
            "same id after another prefix differs"
        );
        assert_eq!(parse_line(&r.to_json_line()).unwrap(), r);
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        let neg = parse_line(
            r#"{"timestamp": 0, "input_length": -4, "output_length": 5, "hash_ids": []}"#,
        )
        .unwrap_err();
        assert!(
            neg.contains("input_length") && neg.contains("negative"),
            "{neg}"
        );
        let ids = parse_line(
            r#"{"timestamp": 0, "input_length": 4, "output_length": 5, "hash_ids": "abc"}"#,
        )
        .unwrap_err();
        assert!(
            ids.contains("hash_ids") && ids.contains("a string"),
            "{ids}"
        );
        assert!(parse_line("{").unwrap_err().contains("not valid JSON"));
        assert!(parse_line("[1]").unwrap_err().contains("object"));
        let missing =
            parse_line(r#"{"timestamp": 0, "input_length": 4, "output_length": 5}"#).unwrap_err();
        assert!(missing.contains("hash_ids"), "{missing}");
    }
}
