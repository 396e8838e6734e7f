//! The embedded default trace: generated in-process from a fixed seed, in the Mooncake format,
//! with the prefix sharing of a chat service.
//!
//! Every request starts with one of a few system prompts (Zipf popularity), about half of the
//! conversations then carry a document (RAG context or few-shot examples, Zipf popularity over a
//! few hundred), and conversations go on for several turns, each turn's prompt being the whole
//! previous prompt plus the previous answer plus a new user message. Block ids follow the
//! Mooncake rule: a block's id is determined by every token up to its end, so equal ids mean
//! equal prefixes; the last, partial block of a prompt gets an id of its own.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::trace::{TRACE_BLOCK_TOKENS, TraceRequest};

/// Seed of the embedded default trace.
pub const DEFAULT_SEED: u64 = 0x6b76_785f_7265_706c;

/// Shape of a generated trace.
#[derive(Debug, Clone)]
pub struct SynthConfig {
    /// Random seed.
    pub seed: u64,
    /// Requests.
    pub requests: usize,
    /// Mean arrivals per second (Poisson).
    pub rate_per_s: f64,
    /// System prompts.
    pub system_prompts: usize,
    /// Shared documents.
    pub documents: usize,
    /// Share of conversations that carry a document.
    pub doc_share: f64,
    /// Chance that a request continues an open conversation rather than starting one.
    pub follow_up: f64,
    /// Open conversations a follow-up picks from (most recent first).
    pub open_conversations: usize,
    /// Most turns of a conversation.
    pub max_turns: u32,
    /// Longest prompt in tokens (a conversation ends before it would exceed it).
    pub max_context: u64,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig {
            seed: DEFAULT_SEED,
            requests: 1600,
            rate_per_s: 50.0,
            system_prompts: 8,
            documents: 400,
            doc_share: 0.55,
            follow_up: 0.55,
            open_conversations: 48,
            max_turns: 10,
            max_context: 32_768,
        }
    }
}

/// Samples indices 0..n with probability proportional to 1/(i+1)^s.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (0..n.max(1))
            .map(|i| {
                acc += 1.0 / ((i + 1) as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    fn sample(&self, rng: &mut StdRng) -> usize {
        let u: f64 = rng.random();
        self.cdf.partition_point(|c| *c < u).min(self.cdf.len() - 1)
    }
}

fn log_uniform(rng: &mut StdRng, lo: u64, hi: u64) -> u64 {
    let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
    rng.random_range(a..=b).exp().round() as u64
}

fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A prompt as segments of tokens: (segment id, tokens). Equal segment ids have equal length.
type Segments = Vec<(u64, u64)>;

/// Assigns Mooncake-style block ids: one per distinct (prefix, block end).
#[derive(Default)]
struct BlockIds {
    ids: HashMap<(u64, u64), u64>,
    next: u64,
}

impl BlockIds {
    fn hash_ids(&mut self, segs: &Segments) -> (u64, Vec<u64>) {
        let total: u64 = segs.iter().map(|s| s.1).sum();
        let mut out = Vec::new();
        let (mut sig, mut seg, mut seg_start) = (0u64, 0usize, 0u64);
        let mut end = 0;
        while end < total {
            end = (end + TRACE_BLOCK_TOKENS).min(total);
            // Take in every segment that starts before this block's end.
            while seg < segs.len() && seg_start < end {
                sig = mix(sig, segs[seg].0);
                seg_start += segs[seg].1;
                seg += 1;
            }
            let next = &mut self.next;
            let id = *self.ids.entry((sig, end)).or_insert_with(|| {
                *next += 1;
                *next - 1
            });
            out.push(id);
        }
        (total, out)
    }
}

struct Conversation {
    segs: Segments,
    turns_left: u32,
    next_output: u64,
}

/// Generate a trace.
pub fn generate(cfg: &SynthConfig) -> Vec<TraceRequest> {
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let sys_len: Vec<u64> = (0..cfg.system_prompts)
        .map(|_| rng.random_range(1000..=4000))
        .collect();
    let doc_len: Vec<u64> = (0..cfg.documents)
        .map(|_| rng.random_range(2000..=12_000))
        .collect();
    let sys_pick = Zipf::new(cfg.system_prompts, 1.1);
    let doc_pick = Zipf::new(cfg.documents, 1.0);
    let mut ids = BlockIds::default();
    let mut open: Vec<Conversation> = Vec::new();
    let mut next_seg: u64 = 1 << 40; // per-conversation segments: above sys/doc ids
    let mut t_ms = 0.0f64;
    let mut out = Vec::with_capacity(cfg.requests);
    while out.len() < cfg.requests {
        let follow = !open.is_empty() && rng.random_bool(cfg.follow_up);
        let mut conv = if follow {
            let from = open.len().saturating_sub(cfg.open_conversations);
            let i = rng.random_range(from..open.len());
            open.remove(i)
        } else {
            let s = sys_pick.sample(&mut rng);
            let mut segs = vec![(s as u64, sys_len[s])];
            if rng.random_bool(cfg.doc_share) {
                let d = doc_pick.sample(&mut rng);
                segs.push(((1 << 20) + d as u64, doc_len[d]));
            }
            Conversation {
                segs,
                turns_left: rng.random_range(1..=cfg.max_turns),
                next_output: 0,
            }
        };
        if conv.next_output > 0 {
            conv.segs.push((next_seg, conv.next_output));
            next_seg += 1;
        }
        conv.segs.push((next_seg, log_uniform(&mut rng, 50, 1500)));
        next_seg += 1;
        let (input_length, hash_ids) = ids.hash_ids(&conv.segs);
        let output_length = log_uniform(&mut rng, 20, 800);
        // Poisson arrivals.
        let u: f64 = rng.random_range(f64::EPSILON..1.0);
        t_ms += -u.ln() / cfg.rate_per_s * 1000.0;
        out.push(TraceRequest {
            timestamp_ms: t_ms.round(),
            input_length,
            output_length,
            hash_ids,
        });
        conv.turns_left -= 1;
        conv.next_output = output_length;
        if conv.turns_left > 0 && input_length + output_length + 1500 <= cfg.max_context {
            open.push(conv);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn deterministic_and_shares_prefixes() {
        let cfg = SynthConfig {
            requests: 400,
            ..SynthConfig::default()
        };
        let a = generate(&cfg);
        assert_eq!(a, generate(&cfg), "same seed, same trace");
        assert_eq!(a.len(), 400);
        let mut seen = HashSet::new();
        let (mut refs, mut reused) = (0usize, 0usize);
        for r in &a {
            assert_eq!(
                r.hash_ids.len() as u64,
                r.input_length.div_ceil(TRACE_BLOCK_TOKENS),
                "one id per 512-token block"
            );
            for k in r.keys() {
                refs += 1;
                if !seen.insert(k) {
                    reused += 1;
                }
            }
        }
        let share = reused as f64 / refs as f64;
        assert!(
            (0.3..0.9).contains(&share),
            "block reuse {share:.2} is not chat-like"
        );
        assert!(a.windows(2).all(|w| w[0].timestamp_ms <= w[1].timestamp_ms));
    }
}
