//! The scheduler core over kvx-offload's real scheduler side, driven as an engine adapter
//! drives it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvx_core::BlockError;
use kvx_offload::{FileTierProbe, JobPart, JobResult, ProbeAnswer, SchedulerConfig, WorkerOutput};

use super::*;
use crate::Namespace;
use crate::groups::Group;
use crate::test_support::stored_on_host;

const BT: u64 = 4;

fn core(host_loads_in_step: bool) -> Scheduler {
    let side = SchedulerSide::new(SchedulerConfig {
        block_tokens: BT as u32,
        host_blocks: 64,
        ..SchedulerConfig::default()
    })
    .unwrap();
    let keys = Keyring::new(vec![Namespace::new(b"m")], 1).unwrap();
    Scheduler::new(side, keys, None, host_loads_in_step).unwrap()
}

fn hashes(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("h{i}").into_bytes()).collect()
}

fn extend(s: &mut Scheduler, name: &str, hashes: &[Vec<u8>]) {
    let seen = s.hashes_seen(name);
    s.extend_keys(name, hashes[seen..].iter().map(Vec::as_slice));
}

/// Every job of this step reported: stores done on the host tier, loads as `load_failed`
/// says (the keys it names fail, the rest arrive).
fn run_step(s: &mut Scheduler, load_failed: &[BlockKey]) -> (StepMsg, usize) {
    let step = s.build_step();
    let mut jobs: Vec<JobResult> = step.meta.stores.iter().map(stored_on_host).collect();
    for l in &step.meta.loads {
        let (failed, ok): (Vec<_>, Vec<_>) = l
            .blocks
            .iter()
            .map(|b| b.key)
            .partition(|k| load_failed.contains(k));
        jobs.push(JobResult {
            job: l.job,
            request: l.request,
            part: JobPart::Load,
            ok,
            failed: failed
                .into_iter()
                .map(|k| (k, BlockError::Corrupt("flipped".into())))
                .collect(),
            promoted: vec![],
        });
    }
    let failed = s.update_from_rank(
        0,
        &WorkerOutput {
            jobs,
            ..Default::default()
        },
    );
    (step, failed)
}

/// `s` holds the first `n` blocks of `hashes` in its host tier (stored by request "w").
fn stored(s: &mut Scheduler, hs: &[Vec<u8>], n: usize) {
    extend(s, "w", hs);
    let blocks: Vec<u32> = (0..n as u32).collect();
    assert!(s.save_blocks("w", 0, &blocks));
    run_step(s, &[]);
    assert!(!s.finished("w"));
}

/// A core whose host tier holds the first `stored` of `blocks` blocks, and a reader "r" of all
/// `blocks` keyed; the blocks' hashes.
fn with_reader(
    host_loads_in_step: bool,
    blocks: usize,
    stored_blocks: usize,
) -> (Scheduler, Vec<Vec<u8>>) {
    let mut s = core(host_loads_in_step);
    let hs = hashes(blocks);
    stored(&mut s, &hs, stored_blocks);
    extend(&mut s, "r", &hs);
    (s, hs)
}

#[test]
fn a_stored_prefix_is_offered_loaded_and_reported_and_then_nothing_is_left() {
    let (mut s, _) = with_reader(false, 4, 3);
    let offer = s.lookup("r", 0, 17).unwrap();
    assert_eq!(
        offer,
        Offer {
            tokens: 3 * BT,
            asynchronous: true
        }
    );
    assert_eq!(s.matched("r").host_blocks, 3);
    let loaded = s.allocated("r", &[vec![10, 11, 12, 13]], 3 * BT).unwrap();
    assert_eq!(loaded.map(|b| b.len()), Some(3));
    let (step, _) = run_step(&mut s, &[]);
    assert_eq!(step.loads, vec![RequestId(2)]);
    assert_eq!(step.names, vec![(RequestId(2), "r".to_string())]);
    assert!(s.requests().is_loading("r"));
    s.reported(["r"], []);
    assert!(!s.finished("r"));
    assert_eq!(s.counts(), [0; 6]);
}

#[test]
fn a_host_hit_that_leaves_a_token_loads_in_the_step_and_a_whole_prompt_hit_does_not() {
    let (mut s, hs) = with_reader(true, 2, 2);
    // 9 tokens: the 8 of the hit leave one to compute.
    assert_eq!(s.lookup("r", 0, 9).map(|o| o.asynchronous), Some(false));
    assert!(
        s.allocated("r", &[vec![5, 6, 7]], 2 * BT)
            .unwrap()
            .is_some()
    );
    let step = s.build_step();
    assert_eq!((step.loads.len(), step.in_step), (0, vec![RequestId(2)]));
    assert!(
        !s.requests().is_loading("r"),
        "never reported in finished_recving"
    );
    // A hit of the whole prompt loads asynchronously.
    extend(&mut s, "q", &hs);
    assert_eq!(s.lookup("q", 0, 8).map(|o| o.asynchronous), Some(true));
}

