//! A compact byte encoding of what crosses an engine's process boundary: the scheduler side's
//! [`StepMsg`] (pickled to every worker each step) and the worker side's job results (sent back
//! as worker metadata). LEB128 lengths and ids, 16-byte big-endian keys, a version byte first.
//! Decoding never panics and allocates no more than the input's length allows: bytes from
//! another build or a damaged message are a [`DecodeError`].

use kvx_core::{BlockError, BlockKey, EngineBlockId, RequestId};
use kvx_offload::{
    ExportJob, JobId, JobPart, JobResult, LoadBlock, LoadJob, RemoteLoadJob, RemoteSource,
    StepMeta, StoreJob, Tier, WriteBackJob,
};

use crate::step::StepMsg;

/// Encoding version: the first byte of every message.
const VERSION: u8 = 3;

/// Why bytes could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed kvx message: {0}")]
pub struct DecodeError(pub String);

struct Writer(Vec<u8>);

impl Writer {
    fn new() -> Writer {
        Writer(vec![VERSION])
    }

    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    fn var(&mut self, mut v: u64) {
        loop {
            let byte = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                self.0.push(byte);
                return;
            }
            self.0.push(byte | 0x80);
        }
    }

    fn key(&mut self, k: BlockKey) {
        self.0.extend_from_slice(&k.to_be_bytes());
    }

    fn keys(&mut self, ks: &[BlockKey]) {
        self.var(ks.len() as u64);
        for k in ks {
            self.key(*k);
        }
    }

    fn reqs(&mut self, rs: &[RequestId]) {
        self.var(rs.len() as u64);
        for r in rs {
            self.var(r.0);
        }
    }

    fn text(&mut self, s: &str) {
        self.var(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
    }

    fn blocks(&mut self, bs: &[EngineBlockId]) {
        self.var(bs.len() as u64);
        for b in bs {
            self.var(u64::from(b.0));
        }
    }

    fn keyed(&mut self, bs: &[(BlockKey, EngineBlockId)]) {
        self.var(bs.len() as u64);
        for (k, e) in bs {
            self.key(*k);
            self.var(u64::from(e.0));
        }
    }

    fn flag(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Result<Reader<'a>, DecodeError> {
        match buf.first() {
            Some(&VERSION) => Ok(Reader { buf, pos: 1 }),
            Some(v) => Err(DecodeError(format!(
                "encoding version {v}, this build reads {VERSION}"
            ))),
            None => Err(DecodeError("empty message".into())),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| DecodeError(format!("truncated at byte {}", self.pos)))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn var(&mut self) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            // The tenth byte holds bit 63 only; a last byte 0 after others is not minimal.
            if (shift == 63 && b > 1) || (shift > 0 && b == 0) {
                return Err(DecodeError(format!("bad varint at byte {}", self.pos - 1)));
            }
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError(format!("varint too long at byte {}", self.pos)))
    }

    /// A count of items, each at least `min_bytes` long (bounds allocations by the input).
    fn count(&mut self, min_bytes: usize) -> Result<usize, DecodeError> {
        let n = self.var()? as usize;
        if n.saturating_mul(min_bytes) > self.buf.len() - self.pos {
            return Err(DecodeError(format!("count {n} exceeds the message")));
        }
        Ok(n)
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        u32::try_from(self.var()?).map_err(|_| DecodeError("engine block id overflows".into()))
    }

    fn key(&mut self) -> Result<BlockKey, DecodeError> {
        let b: [u8; 16] = self.take(16)?.try_into().expect("16 bytes");
        Ok(BlockKey::from_be_bytes(b))
    }

    fn keys(&mut self) -> Result<Vec<BlockKey>, DecodeError> {
        let n = self.count(16)?;
        (0..n).map(|_| self.key()).collect()
    }

    fn reqs(&mut self) -> Result<Vec<RequestId>, DecodeError> {
        let n = self.count(1)?;
        (0..n).map(|_| self.var().map(RequestId)).collect()
    }

    fn text(&mut self) -> Result<String, DecodeError> {
        let n = self.count(1)?;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| DecodeError("text is not UTF-8".into()))
    }

    fn blocks(&mut self) -> Result<Vec<EngineBlockId>, DecodeError> {
        let n = self.count(1)?;
        (0..n).map(|_| self.u32().map(EngineBlockId)).collect()
    }

    fn keyed(&mut self) -> Result<Vec<(BlockKey, EngineBlockId)>, DecodeError> {
        let n = self.count(17)?;
        (0..n)
            .map(|_| Ok((self.key()?, EngineBlockId(self.u32()?))))
            .collect()
    }

    fn flag(&mut self, what: &str) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            c => Err(DecodeError(format!("bad {what} flag {c}"))),
        }
    }

    fn done(&self) -> Result<(), DecodeError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(DecodeError(format!(
                "{} trailing bytes",
                self.buf.len() - self.pos
            )))
        }
    }
}

