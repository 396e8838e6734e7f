//! [`PosixStore`]: the file block store as a kvx [`Backend`].

mod completion;
pub(crate) mod handle;
pub(crate) mod index;
pub(crate) mod key_order;
pub(crate) mod root_check;
mod setup;
mod submit;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvx_core::{
    Backend, BlockError, BlockKey, Buf, EngineBlockId, Notifier, Op, OpCompletion, OpId,
    SubmitError, WaitOutcome,
};
use rustc_hash::{FxHashMap, FxHashSet};

use crate::config::{Capabilities, PosixConfig};
use crate::error::PosixError;
use crate::store::handle::{PosixHandle, StoreState};

struct BlockSlot {
    key: BlockKey,
    engine_block: Option<EngineBlockId>,
    root: usize,
    buf: Option<Buf>,
    result: Option<Result<(), BlockError>>,
    /// What the block's job saw of its key's removes when it started.
    ticket: Option<key_order::Ticket>,
    /// The engine took the block's job: its outcome tells the root's breaker something.
    did_io: bool,
}

struct OpState {
    op: Op,
    slots: Vec<BlockSlot>,
    pending: usize,
    cancel: Arc<AtomicBool>,
    submitted: Instant,
    /// Roots whose breaker admitted this op.
    roots: Vec<usize>,
    health_recorded: bool,
}

/// A file block store: one verified file per block under one or more roots. Implements
/// [`Backend`]: loads fill the op's owned buffers, stores persist the buffers' bytes; it never
/// touches engine memory.
#[must_use = "a store dropped at once stops its engine; hand it to a driver"]
pub struct PosixStore {
    name: String,
    cfg: PosixConfig,
    state: Arc<StoreState>,
    direct: Vec<bool>,
    /// Inline I/O per root (see [`PosixConfig::inline_io`]).
    inline: Vec<bool>,
    dirs: FxHashSet<(usize, u16)>,
    ops: FxHashMap<OpId, OpState>,
    ready: Vec<OpCompletion>,
    notifier: Notifier,
    /// Loads in flight per key, when removed block files are recycled as spares.
    recycling: Option<crate::spare::recycle::Recycling>,
}

impl PosixStore {
    /// Open (or create) a store: probe each root for O_DIRECT, scan it to rebuild the index and
    /// remove stale temporary files, and start the engine. Blocks while it scans: open a store
    /// before its mount is in the engine's critical path.
    pub fn open(cfg: PosixConfig) -> Result<PosixStore, PosixError> {
        PosixStore::open_with(cfg, crate::io::EngineOverride::default())
    }

    /// A thread-safe handle for lookups, removal, health and counters.
    pub fn handle(&self) -> PosixHandle {
        PosixHandle {
            state: self.state.clone(),
        }
    }

    /// What the store found out when it opened.
    pub fn capabilities(&self) -> &Capabilities {
        &self.state.caps
    }

    /// How many of `keys`, from the first, the store holds.
    pub fn lookup(&self, keys: &[BlockKey]) -> usize {
        self.state.index.lookup(keys)
    }

    /// Forget `key` and unlink its file in the background; true if the store held it.
    pub fn remove(&self, key: BlockKey) -> bool {
        self.handle().remove(key)
    }

    pub(super) fn prefix(key: BlockKey) -> u16 {
        u16::from(crate::paths::fan_out(key))
    }
}

impl Backend for PosixStore {
    fn name(&self) -> &str {
        &self.name
    }

    fn touches_engine_memory(&self) -> bool {
        false
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        self.notifier = notifier.clone();
        self.state.board.set_notifier(notifier);
    }

    fn submit(&mut self, op: Op) -> Result<(), SubmitError> {
        self.submit_op(op)
    }

    fn poll(&mut self, out: &mut Vec<OpCompletion>) {
        self.take_completions(out);
    }

    fn cancel(&mut self, op: OpId) {
        let now = Instant::now();
        let Some(st) = self.ops.get_mut(&op) else {
            return;
        };
        st.cancel.store(true, Ordering::Release);
        if now >= st.op.deadline && !st.health_recorded {
            // A timeout: count it now, while the I/O may still be stuck.
            st.health_recorded = true;
            for &root in &st.roots {
                self.state.health.failure(root, now);
            }
        }
        self.state.io_engine.write_off_overdue();
    }

    fn wait(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome {
        self.wait_for(ops, until)
    }
}
