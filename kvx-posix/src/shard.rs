//! Sharded stores: the file tier of an engine whose KV cache is split over several workers
//! (tensor-parallel ranks hold some heads of every layer, pipeline-parallel ranks some layers).
//!
//! Each worker keeps its part of a block (its *shard*) in a directory of its own under each root:
//! `root/shard-tp<t>of<T>-pp<p>of<P>/ab/<32 hex>.kvb`. Inside a shard directory the layout is a
//! plain store's (a [`crate::PosixStore`] opened on the shard directories as its roots), and the
//! file name is the logical block's key in every shard, so:
//!
//! - a logical block is complete when every shard directory of its set (`T × P` of them) holds
//!   its file, which a listing of names shows without reading a byte;
//! - each shard file checks itself as any block does (its header names its key, its payload has
//!   its checksum), so `verify` of a shard directory is `verify` of a store;
//! - the shards of one key sit under the same root (a key picks its root the same way in every
//!   shard), and an engine of another parallel layout (another `T × P`) never reads them: its
//!   directories have other names (and its keys another namespace).
//!
//! Keys derived per shard (one directory, a different key per shard) would hide which files
//! make up one block: completeness could not be seen from names, and `gc` could not remove a
//! block's shards together.

use std::path::{Path, PathBuf};

/// A worker's place in the parallel layout: which shard of each block it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shard {
    /// Tensor-parallel rank (`0..tp_size`).
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline-parallel rank (`0..pp_size`).
    pub pp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
}

/// The prefix of a shard directory's name.
const PREFIX: &str = "shard-";

impl Shard {
    /// A shard; an out-of-range rank or a zero size is refused with a reason.
    pub fn new(tp_rank: u32, tp_size: u32, pp_rank: u32, pp_size: u32) -> Result<Shard, String> {
        if tp_size == 0 || pp_size == 0 {
            return Err(format!(
                "parallel sizes must be at least 1 (tensor {tp_size}, pipeline {pp_size})"
            ));
        }
        if tp_rank >= tp_size || pp_rank >= pp_size {
            return Err(format!(
                "rank tp {tp_rank} / pp {pp_rank} outside sizes tp {tp_size} / pp {pp_size}"
            ));
        }
        Ok(Shard {
            tp_rank,
            tp_size,
            pp_rank,
            pp_size,
        })
    }

    /// Every shard of a `tp_size × pp_size` layout, in rank order.
    pub fn all(tp_size: u32, pp_size: u32) -> Vec<Shard> {
        (0..pp_size)
            .flat_map(|p| (0..tp_size).map(move |t| (t, p)))
            .filter_map(|(t, p)| Shard::new(t, tp_size, p, pp_size).ok())
            .collect()
    }

    /// Workers in the layout (`tp_size × pp_size`).
    pub fn world(&self) -> u32 {
        self.tp_size * self.pp_size
    }

    /// The worker's global rank, as vLLM numbers it: `pp_rank × tp_size + tp_rank`.
    pub fn rank(&self) -> u32 {
        self.pp_rank * self.tp_size + self.tp_rank
    }

    /// The layout this shard belongs to: (tensor size, pipeline size).
    pub fn layout(&self) -> (u32, u32) {
        (self.tp_size, self.pp_size)
    }

    /// The shard's directory name: `shard-tp<t>of<T>-pp<p>of<P>`.
    pub fn dir_name(&self) -> String {
        format!(
            "{PREFIX}tp{}of{}-pp{}of{}",
            self.tp_rank, self.tp_size, self.pp_rank, self.pp_size
        )
    }

    /// The shard a directory name stands for (`None`: not a shard directory's name).
    pub fn parse(name: &str) -> Option<Shard> {
        let rest = name.strip_prefix(PREFIX)?;
        let (tp, pp) = rest.split_once('-')?;
        let two = |s: &str, tag: &str| -> Option<(u32, u32)> {
            let (r, n) = s.strip_prefix(tag)?.split_once("of")?;
            Some((r.parse().ok()?, n.parse().ok()?))
        };
        // The round trip below refuses what `parse` allows beyond the canonical form ("01").
        let (t, tn) = two(tp, "tp")?;
        let (p, pn) = two(pp, "pp")?;
        let s = Shard::new(t, tn, p, pn).ok()?;
        (s.dir_name() == name).then_some(s)
    }

    /// The shard's directory under each of `roots` (the roots of its store).
    pub fn roots(&self, roots: &[PathBuf]) -> Vec<PathBuf> {
        roots.iter().map(|r| r.join(self.dir_name())).collect()
    }
}

/// The shard directories directly under `root`, sorted by layout and rank.
pub fn shard_dirs(root: &Path) -> std::io::Result<Vec<(Shard, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(root)? {
        let e = e?;
        if let Some(s) = e.file_name().to_str().and_then(Shard::parse)
            && e.file_type()?.is_dir()
        {
            out.push((s, e.path()));
        }
    }
    out.sort_by_key(|(s, _)| (s.layout(), s.rank()));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_strangers_are_refused() {
        let all = Shard::all(2, 2);
        assert_eq!(all.len(), 4);
        assert_eq!(
            all.iter().map(Shard::rank).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        for s in &all {
            assert_eq!(Shard::parse(&s.dir_name()), Some(*s));
            assert_eq!(s.world(), 4);
        }
        assert_eq!(all[1].dir_name(), "shard-tp1of2-pp0of2");
        for bad in [
            "shard-tp2of2-pp0of1",
            "shard-tp0of0-pp0of1",
            "shard-tp01of2-pp0of1",
            "shard-tp0of2",
            "shard-tp0of2-pp0of1x",
            "ab",
            ".kvx-spare",
        ] {
            assert_eq!(Shard::parse(bad), None, "{bad}");
        }
        assert!(Shard::new(0, 1, 1, 1).is_err());
        assert_eq!(
            all[3].roots(&["/a".into(), "/b".into()]),
            vec![
                PathBuf::from("/a/shard-tp1of2-pp1of2"),
                PathBuf::from("/b/shard-tp1of2-pp1of2")
            ]
        );
    }

    #[test]
    fn shard_dirs_lists_only_shard_directories() {
        let d = tempfile::tempdir().unwrap();
        for s in Shard::all(2, 1) {
            std::fs::create_dir(d.path().join(s.dir_name())).unwrap();
        }
        std::fs::create_dir(d.path().join("ab")).unwrap();
        std::fs::write(d.path().join("shard-tp0of1-pp0of1"), b"a file").unwrap();
        let found = shard_dirs(d.path()).unwrap();
        assert_eq!(
            found.iter().map(|f| f.0).collect::<Vec<_>>(),
            Shard::all(2, 1)
        );
    }
}
