//! A GlusterFS volume in loopback for tests: one `glusterd` of the test's own (its working
//! directory in a temp dir), volumes of two bricks on local directories (replica 2, or plain
//! distributed), one FUSE mount per kvx node, and brick faults (stop, continue, kill).
//!
//! Everything the fixture starts is recorded by process id and mount path, and ended when its
//! owner drops (also while a failed test unwinds): mounts unmounted and their FUSE clients
//! ended, bricks continued and the volume stopped and deleted, then `glusterd` ended.
//! [`Gluster::stop`] does the same and returns what is still left, for the suite's last check.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvx_core::sync::lock;

/// The port `glusterd` listens on (fixed by GlusterFS's command line tool).
const GLUSTERD_PORT: u16 = 24007;
/// How long a `gluster` command may take before the fixture gives up on it.
const CLI_TIMEOUT_S: &str = "60";

/// How a volume spreads its files over its two bricks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Every file on both bricks.
    Replica2,
    /// Each file on one brick, chosen by its name's hash.
    Distributed,
}

/// Why the GlusterFS tests cannot run here, or `Ok` when they can.
pub fn available() -> Result<(), String> {
    if !Path::new("/dev/fuse").exists() {
        return Err("no /dev/fuse".into());
    }
    for tool in ["glusterd", "gluster", "mount.glusterfs"] {
        let found = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
            .iter()
            .any(|d| Path::new(d).join(tool).exists());
        if !found {
            return Err(format!(
                "GlusterFS is not installed ({tool} missing; apt-get install glusterfs-server glusterfs-client)"
            ));
        }
    }
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(str::to_string))
        });
    if uid.as_deref() != Some("0") {
        return Err("GlusterFS needs root (glusterd, mount)".into());
    }
    if std::net::TcpListener::bind(("0.0.0.0", GLUSTERD_PORT)).is_err() {
        return Err(format!(
            "port {GLUSTERD_PORT} is taken: another glusterd runs on this machine"
        ));
    }
    Ok(())
}

/// Run `cmd`, returning its stdout, or its stderr and stdout as the error.
pub fn output(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "{cmd:?} exited {}: {}{stdout}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// One `gluster` command in script mode.
fn cli(args: &[&str]) -> Result<String, String> {
    output(
        Command::new("gluster")
            .arg("--mode=script")
            .arg(format!("--timeout={CLI_TIMEOUT_S}"))
            .args(args),
    )
}

/// Send `signal` (`STOP`, `CONT`, `KILL`, `TERM`) to process `pid`.
pub fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// True while process `pid` exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The mount points below `dir` that `/proc/mounts` lists.
pub fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect()
}

/// The process ids whose command line holds every one of `needles`.
fn pids_with(needles: &[&str]) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            needles.iter().all(|n| cmd.contains(n))
        })
        .collect()
}

