//! A network namespace joined to this one by a veth pair, for a node cut from the bricks: its
//! FUSE client (and the node) run in the namespace and reach the volume through the pair only.
//! Dropping the link cuts them off; the namespace (and with it the pair) is deleted on drop.

use std::process::Command;

/// The host's end of the pair: the address the volume's bricks are named by, reachable from
/// this namespace (a local address) and from the island (over the pair). Link-local, so the
/// traffic never leaves the pair.
pub const HOST_ADDR: &str = "169.254.78.1";
/// The island's end of the pair.
const ISLAND_ADDR: &str = "169.254.78.2";

/// The prefix every namespace this process makes starts with (the suite's last check looks
/// for it in `ip netns list`).
pub fn prefix() -> String {
    format!("kvxg{}", std::process::id() % 100_000)
}

/// Run `ip` with `args`.
fn ip(args: &[&str]) -> Result<(), String> {
    crate::volume::output(Command::new("ip").args(args)).map(drop)
}

/// The names in `ip netns list` that this process made (empty when all are gone).
pub fn left() -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let mine = prefix();
    out.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&mine))
        .map(str::to_string)
        .collect()
}

/// A namespace linked to this one by a veth pair (`HOST_ADDR` here, `ISLAND_ADDR` there).
pub struct Island {
    name: String,
    host_end: String,
    island_end: String,
}

impl Island {
    /// Make the namespace and the pair, both ends up.
    pub fn create() -> Result<Island, String> {
        let name = prefix();
        let island = Island {
            host_end: format!("{name}h"),
            island_end: format!("{name}i"),
            name,
        };
        // From here on, Drop deletes whatever was made.
        ip(&["netns", "add", &island.name])?;
        ip(&[
            "link",
            "add",
            &island.host_end,
            "type",
            "veth",
            "peer",
            "name",
            &island.island_end,
        ])?;
        ip(&["link", "set", &island.island_end, "netns", &island.name])?;
        ip(&[
            "addr",
            "add",
            &format!("{HOST_ADDR}/30"),
            "dev",
            &island.host_end,
        ])?;
        ip(&[
            "-n",
            &island.name,
            "addr",
            "add",
            &format!("{ISLAND_ADDR}/30"),
            "dev",
            &island.island_end,
        ])?;
        ip(&["link", "set", &island.host_end, "up"])?;
        ip(&["-n", &island.name, "link", "set", "lo", "up"])?;
        island.restore()?;
        Ok(island)
    }

    /// The command prefix that runs a program in the namespace (network only: it keeps this
    /// mount namespace, so mounts made under it are seen here).
    pub fn enter(&self) -> Vec<String> {
        vec!["nsenter".into(), format!("--net=/run/netns/{}", self.name)]
    }

    /// Drop the link: the island's end goes down, and nothing it sends reaches the bricks.
    pub fn cut(&self) -> Result<(), String> {
        ip(&["-n", &self.name, "link", "set", &self.island_end, "down"])
    }

    /// Bring the link back up.
    pub fn restore(&self) -> Result<(), String> {
        ip(&["-n", &self.name, "link", "set", &self.island_end, "up"])
    }
}

impl Drop for Island {
    fn drop(&mut self) {
        // The host's end first (the namespace's goes with it), then the namespace.
        let _ = ip(&["link", "del", &self.host_end]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}
