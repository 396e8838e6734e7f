//! What the engine does when some blocks of a request fail to load.
//!
//! Blocks are prefix-chained: block `i` is only meaningful after blocks `0..i`. So once one block
//! is invalid, every block after it must be recomputed too, even the ones that loaded fine.

use kvx_core::EngineBlockId;
use serde::{Deserialize, Serialize};

use crate::error::PolicyError;

/// How a request reacts to blocks that failed to load.
///
/// Serialized externally tagged in snake case: `"fail"`, `"recompute"`, or
/// `{ auto = { max_recompute_tokens = 2048 } }` (TOML) / `{"auto": {"max_recompute_tokens": 2048}}`
/// (JSON). The default is `recompute`: the engine never computes on garbage and never fails a
/// request that it could finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadFailurePolicy {
    /// End the request with an error that names the failed blocks.
    Fail,
    /// Keep the tokens before the first invalid block and recompute from there.
    #[default]
    Recompute,
    /// Recompute when the tokens to redo are at most `max_recompute_tokens`, otherwise fail.
    Auto {
        /// Largest number of tokens the engine is willing to recompute for one request.
        max_recompute_tokens: u64,
    },
}

/// Whether one block of a request loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockOutcome {
    /// The engine block the data was loaded into.
    pub block: EngineBlockId,
    /// `true` if the block loaded and verified.
    pub ok: bool,
}

impl BlockOutcome {
    /// A block that loaded and verified.
    pub fn loaded(block: EngineBlockId) -> BlockOutcome {
        BlockOutcome { block, ok: true }
    }

    /// A block that failed to load.
    pub fn failed(block: EngineBlockId) -> BlockOutcome {
        BlockOutcome { block, ok: false }
    }
}

/// What the engine must do after a request's loads ended: a value to act on, not a side effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadDecision {
    /// Every block loaded: use them all.
    AllLoaded,
    /// Keep `valid_tokens` computed tokens and recompute the blocks in `invalid`.
    Recompute {
        /// Index (in prefix order) of the first block that failed.
        first_invalid_index: usize,
        /// Tokens the engine keeps: `first_invalid_index * block_tokens`, clipped to the total.
        valid_tokens: u64,
        /// The first invalid block and every block after it, in prefix order.
        invalid: Vec<EngineBlockId>,
    },
    /// End the request with an error.
    Fail {
        /// Exactly the blocks that failed, in prefix order.
        failed: Vec<EngineBlockId>,
    },
}

impl LoadDecision {
    /// The blocks this decision reports as unusable (empty for `AllLoaded`).
    pub fn invalid_blocks(&self) -> &[EngineBlockId] {
        match self {
            LoadDecision::AllLoaded => &[],
            LoadDecision::Recompute { invalid, .. } => invalid,
            LoadDecision::Fail { failed } => failed,
        }
    }

    /// `true` if every block loaded.
    pub fn is_all_loaded(&self) -> bool {
        matches!(self, LoadDecision::AllLoaded)
    }
}

impl LoadFailurePolicy {
    /// Decide what to do with a request whose blocks (in prefix order) ended as in `outcomes`.
    ///
    /// `block_tokens` is the number of tokens per block and `total_tokens` the number of tokens
    /// the loaded blocks cover (the last block may be partly filled).
    pub fn decide(
        &self,
        outcomes: &[BlockOutcome],
        block_tokens: u32,
        total_tokens: u64,
    ) -> LoadDecision {
        let Some(first_invalid_index) = outcomes.iter().position(|o| !o.ok) else {
            return LoadDecision::AllLoaded;
        };
        let fail = || LoadDecision::Fail {
            failed: outcomes.iter().filter(|o| !o.ok).map(|o| o.block).collect(),
        };
        let valid_tokens = u64::try_from(first_invalid_index)
            .unwrap_or(u64::MAX)
            .saturating_mul(u64::from(block_tokens))
            .min(total_tokens);
        let recompute = || LoadDecision::Recompute {
            first_invalid_index,
            valid_tokens,
            invalid: outcomes[first_invalid_index..]
                .iter()
                .map(|o| o.block)
                .collect(),
        };
        match *self {
            LoadFailurePolicy::Fail => fail(),
            LoadFailurePolicy::Recompute => recompute(),
            LoadFailurePolicy::Auto {
                max_recompute_tokens,
            } => {
                if total_tokens - valid_tokens <= max_recompute_tokens {
                    recompute()
                } else {
                    fail()
                }
            }
        }
    }