fn tier_code(t: Tier) -> u8 {
    match t {
        Tier::Host => 0,
        Tier::File => 1,
    }
}

fn tier_of(c: u8) -> Result<Tier, DecodeError> {
    match c {
        0 => Ok(Tier::Host),
        1 => Ok(Tier::File),
        _ => Err(DecodeError(format!("unknown tier {c}"))),
    }
}

/// Encode one step's message.
pub fn encode_step(s: &StepMsg) -> Vec<u8> {
    let mut w = Writer::new();
    w.var(s.step);
    write_meta(&mut w, &s.meta);
    w.var(s.names.len() as u64);
    for (r, name) in &s.names {
        w.var(r.0);
        w.text(name);
    }
    w.reqs(&s.loads);
    w.reqs(&s.delayed);
    w.reqs(&s.abandoned);
    w.reqs(&s.in_step);
    w.blocks(&s.fence);
    w.0
}

/// Decode one step's message.
pub fn decode_step(buf: &[u8]) -> Result<StepMsg, DecodeError> {
    let mut r = Reader::new(buf)?;
    let step = r.var()?;
    let meta = read_meta(&mut r)?;
    let n = r.count(2)?;
    let mut names = Vec::with_capacity(n);
    for _ in 0..n {
        let req = RequestId(r.var()?);
        names.push((req, r.text()?));
    }
    let msg = StepMsg {
        step,
        meta,
        names,
        loads: r.reqs()?,
        delayed: r.reqs()?,
        abandoned: r.reqs()?,
        in_step: r.reqs()?,
        fence: r.blocks()?,
    };
    r.done()?;
    Ok(msg)
}

fn write_meta(w: &mut Writer, m: &StepMeta) {
    w.var(m.loads.len() as u64);
    for l in &m.loads {
        w.var(l.job.0);
        w.var(l.request.0);
        w.var(l.blocks.len() as u64);
        for b in &l.blocks {
            w.key(b.key);
            w.var(u64::from(b.engine.0));
            w.u8(tier_code(b.tier) | (u8::from(b.promote) << 1));
        }
    }
    w.var(m.stores.len() as u64);
    for s in &m.stores {
        w.var(s.job.0);
        w.var(s.request.0);
        w.keyed(&s.blocks);
        w.keys(&s.write_file);
        w.keys(&s.file_only);
    }
    w.reqs(&m.preempted);
    w.reqs(&m.finished);
    w.reqs(&m.delayed_free);
    w.var(m.write_back.len() as u64);
    for j in &m.write_back {
        w.var(j.job.0);
        w.keys(&j.keys);
    }
    w.keys(&m.evict_host);
    w.keys(&m.evict_file);
    w.keys(&m.remove_file);
    match &m.retain_host {
        None => w.u8(0),
        Some(keep) => {
            w.u8(1);
            w.keys(keep);
        }
    }
    w.flag(m.submit_stores_now);
    w.var(m.exports.len() as u64);
    for x in &m.exports {
        w.var(x.request.0);
        w.var(x.export);
        w.keyed(&x.blocks);
    }
    w.var(m.remote_loads.len() as u64);
    for l in &m.remote_loads {
        w.var(l.job.0);
        w.var(l.request.0);
        w.text(&l.source.to_json());
        w.var(l.blocks.len() as u64);
        for (i, e) in &l.blocks {
            w.var(u64::from(*i));
            w.var(u64::from(e.0));
        }
    }
}

