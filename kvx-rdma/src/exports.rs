//! The producer's bookkeeping, sans-IO: exported requests, their leases (kvx-policy's
//! [`LeaseTable`]) and the reads in progress on each.
//!
//! A lease that ends (all readers done, expiry, abort) stops new reads at once, but the
//! request is reported released only when no read still copies from its blocks: the engine
//! may reuse blocks the moment it sees the release, so the release is the fence.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use kvx_core::{BlockKey, EngineBlockId, RequestId};
use kvx_policy::{LeaseConfig, LeaseState, LeaseTable, PolicyError, ReleaseReason};

use crate::error::RdmaError;
use crate::wire::ErrorCode;

/// How many released request ids are remembered to explain late reads.
const RECENT: usize = 4096;

/// A request whose lease ended and whose blocks the engine may now free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// The request.
    pub request: RequestId,
    /// Why its lease ended.
    pub reason: ReleaseReason,
    /// The engine blocks it had exported.
    pub blocks: Vec<EngineBlockId>,
}

/// Counters of the producer side.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportStats {
    /// Requests exported and not yet released (any state).
    pub exported: usize,
    /// Of those, with a started lease.
    pub active: usize,
    /// Of those, whose lease ended but a read still holds the blocks.
    pub draining: usize,
    /// Reads copying from engine memory right now.
    pub pins: u64,
    /// Releases not yet taken by `poll_released`.
    pub unpolled: usize,
    /// Released because every reader was done.
    pub released_read: u64,
    /// Released because the lease expired.
    pub released_expired: u64,
    /// Released because the producer aborted.
    pub released_aborted: u64,
}

/// A refused read, heartbeat or done: the error code and message to send back.
pub(crate) type Refusal = (ErrorCode, String);

struct Entry {
    blocks: Vec<(BlockKey, EngineBlockId)>,
    lease: LeaseConfig,
    pins: u64,
    ended: Option<ReleaseReason>,
}

/// Exported requests and their leases.
pub(crate) struct ExportTable {
    leases: LeaseTable<RequestId>,
    entries: HashMap<RequestId, Entry>,
    fresh: Vec<Released>,
    released: VecDeque<Released>,
    recent: VecDeque<(RequestId, ReleaseReason)>,
    num_blocks: u32,
    block_bytes: u64,
    /// Entries whose lease ended but which are not yet released (reads drain).
    ending: usize,
    /// Bumped whenever a lease starts or ends: replies in progress re-read their deadline.
    epoch: u64,
    stats: ExportStats,
}

impl ExportTable {
    /// A table for an engine pool of `num_blocks` blocks of `block_bytes` each.
    pub fn new(num_blocks: u32, block_bytes: u64) -> ExportTable {
        ExportTable {
            leases: LeaseTable::new(),
            entries: HashMap::new(),
            fresh: Vec::new(),
            released: VecDeque::new(),
            recent: VecDeque::new(),
            num_blocks,
            block_bytes,
            ending: 0,
            epoch: 0,
            stats: ExportStats::default(),
        }
    }

    /// Bytes of each block.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Changes whenever a lease starts or ends (a reply in progress re-reads
    /// [`ExportTable::read_deadline`] then).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The instant by which a reply from `request`'s blocks must be fully written: the lease's
    /// current expiry. `None` once the lease ended (or if it never started): cut the reply now.
    pub fn read_deadline(&self, request: RequestId) -> Option<Instant> {
        match self.entries.get(&request) {
            Some(Entry { ended: None, .. }) => self.leases.get(&request)?.expiry(),
            _ => None,
        }
    }

    /// Export `blocks` of `request` under a pending lease (no reads, no expiry until `ready`).
    pub fn export(
        &mut self,
        request: RequestId,
        blocks: &[(BlockKey, EngineBlockId)],
        cfg: &LeaseConfig,
    ) -> Result<(), RdmaError> {
        if self.entries.contains_key(&request) {
            return Err(RdmaError::AlreadyExported(request));
        }
        if blocks.is_empty() {
            return Err(RdmaError::BadDescriptor {
                request,
                what: "no blocks to export".into(),
            });
        }
        if let Some((_, b)) = blocks.iter().find(|(_, b)| b.0 >= self.num_blocks) {
            return Err(RdmaError::BlockOutOfRange {
                request,
                block: *b,
                num_blocks: self.num_blocks,
            });
        }
        self.leases
            .insert(request, cfg)
            .map_err(|source| RdmaError::Lease { request, source })?;
        self.entries.insert(
            request,
            Entry {
                blocks: blocks.to_vec(),
                lease: *cfg,
                pins: 0,
                ended: None,
            },
        );
        Ok(())
    }

