//! Property tests of the codec: every message round-trips, and no input, however damaged,
//! panics the decoder or decodes into something other than what was encoded.

use std::net::SocketAddr;
use std::sync::Arc;

use kvx_core::{BlockError, BlockKey, EngineBlockId, RequestId};
use kvx_offload::{
    ExportJob, JobId, JobPart, JobResult, LoadBlock, LoadJob, RemoteLoadJob, RemoteSource,
    StepMeta, StoreJob, Tier, WriteBackJob,
};
use proptest::collection::vec;
use proptest::prelude::*;

use super::{decode_jobs, decode_step, encode_jobs, encode_step};
use crate::step::StepMsg;

fn key() -> impl Strategy<Value = BlockKey> {
    any::<u128>().prop_map(BlockKey)
}

fn keys() -> impl Strategy<Value = Vec<BlockKey>> {
    vec(key(), 0..4)
}

fn req() -> impl Strategy<Value = RequestId> {
    any::<u64>().prop_map(RequestId)
}

fn block() -> impl Strategy<Value = EngineBlockId> {
    any::<u32>().prop_map(EngineBlockId)
}

fn keyed_blocks() -> impl Strategy<Value = Vec<(BlockKey, EngineBlockId)>> {
    vec((key(), block()), 0..4)
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::Host), Just(Tier::File)]
}

fn load() -> impl Strategy<Value = LoadJob> {
    let b = (key(), block(), tier(), any::<bool>()).prop_map(|(key, engine, tier, promote)| {
        LoadBlock {
            key,
            engine,
            tier,
            promote,
        }
    });
    (any::<u64>(), req(), vec(b, 0..4)).prop_map(|(j, request, blocks)| LoadJob {
        job: JobId(j),
        request,
        blocks,
    })
}

fn store() -> impl Strategy<Value = StoreJob> {
    (any::<u64>(), req(), keyed_blocks(), keys(), keys()).prop_map(
        |(j, request, blocks, write_file, file_only)| StoreJob {
            job: JobId(j),
            request,
            blocks,
            write_file,
            file_only,
        },
    )
}

fn source() -> impl Strategy<Value = RemoteSource> {
    (
        "[a-z0-9|=]{0,12}",
        any::<u64>(),
        // As JSON carries them: an IPv6 address's flow label is not part of its text.
        vec(
            any::<SocketAddr>().prop_map(|mut a| {
                if let SocketAddr::V6(v6) = &mut a {
                    v6.set_flowinfo(0);
                }
                a
            }),
            1..3,
        ),
        vec(key(), 1..4),
        2..u64::MAX,
    )
        .prop_map(
            |(namespace, export, producers, keys, ttl_ms)| RemoteSource {
                namespace,
                export,
                producers,
                keys,
                ttl_ms,
                heartbeat_ms: ttl_ms / 2,
            },
        )
}

fn remote_load() -> impl Strategy<Value = RemoteLoadJob> {
    (
        any::<u64>(),
        req(),
        source(),
        vec((any::<u32>(), block()), 0..4),
    )
        .prop_map(|(j, request, source, blocks)| RemoteLoadJob {
            job: JobId(j),
            request,
            source: Arc::new(source),
            blocks,
        })
}

fn meta() -> impl Strategy<Value = StepMeta> {
    let jobs = (
        vec(load(), 0..3),
        vec(store(), 0..3),
        vec((any::<u64>(), keys()), 0..2),
        vec((req(), any::<u64>(), keyed_blocks()), 0..2),
        vec(remote_load(), 0..2),
    );
    let lists = (
        vec(req(), 0..3),
        vec(req(), 0..3),
        vec(req(), 0..3),
        keys(),
        keys(),
        keys(),
        proptest::option::of(keys()),
        any::<bool>(),
    );
    (jobs, lists).prop_map(
        |(
            (loads, stores, write_back, exports, remote_loads),
            (preempted, finished, delayed_free, evict_host, evict_file, remove_file, retain, now),
        )| StepMeta {
            loads,
            stores,
            preempted,
            finished,
            delayed_free,
            write_back: write_back
                .into_iter()
                .map(|(j, keys)| WriteBackJob {
                    job: JobId(j),
                    keys,
                })
                .collect(),
            evict_host,
            evict_file,
            remove_file,
            retain_host: retain,
            exports: exports
                .into_iter()
                .map(|(request, export, blocks)| ExportJob {
                    request,
                    export,
                    blocks,
                })
                .collect(),
            remote_loads,
            submit_stores_now: now,
        },
    )
}