#[test]
fn a_failed_block_is_never_offered_again() {
    let (mut s, _) = with_reader(false, 4, 4);
    assert_eq!(s.lookup("r", 0, 17).unwrap().tokens, 4 * BT);
    assert!(
        s.allocated("r", &[vec![1, 2, 3, 4]], 4 * BT)
            .unwrap()
            .is_some()
    );
    let third = s.keys("r")[2];
    let (_, failed) = run_step(&mut s, &[third]);
    assert_eq!(failed, 1);
    s.reported(["r"], []);
    // The engine restarts it from its local prefix: blocks from the failed one on are not
    // offered, those before it are.
    assert_eq!(s.lookup("r", 0, 17).unwrap().tokens, 2 * BT);
    let c = s.counters();
    assert_eq!(
        (c.lookups, c.loads, c.hit_tokens, c.failed_loads),
        (2, 1, 4 * BT, 1)
    );
    assert_eq!(c.host_hit_blocks + c.file_hit_blocks, 4);
    assert!(s.preempted("r"));
    assert_eq!(s.counters().preemptions, 1);
}

#[test]
fn a_request_finished_while_loading_is_abandoned_once_and_never_delayed() {
    let (mut s, _) = with_reader(false, 2, 2);
    s.lookup("r", 0, 9).unwrap();
    s.allocated("r", &[vec![1, 2]], 2 * BT).unwrap();
    let step = s.build_step();
    assert_eq!(step.loads.len(), 1);
    assert!(
        !s.finished("r"),
        "the engine keeps its blocks until the load is reported"
    );
    let step = s.build_step();
    assert_eq!(step.abandoned, vec![RequestId(2)]);
    assert!(step.delayed.is_empty());
    assert!(s.build_step().abandoned.is_empty(), "handed out once");
    assert_eq!(s.requests().name(RequestId(2)), Some("r"));
    s.reported(["r"], []);
    assert_eq!(s.counts()[..4], [0, 0, 0, 0]);
}

#[test]
fn an_allocation_that_does_not_fit_the_match_queues_nothing() {
    let (mut s, _) = with_reader(false, 2, 2);
    s.lookup("r", 0, 9).unwrap();
    let err = s.allocated("r", &[vec![1]], 2 * BT).unwrap_err();
    assert!(err.contains("no blocks 0..+2"), "{err}");
    assert!(s.build_step().loads.is_empty());
    assert!(!s.requests().is_loading("r"));
}

/// A shared file tier's probe that finds nothing and counts the keys it was asked about.
#[derive(Default)]
struct CountingProbe(AtomicUsize);

impl FileTierProbe for CountingProbe {
    fn probe(&self, _key: BlockKey) -> ProbeAnswer {
        self.0.fetch_add(1, Ordering::Relaxed);
        ProbeAnswer::Absent
    }
}

#[test]
fn a_lookup_asks_the_tiers_once() {
    // PyO3's get_num_new_matched_tokens once ran the lookup twice (a825c82): on a shared
    // mount, every lookup probed the mount twice.
    let mut side = SchedulerSide::new(SchedulerConfig {
        block_tokens: BT as u32,
        host_blocks: 64,
        file_blocks: Some(64),
        ..SchedulerConfig::default()
    })
    .unwrap();
    let probe = Arc::new(CountingProbe::default());
    side.set_file_probe(probe.clone());
    let keys = Keyring::new(vec![Namespace::new(b"m")], 1).unwrap();
    let mut s = Scheduler::new(side, keys, None, false).unwrap();
    extend(&mut s, "r", &hashes(3));
    assert_eq!(s.lookup("r", 0, 13).unwrap().tokens, 0);
    assert_eq!(
        probe.0.load(Ordering::Relaxed),
        1,
        "one probe: the first missing block"
    );
}

