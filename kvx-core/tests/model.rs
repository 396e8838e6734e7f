//! Model test: random sequences of submit / complete / late complete / timeout / cancel /
//! preempt / finish / block reuse / reset against the tracker's invariants (fake time).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kvx_core::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Action {
    Submit {
        slot: u8,
        load: bool,
        blocks: Vec<u8>,
        two_stage: bool,
        deferred: bool,
        deadline_ms: u16,
    },
    Complete {
        pick: usize,
        ok: bool,
    },
    Advance(u16),
    Cancel(usize),
    Preempt(u8),
    Finish(u8),
    StartStep,
    Reset,
    Fence(Vec<u8>),
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => (0u8..4, any::<bool>(), prop::collection::vec(0u8..6, 1..3), any::<bool>(), any::<bool>(), 5u16..200)
            .prop_map(|(slot, load, blocks, two_stage, deferred, deadline_ms)| Action::Submit {
                slot, load, blocks, two_stage, deferred, deadline_ms
            }),
        4 => (any::<usize>(), prop::bool::weighted(0.85)).prop_map(|(pick, ok)| Action::Complete { pick, ok }),
        2 => (1u16..80).prop_map(Action::Advance),
        1 => any::<usize>().prop_map(Action::Cancel),
        1 => (0u8..4).prop_map(Action::Preempt),
        1 => (0u8..4).prop_map(Action::Finish),
        1 => Just(Action::StartStep),
        1 => Just(Action::Reset),
        1 => prop::collection::vec(0u8..6, 1..3).prop_map(Action::Fence),
    ]
}

struct LiveTask {
    deadline: Instant,
    blocks: Vec<u32>,
}

struct FenceCheck {
    fence: Fence,
    ops: Vec<OpId>,
    tasks: Vec<TaskId>,
}

struct Model {
    t: Tracker,
    pool: BufferPool,
    engine: BackendId,
    file: BackendId,
    now: Instant,
    outstanding: Vec<(BackendId, Op)>,
    live: HashMap<TaskId, LiveTask>,
    reported: HashSet<TaskId>,
    dropped_by_reset: HashSet<TaskId>,
    generation: [u64; 4],
    requests: HashSet<RequestId>,
    /// Requests the engine finished, and those the tracker released.
    finished: HashSet<RequestId>,
    released: HashSet<RequestId>,
    fences: Vec<FenceCheck>,
}

impl Model {
    fn new() -> Model {
        let mut t = Tracker::new(TrackerConfig {
            zombie_budget_ops: 6,
            zombie_budget_bytes: u64::MAX,
        });
        let engine = t.add_backend(true);
        let file = t.add_backend(false);
        Model {
            t,
            pool: BufferPool::new(256, 512, 512).unwrap(),
            engine,
            file,
            now: Instant::now(),
            outstanding: Vec::new(),
            live: HashMap::new(),
            reported: HashSet::new(),
            dropped_by_reset: HashSet::new(),
            generation: [0; 4],
            requests: HashSet::new(),
            finished: HashSet::new(),
            released: HashSet::new(),
            fences: Vec::new(),
        }
    }

    fn req(&self, slot: u8) -> RequestId {
        RequestId(slot as u64 * 1_000_000 + self.generation[slot as usize])
    }

    fn engine_ops_touching(&self, blocks: &[EngineBlockId]) -> Vec<OpId> {
        self.outstanding
            .iter()
            .filter(|(b, op)| {
                *b == self.engine
                    && op
                        .blocks
                        .iter()
                        .any(|x| x.engine.is_some_and(|e| blocks.contains(&e)))
            })
            .map(|(_, op)| op.id)
            .collect()
    }

    fn live_tasks_touching(&self, blocks: &[EngineBlockId]) -> Vec<TaskId> {
        self.live
            .iter()
            .filter(|(_, t)| t.blocks.iter().any(|b| blocks.contains(&EngineBlockId(*b))))
            .map(|(id, _)| *id)
            .collect()
    }

