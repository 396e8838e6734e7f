//! Engine memory on a CUDA device (a GPU, or the CPU stand-in for the driver) for the
//! connector rig: the same host-tier scenarios as `tests/connector.rs`, with the engine tier
//! on kvx-cuda.

use std::path::Path;

use kvx_core::{EngineBlockId, KvLayout, MemoryKind, Region};
use kvx_cuda::{CudaDevice, DeviceMem};
use kvx_cuda_standin::control::Standin;
use kvx_offload::{EngineMemory, OffloadBuilder};
use libtest_mimic::Failed;

use crate::common::{BLOCK, ENGINE_BLOCKS, EngineBlocks, Opts, Rig};

/// The device a trial runs on, and the stand-in's knobs when the driver is the stand-in.
#[derive(Clone)]
pub struct Gpu {
    pub dev: CudaDevice,
    pub standin: Option<Standin>,
}

/// Engine blocks in device memory: 2 regions (K and V) of `BLOCK / 2` segments, as a
/// per-layer engine lays them out.
pub struct DeviceArena {
    mem: DeviceMem,
    layout: KvLayout,
}

impl DeviceArena {
    /// `ENGINE_BLOCKS` blocks of device memory on `dev`.
    pub fn new(dev: &CudaDevice) -> Result<DeviceArena, Failed> {
        let seg = BLOCK / 2;
        let region = seg * ENGINE_BLOCKS as usize;
        let mem = dev.alloc(2 * region)?;
        let regions = (0..2)
            .map(|r| Region {
                base: mem.ptr() as usize + r * region,
                kind: MemoryKind::Cuda(dev.ordinal()),
                stride: seg,
                segment_len: seg,
            })
            .collect();
        let layout = KvLayout::new(regions, ENGINE_BLOCKS)?;
        Ok(DeviceArena { mem, layout })
    }

    /// The engine layout of these blocks.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn offset(&self, addr: usize) -> usize {
        addr - self.mem.ptr() as usize
    }
}

impl EngineBlocks for DeviceArena {
    fn write_block(&mut self, b: EngineBlockId, data: &[u8]) -> Result<(), String> {
        let mut pos = 0;
        for (addr, len) in self.layout.segments(b).map_err(|e| e.to_string())? {
            self.mem
                .write(self.offset(addr), &data[pos..pos + len])
                .map_err(|e| e.to_string())?;
            pos += len;
        }
        Ok(())
    }

    fn read_block(&self, b: EngineBlockId) -> Result<Vec<u8>, String> {
        let mut out = Vec::with_capacity(self.layout.block_bytes());
        for (addr, len) in self.layout.segments(b).map_err(|e| e.to_string())? {
            let mut seg = vec![0u8; len];
            self.mem
                .read(self.offset(addr), &mut seg)
                .map_err(|e| e.to_string())?;
            out.extend_from_slice(&seg);
        }
        Ok(out)
    }
}

/// A builder-made connector whose engine memory is on `gpu` (each block filled with 0xAB) and
/// whose file tier is in `dir`. On the stand-in every engine copy takes `o.host_delay` (its
/// delay knob); a real GPU is as fast as it is.
pub fn cuda_rig(dir: &Path, o: Opts, gpu: &Gpu) -> Result<Rig<DeviceArena>, Failed> {
    let mut arena = DeviceArena::new(&gpu.dev)?;
    for b in 0..ENGINE_BLOCKS {
        arena.write_block(EngineBlockId(b), &vec![0xAB; BLOCK])?;
    }
    if let Some(s) = &gpu.standin {
        s.set_copy_delay(gpu.dev.ordinal(), o.host_delay);
    }
    // SAFETY: the device memory outlives the runtime (Rig drops the runtime before its arena);
    // the tests touch engine blocks only when no load or store on them is in flight, and
    // "compute" a block (a synchronous write) before they save it.
    let memory = unsafe { EngineMemory::cuda(&gpu.dev, arena.layout.clone()) };
    let offload = OffloadBuilder::new(o.config(dir), memory).build()?;
    Ok(Rig::new(offload, arena))
}
