//! What the tests of this crate share: a worker's report of a job.

use kvx_offload::{JobPart, JobResult, StoreJob};

/// A worker's report that host-tier store `job` stored every one of its blocks.
pub(crate) fn stored_on_host(job: &StoreJob) -> JobResult {
    JobResult {
        job: job.job,
        request: job.request,
        part: JobPart::StoreHost,
        ok: job.blocks.iter().map(|(k, _)| *k).collect(),
        failed: vec![],
        promoted: vec![],
    }
}