    /// Check the setting: an `Auto` limit of zero is rejected (it means `Fail`).
    pub fn validate(&self) -> Result<(), PolicyError> {
        match self {
            LoadFailurePolicy::Auto {
                max_recompute_tokens: 0,
            } => Err(PolicyError::ZeroRecomputeLimit),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(oks: &[bool]) -> Vec<BlockOutcome> {
        oks.iter()
            .enumerate()
            .map(|(i, &ok)| BlockOutcome {
                block: EngineBlockId(100 + i as u32),
                ok,
            })
            .collect()
    }

    fn ids(range: std::ops::Range<u32>) -> Vec<EngineBlockId> {
        range.map(|i| EngineBlockId(100 + i)).collect()
    }

    #[test]
    fn all_ok_is_all_loaded_under_every_policy() {
        let o = blocks(&[true, true, true]);
        for p in [
            LoadFailurePolicy::Fail,
            LoadFailurePolicy::Recompute,
            LoadFailurePolicy::Auto {
                max_recompute_tokens: 1,
            },
        ] {
            let d = p.decide(&o, 16, 48);
            assert_eq!(d, LoadDecision::AllLoaded, "{p:?}");
            assert!(d.invalid_blocks().is_empty());
        }
        assert_eq!(
            LoadFailurePolicy::Fail.decide(&[], 16, 0),
            LoadDecision::AllLoaded
        );
    }

    #[test]
    fn recompute_first_block_bad_invalidates_everything() {
        let d = LoadFailurePolicy::Recompute.decide(&blocks(&[false, true, true, true]), 16, 64);
        assert_eq!(
            d,
            LoadDecision::Recompute {
                first_invalid_index: 0,
                valid_tokens: 0,
                invalid: ids(0..4),
            }
        );
        assert_eq!(d.invalid_blocks(), ids(0..4).as_slice());
    }

    #[test]
    fn recompute_middle_block_bad_invalidates_suffix_even_if_later_ones_loaded() {
        let d =
            LoadFailurePolicy::Recompute.decide(&blocks(&[true, true, false, true, false]), 16, 80);
        assert_eq!(
            d,
            LoadDecision::Recompute {
                first_invalid_index: 2,
                valid_tokens: 32,
                invalid: ids(2..5),
            }
        );
    }

    #[test]
    fn recompute_last_block_bad_keeps_the_prefix() {
        let d = LoadFailurePolicy::Recompute.decide(&blocks(&[true, true, true, false]), 16, 64);
        assert_eq!(
            d,
            LoadDecision::Recompute {
                first_invalid_index: 3,
                valid_tokens: 48,
                invalid: ids(3..4),
            }
        );
    }

    #[test]
    fn valid_tokens_are_clipped_to_total_tokens() {
        // The prefix would be 3 * 16 = 48 tokens, but the request only has 40.
        let d = LoadFailurePolicy::Recompute.decide(&blocks(&[true, true, true, false]), 16, 40);
        match d {
            LoadDecision::Recompute { valid_tokens, .. } => assert_eq!(valid_tokens, 40),
            other => panic!("expected Recompute, got {other:?}"),
        }
    }

    #[test]
    fn fail_lists_exactly_the_failed_blocks() {
        let d = LoadFailurePolicy::Fail.decide(&blocks(&[true, false, true, false]), 16, 64);
        assert_eq!(
            d,
            LoadDecision::Fail {
                failed: vec![EngineBlockId(101), EngineBlockId(103)],
            }
        );
        assert_eq!(
            d.invalid_blocks(),
            &[EngineBlockId(101), EngineBlockId(103)]
        );
        assert!(!d.is_all_loaded());
    }

    #[test]
    fn auto_recomputes_exactly_at_the_limit_and_fails_one_above() {
        // First invalid index 1: keep 16 of 64 tokens, redo 48.
        let o = blocks(&[true, false, true, true]);
        let at = LoadFailurePolicy::Auto {
            max_recompute_tokens: 48,
        };
        assert_eq!(
            at.decide(&o, 16, 64),
            LoadDecision::Recompute {
                first_invalid_index: 1,
                valid_tokens: 16,
                invalid: ids(1..4),
            }
        );
        let below = LoadFailurePolicy::Auto {
            max_recompute_tokens: 47,
        };
        assert_eq!(
            below.decide(&o, 16, 64),
            LoadDecision::Fail {
                failed: vec![EngineBlockId(101)],
            }
        );
    }

    #[test]
    fn auto_counts_redo_tokens_after_clipping() {
        // Last block bad with a partly filled last block: 3 * 16 = 48 kept, 50 total, redo 2.
        let o = blocks(&[true, true, true, false]);
        let p = LoadFailurePolicy::Auto {
            max_recompute_tokens: 2,
        };
        assert!(matches!(
            p.decide(&o, 16, 50),
            LoadDecision::Recompute {
                valid_tokens: 48,
                ..
            }
        ));
        let p = LoadFailurePolicy::Auto {
            max_recompute_tokens: 1,
        };
        assert!(matches!(p.decide(&o, 16, 50), LoadDecision::Fail { .. }));
    }

    #[test]
    fn auto_zero_limit_is_rejected_others_accepted() {
        assert_eq!(
            LoadFailurePolicy::Auto {
                max_recompute_tokens: 0
            }
            .validate(),
            Err(PolicyError::ZeroRecomputeLimit)
        );
        assert_eq!(LoadFailurePolicy::Fail.validate(), Ok(()));
        assert_eq!(LoadFailurePolicy::Recompute.validate(), Ok(()));
        assert_eq!(
            LoadFailurePolicy::Auto {
                max_recompute_tokens: 1
            }
            .validate(),
            Ok(())
        );
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Wrap {
        policy: LoadFailurePolicy,
    }

    #[test]
    fn policy_parses_from_toml_in_every_form() {
        let w: Wrap = toml::from_str(r#"policy = "recompute""#).unwrap();
        assert_eq!(w.policy, LoadFailurePolicy::Recompute);
        let w: Wrap = toml::from_str(r#"policy = "fail""#).unwrap();
        assert_eq!(w.policy, LoadFailurePolicy::Fail);
        let w: Wrap =
            toml::from_str("policy = { auto = { max_recompute_tokens = 2048 } }").unwrap();
        assert_eq!(
            w.policy,
            LoadFailurePolicy::Auto {
                max_recompute_tokens: 2048
            }
        );
        let w: Wrap = toml::from_str("[policy.auto]\nmax_recompute_tokens = 7\n").unwrap();
        assert_eq!(
            w.policy,
            LoadFailurePolicy::Auto {
                max_recompute_tokens: 7
            }
        );
        assert!(toml::from_str::<Wrap>(r#"policy = "Recompute""#).is_err());
        assert!(toml::from_str::<Wrap>(r#"policy = "auto""#).is_err());
        // Round trip through the serializer.
        let w = Wrap {
            policy: LoadFailurePolicy::Auto {
                max_recompute_tokens: 9,
            },
        };
        assert_eq!(
            toml::from_str::<Wrap>(&toml::to_string(&w).unwrap()).unwrap(),
            w
        );
    }

    #[test]
    fn policy_parses_from_json_in_every_form() {
        let p: LoadFailurePolicy = serde_json::from_str(r#""recompute""#).unwrap();
        assert_eq!(p, LoadFailurePolicy::Recompute);
        let p: LoadFailurePolicy = serde_json::from_str(r#""fail""#).unwrap();
        assert_eq!(p, LoadFailurePolicy::Fail);
        let p: LoadFailurePolicy =
            serde_json::from_str(r#"{"auto":{"max_recompute_tokens":2048}}"#).unwrap();
        assert_eq!(
            p,
            LoadFailurePolicy::Auto {
                max_recompute_tokens: 2048
            }
        );
        assert_eq!(
            serde_json::to_string(&LoadFailurePolicy::Auto {
                max_recompute_tokens: 5
            })
            .unwrap(),
            r#"{"auto":{"max_recompute_tokens":5}}"#
        );
        assert_eq!(
            serde_json::to_string(&LoadFailurePolicy::Fail).unwrap(),
            r#""fail""#
        );
        assert!(serde_json::from_str::<LoadFailurePolicy>(r#""sometimes""#).is_err());
        assert!(serde_json::from_str::<LoadFailurePolicy>(r#"{"auto":{}}"#).is_err());
    }
}