/// Wait until `pid` is gone or `within` passes; true when it is gone.
fn gone_within(pid: u32, within: Duration) -> bool {
    let end = Instant::now() + within;
    while alive(pid) {
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// End `pid`: TERM, then KILL if it is still there after `grace`.
fn end_process(pid: u32, grace: Duration) {
    if !alive(pid) {
        return;
    }
    signal(pid, "TERM");
    if !gone_within(pid, grace) {
        signal(pid, "KILL");
        gone_within(pid, Duration::from_secs(5));
    }
}

/// The test's own `glusterd`, and every process and mount it led to.
pub struct Gluster {
    dir: tempfile::TempDir,
    host: String,
    glusterd: Option<Child>,
    volumes: AtomicUsize,
    /// Every brick, self-heal and FUSE client process the fixture saw start.
    started: Mutex<Vec<u32>>,
}

impl Gluster {
    /// Start `glusterd` with its state in a new temp dir (check [`available`] first).
    pub fn start() -> Result<Gluster, String> {
        let dir = tempfile::Builder::new()
            .prefix("kvx-gluster-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        let host = output(&mut Command::new("hostname"))?.trim().to_string();
        let work = dir.path().join("glusterd");
        std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
        let vol = dir.path().join("glusterd.vol");
        std::fs::write(
            &vol,
            format!(
                "volume management\n    type mgmt/glusterd\n    option working-directory {}\n    \
                 option transport-type socket\n    option transport.socket.listen-port {GLUSTERD_PORT}\n    \
                 option ping-timeout 0\n    option event-threads 1\n    option max-port 60999\nend-volume\n",
                work.display()
            ),
        )
        .map_err(|e| e.to_string())?;
        let glusterd = Command::new("glusterd")
            .arg("-N")
            .arg("-f")
            .arg(&vol)
            .arg("-l")
            .arg(dir.path().join("glusterd.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start glusterd: {e}"))?;
        let g = Gluster {
            dir,
            host,
            glusterd: Some(glusterd),
            volumes: AtomicUsize::new(0),
            started: Mutex::new(Vec::new()),
        };
        let end = Instant::now() + Duration::from_secs(30);
        while let Err(e) = cli(&["pool", "list"]) {
            if Instant::now() > end {
                return Err(format!("glusterd did not answer: {e}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(g)
    }

    /// Create and start a volume of two bricks with `layout`, named by this machine's name.
    pub fn volume(&self, layout: Layout) -> Result<Volume<'_>, String> {
        self.volume_at(layout, &self.host)
    }

    /// Create and start a volume of two bricks with `layout`, named by `host` (an address of
    /// this machine: clients reach the bricks there).
    pub fn volume_at(&self, layout: Layout, host: &str) -> Result<Volume<'_>, String> {
        let n = self.volumes.fetch_add(1, Ordering::Relaxed);
        let name = format!("kvx{}-{n}", std::process::id());
        let home = self.dir.path().join(&name);
        let bricks: Vec<PathBuf> = (0..2).map(|i| home.join(format!("brick{i}"))).collect();
        for b in &bricks {
            std::fs::create_dir_all(b).map_err(|e| e.to_string())?;
        }
        let mut args = vec!["volume".to_string(), "create".into(), name.clone()];
        if layout == Layout::Replica2 {
            args.extend(["replica".into(), "2".into()]);
        }
        args.extend(bricks.iter().map(|b| format!("{host}:{}", b.display())));
        // Bricks on the root file system need `force`.
        args.push("force".into());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cli(&args)?;
        let mut v = Volume {
            gluster: self,
            host: host.to_string(),
            name,
            home,
            bricks: bricks
                .into_iter()
                .map(|path| Brick { path, pid: 0 })
                .collect(),
            mounts: Vec::new(),
        };
        // From here on, dropping `v` deletes the volume.
        cli(&["volume", "start", &v.name])?;
        v.find_pids()?;
        Ok(v)
    }

    fn record(&self, pid: u32) {
        let mut started = lock(&self.started);
        if !started.contains(&pid) {
            started.push(pid);
        }
    }

    /// End `glusterd` and everything left of the volumes; returns what is still there: live
    /// processes the fixture started and mounts below its dir (empty when all is gone).
    pub fn stop(mut self) -> Vec<String> {
        self.end_all();
        let mut left: Vec<String> = lock(&self.started)
            .iter()
            .filter(|p| alive(**p))
            .map(|p| format!("process {p} still runs"))
            .collect();
        left.extend(
            mounts_below(self.dir.path())
                .into_iter()
                .map(|m| format!("{} still mounted", m.display())),
        );
        left
    }

    fn end_all(&mut self) {
        for m in mounts_below(self.dir.path()) {
            unmount(&m);
        }
        if let Some(mut d) = self.glusterd.take() {
            end_process(d.id(), Duration::from_secs(5));
            let _ = d.wait();
        }
        let started = lock(&self.started).clone();
        for pid in started {
            signal(pid, "CONT");
            end_process(pid, Duration::from_secs(2));
        }
    }
}

impl Drop for Gluster {
    fn drop(&mut self) {
        self.end_all();
    }
}

/// Unmount `at`; a mount that will not go (I/O stuck in it) is detached.
fn unmount(at: &Path) {
    let ok = Command::new("umount")
        .arg(at)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(at)
            .stderr(Stdio::null())
            .status();
    }
}

/// One brick: its directory, and its `glusterfsd` process.
#[derive(Debug)]
pub struct Brick {
    /// The brick's directory (where its files really are).
    pub path: PathBuf,
    /// The brick's `glusterfsd`.
    pub pid: u32,
}

/// A started volume; dropping it unmounts it everywhere, stops and deletes it.
pub struct Volume<'g> {
    gluster: &'g Gluster,
    host: String,
    name: String,
    home: PathBuf,
    /// Its two bricks.
    pub bricks: Vec<Brick>,
    mounts: Vec<(PathBuf, u32)>,
}

impl Volume<'_> {
    /// Find the bricks' and the self-heal daemon's processes (their command lines name the
    /// brick directory and the volume).
    fn find_pids(&mut self) -> Result<(), String> {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            for b in &mut self.bricks {
                let at = format!("--brick-name {} ", b.path.display());
                if let Some(pid) = pids_with(&["glusterfsd", &at]).into_iter().next() {
                    b.pid = pid;
                    self.gluster.record(pid);
                }
            }
            for pid in pids_with(&["glusterfs", &format!("shd/{} ", self.name)]) {
                self.gluster.record(pid);
            }
            if self.bricks.iter().all(|b| b.pid != 0) {
                return Ok(());
            }
            if Instant::now() > end {
                return Err(format!("bricks not running: {:?}", self.bricks));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Mount the volume once more (one mount per node); returns the mount point.
    pub fn mount(&mut self) -> Result<PathBuf, String> {
        self.mount_under(&[])
    }

    /// Mount the volume once more under the command `prefix` (which must exec `mount`, as
    /// `nsenter --net=...` does: the FUSE client then runs where the prefix put it).
    pub fn mount_under(&mut self, prefix: &[String]) -> Result<PathBuf, String> {
        let at = self.home.join(format!("mount{}", self.mounts.len()));
        std::fs::create_dir_all(&at).map_err(|e| e.to_string())?;
        output(
            crate::node::command_under(prefix, "mount")
                .args(["-t", "glusterfs"])
                .arg(format!("{}:/{}", self.host, self.name))
                .arg(&at),
        )?;
        let at_s = at.to_string_lossy().into_owned();
        let client = pids_with(&["glusterfs", &self.name, &at_s])
            .into_iter()
            .next()
            .ok_or_else(|| format!("no FUSE client process for {at_s}"))?;
        self.gluster.record(client);
        self.mounts.push((at.clone(), client));
        Ok(at)
    }

    /// Stop brick `i` (SIGSTOP: it holds its connections and answers nothing).
    pub fn stop_brick(&self, i: usize) {
        signal(self.bricks[i].pid, "STOP");
    }

    /// Continue brick `i` after [`Volume::stop_brick`].
    pub fn continue_brick(&self, i: usize) {
        signal(self.bricks[i].pid, "CONT");
    }

    /// Kill brick `i` (SIGKILL: its connections reset).
    pub fn kill_brick(&self, i: usize) {
        signal(self.bricks[i].pid, "KILL");
        gone_within(self.bricks[i].pid, Duration::from_secs(5));
    }
}

impl Drop for Volume<'_> {
    fn drop(&mut self) {
        for b in &self.bricks {
            signal(b.pid, "CONT");
        }
        for (at, client) in &self.mounts {
            unmount(at);
            end_process(*client, Duration::from_secs(2));
        }
        let _ = cli(&["volume", "stop", &self.name, "force"]);
        let _ = cli(&["volume", "delete", &self.name]);
        for b in &self.bricks {
            end_process(b.pid, Duration::from_secs(2));
        }
        let _ = std::fs::remove_dir_all(&self.home);
    }
}
