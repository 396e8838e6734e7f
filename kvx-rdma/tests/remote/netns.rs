//! Two network namespaces joined by a veth pair, made and removed by the test.

use std::process::Command;

/// Run `ip` with `args`; the error names the command and its stderr.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Whether this process may create network namespaces (probes by making and removing one).
pub fn available() -> Result<(), String> {
    let name = format!("kvx5probe{}", std::process::id());
    ip(&["netns", "add", &name])?;
    ip(&["netns", "del", &name])
}

/// Namespaces `a` (producer, 169.254.77.1) and `b` (consumer, 169.254.77.2) linked by a veth
/// pair. Link-local addresses: the traffic never leaves the pair. Removed on drop, even when
/// the test panics.
pub struct Pair {
    pub a: String,
    pub b: String,
    pub veth_a: String,
}

pub const ADDR_A: &str = "169.254.77.1";

impl Pair {
    pub fn create() -> Result<Pair, String> {
        let id = std::process::id() % 100_000;
        let pair = Pair {
            a: format!("kvx5a{id}"),
            b: format!("kvx5b{id}"),
            veth_a: format!("kvx5va{id}"),
        };
        let veth_b = format!("kvx5vb{id}");
        // From here on, Drop cleans up whatever was made.
        ip(&["netns", "add", &pair.a])?;
        ip(&["netns", "add", &pair.b])?;
        ip(&[
            "link",
            "add",
            &pair.veth_a,
            "type",
            "veth",
            "peer",
            "name",
            &veth_b,
        ])?;
        ip(&["link", "set", &pair.veth_a, "netns", &pair.a])?;
        ip(&["link", "set", &veth_b, "netns", &pair.b])?;
        ip(&[
            "-n",
            &pair.a,
            "addr",
            "add",
            &format!("{ADDR_A}/30"),
            "dev",
            &pair.veth_a,
        ])?;
        ip(&[
            "-n",
            &pair.b,
            "addr",
            "add",
            "169.254.77.2/30",
            "dev",
            &veth_b,
        ])?;
        for (ns, dev) in [(&pair.a, &pair.veth_a), (&pair.b, &veth_b)] {
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        Ok(pair)
    }

    /// The `ip netns exec` prefix for namespace `ns`.
    pub fn exec(ns: &str) -> Vec<String> {
        ["ip", "netns", "exec", ns].map(String::from).to_vec()
    }

    /// Cut the link: the producer's side goes down.
    pub fn cut(&self) -> Result<(), String> {
        ip(&["-n", &self.a, "link", "set", &self.veth_a, "down"])
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it, and with it the pair.
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}
