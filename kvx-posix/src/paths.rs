//! Where a block lives: `root/ab/<32 hex>.kvb` (`ab`: the key's first two hex digits), the root
//! chosen by key; temporary names `<32 hex>.<host>-<pid>-<seq>.kvb.tmp` beside it, so that any
//! node sharing the mount can tell whose leftover a temporary file is. The older form
//! `<32 hex>.<pid>-<seq>.kvb.tmp` (no host) is still recognised as a temporary.
//!
//! One level of 256 directories: a store makes at most 256 directories in its life, so a store
//! of a new block costs no `mkdir` once they exist (two levels cost one per block until tens of
//! thousands of blocks were stored, and a `mkdir` costs as much as the file's own create). A
//! million blocks put about 4,000 names in each directory, which hashed directories (ext4, XFS,
//! NFS and the parallel file systems) look up in constant time. Blocks of the older two-level
//! layout (`root/ab/cd/`) are not read; `kvx verify --repair` removes them.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use kvx_core::BlockKey;

/// Suffix of a block file.
pub(crate) const BLOCK_SUFFIX: &str = ".kvb";
/// Suffix of a temporary file being written.
pub(crate) const TEMP_SUFFIX: &str = ".kvb.tmp";

/// The directory tree of a store.
#[derive(Debug)]
pub(crate) struct Layout {
    roots: Vec<PathBuf>,
    pid: u32,
    host: String,
    seq: AtomicU64,
}

/// This machine's host name as it appears in temporary names: ASCII letters, digits and `_`
/// only (anything else becomes `_`), at most 64 characters; `unknown` when it cannot be read.
pub(crate) fn host_tag() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into our own stack buffer.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let raw = if r == 0 {
        let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    };
    let tag: String = raw
        .chars()
        .take(64)
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if tag.is_empty() {
        "unknown".into()
    } else {
        tag
    }
}

/// The names one block job needs, as C strings for the kernel.
#[derive(Debug)]
pub(crate) struct BlockPaths {
    /// Index of the root that holds the block.
    pub(crate) root: usize,
    /// `root/ab`.
    pub(crate) dir: CString,
    /// `root/ab/<hex>.kvb`.
    pub(crate) block: CString,
    /// The name a store writes before the rename: a fresh temporary name beside the block, or
    /// a spare file (stores only).
    pub(crate) temp: Option<CString>,
    /// With a spare file in `temp`: the fresh temporary name to create if the spare is gone.
    pub(crate) fallback_temp: Option<CString>,
}

impl BlockPaths {
    /// Write into the spare file `spare` instead of creating the temporary file.
    pub(crate) fn use_spare(&mut self, spare: CString) {
        self.fallback_temp = self.temp.replace(spare);
    }

    /// Whether the store writes into a spare file (which exists: no create).
    pub(crate) fn writes_spare(&self) -> bool {
        self.fallback_temp.is_some()
    }

    /// Take the spare file back out (the store creates the fresh temporary name instead).
    pub(crate) fn take_spare(&mut self) -> Option<CString> {
        let fresh = self.fallback_temp.take()?;
        self.temp.replace(fresh)
    }

    /// The spare file is gone: create the fresh temporary name instead; false if there is none.
    pub(crate) fn drop_spare(&mut self) -> bool {
        match self.fallback_temp.take() {
            Some(t) => {
                self.temp = Some(t);
                true
            }
            None => false,
        }
    }
}

fn cstr(p: &Path) -> CString {
    // Paths built from a root (checked at open to have no NUL) and hex digits.
    CString::new(p.as_os_str().as_bytes()).unwrap_or_default()
}

impl Layout {
    /// A layout over `roots` (non-empty, without NUL bytes).
    pub(crate) fn new(roots: Vec<PathBuf>) -> Layout {
        Layout {
            roots,
            pid: std::process::id(),
            host: host_tag(),
            seq: AtomicU64::new(0),
        }
    }

