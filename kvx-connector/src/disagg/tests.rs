//! The P/D lifecycle on kvx-offload's real scheduler side, with a lease keeper whose answers
//! the test sets (kvx-rdma's keeper is tested against real producers in kvx-python's P/D
//! suite); and a model-based property test over random engine-call sequences.

use std::time::{Duration, Instant};

use kvx_core::{BlockKey, RequestId};
use kvx_offload::{RemoteSource, RemoteTierConfig, SchedulerConfig, SchedulerSide};
use proptest::prelude::*;
use rustc_hash::FxHashMap;
use serde_json::{Value, json};

use super::{Allocated, Asking, Disagg, DisaggConfig, RemoteMatch};
use crate::leases::{LeaseState, Leases};

const BLOCK: u64 = 16;
const LOAD_MS: u64 = 500;
const NS: &str = "ns-of-this-engine";

/// A keeper whose lease states the test sets; it records every keep and release.
#[derive(Default)]
struct Keeper {
    states: FxHashMap<u64, LeaseState>,
    kept: Vec<u64>,
    released: Vec<(u64, bool)>,
}

impl Leases for Keeper {
    fn keep(&mut self, id: u64, _source: &RemoteSource) -> Result<(), String> {
        if self.states.contains_key(&id) {
            return Err(format!("{id} is kept already"));
        }
        self.states.insert(id, LeaseState::Pending);
        self.kept.push(id);
        Ok(())
    }
    fn state(&self, id: u64) -> Option<LeaseState> {
        self.states.get(&id).cloned()
    }
    fn release(&mut self, id: u64, done: bool) {
        self.states.remove(&id);
        self.released.push((id, done));
    }
    fn kept(&self) -> usize {
        self.states.len()
    }
}

fn remote_cfg(listen: bool) -> RemoteTierConfig {
    RemoteTierConfig {
        listen: listen.then(|| "127.0.0.1:7000".parse().expect("an address")),
        load_ms: LOAD_MS,
        lease_ttl_ms: 60_000,
        heartbeat_ms: 1_000,
        ..RemoteTierConfig::default()
    }
}

fn disagg(produce: bool, consume: bool, world: u32) -> Disagg {
    Disagg::new(DisaggConfig {
        namespace: NS.into(),
        remote: remote_cfg(produce),
        world,
        produce,
        consume,
        block_tokens: BLOCK,
        export_seed: 7,
    })
}

fn side() -> SchedulerSide {
    SchedulerSide::new(SchedulerConfig {
        block_tokens: BLOCK as u32,
        host_blocks: 64,
        ..SchedulerConfig::default()
    })
    .expect("a scheduler side")
}

fn keys(first: u128, n: usize) -> Vec<BlockKey> {
    (0..n as u128).map(|i| BlockKey(first + i)).collect()
}

/// What P hands D for these keys: kvx's source under `"kvx"`.
fn params(namespace: &str, producers: usize, keys: &[BlockKey]) -> Value {
    let source = RemoteSource {
        namespace: namespace.into(),
        export: 9,
        producers: (0..producers)
            .map(|r| {
                format!("127.0.0.1:{}", 7000 + r)
                    .parse()
                    .expect("an address")
            })
            .collect(),
        keys: keys.to_vec(),
        ttl_ms: 60_000,
        heartbeat_ms: 1_000,
    };
    let kvx: Value = serde_json::from_str(&source.to_json()).expect("JSON");
    json!({"do_remote_prefill": true, "kvx": kvx})
}

