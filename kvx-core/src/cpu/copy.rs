//! The only code in kvx-core that dereferences engine memory.
//!
//! SAFETY rule relied on by both functions: the caller (the CPU backend) holds the op that
//! names `block`, and the engine, by registering the layout through the `unsafe`
//! `CpuBackend::new`, promised that every region is valid host memory for reads and writes
//! for as long as the backend lives, and that it does not touch a block while an op on it is
//! outstanding (it waits for the fences kvx gives it). So for the duration of the copy, the
//! block's segments are exclusively ours.

use crate::ids::EngineBlockId;
use crate::layout::KvLayout;
use crate::op::BlockError;

fn segments(
    layout: &KvLayout,
    block: EngineBlockId,
    len: usize,
) -> Result<impl Iterator<Item = (usize, usize)> + '_, BlockError> {
    if len < layout.block_bytes() {
        return Err(BlockError::Invalid(format!(
            "buffer holds {len} bytes, block {block} needs {}",
            layout.block_bytes()
        )));
    }
    layout
        .segments(block)
        .map_err(|e| BlockError::Invalid(e.to_string()))
}

/// Copy `src` (a block's segments concatenated) into engine block `block`.
pub(crate) fn to_engine(
    layout: &KvLayout,
    block: EngineBlockId,
    src: &[u8],
) -> Result<(), BlockError> {
    let mut pos = 0;
    for (addr, len) in segments(layout, block, src.len())? {
        // SAFETY: see the module docs: `addr..addr+len` is a registered, live host segment of
        // `block`, which only this op may access now; `src` is a distinct kvx-owned buffer of at
        // least `pos + len` bytes (checked by `segments`).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(pos), addr as *mut u8, len) };
        pos += len;
    }
    Ok(())
}

/// Copy engine block `block` into `dst` (segments concatenated); returns the bytes written.
pub(crate) fn from_engine(
    layout: &KvLayout,
    block: EngineBlockId,
    dst: &mut [u8],
) -> Result<usize, BlockError> {
    let mut pos = 0;
    for (addr, len) in segments(layout, block, dst.len())? {
        // SAFETY: as in `to_engine`; `dst` is a distinct kvx-owned buffer exclusively borrowed.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, dst.as_mut_ptr().add(pos), len) };
        pos += len;
    }
    Ok(pos)
}