    /// A fresh write nonce: unique to this process's stores, and (mixed with the pid and the
    /// clock) across processes and nodes with overwhelming probability.
    pub(crate) fn nonce(&self) -> u64 {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut z = clock ^ (u64::from(self.pid) << 40) ^ seq.rotate_left(20);
        // splitmix64 finalizer: spreads nearby inputs over the whole range.
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)).max(1)
    }

    /// This machine's host tag, as written into temporary names.
    pub(crate) fn host(&self) -> &str {
        &self.host
    }

    /// The roots.
    pub(crate) fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    /// Index of the root that holds `key`.
    pub(crate) fn root_of(&self, key: BlockKey) -> usize {
        let mixed = (key.0 as u64) ^ ((key.0 >> 64) as u64).rotate_left(17);
        (mixed % self.roots.len() as u64) as usize
    }

    /// `root/ab` for `key`.
    pub(crate) fn dir_of(&self, key: BlockKey) -> PathBuf {
        self.roots[self.root_of(key)].join(format!("{:02x}", fan_out(key)))
    }

    /// Final path of `key`'s block file.
    pub(crate) fn block_path(&self, key: BlockKey) -> PathBuf {
        self.dir_of(key)
            .join(format!("{}{BLOCK_SUFFIX}", key.to_hex()))
    }

    /// The C paths of a job on `key`; with a fresh temporary name when `temp`.
    pub(crate) fn paths(&self, key: BlockKey, temp: bool) -> BlockPaths {
        let dir = self.dir_of(key);
        let hex = key.to_hex();
        let temp = temp.then(|| {
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            cstr(&dir.join(format!(
                "{hex}.{}-{}-{seq}{TEMP_SUFFIX}",
                self.host, self.pid
            )))
        });
        BlockPaths {
            root: self.root_of(key),
            block: cstr(&dir.join(format!("{hex}{BLOCK_SUFFIX}"))),
            dir: cstr(&dir),
            temp,
            fallback_temp: None,
        }
    }
}

/// What a file name in a leaf directory is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Entry {
    /// A block file of this key.
    Block(BlockKey),
    /// A temporary file written by process `pid` on host `host` (`None`: the older name form
    /// without a host).
    Temp {
        /// Writer's host tag (see [`host_tag`]).
        host: Option<String>,
        /// Writer's process id.
        pid: u32,
    },
    /// Anything else (left alone).
    Other,
}

/// The fan-out directory of `key`: its first byte (the first two hex digits of its name).
pub(crate) fn fan_out(key: BlockKey) -> u8 {
    (key.0 >> 120) as u8
}

/// Classify a file name found in the fan-out directory `ab/`.
pub(crate) fn classify(name: &str, ab: &str) -> Entry {
    if let Some(stem) = name.strip_suffix(TEMP_SUFFIX) {
        let Some((hex, tag)) = stem.split_once('.') else {
            return Entry::Other;
        };
        let mut parts = tag.rsplitn(3, '-');
        let (Some(seq), Some(pid)) = (parts.next(), parts.next()) else {
            return Entry::Other;
        };
        let host = parts.next().map(str::to_owned);
        if seq.parse::<u64>().is_err() || host.as_deref() == Some("") {
            return Entry::Other;
        }
        return match (BlockKey::from_hex(hex), pid.parse()) {
            (Some(_), Ok(pid)) => Entry::Temp { host, pid },
            _ => Entry::Other,
        };
    }
    if let Some(hex) = name.strip_suffix(BLOCK_SUFFIX)
        && let Some(key) = BlockKey::from_hex(hex)
        && hex.get(0..2) == Some(ab)
    {
        return Entry::Block(key);
    }
    Entry::Other
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_classification() {
        let l = Layout::new(vec!["/r0".into(), "/r1".into()]);
        let key = BlockKey(0xabcd_0000_0000_0000_0000_0000_0000_1234u128);
        let p = l.block_path(key);
        let name = p.file_name().unwrap().to_str().unwrap();
        assert!(p.to_str().unwrap().contains("/ab/abcd"), "{p:?}");
        assert_eq!(fan_out(key), 0xab);
        assert_eq!(classify(name, "ab"), Entry::Block(key));
        assert_eq!(classify(name, "ac"), Entry::Other);
        let paths = l.paths(key, true);
        let t = PathBuf::from(std::ffi::OsStr::from_bytes(
            paths.temp.as_ref().unwrap().as_bytes(),
        ));
        let tname = t.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            classify(tname, "ab"),
            Entry::Temp {
                host: Some(host_tag()),
                pid: std::process::id()
            }
        );
        assert!(tname.contains(&format!("{}-{}-", host_tag(), std::process::id())));
        // The older form without a host is still a temporary.
        let hex = key.to_hex();
        assert_eq!(
            classify(&format!("{hex}.42-7.kvb.tmp"), "ab"),
            Entry::Temp {
                host: None,
                pid: 42
            }
        );
        assert_eq!(
            classify(&format!("{hex}.node-a_1-42-7.kvb.tmp"), "ab"),
            Entry::Temp {
                host: Some("node-a_1".into()),
                pid: 42
            }
        );
        assert_eq!(classify(&format!("{hex}.x-7.kvb.tmp"), "ab"), Entry::Other);
        assert_ne!(l.paths(key, true).temp, paths.temp, "temp names are unique");
        assert_eq!(classify("notes.txt", "ab"), Entry::Other);
        // Keys spread over both roots.
        let hits: std::collections::HashSet<usize> =
            (0..64u128).map(|i| l.root_of(BlockKey(i * 7919))).collect();
        assert_eq!(hits.len(), 2);
    }
}
