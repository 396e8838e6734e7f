//! The in-memory backing: a tree of nodes behind one mutex.
//!
//! A node whose last name is removed (unlink, rmdir, a rename over it) lives on while a handle
//! is open on it, as on a real filesystem, and is freed at its last release.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::sync::Mutex;
use std::time::SystemTime;

use fuser::{Errno, FileAttr, FileType, INodeNo};
use kvx_core::sync::lock;

use crate::backing::{
    DirEntry, FsResult, Owner, ROOT_INO, StatFs, Store, rename_noreplace, rename_unsupported,
};

/// Block size reported in attributes and statfs.
const BLOCK: u32 = 4096;

#[derive(Debug)]
enum Content {
    File(Vec<u8>),
    Dir(BTreeMap<OsString, u64>),
}

#[derive(Debug)]
struct Node {
    content: Content,
    parent: u64,
    perm: u16,
    owner: Owner,
    /// Names pointing at the node (0 once removed).
    links: u32,
    /// Open handles.
    open: u32,
    atime: SystemTime,
    mtime: SystemTime,
    ctime: SystemTime,
}

impl Node {
    fn new(content: Content, parent: u64, perm: u16, owner: Owner) -> Node {
        let now = SystemTime::now();
        Node {
            content,
            parent,
            perm,
            owner,
            links: 1,
            open: 0,
            atime: now,
            mtime: now,
            ctime: now,
        }
    }

    fn attr(&self, ino: u64) -> FileAttr {
        let (kind, size, nlink) = match &self.content {
            Content::File(data) => (FileType::RegularFile, data.len() as u64, self.links),
            Content::Dir(_) => (FileType::Directory, u64::from(BLOCK), self.links + 1),
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: self.atime,
            mtime: self.mtime,
            ctime: self.ctime,
            crtime: self.ctime,
            kind,
            perm: self.perm,
            nlink,
            uid: self.owner.uid,
            gid: self.owner.gid,
            rdev: 0,
            blksize: BLOCK,
            flags: 0,
        }
    }

    fn is_dir(&self) -> bool {
        matches!(self.content, Content::Dir(_))
    }
}

#[derive(Debug)]
struct Tree {
    nodes: HashMap<u64, Node>,
    /// Open file handle -> inode.
    handles: HashMap<u64, u64>,
    next_ino: u64,
    next_fh: u64,
}

impl Tree {
    fn node(&self, ino: u64) -> FsResult<&Node> {
        self.nodes.get(&ino).ok_or(Errno::ENOENT)
    }

    fn node_mut(&mut self, ino: u64) -> FsResult<&mut Node> {
        self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)
    }

    fn children(&self, dir: u64) -> FsResult<&BTreeMap<OsString, u64>> {
        match &self.node(dir)?.content {
            Content::Dir(children) => Ok(children),
            Content::File(_) => Err(Errno::ENOTDIR),
        }
    }

    fn children_mut(&mut self, dir: u64) -> FsResult<&mut BTreeMap<OsString, u64>> {
        match &mut self.node_mut(dir)?.content {
            Content::Dir(children) => Ok(children),
            Content::File(_) => Err(Errno::ENOTDIR),
        }
    }

    fn child(&self, dir: u64, name: &OsStr) -> FsResult<u64> {
        self.children(dir)?.get(name).copied().ok_or(Errno::ENOENT)
    }

    fn file_of(&mut self, fh: u64) -> FsResult<&mut Node> {
        let ino = *self.handles.get(&fh).ok_or(Errno::EBADF)?;
        self.node_mut(ino)
    }

    /// Add a new node named `name` under `parent`.
    fn insert(&mut self, parent: u64, name: &OsStr, node: Node) -> FsResult<u64> {
        let ino = self.next_ino;
        let children = self.children_mut(parent)?;
        if children.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        children.insert(name.to_owned(), ino);
        self.nodes.insert(ino, node);
        self.next_ino += 1;
        self.touch(parent);
        Ok(ino)
    }

    fn touch(&mut self, ino: u64) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            let now = SystemTime::now();
            node.mtime = now;
            node.ctime = now;
        }
    }

    fn open_handle(&mut self, ino: u64) -> FsResult<u64> {
        self.node_mut(ino)?.open += 1;
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, ino);
        Ok(fh)
    }

    /// A name of `ino` went away: free it unless it is still open.
    fn unlinked(&mut self, ino: u64) {
        if let Some(node) = self.nodes.get_mut(&ino) {
            node.links = node.links.saturating_sub(1);
            node.ctime = SystemTime::now();
            if node.links == 0 && node.open == 0 {
                self.nodes.remove(&ino);
            }
        }
    }

    /// Check that `victim` may be replaced by (or removed as) an entry of kind `dir`.
    fn replaceable(&self, victim: u64, by_dir: bool) -> FsResult<()> {
        let node = self.node(victim)?;
        match (&node.content, by_dir) {
            (Content::Dir(children), true) if children.is_empty() => Ok(()),
            (Content::Dir(_), true) => Err(Errno::ENOTEMPTY),
            (Content::Dir(_), false) => Err(Errno::EISDIR),
            (Content::File(_), true) => Err(Errno::ENOTDIR),
            (Content::File(_), false) => Ok(()),
        }
    }

    /// Whether `ino` is `ancestor` or lies below it.
    fn is_within(&self, mut ino: u64, ancestor: u64) -> bool {
        loop {
            if ino == ancestor {
                return true;
            }
            match self.nodes.get(&ino) {
                Some(node) if ino != ROOT_INO => ino = node.parent,
                _ => return false,
            }
        }
    }
}

