//! The CPU-memory backend: memcpy between engine memory in CPU RAM and kvx-owned buffers, on worker

mod copy;

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::{Backend, Notifier, SubmitError, SubmitErrorKind, WaitOutcome};
use crate::buffer::Buf;
use crate::completions::CompletionBoard;
use crate::error::CoreError;
use crate::ids::{Direction, OpId};
use crate::layout::KvLayout;
use crate::op::{BlockError, Op, OpBlock, OpCompletion};
use crate::sync::lock;

/// Settings of the CPU backend.
#[derive(Debug, Clone)]
pub struct CpuBackendConfig {
    /// Worker threads doing the copies, and the threads one op of at least 4 MiB is spread over
    /// (default 1).
    pub threads: usize,
    /// Fault injection for tests: each op sleeps this long before copying (default zero).
    pub delay: Duration,
}

impl Default for CpuBackendConfig {
    fn default() -> Self {
        CpuBackendConfig {
            threads: 1,
            delay: Duration::ZERO,
        }
    }
}

/// What the copy threads work with: the completion board (a pending op's state is its cancel
/// flag), the engine memory's layout, and the test delay.
struct CopyContext {
    board: CompletionBoard<bool>,
    layout: KvLayout,
    delay: Duration,
    /// Threads one large op is spread over (the backend's `threads`).
    threads: usize,
}

/// Copies blocks between registered engine memory in CPU RAM and op buffers.
///
/// threads. CPU-only engines use it as their engine tier, and it lets every layer above run on a
/// machine without a GPU.
pub struct CpuBackend {
    name: String,
    tx: Option<Sender<Op>>,
    ctx: Arc<CopyContext>,
    workers: Vec<JoinHandle<()>>,
}

impl CpuBackend {
    /// A CPU backend over `layout`.
    ///
    /// # Safety
    /// Every region of `layout` must be host memory valid for reads and writes for as long as
    /// this backend (and any op it still runs) lives, and the caller must not read or write a
    /// block while an op naming it is outstanding: wait for the task's report or a fence.
    pub unsafe fn new(layout: KvLayout, cfg: CpuBackendConfig) -> Result<CpuBackend, CoreError> {
        if !layout.is_cpu() {
            return Err(CoreError::UnsupportedMemory {
                backend: "host".into(),
                what: "device memory".into(),
            });
        }
        let ctx = Arc::new(CopyContext {
            board: CompletionBoard::default(),
            layout,
            delay: cfg.delay,
            threads: cfg.threads.max(1),
        });
        let (tx, rx) = channel::<Op>();
        let rx = Arc::new(Mutex::new(rx));
        let workers = (0..cfg.threads.max(1))
            .map(|i| {
                let ctx = ctx.clone();
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("kvx-cpu-{i}"))
                    .spawn(move || worker(ctx, rx))
                    .map_err(|e| CoreError::BadLayout(format!("cannot spawn host worker: {e}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(CpuBackend {
            name: "host".into(),
            tx: Some(tx),
            ctx,
            workers,
        })
    }
}

fn worker(ctx: Arc<CopyContext>, rx: Arc<Mutex<Receiver<Op>>>) {
    loop {
        let op = {
            let rx = lock(&rx);
            match rx.recv() {
                Ok(op) => op,
                Err(_) => return,
            }
        };
        if !ctx.delay.is_zero() {
            std::thread::sleep(ctx.delay);
        }
        let cancelled = ctx.board.with_pending(op.id, |c| *c).unwrap_or(false);
        let completion = if cancelled {
            OpCompletion::all(op, Err(BlockError::Cancelled))
        } else {
            run(&ctx, op)
        };
        ctx.board.complete(completion);
    }
}

/// An op of at least this many bytes is copied by up to `threads` threads at once: one thread's
/// memcpy here is about 13 GB/s, two reach about 27 (a 64 MiB load: 5 ms, or 2.5).
const PARALLEL_BYTES: u64 = 4 << 20;

fn run(ctx: &CopyContext, mut op: Op) -> OpCompletion {
    let (layout, dir) = (&ctx.layout, op.dir);
    let parts = if op.buffer_bytes() >= PARALLEL_BYTES {
        ctx.threads.min(op.blocks.len())
    } else {
        1
    };
    let results = if parts <= 1 {
        op.blocks
            .iter_mut()
            .map(|b| copy_block(layout, dir, b))
            .collect()
    } else {
        let per = op.blocks.len().div_ceil(parts);
        std::thread::scope(|s| {
            let mut chunks = op.blocks.chunks_mut(per);
            let first = chunks.next().unwrap_or_default();
            let helpers: Vec<_> = chunks
                .map(|chunk| {
                    let n = chunk.len();
                    let copy = move || {
                        chunk
                            .iter_mut()
                            .map(|b| copy_block(layout, dir, b))
                            .collect::<Vec<_>>()
                    };
                    (n, std::thread::Builder::new().spawn_scoped(s, copy))
                })
                .collect();
            let mut results: Vec<Result<(), BlockError>> = first
                .iter_mut()
                .map(|b| copy_block(layout, dir, b))
                .collect();
            for (n, helper) in helpers {
                // A helper that could not start or died leaves its blocks failed, never copied
                // twice (its blocks are borrowed by it until the scope ends).
                let done = helper.map_err(|e| e.to_string()).and_then(|h| {
                    h.join()
                        .map_err(|_| "copy helper thread panicked".to_string())
                });
                match done {
                    Ok(r) => results.extend(r),
                    Err(why) => results.extend(
                        (0..n).map(|_| Err(BlockError::Unavailable(format!("host copy: {why}")))),
                    ),
                }
            }
            results
        })
    };
    OpCompletion { op, results }
}

fn copy_block(layout: &KvLayout, dir: Direction, b: &mut OpBlock) -> Result<(), BlockError> {
    let engine = b
        .engine
        .ok_or_else(|| BlockError::Invalid("host op block names no engine block".into()))?;
    match dir {
        Direction::Load => copy::to_engine(layout, engine, b.buf.as_slice()),
        Direction::Store => match &mut b.buf {
            Buf::Owned(buf) => {
                let cap = buf.capacity();
                buf.set_len(cap);
                let n = copy::from_engine(layout, engine, buf.as_mut_slice())?;
                buf.set_len(n);
                Ok(())
            }
            Buf::Shared(_) => Err(BlockError::Invalid(
                "a store needs an owned destination buffer".into(),
            )),
        },
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn touches_engine_memory(&self) -> bool {
        true
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        self.ctx.board.set_notifier(notifier);
    }

    fn submit(&mut self, op: Op) -> Result<(), SubmitError> {
        let id = op.id;
        let Some(tx) = self.tx.as_ref() else {
            return Err(SubmitError {
                op,
                kind: SubmitErrorKind::Unavailable("CPU backend is shutting down".into()),
            });
        };
        self.ctx.board.begin(id, false);
        tx.send(op).map_err(|std::sync::mpsc::SendError(op)| {
            self.ctx.board.abandon(id);
            SubmitError {
                op,
                kind: SubmitErrorKind::Unavailable("host workers stopped".into()),
            }
        })
    }

    fn poll(&mut self, out: &mut Vec<OpCompletion>) {
        self.ctx.board.drain(out);
    }

    fn cancel(&mut self, op: OpId) {
        self.ctx.board.with_pending(op, |c| *c = true);
    }

    fn wait(&mut self, ops: &[OpId], until: Instant) -> WaitOutcome {
        self.ctx.board.wait(ops, until)
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        self.tx.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
