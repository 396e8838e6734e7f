//! The only code of kvx-rdma that calls libibverbs directly: small RAII wrappers.
//!
//! The `ibverbs` crate's safe API lists devices but cannot register caller-owned memory, post
//! an RDMA READ or move a queue pair to the error state, so those go through `ibverbs-sys`.
//! Ownership rules relied on below:
//! - every wrapper holds an `Arc` of what it was created from (QP → PD and CQ → context), so
//!   the verbs objects are destroyed children first;
//! - a memory region covers memory its creator keeps alive and unmoved until the region is
//!   dropped (deregistration returns only when the device no longer accesses it);
//! - a buffer named by a posted work request is not touched by us, and not handed back to its
//!   owner, until that request's completion has been polled (success, error or flush).

use std::io;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::error::RdmaError;

const PORT: u8 = 1;

fn verbs(call: &'static str, errno: i32) -> RdmaError {
    RdmaError::Verbs {
        call,
        source: io::Error::from_raw_os_error(errno),
    }
}

fn last(call: &'static str) -> RdmaError {
    RdmaError::Verbs {
        call,
        source: io::Error::last_os_error(),
    }
}

/// How to reach one queue pair: exchanged over the TCP side channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub qpn: u32,
    pub lid: u16,
    pub psn: u32,
    pub gid: Option<[u8; 16]>,
}

impl Endpoint {
    pub(crate) const BYTES: usize = 4 + 2 + 4 + 1 + 16;

    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.qpn.to_be_bytes());
        out.extend_from_slice(&self.lid.to_be_bytes());
        out.extend_from_slice(&self.psn.to_be_bytes());
        out.push(u8::from(self.gid.is_some()));
        out.extend_from_slice(&self.gid.unwrap_or([0; 16]));
    }

    pub(crate) fn decode(b: &[u8]) -> Option<Endpoint> {
        if b.len() != Self::BYTES {
            return None;
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[11..27]);
        Some(Endpoint {
            qpn: u32::from_be_bytes(b[0..4].try_into().ok()?),
            lid: u16::from_be_bytes(b[4..6].try_into().ok()?),
            psn: u32::from_be_bytes(b[6..10].try_into().ok()?) & 0x00ff_ffff,
            gid: (b[10] != 0).then_some(gid),
        })
    }
}

/// An open RDMA device (port 1).
pub(crate) struct Context {
    ctx: *mut ffi::ibv_context,
    lid: u16,
    gid: Option<[u8; 16]>,
    mtu: ffi::ibv_mtu,
}

// SAFETY: libibverbs contexts are thread safe (the verbs API serializes internally); the raw
// pointer is owned by this struct and closed once, in Drop.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Open the device named `name` (or the first one). `NoRdmaDevice` when the machine has
    /// none or no kernel support (`ibv_get_device_list` fails with ENOSYS).
    pub(crate) fn open(name: Option<&str>, gid_index: i32) -> Result<Arc<Context>, RdmaError> {
        let listed = ibverbs::devices()
            .map_err(|e| RdmaError::NoRdmaDevice(format!("listing RDMA devices failed: {e}")))?;
        if listed.is_empty() {
            return Err(RdmaError::NoRdmaDevice("no RDMA devices found".into()));
        }
        drop(listed);
        let mut n = 0i32;
        // SAFETY: `n` is a valid out pointer; the list is freed below on every path.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(RdmaError::NoRdmaDevice(format!(
                "listing RDMA devices failed: {}",
                io::Error::last_os_error()
            )));
        }
        // SAFETY: the library returned `n` valid device pointers at `list`.
        let devs = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
        let pick = devs.iter().copied().find(|d| match name {
            None => true,
            Some(want) => {
                // SAFETY: `d` is a listed device; its name is a NUL-terminated static string.
                let got = unsafe { std::ffi::CStr::from_ptr(ffi::ibv_get_device_name(*d)) };
                got.to_str() == Ok(want)
            }
        });
        let result = match pick {
            None => Err(RdmaError::NoRdmaDevice(format!(
                "no RDMA device named {}",
                name.unwrap_or("?")
            ))),
            // SAFETY: `d` is a listed device and the list is still alive.
            Some(d) => match unsafe { ffi::ibv_open_device(d) } {
                p if p.is_null() => Err(last("ibv_open_device")),
                ctx => Ok(ctx),
            },
        };
        // SAFETY: freeing the list does not close devices opened from it.
        unsafe { ffi::ibv_free_device_list(list) };
        let ctx = result?;
        let mut c = Context {
            ctx,
            lid: 0,
            gid: None,
            mtu: ffi::IBV_MTU_1024,
        };
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: `ctx` is open; `attr` is a valid ibv_port_attr out parameter (the compat
        // symbol takes the same layout, as the ibverbs crate relies on too).
        let rc = unsafe { ffi::ibv_query_port(c.ctx, PORT, &mut attr as *mut _ as *mut _) };
        if rc != 0 {
            return Err(verbs("ibv_query_port", rc));
        }
        if attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(RdmaError::NoRdmaDevice(format!(
                "port {PORT} is not active (state {})",
                attr.state
            )));
        }
        c.lid = attr.lid;
        c.mtu = attr.active_mtu;
        if u32::from(attr.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET || attr.lid == 0 {
            let mut gid = ffi::ibv_gid::default();
            // SAFETY: valid context and out parameter.
            let rc = unsafe { ffi::ibv_query_gid(c.ctx, PORT, gid_index, &mut gid) };
            if rc != 0 {
                return Err(verbs("ibv_query_gid", rc));
            }
            // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
            c.gid = Some(unsafe { gid.raw });
        }
        Ok(Arc::new(c))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened in `open`, closed once; children hold Arcs so they are gone already.
        unsafe { ffi::ibv_close_device(self.ctx) };
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pd: *mut ffi::ibv_pd,
    ctx: Arc<Context>,
}

