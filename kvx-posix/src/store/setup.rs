//! Opening a store: check each root, scan it, make the spares, start the I/O engine and the
//! lanes beside it.

use std::sync::Arc;

use kvx_core::Notifier;
use rustc_hash::{FxHashMap, FxHashSet};

use super::PosixStore;
use crate::config::{Capabilities, PosixConfig};
use crate::error::PosixError;
use crate::health::Health;
use crate::io::EngineOverride;
use crate::paths::Layout;
use crate::store::handle::{Counters, StoreState};
use crate::store::index::{Index, scan};
use crate::store::root_check::takes_direct;

impl PosixStore {
    /// [`PosixStore::open`] with the engine changed as `over` says (tests).
    pub(crate) fn open_with(
        cfg: PosixConfig,
        over: EngineOverride,
    ) -> Result<PosixStore, PosixError> {
        cfg.validate()?;
        for r in &cfg.roots {
            if r.as_os_str().as_encoded_bytes().contains(&0) {
                return Err(PosixError::BadConfig(format!(
                    "root {r:?} contains a NUL byte"
                )));
            }
        }
        let direct = cfg
            .roots
            .iter()
            .map(|r| takes_direct(r, cfg.direct))
            .collect::<Result<Vec<bool>, _>>()?;
        let inline: Vec<bool> = cfg
            .roots
            .iter()
            .map(|r| cfg.inline_io && crate::store::root_check::is_local_fs(r))
            .collect();
        let layout = Layout::new(cfg.roots.clone());
        let found = scan(&layout, cfg.stale_temp_age)?;
        let with_spares: Vec<bool> = inline.iter().map(|i| *i && cfg.shared.is_none()).collect();
        let spares = crate::spare::Spares::open(
            &cfg.roots,
            &with_spares,
            cfg.spare_files,
            cfg.spare_file_len(),
            cfg.spare_refill,
            format!("{}-{}", layout.host(), std::process::id()),
        )?;
        let recycling = spares
            .as_ref()
            .is_some_and(crate::spare::Spares::recycles)
            .then(crate::spare::recycle::Recycling::default);
        let mut dirs: FxHashSet<(usize, u16)> = found.dirs.into_iter().collect();
        if spares.is_some() {
            dirs.extend(crate::spare::make_fan_out_dirs(&cfg.roots, &with_spares)?);
        }
        let (board, io_engine) = crate::io::start(&cfg, over)?;
        let caps = Capabilities {
            io_engine: cfg.io_engine,
            direct: direct.iter().all(|d| *d),
            direct_per_root: direct.clone(),
            inline_per_root: inline.clone(),
            scanned_blocks: found.keys.len(),
            removed_temps: found.removed_temps,
        };
        let touch = match &cfg.shared {
            Some(m) if m.touch_on_load => {
                Some(crate::shared_mount::touch::TouchLane::start().map_err(|e| {
                    PosixError::Engine {
                        engine: "touch",
                        msg: format!("cannot start the touch thread: {e}"),
                    }
                })?)
            }
            _ => None,
        };
        let index = Index::default();
        index.extend(found.keys);
        let health = Health::new(&cfg.roots, cfg.breaker)?;
        let name = format!(
            "posix:{}",
            cfg.roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        tracing::info!(store = %name, engine = %cfg.io_engine, direct = caps.direct,
            blocks = caps.scanned_blocks, removed_temps = caps.removed_temps, "posix store opened");
        Ok(PosixStore {
            name,
            state: Arc::new(StoreState {
                index,
                health,
                layout,
                io_engine,
                board,
                caps,
                counters: Counters::default(),
                probes: cfg
                    .shared
                    .clone()
                    .map(crate::shared_mount::probe_cache::ProbeTable::new),
                touch,
                key_order: Default::default(),
                spares,
                listing: std::sync::Mutex::new(None),
            }),
            direct,
            inline,
            dirs,
            ops: FxHashMap::default(),
            ready: Vec::new(),
            notifier: Notifier::noop(),
            recycling,
            cfg,
        })
    }
}