#[test]
fn a_live_lease_offers_the_remote_blocks_and_the_load_releases_it_done() {
    let (mut d, mut k, mut s, t0) = (
        disagg(false, true, 1),
        Keeper::default(),
        side(),
        Instant::now(),
    );
    let own = keys(100, 4);
    let p = params(NS, 1, &own);
    assert!(d.wants("a", Some(&p)));
    // Pending: later, until the load deadline.
    assert_eq!(
        d.lookup(
            &Asking {
                id: "a",
                number: RequestId(1),
                params: Some(&p),
                own: &own,
                num_computed: 0
            },
            &mut k,
            t0
        ),
        RemoteMatch::Later
    );
    assert_eq!(k.kept, [1]);
    k.states.insert(1, LeaseState::Live);
    // One block is the engine's own: three load.
    let m = d.lookup(
        &Asking {
            id: "a",
            number: RequestId(1),
            params: Some(&p),
            own: &own,
            num_computed: BLOCK,
        },
        &mut k,
        t0 + Duration::from_millis(10),
    );
    assert_eq!(m, RemoteMatch::Load(3 * BLOCK));
    assert!(d.is_remote("a"));
    assert_eq!(
        d.allocated("a", &[50, 51, 52, 53], 3 * BLOCK, &mut s, &mut k),
        Allocated::Loading
    );
    let meta = s.build_meta();
    assert_eq!(meta.remote_loads.len(), 1);
    let job = &meta.remote_loads[0];
    let blocks: Vec<(u32, u32)> = job.blocks.iter().map(|(i, b)| (*i, b.0)).collect();
    assert_eq!(blocks, [(1, 51), (2, 52), (3, 53)]);
    // While it loads, a lookup offers nothing more; the report releases the lease, done.
    assert_eq!(
        d.lookup(
            &Asking {
                id: "a",
                number: RequestId(1),
                params: Some(&p),
                own: &own,
                num_computed: BLOCK
            },
            &mut k,
            t0
        ),
        RemoteMatch::Local(None)
    );
    assert!(k.released.is_empty());
    d.loaded("a", &mut k);
    assert_eq!(k.released, [(1, true)]);
    d.finished("a", &mut k);
    assert_eq!(k.released, [(1, true)], "released once");
    assert_eq!(d.tracked(), 0);
    assert!(!d.wants("b", None));
}

#[test]
fn a_lease_pending_past_the_load_deadline_is_given_up_and_computed_here() {
    let (mut d, mut k, t0) = (disagg(false, true, 1), Keeper::default(), Instant::now());
    let own = keys(1, 2);
    let p = params(NS, 1, &own);
    let just_before = t0 + Duration::from_millis(LOAD_MS - 1);
    assert_eq!(
        d.lookup(
            &Asking {
                id: "a",
                number: RequestId(3),
                params: Some(&p),
                own: &own,
                num_computed: 0
            },
            &mut k,
            t0
        ),
        RemoteMatch::Later
    );
    assert_eq!(
        d.lookup(
            &Asking {
                id: "a",
                number: RequestId(3),
                params: Some(&p),
                own: &own,
                num_computed: 0
            },
            &mut k,
            just_before
        ),
        RemoteMatch::Later
    );
    let m = d.lookup(
        &Asking {
            id: "a",
            number: RequestId(3),
            params: Some(&p),
            own: &own,
            num_computed: 0,
        },
        &mut k,
        t0 + Duration::from_millis(LOAD_MS),
    );
    let RemoteMatch::Local(Some(why)) = m else {
        panic!("{m:?}")
    };
    assert!(
        why.contains("no answer from the producer within 500 ms"),
        "{why}"
    );
    assert_eq!(k.released, [(3, false)]);
    assert_eq!(d.refused, 1);
    assert!(!d.wants("a", Some(&p)), "a local request from now on");
    assert!(!d.is_remote("a"));
    d.finished("a", &mut k);
    assert_eq!(k.released.len(), 1);
}