fn step() -> impl Strategy<Value = StepMsg> {
    (
        any::<u64>(),
        meta(),
        vec((req(), "\\PC{0,8}"), 0..3),
        vec(req(), 0..3),
        vec(req(), 0..3),
        vec(req(), 0..3),
        vec(req(), 0..3),
        vec(block(), 0..3),
    )
        .prop_map(
            |(step, meta, names, loads, delayed, abandoned, in_step, fence)| StepMsg {
                step,
                meta,
                names,
                loads,
                delayed,
                abandoned,
                in_step,
                fence,
            },
        )
}

fn error() -> impl Strategy<Value = BlockError> {
    let text = "\\PC{0,6}";
    prop_oneof![
        Just(BlockError::NotFound),
        text.prop_map(BlockError::Corrupt),
        text.prop_map(BlockError::Io),
        Just(BlockError::TimedOut),
        Just(BlockError::Cancelled),
        text.prop_map(BlockError::Unavailable),
        text.prop_map(BlockError::Invalid),
        text.prop_map(BlockError::Remote),
    ]
}

fn result() -> impl Strategy<Value = JobResult> {
    let part = prop_oneof![
        Just(JobPart::Load),
        Just(JobPart::StoreHost),
        Just(JobPart::StoreFile)
    ];
    (
        any::<u64>(),
        req(),
        part,
        keys(),
        vec((key(), error()), 0..3),
        keys(),
    )
        .prop_map(|(j, request, part, ok, failed, promoted)| JobResult {
            job: JobId(j),
            request,
            part,
            ok,
            failed,
            promoted,
        })
}

proptest! {
    #[test]
    fn a_step_round_trips(msg in step()) {
        prop_assert_eq!(decode_step(&encode_step(&msg)).unwrap(), msg);
    }

    #[test]
    fn job_results_round_trip(rank in any::<u32>(), jobs in vec(result(), 0..4)) {
        prop_assert_eq!(decode_jobs(&encode_jobs(rank, &jobs)).unwrap(), (rank, jobs));
    }

    #[test]
    fn every_cut_is_an_error(
        msg in step(),
        rank in any::<u32>(),
        jobs in vec(result(), 0..3),
        cut in any::<prop::sample::Index>(),
    ) {
        let bytes = encode_step(&msg);
        prop_assert!(decode_step(&bytes[..cut.index(bytes.len())]).is_err());
        let bytes = encode_jobs(rank, &jobs);
        prop_assert!(decode_jobs(&bytes[..cut.index(bytes.len())]).is_err());
    }

    #[test]
    fn a_damaged_message_never_panics(
        msg in step(),
        jobs in vec(result(), 0..3),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        // Either an error, or a well-formed message (it round-trips as any other).
        let mut bytes = encode_step(&msg);
        let i = at.index(bytes.len());
        bytes[i] = byte;
        if let Ok(m) = decode_step(&bytes) {
            prop_assert_eq!(decode_step(&encode_step(&m)).unwrap(), m);
        }
        let mut bytes = encode_jobs(0, &jobs);
        let i = at.index(bytes.len());
        bytes[i] = byte;
        if let Ok((rank, jobs)) = decode_jobs(&bytes) {
            prop_assert_eq!(decode_jobs(&encode_jobs(rank, &jobs)).unwrap(), (rank, jobs));
        }
    }

    #[test]
    fn garbage_never_panics(bytes in vec(any::<u8>(), 0..256)) {
        if let Ok(m) = decode_step(&bytes) {
            prop_assert_eq!(decode_step(&encode_step(&m)).unwrap(), m);
        }
        if let Ok((rank, jobs)) = decode_jobs(&bytes) {
            prop_assert_eq!(decode_jobs(&encode_jobs(rank, &jobs)).unwrap(), (rank, jobs));
        }
    }
}

#[test]
fn another_version_is_named() {
    let mut bytes = encode_step(&StepMsg::default());
    bytes[0] = 2;
    let e = decode_step(&bytes).unwrap_err().to_string();
    assert!(e.contains("version 2"), "{e}");
    assert!(decode_step(&[]).is_err());
}