    /// The request is ready to be read: its lease starts at `now`.
    pub fn ready(&mut self, request: RequestId, now: Instant) -> Result<(), RdmaError> {
        self.tick(now);
        let r = self.leases.start(&request, now);
        if r.is_ok() {
            self.epoch += 1;
        }
        self.settle();
        r.map_err(|e| self.lease_error(request, e))
    }

    /// The producer gives up on `request` (e.g. the engine aborted it).
    pub fn abort(&mut self, request: RequestId) -> Result<(), RdmaError> {
        let r = self.leases.abort(&request);
        self.settle();
        r.map_err(|e| self.lease_error(request, e))
    }

    /// Expire leases due at `now`.
    pub fn tick(&mut self, now: Instant) {
        self.leases.handle_timeout(now);
        self.settle();
    }

    /// When `tick` should run next (the earliest lease expiry).
    pub fn next_timeout(&mut self) -> Option<Instant> {
        self.leases.poll_timeout()
    }

    /// The next released request, after expiring what is due at `now` (the sans-IO tests'
    /// view; the exporter publishes after its release hooks ran).
    #[cfg(test)]
    pub fn poll_released(&mut self, now: Instant) -> Option<Released> {
        self.tick(now);
        let fresh = self.take_fresh();
        self.publish(fresh);
        self.pop_released()
    }

    /// Releases settled since the last call, not yet visible to `pop_released` (the caller
    /// lets go of their memory first, then `publish`es them).
    pub fn take_fresh(&mut self) -> Vec<Released> {
        std::mem::take(&mut self.fresh)
    }

    /// Make releases visible to `pop_released`.
    pub fn publish(&mut self, released: Vec<Released>) {
        self.released.extend(released);
    }

    /// The next published release.
    pub fn pop_released(&mut self) -> Option<Released> {
        self.released.pop_front()
    }

    /// Releases not yet taken.
    pub fn unpolled(&self) -> usize {
        self.released.len() + self.fresh.len()
    }

    /// Where the lease of `request` stands (`Released` while reads still drain).
    pub fn lease_state(&self, request: RequestId) -> Option<LeaseState> {
        let e = self.entries.get(&request)?;
        match e.ended {
            Some(r) => Some(LeaseState::Released(r)),
            None => self.leases.get(&request).map(|l| l.state()),
        }
    }

    /// The blocks of an exported request.
    pub fn blocks(&self, request: RequestId) -> Option<&[(BlockKey, EngineBlockId)]> {
        self.entries.get(&request).map(|e| e.blocks.as_slice())
    }

    /// The lease settings `request` was exported with.
    pub fn lease_config(&self, request: RequestId) -> Option<LeaseConfig> {
        self.entries.get(&request).map(|e| e.lease)
    }

    /// Counters.
    pub fn stats(&self) -> ExportStats {
        let mut s = self.stats.clone();
        s.exported = self.entries.len();
        s.active = self
            .entries
            .keys()
            .filter(|r| self.leases.is_active(r))
            .count();
        s.draining = self.entries.values().filter(|e| e.ended.is_some()).count();
        s.pins = self.entries.values().map(|e| e.pins).sum();
        s.unpolled = self.unpolled();
        s
    }

    /// Check a read of `len` bytes at `offset` of block index `block` and pin the request's
    /// blocks until [`ExportTable::end_read`]. Returns the engine block to copy from.
    pub fn begin_read(
        &mut self,
        request: RequestId,
        block: u32,
        offset: u64,
        len: u64,
        now: Instant,
    ) -> Result<EngineBlockId, Refusal> {
        self.tick(now);
        self.usable(request)?;
        let block_bytes = self.block_bytes;
        let Some(e) = self.entries.get_mut(&request) else {
            return Err(self.unknown(request));
        };
        let Some(&(_, engine)) = e.blocks.get(block as usize) else {
            return Err((
                ErrorCode::OutOfBounds,
                format!(
                    "{request} exports {} blocks; block index {block} is out of bounds",
                    e.blocks.len()
                ),
            ));
        };
        if offset.checked_add(len).is_none_or(|end| end > block_bytes) || len == 0 {
            return Err((
                ErrorCode::OutOfBounds,
                format!(
                    "{request} block {block}: bytes {offset}..+{len} are outside the \
                     {block_bytes}-byte block"
                ),
            ));
        }
        e.pins += 1;
        Ok(engine)
    }

    /// Check that `request` is readable at `now` (lease active) without admitting a read.
    pub fn check_readable(&mut self, request: RequestId, now: Instant) -> Result<(), Refusal> {
        self.tick(now);
        self.usable(request)
    }

    /// A read that `begin_read` admitted finished copying.
    pub fn end_read(&mut self, request: RequestId) {
        if let Some(e) = self.entries.get_mut(&request) {
            e.pins = e.pins.saturating_sub(1);
        }
        self.settle();
    }

