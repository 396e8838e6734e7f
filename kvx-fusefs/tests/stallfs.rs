//! StallFs on real FUSE mounts: file operations through std::fs and io_uring on both backings,
//! freeze/thaw, and teardown releasing stuck threads. Skipped (with one `skip:` line) where
//! FUSE cannot be mounted.

mod uring;

use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use kvx_fusefs::{Backing, StallFs, StallMount, fuse_available};
use libtest_mimic::{Arguments, Failed, Trial};

/// Generous bound for "this happens promptly" (never a performance assertion).
const SOON: Duration = Duration::from_secs(5);
/// How long a blocked operation must stay blocked to count as stuck.
const STUCK: Duration = Duration::from_millis(300);

type TestResult = Result<(), Failed>;

// A mount can be handed to another thread (the replay CLI thaws it from a timer thread).
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<StallMount>();
};

fn check(cond: bool, what: impl Into<String>) -> TestResult {
    if cond {
        Ok(())
    } else {
        Err(what.into().into())
    }
}

/// A mount over `backing` in a fresh temp dir; the temp dirs outlive the mount.
struct Fixture {
    mount: Option<StallMount>,
    backing_dir: tempfile::TempDir,
    _mnt_dir: tempfile::TempDir,
}

impl Fixture {
    fn new(passthrough: bool) -> Result<Fixture, Failed> {
        let mnt_dir = tempfile::tempdir()?;
        let backing_dir = tempfile::tempdir()?;
        let backing = if passthrough {
            Backing::Passthrough(backing_dir.path().to_owned())
        } else {
            Backing::Memory
        };
        let mount = StallFs::mount(mnt_dir.path(), backing)?;
        Ok(Fixture {
            mount: Some(mount),
            backing_dir,
            _mnt_dir: mnt_dir,
        })
    }

    fn mount(&self) -> &StallMount {
        self.mount
            .as_ref()
            .expect("mount is present until the fixture drops")
    }

    fn path(&self, rel: &str) -> std::path::PathBuf {
        self.mount().path().join(rel)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // Unmount before the temp dirs go.
        drop(self.mount.take());
    }
}

/// Run `f` on a thread; its result, or `None` if it is still running after `within`.
fn spawn_timed<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> mpsc::Receiver<T> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn round_trip(passthrough: bool) -> TestResult {
    let fx = Fixture::new(passthrough)?;
    let (a, b) = (fx.path("a.tmp"), fx.path("a.kvb"));
    let data = pattern(300_000, 1);
    fs::write(&a, &data)?;
    check(
        fs::metadata(&a)?.len() == data.len() as u64,
        "size after write",
    )?;
    check(fs::read(&a)? == data, "read back after write")?;

    // Overwrite in the middle at an offset, append at the end.
    let f = OpenOptions::new().read(true).write(true).open(&a)?;
    f.write_all_at(b"MIDDLE", 1000)?;
    f.write_all_at(b"END", data.len() as u64)?;
    f.sync_data()?;
    let mut expect = data.clone();
    expect[1000..1006].copy_from_slice(b"MIDDLE");
    expect.extend_from_slice(b"END");
    let mut got = Vec::new();
    File::open(&a)?.read_to_end(&mut got)?;
    check(got == expect, "read back after offset writes")?;
    drop(f);

    // Rename into place, then rename another file over it (replace).
    fs::rename(&a, &b)?;
    check(!a.exists(), "source gone after rename")?;
    check(fs::read(&b)? == expect, "renamed content")?;
    let c = fx.path("c.tmp");
    fs::write(&c, b"replacement")?;
    fs::rename(&c, &b)?;
    check(
        fs::read(&b)? == b"replacement",
        "rename replaced the target",
    )?;

    // Truncate, list, unlink.
    OpenOptions::new().write(true).open(&b)?.set_len(4)?;
    check(fs::read(&b)? == b"repl", "truncate")?;
    let names: Vec<String> = fs::read_dir(fx.mount().path())?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    check(names == ["a.kvb"], format!("listing {names:?}"))?;
    fs::remove_file(&b)?;
    check(!b.exists(), "unlinked")?;
    check(
        fs::read_dir(fx.mount().path())?.next().is_none(),
        "empty after unlink",
    )?;
    if passthrough {
        check(
            fs::read_dir(fx.backing_dir.path())?.next().is_none(),
            "backing dir empty after unlink",
        )?;
    }
    check(fx.mount().ops_served() > 10, "ops counted")
}

