//! The copy planner: engine blocks + host buffers → the fewest copy runs. Pure functions, no
//! CUDA, tested exhaustively on the CPU.
//!
//! A block's bytes in a buffer are its segments concatenated in region order (kvx-core's
//! layout rule), so each `(block, region)` pair is one piece: device `base + i * stride`, host
//! `buffer + offset of the region`. Pieces are sorted by device address and neighbours that are
//! contiguous on **both** sides are merged: adjacent engine blocks copied into adjacent buffer
//! ranges become one run, and so do a block's K and V segments when the engine interleaves them.
//! What is left is handed to one batched copy call (see `stream.rs`), so 1,000 scattered blocks
//! are one driver call, not 1,000.

use kvx_core::{CoreError, EngineBlockId, KvLayout};

/// One copy between device memory and host memory (direction decided by the op).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Run {
    /// Device address.
    pub dev: u64,
    /// Host address.
    pub host: usize,
    /// Bytes.
    pub len: usize,
}

impl Run {
    fn dev_end(&self) -> u64 {
        self.dev + self.len as u64
    }

    fn host_end(&self) -> usize {
        self.host + self.len
    }
}

/// The pieces of `blocks` (`(engine block, host address of its buffer)`), one per block and
/// region, in block order then region order. Fails on a block outside the layout.
pub fn pieces(layout: &KvLayout, blocks: &[(EngineBlockId, usize)]) -> Result<Vec<Run>, CoreError> {
    let mut out = Vec::with_capacity(blocks.len() * layout.regions().len());
    for &(block, host) in blocks {
        let mut off = 0usize;
        for (addr, len) in layout.segments(block)? {
            out.push(Run {
                dev: addr as u64,
                host: host + off,
                len,
            });
            off += len;
        }
    }
    Ok(out)
}

/// Sort `runs` by device address and merge neighbours contiguous on both sides.
///
/// The result copies exactly the same bytes to the same places; no two consecutive runs of it
/// could be merged.
pub fn coalesce(mut runs: Vec<Run>) -> Vec<Run> {
    runs.sort_unstable();
    let mut out: Vec<Run> = Vec::with_capacity(runs.len());
    for r in runs {
        if r.len == 0 {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.dev_end() == r.dev && last.host_end() == r.host => last.len += r.len,
            _ => out.push(r),
        }
    }
    out
}

/// Fewest runs one stream gets when an op's runs are spread over several streams: fewer are
/// not worth the extra event.
pub const MIN_RUNS_PER_STREAM: usize = 32;

/// How many parts [`spread`] cuts `runs` runs into over `streams` streams.
pub fn part_count(runs: usize, streams: usize) -> usize {
    if runs == 0 {
        return 0;
    }
    (runs / MIN_RUNS_PER_STREAM).clamp(1, streams.max(1))
}

/// `runs` cut into `min(streams, runs / MIN_RUNS_PER_STREAM)` consecutive parts (at least one)
/// whose counts differ by at most one, so each part but a lone one has at least
/// [`MIN_RUNS_PER_STREAM`] runs. A copy engine works through one stream's copies one at a
/// time, paying a fixed cost per copy beside the bytes; parts on separate streams are copied
/// side by side. No runs, no parts.
pub fn spread(runs: &[Run], streams: usize) -> Vec<&[Run]> {
    let parts = part_count(runs.len(), streams);
    if parts == 0 {
        return Vec::new();
    }
    let (base, longer) = (runs.len() / parts, runs.len() % parts);
    let mut out = Vec::with_capacity(parts);
    let mut rest = runs;
    for i in 0..parts {
        let (part, tail) = rest.split_at(base + usize::from(i < longer));
        out.push(part);
        rest = tail;
    }
    out
}