#[test]
fn a_lost_lease_is_computed_here_with_the_reason() {
    let (mut d, mut k, t0) = (disagg(false, true, 1), Keeper::default(), Instant::now());
    let own = keys(1, 2);
    let p = params(NS, 1, &own);
    assert_eq!(
        d.lookup(
            &Asking {
                id: "a",
                number: RequestId(3),
                params: Some(&p),
                own: &own,
                num_computed: 0
            },
            &mut k,
            t0
        ),
        RemoteMatch::Later
    );
    k.states
        .insert(3, LeaseState::Lost("the producer refused".into()));
    let m = d.lookup(
        &Asking {
            id: "a",
            number: RequestId(3),
            params: Some(&p),
            own: &own,
            num_computed: 0,
        },
        &mut k,
        t0,
    );
    assert_eq!(
        m,
        RemoteMatch::Local(Some(
            "the producer's lease: lost: the producer refused".into()
        ))
    );
    assert_eq!(k.released, [(3, false)]);
}

#[test]
fn params_that_do_not_fit_are_that_requests_error_only() {
    let own = keys(10, 3);
    let cases: Vec<(Value, &str)> = vec![
        (json!({"do_remote_prefill": true}), "no kvx source"),
        (
            json!({"do_remote_prefill": true, "kvx": "text"}),
            "no kvx source",
        ),
        (
            json!({"do_remote_prefill": true, "kvx": {"namespace": 1}}),
            "kv_transfer_params.kvx",
        ),
        (params("another", 1, &own), "namespace another"),
        (params(NS, 2, &own), "2 producer ranks, this engine has 1"),
        (params(NS, 1, &keys(11, 3)), "not this request's prompt"),
    ];
    for (p, want) in cases {
        let (mut d, mut k) = (disagg(false, true, 1), Keeper::default());
        let m = d.lookup(
            &Asking {
                id: "a",
                number: RequestId(1),
                params: Some(&p),
                own: &own,
                num_computed: 0,
            },
            &mut k,
            Instant::now(),
        );
        let RemoteMatch::Local(Some(why)) = &m else {
            panic!("{p}: {m:?}")
        };
        assert!(why.contains(want), "{p}: {why}");
        assert!(k.kept.is_empty() && k.released.is_empty(), "{p}: no lease");
        assert_eq!(d.refused, 1);
        assert!(!d.wants("a", Some(&p)));
        d.finished("a", &mut k);
        assert_eq!(d.tracked(), 0);
    }
}

#[test]
fn an_allocation_that_does_not_fit_ends_the_remote_part() {
    let (mut d, mut k, mut s, t0) = (
        disagg(false, true, 1),
        Keeper::default(),
        side(),
        Instant::now(),
    );
    let own = keys(1, 2);
    let p = params(NS, 1, &own);
    d.lookup(
        &Asking {
            id: "a",
            number: RequestId(1),
            params: Some(&p),
            own: &own,
            num_computed: 0,
        },
        &mut k,
        t0,
    );
    k.states.insert(1, LeaseState::Live);
    assert_eq!(
        d.lookup(
            &Asking {
                id: "a",
                number: RequestId(1),
                params: Some(&p),
                own: &own,
                num_computed: 0
            },
            &mut k,
            t0
        ),
        RemoteMatch::Load(2 * BLOCK)
    );
    // The engine gave fewer blocks than it allocated tokens for.
    let a = d.allocated("a", &[7], 2 * BLOCK, &mut s, &mut k);
    assert!(
        matches!(&a, Allocated::Ended(Some(why)) if why.contains("blocks 0..2 of 1")),
        "{a:?}"
    );
    assert_eq!(k.released, [(1, false)]);
    assert!(s.build_meta().remote_loads.is_empty());
    // No external tokens allocated: ended, P may free.
    let (mut d, mut k) = (disagg(false, true, 1), Keeper::default());
    d.lookup(
        &Asking {
            id: "b",
            number: RequestId(2),
            params: Some(&p),
            own: &own,
            num_computed: 0,
        },
        &mut k,
        t0,
    );
    k.states.insert(2, LeaseState::Live);
    d.lookup(
        &Asking {
            id: "b",
            number: RequestId(2),
            params: Some(&p),
            own: &own,
            num_computed: 0,
        },
        &mut k,
        t0,
    );
    assert_eq!(
        d.allocated("b", &[7, 8], 0, &mut s, &mut k),
        Allocated::Ended(None)
    );
    assert_eq!(k.released, [(2, true)]);
    assert_eq!(
        d.allocated("nobody", &[7], BLOCK, &mut s, &mut k),
        Allocated::NotRemote
    );
}

