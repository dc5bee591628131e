//! The `[supervisor]` section: how `--gpus` runs its workers, and what each GPU's worker does
//! differently from the rest.
//!
//! ```toml
//! [supervisor]
//! listen = "127.0.0.1:9399"        # the box's /healthz, /readyz, /status, /metrics (SHOTFLEET_BOX_ADDR)
//! metrics_ports = [9400, 9401]     # each worker's port, in the order of --gpus; default: the
//!                                  # [telemetry] listen port + N for gpuN (9400 + N)
//! restart_backoff = "1s"           # the first restart's delay, doubling per quick exit ...
//! max_restart_backoff = "5m"       # ... up to this
//! store_backoff = "5m"             # at least this after exit 77 (the object store refuses)
//! stable_after = "10m"             # a worker that ran this long starts its backoff afresh
//!
//! [supervisor.gpu.1]               # any worker setting, for gpu1's worker only
//! classes = ["xs", "s"]
//! budget = { max_mib = 20000 }
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

/// Settings the supervisor sets itself for each worker: a `[supervisor.gpu.N]` table may not.
pub const SET_PER_WORKER: &[(&str, &str)] = &[
    ("worker_id", "the supervisor names each worker <box>/gpuN"),
    ("gpu", "the supervisor gives each worker its card"),
    ("device", "every worker of a box runs on the same kind of device"),
    ("state_dir", "each worker's state folder is <state_dir>/gpuN"),
    ("telemetry", "each worker's port comes from `[supervisor] metrics_ports` or the [telemetry] port + N"),
    ("supervisor", "a worker does not supervise"),
];

/// `[supervisor]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SupervisorConfig {
    /// The box's health and status port (`SHOTFLEET_BOX_ADDR`). Loopback by default, as the
    /// workers' ports are.
    pub listen: SocketAddr,
    /// Each worker's metrics and health port, in the order of `--gpus`; empty: the `[telemetry]`
    /// listen port + N for gpuN, as `shotfleet-consumer@N.service` uses.
    pub metrics_ports: Vec<u16>,
    /// The delay before the first restart after a quick exit; it doubles with each further one.
    #[serde(with = "humantime_serde")]
    pub restart_backoff: Duration,
    /// The longest delay between restarts: a card that keeps faulting is tried this often.
    #[serde(with = "humantime_serde")]
    pub max_restart_backoff: Duration,
    /// The least delay after exit 77 (the object store refused for good): every worker of the box
    /// shares the store, and restarting helps only once a person fixed it.
    #[serde(with = "humantime_serde")]
    pub store_backoff: Duration,
    /// A worker that ran this long before it exited restarts with the first delay again.
    #[serde(with = "humantime_serde")]
    pub stable_after: Duration,
    /// Worker settings for one GPU (`[supervisor.gpu.N]`, N as in `gpuN`), merged over the rest
    /// of the file: tables key by key, other values replaced.
    pub gpu: BTreeMap<String, toml::Table>,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9399)),
            metrics_ports: Vec::new(),
            restart_backoff: Duration::from_secs(1),
            max_restart_backoff: Duration::from_secs(300),
            store_backoff: Duration::from_secs(300),
            stable_after: Duration::from_secs(600),
            gpu: BTreeMap::new(),
        }
    }
}

impl SupervisorConfig {
    /// Checks the values and the per-GPU tables' names and keys.
    ///
    /// # Errors
    /// The first bad setting, named as in the file, and what to do.
    pub fn validate(&self) -> Result<(), String> {
        if self.restart_backoff.is_zero() {
            return Err("supervisor.restart_backoff: must be above 0 (a worker that exits at once would be restarted in a loop)".into());
        }
        if self.max_restart_backoff < self.restart_backoff {
            return Err(format!(
                "supervisor.max_restart_backoff: {:?} is below restart_backoff ({:?})",
                self.max_restart_backoff, self.restart_backoff
            ));
        }
        for (number, table) in &self.gpu {
            if number.parse::<u32>().is_err() {
                return Err(format!("supervisor.gpu.{number}: name the table by the GPU's number, e.g. [supervisor.gpu.1]"));
            }
            if let Some((key, why)) = SET_PER_WORKER.iter().find(|(key, _)| table.contains_key(*key)) {
                return Err(format!("supervisor.gpu.{number}.{key}: set by the supervisor ({why}); remove it"));
            }
        }
        Ok(())
    }

    /// The overrides of gpuN, if any.
    pub fn overrides(&self, number: u32) -> Option<&toml::Table> {
        self.gpu.get(&number.to_string())
    }
}

/// `over` merged into `base`: tables key by key, anything else replaced.
pub fn merge(base: &mut toml::Table, over: &toml::Table) {
    for (key, value) in over {
        match (base.get_mut(key), value) {
            (Some(toml::Value::Table(inner)), toml::Value::Table(over_inner)) => merge(inner, over_inner),
            _ => {
                base.insert(key.clone(), value.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_merge_table_by_table() {
        let mut base: toml::Table = toml::from_str("classes = \"auto\"\n[budget]\nreserve_mib = 64\n[faults]\nmark_images = true").unwrap();
        let over: toml::Table = toml::from_str("classes = [\"xs\"]\n[budget]\nmax_mib = 800\n[calibration]\nsteps = 1").unwrap();
        merge(&mut base, &over);
        let expected: toml::Table = toml::from_str(
            "classes = [\"xs\"]\n[budget]\nreserve_mib = 64\nmax_mib = 800\n[faults]\nmark_images = true\n[calibration]\nsteps = 1",
        )
        .unwrap();
        assert_eq!(base, expected);
    }

    #[test]
    fn per_gpu_tables_are_named_by_number_and_leave_the_supervisors_settings_alone() {
        let parse = |text: &str| toml::from_str::<SupervisorConfig>(text).unwrap().validate();
        assert_eq!(parse("[gpu.1]\nclasses = [\"xs\"]"), Ok(()));
        let named = parse("[gpu.small]\nclasses = [\"xs\"]").unwrap_err();
        assert!(named.contains("supervisor.gpu.small: name the table by the GPU's number"), "{named}");
        let id = parse("[gpu.0]\nworker_id = \"x\"").unwrap_err();
        assert!(id.starts_with("supervisor.gpu.0.worker_id: set by the supervisor"), "{id}");
        let port = parse("[gpu.0.telemetry]\nlisten = \"127.0.0.1:1\"").unwrap_err();
        assert!(port.starts_with("supervisor.gpu.0.telemetry: set by the supervisor"), "{port}");
        assert!(parse("restart_backoff = \"0s\"").unwrap_err().starts_with("supervisor.restart_backoff"));
        assert!(parse("restart_backoff = \"10s\"\nmax_restart_backoff = \"1s\"").unwrap_err().starts_with("supervisor.max_restart_backoff"));
        assert!(toml::from_str::<SupervisorConfig>("restart = 1").is_err(), "unknown keys are refused");
    }
}