/// Files kept in this process's memory.
#[derive(Debug)]
pub(crate) struct MemoryStore {
    tree: Mutex<Tree>,
}

impl MemoryStore {
    /// An empty filesystem (just the root directory, mode 0755).
    pub(crate) fn new() -> Self {
        let mut nodes = HashMap::new();
        let owner = Owner { uid: 0, gid: 0 };
        nodes.insert(
            ROOT_INO,
            Node::new(Content::Dir(BTreeMap::new()), ROOT_INO, 0o755, owner),
        );
        MemoryStore {
            tree: Mutex::new(Tree {
                nodes,
                handles: HashMap::new(),
                next_ino: ROOT_INO + 1,
                next_fh: 1,
            }),
        }
    }
}

fn perm(mode: u32) -> u16 {
    (mode & 0o7777) as u16
}

impl Store for MemoryStore {
    fn lookup(&self, parent: u64, name: &OsStr) -> FsResult<FileAttr> {
        let tree = lock(&self.tree);
        let ino = tree.child(parent, name)?;
        Ok(tree.node(ino)?.attr(ino))
    }

    fn forget(&self, _ino: u64, _nlookup: u64) {
        // Nodes are freed when their last name and handle are gone, not by lookup count.
    }

    fn getattr(&self, ino: u64, _fh: Option<u64>) -> FsResult<FileAttr> {
        Ok(lock(&self.tree).node(ino)?.attr(ino))
    }

    fn truncate(&self, ino: u64, _fh: Option<u64>, size: u64) -> FsResult<FileAttr> {
        let mut tree = lock(&self.tree);
        let node = tree.node_mut(ino)?;
        let Content::File(data) = &mut node.content else {
            return Err(Errno::EISDIR);
        };
        data.resize(usize::try_from(size).map_err(|_| Errno::EFBIG)?, 0);
        let now = SystemTime::now();
        node.mtime = now;
        node.ctime = now;
        Ok(node.attr(ino))
    }

    fn mkdir(&self, parent: u64, name: &OsStr, mode: u32, owner: Owner) -> FsResult<FileAttr> {
        let mut tree = lock(&self.tree);
        let node = Node::new(Content::Dir(BTreeMap::new()), parent, perm(mode), owner);
        let ino = tree.insert(parent, name, node)?;
        Ok(tree.node(ino)?.attr(ino))
    }