    /// Renew the lease of `request` at `now`.
    pub fn heartbeat(&mut self, request: RequestId, now: Instant) -> Result<(), Refusal> {
        self.tick(now);
        self.usable_or_pending(request)?;
        let r = self.leases.heartbeat(&request, now);
        self.settle();
        r.map_err(|e| self.refusal(request, e))
    }

    /// Reader `reader` is done with `request`.
    pub fn reader_done(
        &mut self,
        request: RequestId,
        reader: u32,
        now: Instant,
    ) -> Result<(), Refusal> {
        self.tick(now);
        self.usable_or_pending(request)?;
        let r = self.leases.reader_done(&request, reader, now);
        self.settle();
        r.map_err(|e| self.refusal(request, e))
    }

    fn usable_or_pending(&self, request: RequestId) -> Result<(), Refusal> {
        match self.entries.get(&request) {
            None => Err(self.unknown(request)),
            Some(Entry {
                ended: Some(reason),
                ..
            }) => Err(ended(request, *reason)),
            Some(_) => Ok(()),
        }
    }

    fn usable(&self, request: RequestId) -> Result<(), Refusal> {
        self.usable_or_pending(request)?;
        if self.leases.is_active(&request) {
            Ok(())
        } else {
            Err((
                ErrorCode::NotReady,
                format!("{request} is exported but not ready to be read yet"),
            ))
        }
    }

    /// `request` will not be exported here (the engine refused it): a reader asking for it
    /// hears that its lease ended (aborted) at once, as for a released request, instead of
    /// waiting for an export that never comes. No effect on a request exported now.
    pub fn refuse(&mut self, request: RequestId) {
        if self.entries.contains_key(&request) || self.recent.iter().any(|(r, _)| *r == request) {
            return;
        }
        self.remember(request, ReleaseReason::Aborted);
    }

    /// Keep how `request` ended among the last [`RECENT`], for readers that ask after it.
    fn remember(&mut self, request: RequestId, reason: ReleaseReason) {
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((request, reason));
    }

    fn unknown(&self, request: RequestId) -> Refusal {
        match self.recent.iter().rev().find(|(r, _)| *r == request) {
            Some((_, reason)) => ended(request, *reason),
            None => (
                ErrorCode::UnknownRequest,
                format!("{request} is not exported here"),
            ),
        }
    }

    fn refusal(&self, request: RequestId, e: PolicyError) -> Refusal {
        match e {
            PolicyError::LeaseReleased { reason, .. } => ended(request, reason),
            PolicyError::UnknownLease { .. } => self.unknown(request),
            other => (ErrorCode::Internal, other.to_string()),
        }
    }

    fn lease_error(&self, request: RequestId, e: PolicyError) -> RdmaError {
        match e {
            PolicyError::LeaseReleased { reason, .. } => RdmaError::LeaseEnded { request, reason },
            PolicyError::UnknownLease { .. } => match self.entries.get(&request) {
                Some(Entry {
                    ended: Some(reason),
                    ..
                }) => RdmaError::LeaseEnded {
                    request,
                    reason: *reason,
                },
                _ => RdmaError::UnknownRequest(request),
            },
            source => RdmaError::Lease { request, source },
        }
    }

    /// Move ended leases into their entries, and drained entries into the released queue.
    fn settle(&mut self) {
        while let Some((request, reason)) = self.leases.poll_released() {
            if let Some(e) = self.entries.get_mut(&request) {
                if e.ended.is_none() {
                    e.ended = Some(reason);
                    self.ending += 1;
                    self.epoch += 1;
                }
            }
        }
        if self.ending == 0 {
            return;
        }
        let done: Vec<RequestId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.ended.is_some() && e.pins == 0)
            .map(|(r, _)| *r)
            .collect();
        for request in done {
            let Some(e) = self.entries.remove(&request) else {
                continue;
            };
            self.ending -= 1;
            let reason = e.ended.unwrap_or(ReleaseReason::Aborted);
            match reason {
                ReleaseReason::Read => self.stats.released_read += 1,
                ReleaseReason::Expired => self.stats.released_expired += 1,
                ReleaseReason::Aborted => self.stats.released_aborted += 1,
            }
            self.remember(request, reason);
            self.fresh.push(Released {
                request,
                reason,
                blocks: e.blocks.into_iter().map(|(_, b)| b).collect(),
            });
        }
    }
}

fn ended(request: RequestId, reason: ReleaseReason) -> Refusal {
    (
        ErrorCode::LeaseEnded,
        format!(
            "the lease of {request} ended ({reason}); its blocks may belong to another request now"
        ),
    )
}

#[cfg(test)]
mod tests;
