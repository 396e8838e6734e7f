//! The consumer side of the verbs transport: one queue pair per read, grants over the TCP side
//! channel, RDMA READs straight into the op's registered buffers, and a flush of the queue
//! pair before any buffer is handed back early.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;
use kvx_core::BlockError;

use super::VerbsConfig;
use super::msg::VerbsMsg;
use super::sys::{Context, Cq, Mr, Pd, Qp};
use crate::descriptor::{RemoteDescriptor, TransportKind};
use crate::error::RdmaError;
use crate::tcp::{TcpClientConfig, TcpTransport};
use crate::transport::{BoxFuture, CancelToken, ReadSlot, Transport};

/// Blocks granted per side-channel request.
const GRANT_CHUNK: usize = 256;

/// Reads exported blocks with one-sided RDMA READ (feature `verbs`).
pub struct VerbsTransport {
    tcp: TcpTransport,
    pd: Arc<Pd>,
    ctx: Arc<Context>,
}

impl VerbsTransport {
    /// Open the RDMA device; `NoRdmaDevice` where there is none. Heartbeats, done and the side
    /// channel go over TCP with `tcp`.
    pub fn new(tcp: TcpClientConfig, verbs: VerbsConfig) -> Result<VerbsTransport, RdmaError> {
        let ctx = Context::open(verbs.device.as_deref(), verbs.gid_index)?;
        let pd = Pd::new(&ctx)?;
        Ok(VerbsTransport {
            tcp: TcpTransport::new(tcp),
            pd,
            ctx,
        })
    }
}

/// Work requests posted on a queue pair and not yet polled back. Dropping it (a read future
/// abandoned mid-flight) moves the QP to the error state and polls until every request is
/// accounted for, so no buffer it names is handed back while the NIC may still write it.
struct InFlight {
    qp: Qp,
    cq: Arc<Cq>,
    outstanding: usize,
}