#[test]
fn a_producer_exports_a_sendable_requests_full_prompt_blocks() {
    let (mut d, mut s) = (disagg(true, false, 2), side());
    let ask = json!({"do_remote_decode": true});
    let k = keys(40, 3);
    // 2.5 blocks of prompt: two full blocks go.
    let out = d
        .export(
            RequestId(5),
            Some(&ask),
            true,
            2 * BLOCK + 8,
            &k,
            &[3, 4, 5],
            &mut s,
        )
        .expect("no error")
        .expect("exported");
    let v: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["do_remote_prefill"], true);
    assert_eq!(v["do_remote_decode"], false);
    let source = RemoteSource::from_json(&v["kvx"].to_string()).expect("a source D parses");
    assert_eq!(source.keys, k[..2]);
    assert_eq!(source.namespace, NS);
    assert_eq!(source.producers.len(), 2, "one server per rank");
    let meta = s.build_meta();
    assert_eq!(meta.exports.len(), 1);
    assert_eq!(meta.exports[0].export, source.export);
    assert_eq!(meta.exports[0].blocks.len(), 2);
    assert!(meta.delayed_free.contains(&RequestId(5)));
    // A second export gets another id.
    let again = d
        .export(
            RequestId(6),
            Some(&ask),
            true,
            2 * BLOCK,
            &k,
            &[3, 4],
            &mut s,
        )
        .expect("ok")
        .expect("exported");
    let again = RemoteSource::from_json(
        &serde_json::from_str::<Value>(&again).expect("JSON")["kvx"].to_string(),
    )
    .expect("source");
    assert_ne!(again.export, source.export);
    assert_eq!(d.exports, 2);
    // Not asked, not sendable, or nothing full: nothing exported.
    assert_eq!(
        d.export(RequestId(7), None, true, 2 * BLOCK, &k, &[3, 4], &mut s),
        Ok(None)
    );
    assert_eq!(
        d.export(
            RequestId(7),
            Some(&ask),
            false,
            2 * BLOCK,
            &k,
            &[3, 4],
            &mut s
        ),
        Ok(None)
    );
    assert_eq!(
        d.export(
            RequestId(7),
            Some(&ask),
            true,
            BLOCK - 1,
            &k,
            &[3, 4],
            &mut s
        ),
        Ok(None)
    );
    // A producer without remote.listen says so.
    let mut no_listen = Disagg::new(DisaggConfig {
        remote: remote_cfg(false),
        ..d.cfg.clone()
    });
    let e = no_listen.export(
        RequestId(7),
        Some(&ask),
        true,
        2 * BLOCK,
        &k,
        &[3, 4],
        &mut s,
    );
    assert!(
        matches!(&e, Err(why) if why.contains("remote.listen")),
        "{e:?}"
    );
}

