//! [`Consumer`]: a decode engine's remote requests under prefill/decode disaggregation, from
//! their first lookup until their load from the prefill engine (the producer) ended.
//!
//! A request arrives with the producer's [`RemoteSource`] (its namespace, export id, servers,
//! block keys and lease). The consumer checks it against this engine (namespace, parallel
//! layout, the request's own prompt), starts keeping its lease, and offers the remote blocks
//! beyond what the engine computed once the producer confirmed the lease (at most the load
//! deadline after the first lookup). The engine allocates, the load is planned, and once it
//! was reported the producer may let the blocks go. A source that does not fit, a lease lost
//! or never confirmed, a plan that does not fit the source: the request computes its prompt
//! here, and the caller hears why. Each request's lease is released exactly once, with `done`
//! when the producer may free its blocks. Time comes in as `now`; the leases are behind
//! [`Leases`], whose calls never wait on the network.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_offload::RemoteSource;

/// A kept lease, as the producers answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lease {
    /// Not every producer confirmed it yet.
    Pending,
    /// Every producer renewed it.
    Live,
    /// A producer refused it (the export is gone), and why.
    Lost(String),
}

/// The consumer's lease keeper (kvx-rdma's `LeaseKeeper`): none of its calls waits.
pub trait Leases {
    /// Start renewing `source`'s lease for request `number`.
    fn keep(&mut self, number: RequestId, source: &RemoteSource) -> Result<(), String>;
    /// The lease of `number`; `None` when it is not kept.
    fn status(&self, number: RequestId) -> Option<Lease>;
    /// Stop renewing it; with `done`, tell the producers they may free the blocks.
    fn release(&mut self, number: RequestId, done: bool);
}

/// What a lookup of a request answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Not a remote request (or no longer one): look it up in this engine's own tiers.
    Local,
    /// Ask again at the next step: the producer has not confirmed the lease yet.
    Wait,
    /// Offer these tokens, loaded asynchronously from the producer.
    Offer(u64),
    /// Nothing to load from the producer: the request computes its prompt here; `why` is set
    /// when that was not the plan (a bad source, a lost lease).
    Compute { why: Option<String> },
}

/// What an allocation for a request means here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allocated {
    /// Not a remote request offered blocks: the local path plans it.
    Local,
    /// The remote part ended without a load (nothing allocated for it, or a plan that does not
    /// fit the source: `why`).
    Ended { why: Option<String> },
    /// Load these blocks of the source (source index, engine block) for request `number`.
    Load {
        number: RequestId,
        source: Arc<RemoteSource>,
        blocks: Vec<(u32, EngineBlockId)>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The lease is kept, not yet confirmed by every producer.
    Waiting {
        since: Instant,
    },
    /// Tokens were offered from block `first` on.
    Offered {
        since: Instant,
        first: u64,
    },
    Loading,
    /// The load ended or was given up: the request goes on as any other.
    Done,
}

#[derive(Debug)]
struct Remote {
    number: RequestId,
    source: Option<Arc<RemoteSource>>,
    /// Blocks of the source that are this request's prompt.
    blocks: u64,
    state: State,
}

/// The decode engine's remote requests (see the module docs).
#[derive(Debug)]
pub struct Consumer {
    namespace: String,
    world: usize,
    block_tokens: u64,
    load_timeout: Duration,
    remote: HashMap<String, Remote>,
    refused: u64,
}

impl Consumer {
    /// A consumer in key namespace `namespace` (the id a producer names), with `world` workers
    /// (each reads from the producer rank of its own place), `block_tokens` per block, and the
    /// remote load deadline `load_timeout` (also the longest wait for a lease's confirmation).
    pub fn new(
        namespace: String,
        world: usize,
        block_tokens: u64,
        load_timeout: Duration,
    ) -> Consumer {
        Consumer {
            namespace,
            world,
            block_tokens,
            load_timeout,
            remote: HashMap::new(),
            refused: 0,
        }
    }

    /// A lookup of request `name` (kvx's `number`, its prompt's keys `own_keys`, `num_computed`
    /// tokens computed here). `source`: the producer's source as it came with the request
    /// (JSON), `None` when the request asks for no remote prefill.
    #[allow(clippy::too_many_arguments)]
    pub fn lookup(
        &mut self,
        leases: &mut impl Leases,
        name: &str,
        number: RequestId,
        source: Option<&str>,
        own_keys: &[BlockKey],
        num_computed: u64,
        now: Instant,
    ) -> Lookup {
        if !self.remote.contains_key(name) {
            let Some(text) = source else {
                return Lookup::Local;
            };
            match self.admit(leases, number, text, own_keys, now) {
                Ok(r) => {
                    self.remote.insert(name.to_string(), r);
                }
                Err(why) => {
                    self.refused += 1;
                    self.remote.insert(name.to_string(), Remote::done(number));
                    return Lookup::Compute { why: Some(why) };
                }
            }
        }
        let Some(r) = self.remote.get_mut(name) else {
            return Lookup::Local;
        };
        let since = match r.state {
            State::Done => return Lookup::Local,
            State::Loading => return Lookup::Compute { why: None },
            State::Waiting { since } | State::Offered { since, .. } => since,
        };
        let lease = leases
            .status(r.number)
            .unwrap_or_else(|| Lease::Lost("not kept".into()));
        let lease = match lease {
            Lease::Pending if now.saturating_duration_since(since) < self.load_timeout => {
                return Lookup::Wait;
            }
            Lease::Pending => Lease::Lost(format!(
                "no answer from the producer within {} ms",
                self.load_timeout.as_millis()
            )),
            other => other,
        };
        if let Lease::Lost(why) = lease {
            r.end(leases, false);
            return Lookup::Compute {
                why: Some(format!("the producer's lease: lost: {why}")),
            };
        }
        let remote_tokens = r.blocks * self.block_tokens;
        if remote_tokens <= num_computed {
            // A full local hit: nothing to read, the producer may free the blocks now.
            r.end(leases, true);
            return Lookup::Compute { why: None };
        }
        r.state = State::Offered {
            since,
            first: num_computed / self.block_tokens,
        };
        Lookup::Offer(remote_tokens - num_computed)
    }