fn nested_mkdir(passthrough: bool) -> TestResult {
    let fx = Fixture::new(passthrough)?;
    let dir = fx.path("ab/cd");
    fs::create_dir_all(&dir)?;
    check(fs::metadata(&dir)?.is_dir(), "ab/cd is a directory")?;
    let file = dir.join("0123.kvb");
    fs::write(&file, b"nested")?;
    check(fs::read(&file)? == b"nested", "nested file content")?;
    fs::create_dir_all(fx.path("ab/ef"))?;
    let mut subdirs: Vec<String> = fs::read_dir(fx.path("ab"))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    subdirs.sort();
    check(subdirs == ["cd", "ef"], format!("subdirs {subdirs:?}"))?;
    check(
        fs::create_dir(&dir).is_err_and(|e| e.kind() == std::io::ErrorKind::AlreadyExists),
        "mkdir of an existing dir fails with EEXIST",
    )?;
    // Renaming a directory moves what is below it.
    fs::rename(fx.path("ab/cd"), fx.path("ab/moved"))?;
    check(
        fs::read(fx.path("ab/moved/0123.kvb"))? == b"nested",
        "file under renamed dir",
    )?;
    if passthrough {
        check(
            fs::read(fx.backing_dir.path().join("ab/moved/0123.kvb"))? == b"nested",
            "file in the backing dir",
        )?;
    }
    fs::remove_dir_all(fx.path("ab"))?;
    check(!fx.path("ab").exists(), "tree removed")
}

fn freeze_blocks_read(passthrough: bool) -> TestResult {
    let fx = Fixture::new(passthrough)?;
    let file = fx.path("block.kvb");
    let data = pattern(1 << 20, 7);
    fs::write(&file, &data)?;
    let f = File::open(&file)?;

    fx.mount().freeze();
    check(fx.mount().is_frozen(), "is_frozen after freeze")?;
    let served = fx.mount().ops_served();
    let rx = spawn_timed(move || {
        let mut buf = vec![0u8; 1 << 20];
        f.read_exact_at(&mut buf, 0).map(|()| buf)
    });
    check(
        fx.mount().wait_blocked(1, SOON),
        "read never reached the filesystem",
    )?;
    thread::sleep(STUCK);
    check(rx.try_recv().is_err(), "read finished while frozen")?;
    check(
        fx.mount().blocked_requests() >= 1,
        "blocked_requests after 300 ms",
    )?;
    check(
        fx.mount().ops_served() == served,
        "nothing served while frozen",
    )?;

    fx.mount().thaw();
    check(!fx.mount().is_frozen(), "is_frozen after thaw")?;
    let got = rx
        .recv_timeout(SOON)
        .map_err(|_| "read not released by thaw")??;
    check(got == data, "bytes read after thaw")?;
    check(
        fx.mount().blocked_requests() == 0,
        "nothing blocked after thaw",
    )?;
    check(fx.mount().ops_served() > served, "ops served after thaw")
}

fn freeze_holds_many() -> TestResult {
    const N: usize = 32;
    let fx = Fixture::new(false)?;
    for i in 0..N {
        fs::write(fx.path(&format!("f{i}")), pattern(4096, i as u8))?;
    }
    fx.mount().freeze();
    let readers: Vec<_> = (0..N)
        .map(|i| {
            let path = fx.path(&format!("f{i}"));
            spawn_timed(move || fs::read(path))
        })
        .collect();
    check(
        fx.mount().wait_blocked(N, SOON),
        format!(
            "only {} of {N} requests blocked",
            fx.mount().blocked_requests()
        ),
    )?;
    // Unrelated operations block too: a stat and a create.
    let stat = spawn_timed({
        let p = fx.path("f0");
        move || fs::metadata(p).map(|m| m.len())
    });
    check(fx.mount().wait_blocked(N + 1, SOON), "stat not blocked")?;
    thread::sleep(STUCK);
    check(stat.try_recv().is_err(), "stat finished while frozen")?;
    fx.mount().thaw();
    for (i, rx) in readers.into_iter().enumerate() {
        let got = rx
            .recv_timeout(SOON)
            .map_err(|_| format!("reader {i} not released"))??;
        check(got == pattern(4096, i as u8), format!("reader {i} bytes"))?;
    }
    check(
        stat.recv_timeout(SOON).map_err(|_| "stat not released")?? == 4096,
        "stat size",
    )
}

fn drop_releases_stuck_read() -> TestResult {
    let mut fx = Fixture::new(false)?;
    let file = fx.path("block.kvb");
    fs::write(&file, pattern(8192, 3))?;
    let f = File::open(&file)?;
    fx.mount().freeze();
    let rx = spawn_timed(move || {
        let mut buf = vec![0u8; 8192];
        f.read_exact_at(&mut buf, 0)
    });
    check(fx.mount().wait_blocked(1, SOON), "read never blocked")?;
    thread::sleep(STUCK);
    check(rx.try_recv().is_err(), "read finished while frozen")?;

    drop(fx.mount.take());
    let res = rx
        .recv_timeout(SOON)
        .map_err(|_| "stuck read not released by drop")?;
    check(
        res.is_err(),
        format!("stuck read should fail after drop, got {res:?}"),
    )
}