/// One engine call, or a change of what the producer answers.
#[derive(Debug, Clone)]
enum Op {
    /// A lookup of request `r` (its params fit, or not), `computed` blocks its own.
    Lookup { r: usize, fits: bool, computed: u64 },
    /// The engine's allocation of `blocks` external blocks for request `r`.
    Alloc { r: usize, blocks: u64 },
    /// Request `r`'s load is reported.
    Loaded { r: usize },
    /// Request `r` finished or was aborted.
    Finished { r: usize },
    /// The producer confirms (true) or loses (false) request `r`'s lease.
    Lease { r: usize, live: bool },
    /// Time passes.
    Wait { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    let r = 0..4usize;
    prop_oneof![
        (r.clone(), any::<bool>(), 0..4u64).prop_map(|(r, fits, computed)| Op::Lookup {
            r,
            fits,
            computed
        }),
        (r.clone(), 0..5u64).prop_map(|(r, blocks)| Op::Alloc { r, blocks }),
        r.clone().prop_map(|r| Op::Loaded { r }),
        r.clone().prop_map(|r| Op::Finished { r }),
        (r, any::<bool>()).prop_map(|(r, live)| Op::Lease { r, live }),
        (0..400u64).prop_map(|ms| Op::Wait { ms }),
    ]
}

proptest! {
    /// Random engine-call sequences on D: a lease is kept only while its request is tracked;
    /// each kept lease is released exactly once, by the time its request finishes; once its
    /// remote part ended (refused, given up, loaded) a request is served as any other; once
    /// every request finished, nothing is left.
    #[test]
    fn every_lease_is_released_exactly_once_and_nothing_leaks(ops in prop::collection::vec(op(), 1..60)) {
        let (mut d, mut k, mut s) = (disagg(false, true, 1), Keeper::default(), side());
        let mut now = Instant::now();
        let own = keys(1000, 4);
        let good = params(NS, 1, &own);
        let bad = params("another", 1, &own);
        // Per request number: it has a generation (a finished request's id may come again).
        let mut generation = [0u64; 4];
        let number = |r: usize, g: u64| RequestId(r as u64 * 1000 + g);
        let mut ended: FxHashMap<u64, bool> = FxHashMap::default();
        for op in ops {
            match op {
                Op::Lookup { r, fits, computed } => {
                    let n = number(r, generation[r]);
                    let p = if fits { &good } else { &bad };
                    let m = d.lookup(&Asking { id: &format!("r{r}"), number: n, params: Some(p), own: &own, num_computed: computed * BLOCK }, &mut k, now);
                    if ended.get(&n.0).copied().unwrap_or(false) {
                        // Its remote part ended: served as any other, without a new reason.
                        prop_assert_eq!(&m, &RemoteMatch::Local(None), "after its end");
                    }
                    match m {
                        RemoteMatch::Load(t) => prop_assert!(t > 0 && t <= 4 * BLOCK),
                        RemoteMatch::Local(_) => {
                            ended.insert(n.0, true);
                        }
                        RemoteMatch::Later => {}
                    }
                }
                Op::Alloc { r, blocks } => {
                    let ids: Vec<u32> = (0..4).collect();
                    d.allocated(&format!("r{r}"), &ids, blocks * BLOCK, &mut s, &mut k);
                }
                Op::Loaded { r } => d.loaded(&format!("r{r}"), &mut k),
                Op::Finished { r } => {
                    d.finished(&format!("r{r}"), &mut k);
                    let n = number(r, generation[r]);
                    prop_assert!(k.state(n.0).is_none(), "a finished request's lease is not kept");
                    generation[r] += 1;
                }
                Op::Lease { r, live } => {
                    let n = number(r, generation[r]).0;
                    if k.states.contains_key(&n) {
                        let st = if live { LeaseState::Live } else { LeaseState::Lost("gone".into()) };
                        k.states.insert(n, st);
                    }
                }
                Op::Wait { ms } => now += Duration::from_millis(ms),
            }
            for (id, _) in &k.released {
                ended.insert(*id, true);
            }
            // Released at most once each; a kept lease is one of a request D tracks.
            let mut seen = rustc_hash::FxHashSet::default();
            for (id, _) in &k.released {
                prop_assert!(seen.insert(*id), "lease {id} released twice");
            }
            prop_assert!(k.kept() <= d.tracked());
        }
        for r in 0..4 {
            d.finished(&format!("r{r}"), &mut k);
        }
        prop_assert_eq!(d.tracked(), 0);
        prop_assert_eq!(k.kept(), 0);
        let mut kept = k.kept.clone();
        let mut released: Vec<u64> = k.released.iter().map(|(id, _)| *id).collect();
        kept.sort_unstable();
        released.sort_unstable();
        prop_assert_eq!(kept, released, "every kept lease released exactly once");
    }
}