    fn admit(
        &self,
        leases: &mut impl Leases,
        number: RequestId,
        text: &str,
        own_keys: &[BlockKey],
        now: Instant,
    ) -> Result<Remote, String> {
        let source = RemoteSource::from_json(text).map_err(|e| e.to_string())?;
        if source.namespace != self.namespace {
            return Err(format!(
                "the blocks belong to namespace {}, this engine's is {}",
                source.namespace, self.namespace
            ));
        }
        if source.producers.len() != self.world {
            return Err(format!(
                "{} producer ranks, this engine has {} workers",
                source.producers.len(),
                self.world
            ));
        }
        let n = source.keys.len().min(own_keys.len());
        if n == 0 || source.keys[..n] != own_keys[..n] {
            return Err("the source's blocks are not this request's prompt".into());
        }
        leases.keep(number, &source)?;
        Ok(Remote {
            number,
            source: Some(Arc::new(source)),
            blocks: n as u64,
            state: State::Waiting { since: now },
        })
    }

    /// The engine allocated `blocks` (the request's block table) for `num_external_tokens`
    /// tokens offered to request `name`.
    pub fn allocated(
        &mut self,
        leases: &mut impl Leases,
        name: &str,
        blocks: &[u32],
        num_external_tokens: u64,
    ) -> Allocated {
        let Some(r) = self.remote.get_mut(name) else {
            return Allocated::Local;
        };
        let State::Offered { first, .. } = r.state else {
            return Allocated::Local;
        };
        if num_external_tokens == 0 {
            r.end(leases, true);
            return Allocated::Ended { why: None };
        }
        let n = num_external_tokens / self.block_tokens;
        let (Some(source), Ok(first32)) = (r.source.clone(), u32::try_from(first)) else {
            r.end(leases, false);
            return Allocated::Ended {
                why: Some("no source".into()),
            };
        };
        let end = first + n;
        let fits = n > 0 && end <= r.blocks && (end as usize) <= blocks.len();
        if !fits {
            r.end(leases, false);
            return Allocated::Ended {
                why: Some(format!(
                    "blocks {first}..+{n} of a source of {} ({} allocated)",
                    r.blocks,
                    blocks.len()
                )),
            };
        }
        r.state = State::Loading;
        Allocated::Load {
            number: r.number,
            source,
            blocks: (first32..)
                .zip(&blocks[first as usize..end as usize])
                .map(|(i, b)| (i, EngineBlockId(*b)))
                .collect(),
        }
    }

    /// Request `name`'s load was reported (`finished_recving`): the producer may free its
    /// blocks.
    pub fn loaded(&mut self, leases: &mut impl Leases, name: &str) {
        if let Some(r) = self.remote.get_mut(name)
            && r.state == State::Loading
        {
            r.end(leases, true);
        }
    }

    /// Request `name` finished (or was aborted): its lease is let go and it is forgotten.
    pub fn finished(&mut self, leases: &mut impl Leases, name: &str) {
        if let Some(mut r) = self.remote.remove(name) {
            r.end(leases, true);
        }
    }

    /// True once request `name` came as a remote one (until it finished), whether or not its
    /// source fitted.
    pub fn knows(&self, name: &str) -> bool {
        self.remote.contains_key(name)
    }

    /// True while request `name` is a remote one this consumer has not finished with.
    pub fn is_remote(&self, name: &str) -> bool {
        self.remote
            .get(name)
            .is_some_and(|r| r.state != State::Done)
    }

    /// Requests tracked (zero when idle) and sources refused so far.
    pub fn counts(&self) -> (usize, u64) {
        (self.remote.len(), self.refused)
    }
}

impl Remote {
    fn done(number: RequestId) -> Remote {
        Remote {
            number,
            source: None,
            blocks: 0,
            state: State::Done,
        }
    }

    /// Done with the producer: its lease released once (`done`: it may free the blocks).
    fn end(&mut self, leases: &mut impl Leases, done: bool) {
        if self.state != State::Done {
            if self.source.is_some() {
                leases.release(self.number, done);
            }
            self.state = State::Done;
        }
    }
}

#[cfg(test)]
mod tests;