#[test]
fn several_groups_need_a_namespace_each_and_offer_what_every_group_holds() {
    let side = || {
        SchedulerSide::new(SchedulerConfig {
            block_tokens: BT as u32,
            host_blocks: 64,
            ..SchedulerConfig::default()
        })
        .unwrap()
    };
    let groups = Groups::new(vec![Group::FULL, Group::sliding(8, 0)], BT).unwrap();
    let one = Keyring::new(vec![Namespace::new(b"g0")], 1).unwrap();
    assert!(Scheduler::new(side(), one, Some(groups.clone()), false).is_err());
    let two = Keyring::new(vec![Namespace::new(b"g0"), Namespace::new(b"g1")], 1).unwrap();
    let mut s = Scheduler::new(side(), two, Some(groups), false).unwrap();
    let hs = hashes(4);
    extend(&mut s, "w", &hs);
    assert!(s.save_groups("w", 0, 4, 16, &[vec![1, 2, 3, 4], vec![0, 0, 13, 14]]));
    run_step(&mut s, &[]);
    s.finished("w");
    extend(&mut s, "r", &hs);
    // 17 tokens: the engine computes the last one, so 4 blocks at most.
    let offer = s.lookup("r", 0, 17).unwrap();
    assert_eq!(offer.tokens, 4 * BT);
    let tables = [vec![21, 22, 23, 24], vec![0, 0, 33, 34]];
    assert_eq!(
        s.allocated("r", &tables, 4 * BT).unwrap().map(|b| b.len()),
        Some(6)
    );
    // A sliding-window store source handed out again is fenced once.
    assert_eq!(s.fence([EngineBlockId(14)]), 1);
    assert_eq!(s.build_step().fence, vec![EngineBlockId(14)]);
    assert_eq!(s.fence([EngineBlockId(14)]), 0);
    assert!(s.build_step().fence.is_empty());
}

mod engine_model {
    //! Random engine calls and worker reports against the core over kvx-offload's real
    //! scheduler side: whatever the order, once the engine finished every request and the
    //! worker reported every job, nothing is left of any request anywhere.

    use std::collections::{BTreeMap, BTreeSet};

    use kvx_offload::{LoadJob, StoreJob};
    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Call {
        Lookup(usize),
        Alloc(usize),
        Store(usize),
        Step,
        Complete(usize, bool),
        Preempt(usize),
        Finish(usize),
        /// The engine resets its prefix cache with the connector's (`reset_cache`).
        Reset,
    }

