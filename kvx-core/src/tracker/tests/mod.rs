//! Deterministic tests of the tracker: fake time, ops completed by hand.

mod block_order;
mod detached;
mod request_end;
mod timeouts;
mod transfers;

use std::time::{Duration, Instant};

use super::*;
use crate::backend::SubmitError;
use crate::buffer::{Buf, BufferPool};
use crate::ids::{BlockKey, EngineBlockId};
use crate::op::{BlockError, Op, OpCompletion};
use crate::task::{FailReason, TaskReport, TaskSpec, TaskState};

const MS: Duration = Duration::from_millis(1);

impl Tracker {
    /// State of a live task (`None` once it ended).
    fn task_state(&self, task: TaskId) -> Option<TaskState> {
        let slot = self.task_slots.get(task)?;
        self.tasks.get(slot).map(|t| match t.phase {
            Phase::InFlight(_) => TaskState::InFlight,
            _ => TaskState::Queued,
        })
    }
}

struct World {
    t: Tracker,
    pool: BufferPool,
    engine: BackendId,
    file: BackendId,
    now: Instant,
}

fn world() -> World {
    world_with(TrackerConfig::default())
}

fn world_with(cfg: TrackerConfig) -> World {
    let mut t = Tracker::new(cfg);
    let engine = t.add_backend(true);
    let file = t.add_backend(false);
    World {
        t,
        pool: BufferPool::new(64, 4096, 4096).unwrap(),
        engine,
        file,
        now: Instant::now(),
    }
}

impl World {
    fn spec(&self, req: u64, dir: Direction, blocks: &[u32], route: Vec<BackendId>) -> TaskSpec {
        TaskSpec {
            request: RequestId(req),
            dir,
            route,
            blocks: blocks
                .iter()
                .map(|b| OpBlock {
                    key: BlockKey(*b as u128 + 1000),
                    engine: Some(EngineBlockId(*b)),
                    buf: Buf::Owned(self.pool.take().unwrap()),
                })
                .collect(),
            deadline: self.now + 100 * MS,
            deferred: false,
        }
    }

    fn submit(&mut self, req: u64, dir: Direction, blocks: &[u32]) -> TaskId {
        let s = self.spec(req, dir, blocks, vec![self.engine]);
        self.t.submit(s, self.now)
    }

    /// Ops handed to backends so far (cancels dropped).
    fn take_ops(&mut self) -> Vec<(BackendId, Op)> {
        let mut out = Vec::new();
        while let Some(x) = self.t.poll_backend_command() {
            if let BackendCommand::Submit { backend, op } = x {
                out.push((backend, op));
            }
        }
        out
    }

    fn complete(&mut self, op: Op) {
        self.t
            .handle_completion(OpCompletion::all(op, Ok(())), self.now);
    }

    fn reports(&mut self) -> Vec<TaskReport> {
        let mut out = Vec::new();
        while let Some(e) = self.t.poll_event() {
            if let Event::TaskFinished(r) = e {
                out.push(r);
            }
        }
        out
    }

    fn events(&mut self) -> Vec<Event> {
        std::iter::from_fn(|| self.t.poll_event()).collect()
    }
}
