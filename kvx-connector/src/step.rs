//! [`StepMsg`]: what the scheduler side hands every worker once per step.

use kvx_core::{EngineBlockId, RequestId};
use kvx_offload::StepMeta;

/// One step's message from the scheduler side to each worker (encoded by
/// [`crate::codec::encode_step`], pickled by the engine).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepMsg {
    /// The step's number, counted from 1 by the scheduler side: a worker starts each step once,
    /// whichever of the engine's per-step calls comes first.
    pub step: u64,
    /// kvx-offload's instructions for the step.
    pub meta: StepMeta,
    /// The engine's id of each request in `loads` and `delayed`.
    pub names: Vec<(RequestId, String)>,
    /// Requests whose asynchronous load starts (each reported once in `finished_recving`).
    pub loads: Vec<RequestId>,
    /// Requests whose freeing waits for their stores or their export (each reported once in
    /// `finished_sending`).
    pub delayed: Vec<RequestId>,
    /// Requests that finished while their load was in flight: reported in `finished_recving`
    /// once the load ended, so that the engine frees their blocks.
    pub abandoned: Vec<RequestId>,
    /// Requests whose load this step's forward reads: the step waits for them before the
    /// forward and never reports them in `finished_recving`.
    pub in_step: Vec<RequestId>,
    /// Engine blocks handed to another use this step while a queued store of them may still
    /// read them (sliding-window blocks): fenced before this step's stores are queued.
    pub fence: Vec<EngineBlockId>,
}