// SAFETY: verbs objects are thread safe; owned pointer freed once in Drop.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Arc<Pd>, RdmaError> {
        // SAFETY: `ctx` is open for as long as the Pd holds its Arc.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.ctx) };
        if pd.is_null() {
            return Err(last("ibv_alloc_pd"));
        }
        Ok(Arc::new(Pd {
            pd,
            ctx: ctx.clone(),
        }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`; every MR and QP of it holds an Arc, so none is left.
        unsafe { ffi::ibv_dealloc_pd(self.pd) };
    }
}

/// A completion queue.
pub(crate) struct Cq {
    cq: *mut ffi::ibv_cq,
    _ctx: Arc<Context>,
}

// SAFETY: verbs objects are thread safe; owned pointer freed once in Drop.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub(crate) fn new(ctx: &Arc<Context>, entries: i32) -> Result<Arc<Cq>, RdmaError> {
        // SAFETY: open context; no channel, no user context.
        let cq = unsafe {
            ffi::ibv_create_cq(
                ctx.ctx,
                entries,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(last("ibv_create_cq"));
        }
        Ok(Arc::new(Cq {
            cq,
            _ctx: ctx.clone(),
        }))
    }

    /// Pop up to `wcs.len()` completions; returns how many.
    pub(crate) fn poll(&self, wcs: &mut [ffi::ibv_wc]) -> Result<usize, RdmaError> {
        // SAFETY: `cq` is live; `poll_cq` is the provider's entry point for it, writing at most
        // `wcs.len()` entries into `wcs`.
        let n = unsafe {
            let ctx = (*self.cq).context;
            match (*ctx).ops.poll_cq {
                Some(f) => f(self.cq, wcs.len() as i32, wcs.as_mut_ptr()),
                None => -1,
            }
        };
        if n < 0 {
            return Err(verbs("ibv_poll_cq", libc_eio()));
        }
        Ok(n as usize)
    }
}

fn libc_eio() -> i32 {
    5
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created in `new`; QPs using it hold an Arc, so none is left.
        unsafe { ffi::ibv_destroy_cq(self.cq) };
    }
}

/// A memory region over memory the caller keeps alive until it is dropped.
pub(crate) struct Mr {
    mr: *mut ffi::ibv_mr,
    _pd: Arc<Pd>,
}

// SAFETY: verbs objects are thread safe; owned pointer deregistered once in Drop.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Register `len` bytes at `addr`; `remote_read` lets peers RDMA READ it.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid and mapped until the returned region is dropped.
    pub(crate) unsafe fn register(
        pd: &Arc<Pd>,
        addr: usize,
        len: usize,
        remote_read: bool,
    ) -> Result<Mr, RdmaError> {
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_read {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        }
        // SAFETY: the caller guarantees the range is valid until Drop; the PD is alive.
        let mr = unsafe { ffi::ibv_reg_mr(pd.pd, addr as *mut _, len, access.0 as i32) };
        if mr.is_null() {
            return Err(last("ibv_reg_mr"));
        }
        Ok(Mr {
            mr,
            _pd: pd.clone(),
        })
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: `mr` is a live registration.
        unsafe { (*self.mr).lkey }
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: `mr` is a live registration.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `register`; after this returns the device no longer accesses
        // the memory, so the owner may reuse it.
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr) };
        if rc != 0 {
            tracing::error!(rc, "ibv_dereg_mr failed");
        }
    }
}

/// A reliable-connection queue pair.
pub(crate) struct Qp {
    qp: *mut ffi::ibv_qp,
    pd: Arc<Pd>,
    _cq: Arc<Cq>,
    psn: u32,
}

// SAFETY: verbs objects are thread safe; owned pointer destroyed once in Drop.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Qp {
    pub(crate) fn new_rc(pd: &Arc<Pd>, cq: &Arc<Cq>, max_wr: u32) -> Result<Qp, RdmaError> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq.cq,
            recv_cq: cq.cq,
            srq: std::ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: max_wr,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: PD and CQ are alive (and kept alive by the Arcs stored below).
        let qp = unsafe { ffi::ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(last("ibv_create_qp"));
        }
        let psn = (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0))
            & 0x00ff_ffff;
        Ok(Qp {
            qp,
            pd: pd.clone(),
            _cq: cq.clone(),
            psn,
        })
    }

    pub(crate) fn endpoint(&self) -> Endpoint {
        let ctx = &self.pd.ctx;
        Endpoint {
            // SAFETY: `qp` is live.
            qpn: unsafe { (*self.qp).qp_num },
            lid: ctx.lid,
            psn: self.psn,
            gid: ctx.gid,
        }
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
    ) -> Result<(), RdmaError> {
        // SAFETY: `qp` is live; `attr` is a valid attribute struct for `mask`.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            return Err(verbs("ibv_modify_qp", rc));
        }
        Ok(())
    }

    /// INIT → RTR → RTS towards `remote`. `remote_read` lets the peer RDMA READ our regions.
    pub(crate) fn connect(&self, remote: &Endpoint, remote_read: bool) -> Result<(), RdmaError> {
        use ffi::ibv_qp_attr_mask as M;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            port_num: PORT,
            pkey_index: 0,
            qp_access_flags: if remote_read {
                ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
            } else {
                0
            },
            ..Default::default()
        };
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
        )?;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: self.pd.ctx.mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            ah_attr: ffi::ibv_ah_attr {
                dlid: remote.lid,
                port_num: PORT,
                ..Default::default()
            },
            ..Default::default()
        };
        if let Some(gid) = remote.gid {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ffi::ibv_gid { raw: gid };
            a.ah_attr.grh.hop_limit = 1;
            a.ah_attr.grh.sgid_index = 0;
        }
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
        )?;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: self.psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
            ..Default::default()
        };
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Move to the error state: every outstanding work request completes with a flush error.
    pub(crate) fn to_error(&self) -> Result<(), RdmaError> {
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(&mut a, ffi::ibv_qp_attr_mask::IBV_QP_STATE)
    }

    /// Post a signaled RDMA READ of `len` bytes at `remote_addr` (`rkey`) into `local_addr`
    /// (`lkey`), completing with `wr_id`.
    ///
    /// # Safety
    /// `local_addr..+len` must lie in the region of `lkey` and must not be touched or handed
    /// back to its owner until this request's completion has been polled from the CQ.
    pub(crate) unsafe fn post_read(
        &self,
        wr_id: u64,
        local_addr: usize,
        len: u32,
        lkey: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> Result<(), RdmaError> {
        let mut sge = ffi::ibv_sge {
            addr: local_addr as u64,
            length: len,
            lkey,
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            wr: ffi::ibv_send_wr__bindgen_ty_2 {
                rdma: ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey },
            },
            ..Default::default()
        };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `qp` is live; `wr` and `sge` outlive the call (the provider copies them);
        // the caller upholds the buffer rule above.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_send {
                Some(f) => f(self.qp, &mut wr, &mut bad),
                None => libc_eio(),
            }
        };
        if rc != 0 {
            return Err(verbs("ibv_post_send", rc));
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created in `new_rc`, destroyed once. Callers drain its work requests first.
        let rc = unsafe { ffi::ibv_destroy_qp(self.qp) };
        if rc != 0 {
            tracing::error!(rc, "ibv_destroy_qp failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trip() {
        let e = Endpoint {
            qpn: 77,
            lid: 3,
            psn: 0x12_3456,
            gid: Some([9; 16]),
        };
        let mut b = Vec::new();
        e.encode(&mut b);
        assert_eq!(Endpoint::decode(&b), Some(e));
        assert_eq!(Endpoint::decode(&b[1..]), None);
    }
}