fn drop_releases_stuck_process() -> TestResult {
    let mut fx = Fixture::new(false)?;
    let file = fx.path("block.kvb");
    fs::write(&file, pattern(4096, 4))?;
    fx.mount().freeze();
    let mut child = std::process::Command::new("cat")
        .arg(&file)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    check(fx.mount().wait_blocked(1, SOON), "cat never blocked")?;
    thread::sleep(STUCK);
    check(child.try_wait()?.is_none(), "cat finished while frozen")?;

    drop(fx.mount.take());
    let end = std::time::Instant::now() + SOON;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if std::time::Instant::now() > end {
            return Err("cat still stuck after the mount was dropped".into());
        }
        thread::sleep(Duration::from_millis(10));
    };
    check(
        !status.success(),
        format!("cat should fail after drop, got {status}"),
    )
}

fn abort_releases_stuck_open() -> TestResult {
    let mut fx = Fixture::new(true)?;
    let file = fx.path("block.kvb");
    fs::write(&file, b"x")?;
    fx.mount().freeze();
    let rx = spawn_timed(move || File::open(file).map(|_| ()));
    check(fx.mount().wait_blocked(1, SOON), "open never blocked")?;
    thread::sleep(STUCK);
    check(rx.try_recv().is_err(), "open finished while frozen")?;

    let mount = fx.mount.take().ok_or("mount already gone")?;
    let path = mount.path().to_owned();
    mount.abort()?;
    let res = rx
        .recv_timeout(SOON)
        .map_err(|_| "stuck open not released by abort")?;
    check(res.is_err(), "stuck open should fail after abort")?;
    // The mountpoint is the plain directory again.
    let parent = path.parent().ok_or("mountpoint has no parent")?;
    check(
        fs::metadata(&path)?.dev() == fs::metadata(parent)?.dev(),
        "still mounted after abort",
    )
}

/// A 4096-aligned window of `len` bytes inside `buf`.
fn aligned(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    buf.resize(len + 4096, 0);
    let off = buf.as_ptr().align_offset(4096);
    &mut buf[off..off + len]
}

fn direct_io(passthrough: bool) -> TestResult {
    let fx = Fixture::new(passthrough)?;
    let path = fx.path("direct.kvb");
    let mut wbuf = Vec::new();
    let data = pattern(1 << 20, 9);
    let chunk = aligned(&mut wbuf, 256 << 10);
    {
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)?;
        // Out of order, at aligned offsets.
        for i in [2usize, 0, 3, 1] {
            let off = i * (256 << 10);
            chunk.copy_from_slice(&data[off..off + (256 << 10)]);
            f.write_all_at(chunk, off as u64)?;
        }
        f.sync_data()?;
    }
    check(
        fs::metadata(&path)?.len() == data.len() as u64,
        "size after direct writes",
    )?;
    let mut rbuf = Vec::new();
    let whole = aligned(&mut rbuf, 1 << 20);
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)?;
    f.read_exact_at(whole, 0)?;
    check(whole == data.as_slice(), "direct read back")?;
    check(fs::read(&path)? == data, "buffered read back")
}

fn main() {
    let args = Arguments::from_args();
    let available = match fuse_available() {
        Ok(()) => true,
        Err(reason) => {
            println!("skip: {reason}");
            false
        }
    };
    let t = |name: &str, f: fn() -> TestResult| Trial::test(name, f).with_ignored_flag(!available);
    let trials = vec![
        t("round_trip_memory", || round_trip(false)),
        t("round_trip_passthrough", || round_trip(true)),
        t("nested_mkdir_memory", || nested_mkdir(false)),
        t("nested_mkdir_passthrough", || nested_mkdir(true)),
        t("freeze_blocks_read_memory", || freeze_blocks_read(false)),
        t("freeze_blocks_read_passthrough", || {
            freeze_blocks_read(true)
        }),
        t("freeze_holds_many_requests", freeze_holds_many),
        t("drop_releases_stuck_read", drop_releases_stuck_read),
        t("drop_releases_stuck_process", drop_releases_stuck_process),
        t("abort_releases_stuck_open", abort_releases_stuck_open),
        t("direct_io_memory", || direct_io(false)),
        t("direct_io_passthrough", || direct_io(true)),
        t("io_uring_ops_memory", || uring::ops(false)),
        t("io_uring_ops_passthrough", || uring::ops(true)),
        t(
            "io_uring_open_blocks_while_frozen",
            uring::open_blocks_while_frozen,
        ),
    ];
    libtest_mimic::run(&args, trials).exit();
}