    fn apply(&mut self, a: Action) {
        match a {
            Action::Submit {
                slot,
                load,
                blocks,
                two_stage,
                deferred,
                deadline_ms,
            } => {
                let Some(bufs) = blocks
                    .iter()
                    .map(|_| self.pool.take())
                    .collect::<Option<Vec<_>>>()
                else {
                    return;
                };
                let route = match (load, two_stage) {
                    (_, false) => vec![self.engine],
                    (true, true) => vec![self.file, self.engine],
                    (false, true) => vec![self.engine, self.file],
                };
                let req = self.req(slot);
                self.requests.insert(req);
                let spec = TaskSpec {
                    request: req,
                    dir: if load {
                        Direction::Load
                    } else {
                        Direction::Store
                    },
                    route,
                    blocks: blocks
                        .iter()
                        .zip(bufs)
                        .map(|(b, buf)| OpBlock {
                            key: BlockKey(*b as u128),
                            engine: Some(EngineBlockId(*b as u32)),
                            buf: Buf::Owned(buf),
                        })
                        .collect(),
                    deadline: self.now + Duration::from_millis(deadline_ms as u64),
                    deferred,
                };
                let deadline = spec.deadline;
                let id = self.t.submit(spec, self.now);
                self.live.insert(
                    id,
                    LiveTask {
                        deadline,
                        blocks: blocks.iter().map(|b| *b as u32).collect(),
                    },
                );
            }
            Action::Complete { pick, ok } => {
                if self.outstanding.is_empty() {
                    return;
                }
                let (_, op) = self.outstanding.remove(pick % self.outstanding.len());
                let r = if ok {
                    Ok(())
                } else {
                    Err(BlockError::Io("injected".into()))
                };
                self.t.handle_completion(OpCompletion::all(op, r), self.now);
            }
            Action::Advance(ms) => {
                self.now += Duration::from_millis(ms as u64);
                self.t.handle_timeout(self.now);
                self.drain();
                for (id, t) in &self.live {
                    assert!(
                        t.deadline > self.now,
                        "{id} is past its deadline after handle_timeout"
                    );
                }
            }
            Action::Cancel(pick) => {
                let mut ids: Vec<TaskId> = self.live.keys().copied().collect();
                ids.sort();
                if !ids.is_empty() {
                    self.t.cancel(ids[pick % ids.len()], self.now);
                }
            }
            Action::Preempt(slot) => {
                let req = self.req(slot);
                // Snapshot before: ops and tasks touching the request's blocks.
                let f = self.t.preempt(req, self.now);
                let ops = self.engine_ops_touching(f.blocks());
                let tasks = self.live_tasks_touching(f.blocks());
                self.fences.push(FenceCheck {
                    fence: f,
                    ops,
                    tasks,
                });
            }
            Action::Finish(slot) => {
                let req = self.req(slot);
                self.finished.insert(req);
                self.t.finish(req, self.now);
                self.generation[slot as usize] += 1;
            }
            Action::StartStep => self.t.start_step(),
            Action::Reset => {
                let all: Vec<EngineBlockId> = (0..6).map(EngineBlockId).collect();
                let ops = self.engine_ops_touching(&all);
                let fence = self.t.reset(self.now);
                self.dropped_by_reset
                    .extend(self.live.drain().map(|(id, _)| id));
                self.fences.clear();
                self.fences.push(FenceCheck {
                    fence,
                    ops,
                    tasks: Vec::new(),
                });
            }
            Action::Fence(blocks) => {
                let blocks: Vec<EngineBlockId> =
                    blocks.iter().map(|b| EngineBlockId(*b as u32)).collect();
                let ops = self.engine_ops_touching(&blocks);
                let tasks = self.live_tasks_touching(&blocks);
                let fence = self.t.fence_blocks(&blocks);
                self.fences.push(FenceCheck { fence, ops, tasks });
            }
        }
        self.drain();
        self.check();
    }