impl InFlight {
    /// Poll once; `f(wr_id, error)` per completion.
    fn poll(&mut self, f: &mut dyn FnMut(u64, Option<String>)) -> Result<usize, RdmaError> {
        let mut wcs = [ffi::ibv_wc::default(); 32];
        let n = self.cq.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            self.outstanding = self.outstanding.saturating_sub(1);
            let err = wc.error().map(|(status, vendor)| {
                format!("RDMA READ failed: status {status}, vendor error {vendor}")
            });
            f(wc.wr_id(), err);
        }
        Ok(n)
    }

    /// Move the QP to error and wait (spinning, then sleeping) until every request flushed.
    fn flush(&mut self, f: &mut dyn FnMut(u64, Option<String>)) {
        if self.outstanding == 0 {
            return;
        }
        if let Err(e) = self.qp.to_error() {
            tracing::error!(error = %e, "kvx-rdma verbs: cannot move the queue pair to error");
        }
        let t0 = Instant::now();
        let mut warned = false;
        while self.outstanding > 0 {
            match self.poll(f) {
                Ok(0) => std::thread::sleep(Duration::from_micros(100)),
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(error = %e, "kvx-rdma verbs: polling the flush failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            if !warned && t0.elapsed() > Duration::from_secs(1) {
                warned = true;
                tracing::warn!(
                    outstanding = self.outstanding,
                    "kvx-rdma verbs: flush is slow; buffers stay held until it completes"
                );
            }
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.flush(&mut |_, _| {});
    }
}

fn io(e: impl std::fmt::Display) -> BlockError {
    BlockError::Io(e.to_string())
}

impl VerbsTransport {
    async fn read_all(
        &self,
        desc: &RemoteDescriptor,
        slots: &mut [ReadSlot<'_>],
        results: &mut [Option<Result<(), BlockError>>],
        deadline: Instant,
        cancel: &CancelToken,
    ) -> Result<(), BlockError> {
        let addr = desc.addr;
        let mut conn = self.tcp.checkout(addr).await.map_err(io)?;
        let cq = Cq::new(&self.ctx, (slots.len() * 4 + 16) as i32).map_err(io)?;
        let qp = Qp::new_rc(&self.pd, &cq, (slots.len() * 2 + 16) as u32).map_err(io)?;
        let reply = self
            .tcp
            .side_call(&mut conn, addr, VerbsMsg::Connect(qp.endpoint()).encode())
            .await
            .map_err(io)?;
        let remote = match VerbsMsg::decode(&reply).map_err(io)? {
            VerbsMsg::Accept(e) => e,
            other => return Err(io(format!("{addr}: unexpected answer {other:?}"))),
        };
        qp.connect(&remote, false).map_err(io)?;
        // Grants: the lease is checked now, for every block of this read.
        let mut grants = Vec::with_capacity(slots.len());
        for chunk in slots.chunks(GRANT_CHUNK) {
            let blocks = chunk.iter().map(|s| s.index).collect();
            let msg = VerbsMsg::Grant {
                request: desc.request.0,
                blocks,
            };
            let reply = self
                .tcp
                .side_call(&mut conn, addr, msg.encode())
                .await
                .map_err(|e| BlockError::Remote(e.to_string()))?;
            match VerbsMsg::decode(&reply).map_err(io)? {
                VerbsMsg::Granted(g) if g.len() == chunk.len() => grants.extend(g),
                other => return Err(io(format!("{addr}: unexpected grant {other:?}"))),
            }
        }
        // Register the destination buffers; `mrs` is declared before `inflight`, so on every
        // exit the flush (inflight's drop) happens before the deregistration.
        let mut mrs = Vec::with_capacity(slots.len());
        for s in slots.iter_mut() {
            let (ptr, cap) = (s.buf.as_mut_ptr() as usize, s.buf.capacity());
            // SAFETY: the slot's buffer is borrowed mutably for this whole call and the region
            // is dropped before the call returns (after the flush below).
            mrs.push(unsafe { Mr::register(&self.pd, ptr, cap, false) }.map_err(io)?);
        }
        let mut inflight = InFlight {
            qp,
            cq,
            outstanding: 0,
        };
        let mut remaining = vec![0usize; slots.len()];
        for (i, (s, segs)) in slots.iter_mut().zip(&grants).enumerate() {
            let total: u64 = segs.iter().map(|g| u64::from(g.len)).sum();
            if total != desc.block_bytes || total > s.buf.capacity() as u64 {
                results[i] = Some(Err(BlockError::Remote(format!(
                    "granted {total} bytes for a {}-byte block",
                    desc.block_bytes
                ))));
                continue;
            }
            let base = s.buf.as_mut_ptr() as usize;
            let mut off = 0usize;
            for (j, g) in segs.iter().enumerate() {
                let wr_id = ((i as u64) << 20) | j as u64;
                // SAFETY: `base+off..+len` lies inside the slot's buffer (total checked above),
                // registered as `mrs[i]`; it is not touched until the completion is polled or
                // the QP flushed (InFlight).
                let posted = unsafe {
                    inflight
                        .qp
                        .post_read(wr_id, base + off, g.len, mrs[i].lkey(), g.addr, g.rkey)
                };
                match posted {
                    Ok(()) => {
                        inflight.outstanding += 1;
                        remaining[i] += 1;
                    }
                    Err(e) => {
                        results[i] = Some(Err(io(e)));
                        break;
                    }
                }
                off += g.len as usize;
            }
        }
        let mut on_wc = |wr_id: u64, err: Option<String>| {
            let i = (wr_id >> 20) as usize;
            if i >= remaining.len() {
                return;
            }
            remaining[i] = remaining[i].saturating_sub(1);
            match err {
                Some(e) if results[i].is_none() => {
                    results[i] = Some(Err(BlockError::Remote(e)));
                }
                Some(_) => {}
                None if remaining[i] == 0 && results[i].is_none() => {
                    slots[i].buf.set_len(desc.block_bytes as usize);
                    results[i] = Some(Ok(()));
                }
                None => {}
            }
        };
        let until = tokio::time::Instant::from_std(deadline);
        let mut idle = 0u32;
        let stop = loop {
            if inflight.outstanding == 0 {
                break None;
            }
            match inflight.poll(&mut on_wc) {
                Ok(0) => idle += 1,
                Ok(_) => idle = 0,
                Err(e) => break Some(io(e)),
            }
            if Instant::now() >= deadline {
                break Some(BlockError::TimedOut);
            }
            if cancel.is_cancelled() {
                break Some(BlockError::Cancelled);
            }
            if idle < 64 {
                tokio::task::yield_now().await;
            } else {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(1)) => {}
                    _ = tokio::time::sleep_until(until) => {}
                    _ = cancel.cancelled() => {}
                }
            }
        };
        // Deadline, cancel or a CQ error: flush before the buffers go back.
        inflight.flush(&mut on_wc);
        drop(inflight);
        drop(mrs);
        if stop.is_none() {
            self.tcp.checkin(addr, conn);
        }
        match stop {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Transport for VerbsTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn read<'a, 'b: 'a>(
        &'a self,
        desc: &'a RemoteDescriptor,
        slots: &'a mut [ReadSlot<'b>],
        deadline: Instant,
        cancel: &'a CancelToken,
    ) -> BoxFuture<'a, Vec<Result<(), BlockError>>> {
        Box::pin(async move {
            let mut results: Vec<Option<Result<(), BlockError>>> = vec![None; slots.len()];
            let until = tokio::time::Instant::from_std(deadline);
            // The setup (side channel) is bounded by the deadline; the RDMA phase bounds itself
            // and flushes before returning.
            let stop = match tokio::time::timeout_at(
                until,
                self.read_all(desc, slots, &mut results, deadline, cancel),
            )
            .await
            {
                Ok(Ok(())) => BlockError::Io("block was not read".into()),
                Ok(Err(e)) => e,
                Err(_) => BlockError::TimedOut,
            };
            results
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(stop.clone())))
                .collect()
        })
    }

    fn heartbeat<'a>(&'a self, desc: &'a RemoteDescriptor) -> BoxFuture<'a, Result<(), RdmaError>> {
        self.tcp.heartbeat(desc)
    }

    fn done<'a>(&'a self, desc: &'a RemoteDescriptor) -> BoxFuture<'a, Result<(), RdmaError>> {
        self.tcp.done(desc)
    }
}