/// `coalesce(pieces(..))`: the runs for an op.
pub fn plan(layout: &KvLayout, blocks: &[(EngineBlockId, usize)]) -> Result<Vec<Run>, CoreError> {
    Ok(coalesce(pieces(layout, blocks)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvx_core::{MemoryKind, Region};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    const DEV: u64 = 0x7f00_0000_0000;

    fn cross(block: usize, n: u32) -> KvLayout {
        KvLayout::contiguous(DEV as usize, MemoryKind::Cuda(0), block, n).unwrap()
    }

    fn blk(i: u32) -> EngineBlockId {
        EngineBlockId(i)
    }

    #[test]
    fn spread_keeps_every_run_once_in_order_and_small_ops_whole() {
        let runs: Vec<Run> = (0..2000u64)
            .map(|i| Run {
                dev: i * 4096,
                host: (1999 - i as usize) * 4096,
                len: 64,
            })
            .collect();
        let cases = [
            (1000, 8, 8),
            (1000, 1, 1),
            (63, 8, 1),
            (64, 8, 2),
            (257, 8, 8),
            (1089, 34, 34),
            (1999, 100, 62),
            (0, 8, 0),
        ];
        for (n, streams, want_parts) in cases {
            let parts = spread(&runs[..n], streams);
            assert_eq!(parts.len(), want_parts, "{n} runs over {streams} streams");
            if want_parts > 1 {
                assert!(
                    parts.iter().all(|p| p.len() >= MIN_RUNS_PER_STREAM),
                    "{n} runs over {streams} streams: a part under the minimum"
                );
            }
            let (lo, hi) = parts.iter().fold((usize::MAX, 0), |(lo, hi), p| {
                (lo.min(p.len()), hi.max(p.len()))
            });
            assert!(
                want_parts == 0 || hi - lo <= 1,
                "{n} runs: parts of {lo}..{hi}"
            );
            let joined: Vec<Run> = parts.concat();
            assert_eq!(
                joined,
                runs[..n].to_vec(),
                "{n} runs over {streams} streams"
            );
        }
    }

    #[test]
    fn adjacent_blocks_into_adjacent_buffers_are_one_run() {
        let l = cross(64, 16);
        let blocks: Vec<_> = (4..12)
            .map(|i| (blk(i), 0x10_0000 + (i as usize - 4) * 64))
            .collect();
        assert_eq!(
            plan(&l, &blocks).unwrap(),
            vec![Run {
                dev: DEV + 4 * 64,
                host: 0x10_0000,
                len: 8 * 64
            }]
        );
    }

    #[test]
    fn adjacent_blocks_into_scattered_buffers_stay_separate() {
        let l = cross(64, 16);
        let blocks: Vec<_> = (0..4)
            .map(|i| (blk(i), 0x10_0000 + i as usize * 4096))
            .collect();
        let runs = plan(&l, &blocks).unwrap();
        assert_eq!(runs.len(), 4);
        assert!(runs.iter().all(|r| r.len == 64));
    }

    #[test]
    fn order_of_blocks_in_the_op_does_not_matter() {
        let l = cross(64, 16);
        // Blocks 7, 5, 6 with buffers laid out in block order: one run after sorting.
        let blocks = [(blk(7), 0x2080), (blk(5), 0x2000), (blk(6), 0x2040)];
        assert_eq!(
            plan(&l, &blocks).unwrap(),
            vec![Run {
                dev: DEV + 5 * 64,
                host: 0x2000,
                len: 192
            }]
        );
    }

    #[test]
    fn per_layer_blocks_are_one_run_per_region_when_not_contiguous() {
        // 3 layers, 32-byte segments, stride 32: block i of layer l at base_l + 32 i.
        let regions = (0..3u64)
            .map(|l| Region {
                base: (DEV + l * 0x10000) as usize,
                kind: MemoryKind::Cuda(0),
                stride: 32,
                segment_len: 32,
            })
            .collect();
        let l = KvLayout::new(regions, 8).unwrap();
        let runs = plan(&l, &[(blk(2), 0x9000)]).unwrap();
        assert_eq!(
            runs,
            vec![
                Run {
                    dev: DEV + 64,
                    host: 0x9000,
                    len: 32
                },
                Run {
                    dev: DEV + 0x10000 + 64,
                    host: 0x9020,
                    len: 32
                },
                Run {
                    dev: DEV + 0x20000 + 64,
                    host: 0x9040,
                    len: 32
                },
            ]
        );
    }

    #[test]
    fn interleaved_k_and_v_of_a_block_merge() {
        // K at base, V at base + 16, stride 32: a block's K and V are adjacent on the device.
        let k = Region {
            base: DEV as usize,
            kind: MemoryKind::Cuda(0),
            stride: 32,
            segment_len: 16,
        };
        let v = Region {
            base: DEV as usize + 16,
            ..k
        };
        let l = KvLayout::new(vec![k, v], 8).unwrap();
        let runs = plan(&l, &[(blk(3), 0x4000), (blk(4), 0x4020)]).unwrap();
        assert_eq!(
            runs,
            vec![Run {
                dev: DEV + 96,
                host: 0x4000,
                len: 64
            }]
        );
    }

    #[test]
    fn out_of_range_block_is_an_error() {
        let l = cross(64, 4);
        assert!(matches!(
            plan(&l, &[(blk(4), 0x1000)]),
            Err(CoreError::BlockOutOfRange { .. })
        ));
    }

    /// Every (device byte → host byte) pair the runs copy.
    fn byte_map(runs: &[Run]) -> BTreeMap<u64, usize> {
        let mut m = BTreeMap::new();
        for r in runs {
            for k in 0..r.len {
                assert!(
                    m.insert(r.dev + k as u64, r.host + k).is_none(),
                    "device byte copied twice"
                );
            }
        }
        m
    }

    fn layout_strategy() -> impl Strategy<Value = KvLayout> {
        // 1..=3 regions; segment 1..=8 bytes; stride = segment or segment + gap; regions far apart
        // or interleaved (region r at base + r * segment with stride = regions * segment).
        (1usize..=3, 1usize..=8, 0usize..=4, any::<bool>(), 2u32..=24).prop_map(
            |(nreg, seg, gap, interleave, nblocks)| {
                let regions = (0..nreg)
                    .map(|r| {
                        if interleave {
                            Region {
                                base: DEV as usize + r * seg,
                                kind: MemoryKind::Cuda(0),
                                stride: nreg * seg,
                                segment_len: seg,
                            }
                        } else {
                            Region {
                                base: DEV as usize + r * 0x100000,
                                kind: MemoryKind::Cuda(0),
                                stride: seg + gap,
                                segment_len: seg,
                            }
                        }
                    })
                    .collect();
                KvLayout::new(regions, nblocks).unwrap()
            },
        )
    }

    proptest! {
        #[test]
        fn coalesced_runs_copy_exactly_the_same_bytes_and_are_maximal(
            layout in layout_strategy(),
            picks in proptest::collection::vec((any::<u32>(), any::<bool>()), 0..24),
        ) {
            // Distinct blocks; each buffer either follows the previous one directly (contiguous
            // host memory) or sits on its own page.
            let bb = layout.block_bytes();
            let mut seen = std::collections::HashSet::new();
            let mut blocks = Vec::new();
            let mut host = 0x40_0000usize;
            for (b, adjacent) in picks {
                let b = b % layout.num_blocks();
                if !seen.insert(b) { continue; }
                if !adjacent { host = (host + 4096) & !4095; }
                blocks.push((blk(b), host));
                host += bb;
            }
            let pieces = pieces(&layout, &blocks).unwrap();
            let runs = coalesce(pieces.clone());
            prop_assert_eq!(byte_map(&runs), byte_map(&pieces));
            prop_assert!(runs.len() <= pieces.len());
            for w in runs.windows(2) {
                prop_assert!(w[0].dev < w[1].dev, "sorted by device address");
                prop_assert!(
                    !(w[0].dev_end() == w[1].dev && w[0].host_end() == w[1].host),
                    "two mergeable runs left: {:?}", w
                );
            }
        }
    }

    #[test]
    fn exhaustive_subsets_of_six_blocks_with_contiguous_buffers() {
        // Every subset of 6 blocks, buffers packed in block order: runs = maximal streaks of
        // consecutive block ids.
        let l = cross(16, 6);
        for mask in 0u32..64 {
            let ids: Vec<u32> = (0..6).filter(|i| mask & (1 << i) != 0).collect();
            let blocks: Vec<_> = ids
                .iter()
                .map(|&i| (blk(i), 0x1000 + i as usize * 16))
                .collect();
            let runs = plan(&l, &blocks).unwrap();
            let streaks = ids
                .iter()
                .enumerate()
                .filter(|&(k, &i)| k == 0 || ids[k - 1] + 1 != i)
                .count();
            assert_eq!(runs.len(), streaks, "mask {mask:06b}");
            assert_eq!(runs.iter().map(|r| r.len).sum::<usize>(), ids.len() * 16);
        }
    }
}