    fn create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        owner: Owner,
    ) -> FsResult<(FileAttr, u64)> {
        let mut tree = lock(&self.tree);
        let ino = match tree.child(parent, name) {
            Ok(_) if flags & libc::O_EXCL != 0 => return Err(Errno::EEXIST),
            Ok(ino) => {
                let node = tree.node_mut(ino)?;
                match &mut node.content {
                    Content::Dir(_) => return Err(Errno::EISDIR),
                    Content::File(data) if flags & libc::O_TRUNC != 0 => data.clear(),
                    Content::File(_) => {}
                }
                ino
            }
            Err(_) => {
                let node = Node::new(Content::File(Vec::new()), parent, perm(mode), owner);
                tree.insert(parent, name, node)?
            }
        };
        let fh = tree.open_handle(ino)?;
        Ok((tree.node(ino)?.attr(ino), fh))
    }

    fn open(&self, ino: u64, flags: i32) -> FsResult<u64> {
        let mut tree = lock(&self.tree);
        let node = tree.node_mut(ino)?;
        if let Content::File(data) = &mut node.content {
            if flags & libc::O_TRUNC != 0 {
                data.clear();
            }
        }
        tree.open_handle(ino)
    }

    fn read(&self, fh: u64, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        let mut tree = lock(&self.tree);
        let node = tree.file_of(fh)?;
        node.atime = SystemTime::now();
        let Content::File(data) = &node.content else {
            return Err(Errno::EISDIR);
        };
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(data.len());
        let end = start.saturating_add(size as usize).min(data.len());
        Ok(data[start..end].to_vec())
    }

    fn write(&self, fh: u64, offset: u64, bytes: &[u8]) -> FsResult<u32> {
        let mut tree = lock(&self.tree);
        let node = tree.file_of(fh)?;
        let Content::File(data) = &mut node.content else {
            return Err(Errno::EISDIR);
        };
        let start = usize::try_from(offset).map_err(|_| Errno::EFBIG)?;
        let end = start.checked_add(bytes.len()).ok_or(Errno::EFBIG)?;
        if data.len() < end {
            data.resize(end, 0);
        }
        data[start..end].copy_from_slice(bytes);
        let now = SystemTime::now();
        node.mtime = now;
        node.ctime = now;
        u32::try_from(bytes.len()).map_err(|_| Errno::EINVAL)
    }

    fn fsync(&self, fh: u64, _datasync: bool) -> FsResult<()> {
        lock(&self.tree).file_of(fh).map(|_| ())
    }

    fn release(&self, fh: u64) {
        let mut tree = lock(&self.tree);
        let Some(ino) = tree.handles.remove(&fh) else {
            return;
        };
        if let Some(node) = tree.nodes.get_mut(&ino) {
            node.open = node.open.saturating_sub(1);
            if node.open == 0 && node.links == 0 {
                tree.nodes.remove(&ino);
            }
        }
    }

    fn rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> FsResult<()> {
        if rename_unsupported(flags) {
            return Err(Errno::EINVAL);
        }
        let mut tree = lock(&self.tree);
        let ino = tree.child(parent, name)?;
        let moving_dir = tree.node(ino)?.is_dir();
        if moving_dir && tree.is_within(newparent, ino) {
            return Err(Errno::EINVAL);
        }
        let victim = match tree.child(newparent, newname) {
            Ok(victim) if victim == ino => return Ok(()),
            Ok(_) if rename_noreplace(flags) => return Err(Errno::EEXIST),
            Ok(victim) => {
                tree.replaceable(victim, moving_dir)?;
                Some(victim)
            }
            Err(_) => {
                tree.children(newparent)?;
                None
            }
        };
        tree.children_mut(parent)?.remove(name);
        tree.children_mut(newparent)?
            .insert(newname.to_owned(), ino);
        tree.node_mut(ino)?.parent = newparent;
        tree.touch(parent);
        tree.touch(newparent);
        if let Some(victim) = victim {
            tree.unlinked(victim);
        }
        Ok(())
    }

    fn unlink(&self, parent: u64, name: &OsStr) -> FsResult<()> {
        let mut tree = lock(&self.tree);
        let ino = tree.child(parent, name)?;
        tree.replaceable(ino, false)?;
        tree.children_mut(parent)?.remove(name);
        tree.touch(parent);
        tree.unlinked(ino);
        Ok(())
    }

    fn rmdir(&self, parent: u64, name: &OsStr) -> FsResult<()> {
        let mut tree = lock(&self.tree);
        let ino = tree.child(parent, name)?;
        tree.replaceable(ino, true)?;
        tree.children_mut(parent)?.remove(name);
        tree.touch(parent);
        tree.unlinked(ino);
        Ok(())
    }

    fn readdir(&self, ino: u64) -> FsResult<Vec<DirEntry>> {
        let tree = lock(&self.tree);
        let parent = tree.node(ino)?.parent;
        let mut out = vec![
            DirEntry {
                ino,
                kind: FileType::Directory,
                name: ".".into(),
            },
            DirEntry {
                ino: parent,
                kind: FileType::Directory,
                name: "..".into(),
            },
        ];
        for (name, &child) in tree.children(ino)? {
            let kind = if tree.node(child)?.is_dir() {
                FileType::Directory
            } else {
                FileType::RegularFile
            };
            out.push(DirEntry {
                ino: child,
                kind,
                name: name.clone(),
            });
        }
        Ok(out)
    }

    fn statfs(&self) -> FsResult<StatFs> {
        let tree = lock(&self.tree);
        let used: u64 = tree
            .nodes
            .values()
            .map(|n| match &n.content {
                Content::File(data) => (data.len() as u64).div_ceil(u64::from(BLOCK)),
                Content::Dir(_) => 1,
            })
            .sum();
        // Report a 1 TiB filesystem; memory is the real limit.
        let blocks = (1u64 << 40) / u64::from(BLOCK);
        let free = blocks.saturating_sub(used);
        Ok(StatFs {
            blocks,
            bfree: free,
            bavail: free,
            files: 1 << 32,
            ffree: (1u64 << 32).saturating_sub(tree.nodes.len() as u64),
            bsize: BLOCK,
            namelen: 255,
            frsize: BLOCK,
        })
    }
}
