//! The producer side of the verbs transport: the TCP server plus a side channel that connects
//! queue pairs and grants per-request memory regions while the lease is active.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Weak};

use kvx_core::RequestId;

use super::VerbsConfig;
use super::msg::{Seg, VerbsMsg};
use super::sys::{Context, Cq, Mr, Pd, Qp};
use crate::descriptor::{RemoteDescriptor, TransportKind};
use crate::error::RdmaError;
use crate::exporter::{Exporter, ReleaseHook};
use crate::exports::Refusal;
use crate::tcp::{ServerConfig, SideChannel, TcpServer};
use crate::wire::ErrorCode;

/// A block's registered segments: region, address, length.
type BlockRegs = Vec<(Mr, usize, usize)>;

#[derive(Default)]
struct State {
    /// Per request: per block, its registered segments.
    mrs: HashMap<RequestId, Vec<BlockRegs>>,
    /// Per side-channel connection: its queue pairs.
    qps: HashMap<u64, Vec<Qp>>,
}

struct Side {
    exporter: Exporter,
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    state: Mutex<State>,
}

fn internal(e: RdmaError) -> Refusal {
    (ErrorCode::Internal, e.to_string())
}

impl Side {
    fn grant(&self, request: RequestId, blocks: &[u32]) -> Result<Vec<Vec<Seg>>, Refusal> {
        // Lock order: side state, then the exporter's table (the release hook takes only the
        // side state, and runs without the table lock), so a release racing this grant waits
        // and then deregisters what we register here.
        let mut st = kvx_core::lock(&self.state);
        self.exporter.check_readable(request)?;
        if let std::collections::hash_map::Entry::Vacant(slot) = st.mrs.entry(request) {
            let segs = self.exporter.segments_of(request).ok_or((
                ErrorCode::UnknownRequest,
                format!("{request} is not exported here"),
            ))?;
            let mut per_block = Vec::with_capacity(segs.len());
            for block in segs {
                let mut regs = Vec::with_capacity(block.len());
                for (addr, len) in block {
                    // SAFETY: `addr..addr+len` is exported engine memory, live until the
                    // request is released (Exporter::new's contract); the region is dropped by
                    // the release hook before the engine hears of the release.
                    let mr =
                        unsafe { Mr::register(&self.pd, addr, len, true) }.map_err(internal)?;
                    regs.push((mr, addr, len));
                }
                per_block.push(regs);
            }
            slot.insert(per_block);
        }
        let regs = &st.mrs[&request];
        blocks
            .iter()
            .map(|&b| {
                let block = regs.get(b as usize).ok_or((
                    ErrorCode::OutOfBounds,
                    format!(
                        "{request} exports {} blocks; block index {b} is out of bounds",
                        regs.len()
                    ),
                ))?;
                Ok(block
                    .iter()
                    .map(|(mr, addr, len)| Seg {
                        addr: *addr as u64,
                        len: *len as u32,
                        rkey: mr.rkey(),
                    })
                    .collect())
            })
            .collect()
    }
}

impl SideChannel for Side {
    fn handle(&self, conn: u64, _reader: u32, body: &[u8]) -> Result<Vec<u8>, Refusal> {
        match VerbsMsg::decode(body).map_err(|e| (ErrorCode::MalformedFrame, e))? {
            VerbsMsg::Connect(remote) => {
                let qp = Qp::new_rc(&self.pd, &self.cq, 1).map_err(internal)?;
                qp.connect(&remote, true).map_err(internal)?;
                let me = qp.endpoint();
                kvx_core::lock(&self.state)
                    .qps
                    .entry(conn)
                    .or_default()
                    .push(qp);
                Ok(VerbsMsg::Accept(me).encode())
            }
            VerbsMsg::Grant { request, blocks } => {
                Ok(VerbsMsg::Granted(self.grant(RequestId(request), &blocks)?).encode())
            }
            other => Err((
                ErrorCode::MalformedFrame,
                format!("unexpected verbs message from a consumer: {other:?}"),
            )),
        }
    }

    fn closed(&self, conn: u64) {
        if let Some(qps) = kvx_core::lock(&self.state).qps.remove(&conn) {
            for qp in qps {
                let _ = qp.to_error();
            }
        }
    }
}

struct Hook(Weak<Side>);

impl ReleaseHook for Hook {
    fn released(&self, request: RequestId) {
        if let Some(side) = self.0.upgrade() {
            // Dropping the regions deregisters them: from here on the NIC refuses reads.
            kvx_core::lock(&side.state).mrs.remove(&request);
        }
    }
}

/// The producer's verbs server: a [`TcpServer`] (heartbeats, done, side channel) whose
/// consumers read block memory with one-sided RDMA READs.
pub struct VerbsServer {
    tcp: TcpServer,
    _side: Arc<Side>,
}

impl VerbsServer {
    /// Open the RDMA device and serve `exporter`. `NoRdmaDevice` where there is none.
    pub fn start(
        exporter: Exporter,
        cfg: ServerConfig,
        verbs: VerbsConfig,
    ) -> Result<VerbsServer, RdmaError> {
        let ctx = Context::open(verbs.device.as_deref(), verbs.gid_index)?;
        let pd = Pd::new(&ctx)?;
        let cq = Cq::new(&ctx, 16)?;
        let side = Arc::new(Side {
            exporter: exporter.clone(),
            ctx,
            pd,
            cq,
            state: Mutex::new(State::default()),
        });
        exporter.add_release_hook(Arc::new(Hook(Arc::downgrade(&side))));
        let channel: Arc<dyn SideChannel> = side.clone();
        let tcp = TcpServer::start_with(exporter, cfg, Some(channel))?;
        let _ = &side.ctx;
        Ok(VerbsServer { tcp, _side: side })
    }

    /// The side channel's address.
    pub fn local_addr(&self) -> SocketAddr {
        self.tcp.local_addr()
    }

    /// The descriptor of an exported `request` for verbs consumers.
    pub fn descriptor(
        &self,
        exporter: &Exporter,
        request: RequestId,
    ) -> Result<RemoteDescriptor, RdmaError> {
        exporter.descriptor(request, self.tcp.local_addr(), TransportKind::Verbs)
    }
}