    fn drain(&mut self) {
        while let Some(x) = self.t.poll_backend_command() {
            if let BackendCommand::Submit { backend, op } = x {
                self.outstanding.push((backend, op));
            }
        }
        while let Some(e) = self.t.poll_event() {
            if let Event::RequestReleased(req) = e {
                assert!(
                    self.finished.contains(&req),
                    "{req} released but never finished"
                );
                assert!(
                    !self
                        .outstanding
                        .iter()
                        .any(|(b, op)| *b == self.engine && op.request == req),
                    "{req} released while an engine copy of it is out"
                );
                self.released.insert(req);
            }
            if let Event::TaskFinished(r) = e {
                assert!(r.state.is_terminal());
                assert!(self.reported.insert(r.task), "{} reported twice", r.task);
                let t = self.live.remove(&r.task);
                assert!(t.is_some(), "{} reported but not live", r.task);
                if r.state == TaskState::TimedOut {
                    assert!(r.finished_at >= t.unwrap().deadline);
                }
            }
        }
    }

    fn check(&mut self) {
        // No buffer of an outstanding op is back in its pool.
        for (_, op) in &self.outstanding {
            for b in &op.blocks {
                if let Buf::Owned(p) = &b.buf {
                    assert!(
                        self.pool.is_lent(p.index()),
                        "buffer of {} is in the pool",
                        op.id
                    );
                }
            }
        }
        let held: usize = self.outstanding.iter().map(|(_, o)| o.blocks.len()).sum();
        assert!(self.pool.lent() >= held);
        // A fence holds only when nothing it waits for is outstanding.
        let outstanding: HashSet<OpId> = self.outstanding.iter().map(|(_, o)| o.id).collect();
        for f in &self.fences {
            // A fence not holding says when its copies are due: no earlier than the deadline of
            // any live task it waits for.
            let due = self.t.fence_due(&f.fence);
            assert_eq!(due.is_none(), self.t.fence_holds(&f.fence), "{due:?}");
            if let Some(due) = due {
                for t in &f.tasks {
                    if let Some(live) = self.live.get(t) {
                        assert!(due >= live.deadline, "{t} is due after the fence");
                    }
                }
            }
            if self.t.fence_holds(&f.fence) {
                for op in &f.ops {
                    assert!(
                        !outstanding.contains(op),
                        "fence holds while {op} is outstanding"
                    );
                }
                for t in &f.tasks {
                    assert!(!self.live.contains_key(t), "fence holds while {t} is live");
                }
            }
        }
    }

    fn finish_everything(&mut self) {
        for _ in 0..1000 {
            self.drain();
            if self.outstanding.is_empty() && self.live.is_empty() {
                break;
            }
            if let Some((_, op)) = self.outstanding.pop() {
                self.t
                    .handle_completion(OpCompletion::all(op, Ok(())), self.now);
            } else {
                self.t.start_step();
                self.now += Duration::from_millis(500);
                self.t.handle_timeout(self.now);
            }
            self.drain();
            self.check();
        }
        for r in self.requests.clone() {
            self.finished.insert(r);
            self.t.finish(r, self.now);
        }
        self.drain();
        while let Some((_, op)) = self.outstanding.pop() {
            self.t
                .handle_completion(OpCompletion::all(op, Ok(())), self.now);
            self.drain();
        }
        self.drain();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn tracker_invariants_hold(actions in prop::collection::vec(action(), 1..80)) {
        let mut m = Model::new();
        for a in actions {
            m.apply(a);
        }
        m.finish_everything();
        prop_assert!(m.live.is_empty(), "tasks never reported: {:?}", m.live.keys().collect::<Vec<_>>());
        prop_assert!(m.t.is_empty(), "tracker not empty: {:?}", m.t.stats());
        prop_assert!(m.pool.is_whole(), "pool lent {}", m.pool.lent());
        prop_assert!(m.reported.is_disjoint(&m.dropped_by_reset));
        prop_assert_eq!(&m.finished, &m.released, "every finished request is released");
    }
}