fn read_meta(r: &mut Reader<'_>) -> Result<StepMeta, DecodeError> {
    let mut m = StepMeta::default();
    for _ in 0..r.count(3)? {
        let job = JobId(r.var()?);
        let request = RequestId(r.var()?);
        let n = r.count(18)?;
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            let key = r.key()?;
            let engine = EngineBlockId(r.u32()?);
            let flags = r.u8()?;
            blocks.push(LoadBlock {
                key,
                engine,
                tier: tier_of(flags & 1)?,
                promote: flags & 2 != 0,
            });
        }
        m.loads.push(LoadJob {
            job,
            request,
            blocks,
        });
    }
    for _ in 0..r.count(4)? {
        let job = JobId(r.var()?);
        let request = RequestId(r.var()?);
        let blocks = r.keyed()?;
        let write_file = r.keys()?;
        let file_only = r.keys()?;
        m.stores.push(StoreJob {
            job,
            request,
            blocks,
            write_file,
            file_only,
        });
    }
    m.preempted = r.reqs()?;
    m.finished = r.reqs()?;
    m.delayed_free = r.reqs()?;
    for _ in 0..r.count(2)? {
        let job = JobId(r.var()?);
        m.write_back.push(WriteBackJob {
            job,
            keys: r.keys()?,
        });
    }
    m.evict_host = r.keys()?;
    m.evict_file = r.keys()?;
    m.remove_file = r.keys()?;
    m.retain_host = match r.flag("retain")? {
        false => None,
        true => Some(r.keys()?),
    };
    m.submit_stores_now = r.flag("submit-now")?;
    for _ in 0..r.count(3)? {
        let request = RequestId(r.var()?);
        let export = r.var()?;
        let blocks = r.keyed()?;
        m.exports.push(ExportJob {
            request,
            export,
            blocks,
        });
    }
    for _ in 0..r.count(4)? {
        let job = JobId(r.var()?);
        let request = RequestId(r.var()?);
        let source = RemoteSource::from_json(&r.text()?)
            .map_err(|e| DecodeError(format!("remote load source: {e}")))?;
        let n = r.count(2)?;
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..n {
            let index = r.u32()?;
            blocks.push((index, EngineBlockId(r.u32()?)));
        }
        m.remote_loads.push(RemoteLoadJob {
            job,
            request,
            source: std::sync::Arc::new(source),
            blocks,
        });
    }
    Ok(m)
}

fn part_code(k: JobPart) -> u8 {
    match k {
        JobPart::Load => 0,
        JobPart::StoreHost => 1,
        JobPart::StoreFile => 2,
    }
}

fn part_of(c: u8) -> Result<JobPart, DecodeError> {
    match c {
        0 => Ok(JobPart::Load),
        1 => Ok(JobPart::StoreHost),
        2 => Ok(JobPart::StoreFile),
        _ => Err(DecodeError(format!("unknown job part {c}"))),
    }
}

fn write_error(w: &mut Writer, e: &BlockError) {
    let (code, text) = match e {
        BlockError::NotFound => (0, ""),
        BlockError::Corrupt(s) => (1, s.as_str()),
        BlockError::Io(s) => (2, s.as_str()),
        BlockError::TimedOut => (3, ""),
        BlockError::Cancelled => (4, ""),
        BlockError::Unavailable(s) => (5, s.as_str()),
        BlockError::Invalid(s) => (6, s.as_str()),
        BlockError::Remote(s) => (7, s.as_str()),
    };
    w.u8(code);
    w.text(text);
}

fn read_error(r: &mut Reader<'_>) -> Result<BlockError, DecodeError> {
    let code = r.u8()?;
    let text = r.text()?;
    Ok(match code {
        0 => BlockError::NotFound,
        1 => BlockError::Corrupt(text),
        2 => BlockError::Io(text),
        3 => BlockError::TimedOut,
        4 => BlockError::Cancelled,
        5 => BlockError::Unavailable(text),
        6 => BlockError::Invalid(text),
        7 => BlockError::Remote(text),
        c => return Err(DecodeError(format!("unknown block error {c}"))),
    })
}

/// Encode the job outcomes worker `rank` (its global rank; 0 for a single worker) reports to
/// the scheduler side.
pub fn encode_jobs(rank: u32, jobs: &[JobResult]) -> Vec<u8> {
    let mut w = Writer::new();
    w.var(u64::from(rank));
    w.var(jobs.len() as u64);
    for j in jobs {
        w.var(j.job.0);
        w.var(j.request.0);
        w.u8(part_code(j.part));
        w.keys(&j.ok);
        w.var(j.failed.len() as u64);
        for (k, e) in &j.failed {
            w.key(*k);
            write_error(&mut w, e);
        }
        w.keys(&j.promoted);
    }
    w.0
}

/// Decode job outcomes: the reporting worker's rank, and its results.
pub fn decode_jobs(buf: &[u8]) -> Result<(u32, Vec<JobResult>), DecodeError> {
    let mut r = Reader::new(buf)?;
    let rank = u32::try_from(r.var()?).map_err(|_| DecodeError("rank overflows".into()))?;
    let n = r.count(6)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let job = JobId(r.var()?);
        let request = RequestId(r.var()?);
        let part = part_of(r.u8()?)?;
        let ok = r.keys()?;
        let nf = r.count(18)?;
        let mut failed = Vec::with_capacity(nf);
        for _ in 0..nf {
            let k = r.key()?;
            failed.push((k, read_error(&mut r)?));
        }
        let promoted = r.keys()?;
        out.push(JobResult {
            job,
            request,
            part,
            ok,
            failed,
            promoted,
        });
    }
    r.done()?;
    Ok((rank, out))
}

#[cfg(test)]
mod tests;
