//! The builder with engine memory on a CUDA device: a block stored to the host tier and the
//! file tier loads back byte-exact into another device block. Needs a GPU; elsewhere it prints
//! one `skip:` line and counts as ignored. Run with `--features cuda`.

use std::time::Duration;

use kvx_core::{BlockKey, EngineBlockId, KvLayout, MemoryKind, RequestId};
use kvx_cuda::CudaDevice;
use kvx_offload::{EngineMemory, FileTierConfig, Offload, OffloadBuilder, OffloadConfig};
use libtest_mimic::{Arguments, Failed, Trial};

const BLOCK: usize = 64 << 10;
const BLOCKS: u32 = 16;

fn round_trip(device: CudaDevice) -> Result<(), Failed> {
    let dir = tempfile::tempdir()?;
    let mem = device.alloc(BLOCK * BLOCKS as usize)?;
    let layout = KvLayout::contiguous(mem.ptr() as usize, MemoryKind::Cuda(0), BLOCK, BLOCKS)?;
    let cfg = OffloadConfig {
        host_blocks: 4,
        file: Some(FileTierConfig::new(dir.path(), 64)),
        ..OffloadConfig::default()
    };
    // SAFETY: `mem` outlives the runtime (shut down below); blocks are read or written only
    // when no op on them is out.
    let memory = unsafe { EngineMemory::cuda(&device, layout) };
    let Offload {
        scheduler: mut sched,
        mut worker,
        runtime,
    } = OffloadBuilder::new(cfg, memory).build()?;
    let data: Vec<u8> = (0..BLOCK).map(|i| (i * 7 % 251) as u8).collect();
    mem.write(3 * BLOCK, &data)?;
    let key = BlockKey::chain(None, b"gpu block");
    sched.save_blocks(RequestId(1), &[(key, EngineBlockId(3))]);
    sched.request_finished(RequestId(1));
    assert!(worker.start_step(sched.build_meta())?.fence().is_none());
    let out = worker.drain(Duration::from_secs(10))?;
    sched.update_from_worker(&out);
    if sched.get_num_new_matched_tokens(RequestId(2), &[key], 0) != Some(16) {
        return Err("the stored block is not found".into());
    }
    sched.update_state_after_alloc(RequestId(2), &[EngineBlockId(9)])?;
    assert!(worker.start_step(sched.build_meta())?.fence().is_none());
    let out = worker.drain(Duration::from_secs(10))?;
    if out.finished_recving != vec![RequestId(2)] || !out.invalid_blocks.is_empty() {
        return Err(format!("load did not finish cleanly: {out:?}").into());
    }
    runtime.shutdown();
    let mut back = vec![0u8; BLOCK];
    mem.read(9 * BLOCK, &mut back)?;
    if back != data {
        return Err("the loaded device block differs".into());
    }
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    let device = CudaDevice::open(0);
    if let Err(e) = &device {
        println!("skip: cuda_round_trip: {e}");
    }
    let ignored = device.is_err();
    let trials = vec![
        Trial::test("cuda_round_trip", move || match device {
            Ok(d) => round_trip(d),
            Err(e) => Err(e.to_string().into()),
        })
        .with_ignored_flag(ignored),
    ];
    libtest_mimic::run(&args, trials).exit();
}