    fn call() -> impl Strategy<Value = Call> {
        prop_oneof![
            (0..3usize).prop_map(Call::Lookup),
            (0..3usize).prop_map(Call::Alloc),
            (0..3usize).prop_map(Call::Store),
            Just(Call::Step),
            (0..8usize, any::<bool>()).prop_map(|(i, ok)| Call::Complete(i, ok)),
            (0..3usize).prop_map(Call::Preempt),
            (0..3usize).prop_map(Call::Finish),
            Just(Call::Reset),
        ]
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum State {
        Looked(u64),
        Running,
        Finished,
    }

    #[derive(Debug)]
    enum Job {
        Store(StoreJob),
        Load(LoadJob),
    }

    /// The simulated engine and worker around the core.
    struct Engine {
        s: Scheduler,
        states: BTreeMap<usize, State>,
        out: Vec<Job>,
        delayed: BTreeSet<usize>,
        /// Requests whose finishing the engine was told is not delayed.
        freed: BTreeSet<usize>,
    }

    const NAMES: [&str; 3] = ["r0", "r1", "r2"];

    impl Engine {
        /// Request `n`'s block hashes: r0 and r2 share a prompt, one can hit the other's blocks.
        fn hashes(n: usize) -> Vec<Vec<u8>> {
            hashes(3)
                .into_iter()
                .map(|mut h| {
                    h.push(b'0' + (n % 2) as u8);
                    h
                })
                .collect()
        }

        fn table(n: usize) -> Vec<u32> {
            (0..3).map(|b| (n * 10 + b) as u32).collect()
        }

        fn apply(&mut self, c: Call) {
            match c {
                Call::Lookup(n) => {
                    if matches!(self.states.get(&n), None | Some(State::Looked(_))) {
                        extend(&mut self.s, NAMES[n], &Self::hashes(n));
                        // "Ask again later" leaves the request waiting, to be finished or
                        // looked up again.
                        let tokens = self
                            .s
                            .lookup(NAMES[n], 0, 3 * BT + 1)
                            .map_or(0, |o| o.tokens);
                        self.states.insert(n, State::Looked(tokens));
                    }
                }
                Call::Alloc(n) => {
                    if let Some(State::Looked(tokens)) = self.states.get(&n).copied() {
                        let r = self.s.allocated(NAMES[n], &[Self::table(n)], tokens);
                        assert!(r.is_ok(), "{r:?}");
                        self.states.insert(n, State::Running);
                    }
                }
                Call::Store(n) => {
                    if self.states.get(&n) == Some(&State::Running) {
                        self.s.save_blocks(NAMES[n], 0, &Self::table(n));
                    }
                }
                Call::Step => {
                    let step = self.s.build_step();
                    for r in &step.delayed {
                        let name = &step.names.iter().find(|(q, _)| q == r).unwrap().1;
                        let n = NAMES.iter().position(|x| x == name).unwrap();
                        assert!(
                            !self.freed.contains(&n),
                            "{name} delayed after the engine freed it"
                        );
                        self.delayed.insert(n);
                    }
                    self.out
                        .extend(step.meta.stores.into_iter().map(Job::Store));
                    self.out.extend(step.meta.loads.into_iter().map(Job::Load));
                }
                Call::Complete(i, ok) => {
                    if !self.out.is_empty() {
                        let job = self.out.remove(i % self.out.len());
                        self.complete(job, ok);
                    }
                }
                Call::Preempt(n) => {
                    if self.states.get(&n) == Some(&State::Running) {
                        assert!(self.s.preempted(NAMES[n]));
                        self.states.insert(n, State::Looked(0));
                    }
                }
                Call::Finish(n) => {
                    if matches!(self.states.get(&n), Some(State::Looked(_) | State::Running)) {
                        if self.s.finished(NAMES[n]) {
                            self.delayed.insert(n);
                        } else {
                            self.freed.insert(n);
                        }
                        self.states.insert(n, State::Finished);
                    }
                }
                Call::Reset => {
                    // Between steps: vLLM looks a waiting request up again before it allocates.
                    for st in self.states.values_mut() {
                        if let State::Looked(_) = st {
                            *st = State::Looked(0);
                        }
                    }
                    self.s.side().reset_cache();
                    // A new request with either prompt is offered nothing.
                    for n in 0..2 {
                        extend(&mut self.s, "probe", &Self::hashes(n));
                        let offer = self.s.lookup("probe", 0, 3 * BT + 1);
                        assert_eq!(offer.map_or(0, |o| o.tokens), 0, "served after a reset");
                        assert!(!self.s.finished("probe"));
                    }
                }
            }
        }

        fn complete(&mut self, job: Job, ok: bool) {
            let result = match &job {
                Job::Store(j) => {
                    let mut r = stored_on_host(j);
                    if !ok {
                        r.failed =
                            r.ok.drain(..)
                                .map(|k| (k, BlockError::Io("eio".into())))
                                .collect();
                    }
                    r
                }
                Job::Load(j) => {
                    let keys: Vec<BlockKey> = j.blocks.iter().map(|b| b.key).collect();
                    JobResult {
                        job: j.job,
                        request: j.request,
                        part: JobPart::Load,
                        ok: if ok { keys.clone() } else { vec![] },
                        failed: if ok {
                            vec![]
                        } else {
                            keys.iter()
                                .map(|k| (*k, BlockError::Corrupt("flipped".into())))
                                .collect()
                        },
                        promoted: vec![],
                    }
                }
            };
            let request = result.request;
            self.s.update_from_rank(
                0,
                &WorkerOutput {
                    jobs: vec![result],
                    ..Default::default()
                },
            );
            if let Job::Load(_) = job {
                // The worker reports a load's request in finished_recving once it ended.
                let name = self.s.requests().name(request).map(str::to_string);
                if let Some(name) = name {
                    self.s.reported([name.as_str()], []);
                }
            }
            self.report_sent();
        }

        /// finished_sending for each delayed request none of whose stores is still out.
        fn report_sent(&mut self) {
            let out: BTreeSet<RequestId> = self
                .out
                .iter()
                .filter_map(|j| match j {
                    Job::Store(s) => Some(s.request),
                    Job::Load(_) => None,
                })
                .collect();
            for n in self.delayed.clone() {
                let pending = self
                    .s
                    .requests()
                    .number(NAMES[n])
                    .is_some_and(|r| out.contains(&r));
                if !pending {
                    self.s.reported([], [NAMES[n]]);
                    self.delayed.remove(&n);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn nothing_is_left_once_every_request_finished_and_every_job_was_reported(
            calls in prop::collection::vec(call(), 0..60)
        ) {
            let mut e = Engine {
                s: core(false),
                states: BTreeMap::new(),
                out: Vec::new(),
                delayed: BTreeSet::new(),
                freed: BTreeSet::new(),
            };
            for c in calls {
                e.apply(c);
            }
            for n in 0..NAMES.len() {
                e.apply(Call::Finish(n));
            }
            for _ in 0..10 {
                e.apply(Call::Step);
                while !e.out.is_empty() {
                    e.apply(Call::Complete(0, true));
                }
                e.report_sent();
            }
            prop_assert_eq!(e.s.counts(), [0; 6], "the core's state");
            prop_assert_eq!(e.s.side().request_count(), 0, "kvx-offload's requests");
            prop_assert_eq!(e.s.side().job_count(), 0, "kvx-offload's jobs");
        }
    }
}
