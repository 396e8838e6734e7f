//! Model shapes: KV bytes per token of common models, and the block size a replay moves.
//!
//! One 512-token block of a real model is 6–64 MiB. A replay moves every block for real (fill,
//! copy, write, read, verify), so by default it moves each block scaled down by
//! [`DEFAULT_SCALE`]: capacities, hit rates and "model GiB" figures are those of the real
//! model, while the bytes on the wire are 1/1024 of them. `--block-bytes model` moves
//! full-size blocks.

use super::error::ReplayError;
use super::trace::TRACE_BLOCK_TOKENS;

/// Default ratio of a model block to the block actually moved.
pub const DEFAULT_SCALE: u64 = 1024;

/// Blocks moved are a whole number of these (O_DIRECT alignment of the file tier).
pub const BLOCK_ALIGN: u64 = 4096;

/// A named model shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPreset {
    /// Name on the command line.
    pub name: &'static str,
    /// Transformer layers.
    pub layers: u64,
    /// KV heads.
    pub kv_heads: u64,
    /// Head dimension.
    pub head_dim: u64,
    /// Bytes per element (bf16: 2).
    pub dtype_bytes: u64,
}

impl ModelPreset {
    /// KV bytes per token: 2 (K and V) × layers × kv heads × head dim × dtype bytes.
    pub fn bytes_per_token(&self) -> u64 {
        2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes
    }
}

/// The presets `--model` knows.
pub const PRESETS: &[ModelPreset] = &[
    ModelPreset {
        name: "llama3-8b",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
    },
    ModelPreset {
        name: "qwen2.5-7b",
        layers: 28,
        kv_heads: 4,
        head_dim: 128,
        dtype_bytes: 2,
    },
    ModelPreset {
        name: "llama3.2-1b",
        layers: 16,
        kv_heads: 8,
        head_dim: 64,
        dtype_bytes: 2,
    },
    ModelPreset {
        name: "qwen2.5-0.5b",
        layers: 24,
        kv_heads: 2,
        head_dim: 64,
        dtype_bytes: 2,
    },
];

/// Block sizes of a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockSize {
    /// What the bytes per token came from (a preset name, or "custom").
    pub model: String,
    /// KV bytes per token of the model.
    pub bytes_per_token: u64,
    /// Bytes of one 512-token block of the model.
    pub model_block_bytes: u64,
    /// Bytes actually moved per block.
    pub block_bytes: u64,
}

impl BlockSize {
    /// Model bytes represented by one moved byte.
    pub fn scale(&self) -> f64 {
        self.model_block_bytes as f64 / self.block_bytes as f64
    }
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

/// Resolve `--model`, `--bytes-per-token` and `--block-bytes`.
pub fn block_size(
    model: &str,
    bytes_per_token: Option<u64>,
    block_bytes: Option<&str>,
) -> Result<BlockSize, ReplayError> {
    let (name, bpt) = match bytes_per_token {
        Some(0) => {
            return Err(ReplayError::BadOption(
                "--bytes-per-token must be positive".into(),
            ));
        }
        Some(b) => ("custom".to_string(), b),
        None => {
            let p = PRESETS.iter().find(|p| p.name == model).ok_or_else(|| {
                let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
                ReplayError::BadOption(format!(
                    "unknown --model {model:?} (presets: {}; or give --bytes-per-token)",
                    names.join(", ")
                ))
            })?;
            (p.name.to_string(), p.bytes_per_token())
        }
    };
    let model_block_bytes = bpt
        .checked_mul(TRACE_BLOCK_TOKENS)
        .ok_or_else(|| ReplayError::BadOption(format!("--bytes-per-token {bpt} is too large")))?;
    let moved = match block_bytes {
        None => round_up((model_block_bytes / DEFAULT_SCALE).max(1), BLOCK_ALIGN),
        Some("model") | Some("full") => round_up(model_block_bytes, BLOCK_ALIGN),
        Some(s) => {
            let b = crate::size::parse_size(s).map_err(|_| {
                ReplayError::BadOption(format!(
                    "--block-bytes {s:?}: expected a size like 65536, 64K, 1M, or `model`"
                ))
            })?;
            if b == 0 || b % BLOCK_ALIGN != 0 {
                return Err(ReplayError::BadOption(format!(
                    "--block-bytes {b} must be a positive multiple of {BLOCK_ALIGN}"
                )));
            }
            b
        }
    };
    Ok(BlockSize {
        model: name,
        bytes_per_token: bpt,
        model_block_bytes,
        block_bytes: moved,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_the_published_shapes() {
        let l = block_size("llama3-8b", None, None).unwrap();
        assert_eq!(l.bytes_per_token, 131_072);
        assert_eq!(l.model_block_bytes, 64 << 20);
        assert_eq!(l.block_bytes, 64 << 10);
        let q = block_size("qwen2.5-7b", None, None).unwrap();
        assert_eq!(q.bytes_per_token, 57_344);
        assert_eq!(q.block_bytes, 28 << 10);
        assert_eq!(
            block_size("qwen2.5-7b", None, Some("model"))
                .unwrap()
                .block_bytes,
            28 << 20
        );
        let c = block_size("ignored", Some(100), Some("8K")).unwrap();
        assert_eq!((c.model.as_str(), c.block_bytes), ("custom", 8192));
        assert!(block_size("gpt-9", None, None).is_err());
        assert!(block_size("llama3-8b", None, Some("1000")).is_err());
        assert!(block_size("llama3-8b", Some(0), None).is_err());
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(crate::size::parse_size("4096"), Ok(4096));
        assert_eq!(crate::size::parse_size("64K"), Ok(65536));
        assert_eq!(crate::size::parse_size("2MiB"), Ok(2 << 20));
        assert!(crate::size::parse_size("1x").is_err());
    }
}
