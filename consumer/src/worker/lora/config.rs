//! `[lora]`: where the LoRA library is, how much of it this worker keeps on disk, and how many
//! merged sets its pool keeps on the device and in host memory.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::budget::MIB;
use crate::library::LibraryConfig;
use crate::pipeline::lora::PoolLimits;

/// The `[lora]` section.
///
/// ```toml
/// [lora]
/// prefix = "_loras"                          # the library: <store url>/_loras
/// cache_dir = "/var/cache/shotfleet/loras"   # local copies; default <state_dir>/loras
/// cache_max_mib = 20480
/// max_file_mib = 1024                        # larger files are refused (as `lora push` does)
/// device_mib = 12000                         # sets kept on the device between jobs; default: half the idle room
/// host_mib = 16384                           # merged sets kept in host memory, placed again without a merge
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// The library's folder under the image store's url (`shotfleet lora push --prefix`).
    pub prefix: String,
    /// The local copies of LoRA files; unset: `<state_dir>/loras`.
    pub cache_dir: Option<PathBuf>,
    pub cache_max_mib: u64,
    pub max_file_mib: u64,
    /// The most merged sets may keep on the device between jobs (least recently used first
    /// out); unset: half the room the budget has beside the models at start. A job's set stays
    /// on the device while the job renders whatever this says, and the budget takes sets no
    /// render holds back before it refuses a job. `0`: no set outlives its jobs (on small
    /// cards, where a full-size SDXL set, 5.44 GiB, leaves too little room).
    pub device_mib: Option<u64>,
    /// The most merged sets kept in host memory, to place again without merging (one copy).
    pub host_mib: u64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        let library = LibraryConfig::default();
        Self {
            prefix: library.prefix,
            cache_dir: None,
            cache_max_mib: library.cache_max_mib,
            max_file_mib: library.max_file_mib,
            device_mib: None,
            // Three full-size SDXL sets.
            host_mib: 16 * 1024,
        }
    }
}

impl LoraConfig {
    /// Checks what can be checked at start.
    ///
    /// # Errors
    /// The setting (under `lora.`) and what is wrong with it.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let prefix = self.prefix.trim_matches('/');
        if prefix.is_empty() || prefix.split('/').any(|part| part.is_empty() || part == "." || part == "..") {
            return Err(("lora.prefix", format!("`{}` is not a folder under the store (e.g. \"_loras\")", self.prefix)));
        }
        if self.cache_max_mib == 0 {
            return Err(("lora.cache_max_mib", "must be at least 1".into()));
        }
        if self.max_file_mib == 0 {
            return Err(("lora.max_file_mib", "must be at least 1".into()));
        }
        Ok(())
    }

    /// The library's settings, the cache under `state_dir` unless `cache_dir` says otherwise.
    pub fn library(&self, state_dir: &Path) -> LibraryConfig {
        LibraryConfig {
            prefix: self.prefix.clone(),
            cache_dir: self.cache_dir.clone().unwrap_or_else(|| state_dir.join("loras")),
            cache_max_mib: self.cache_max_mib,
            max_file_mib: self.max_file_mib,
        }
    }

    /// The pool's limits on a card whose budget has `idle_room` bytes beside the models.
    pub fn pool_limits(&self, idle_room: u64) -> PoolLimits {
        PoolLimits { device_bytes: self.device_mib.map_or(idle_room / 2, |mib| mib * MIB), host_bytes: self.host_mib * MIB }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_lives_under_the_state_dir_unless_set() {
        let config: LoraConfig = toml::from_str("host_mib = 0").unwrap();
        assert_eq!(config.library(Path::new("/var/lib/shotfleet")).cache_dir, Path::new("/var/lib/shotfleet/loras"));
        assert_eq!(config.library(Path::new("/s")).prefix, "_loras");
        let set: LoraConfig = toml::from_str("cache_dir = \"/cache\"\ndevice_mib = 100").unwrap();
        assert_eq!(set.library(Path::new("/s")).cache_dir, Path::new("/cache"));
        assert_eq!(set.pool_limits(4000 * MIB), PoolLimits { device_bytes: 100 * MIB, host_bytes: 16 * 1024 * MIB });
        assert_eq!(config.pool_limits(4000 * MIB), PoolLimits { device_bytes: 2000 * MIB, host_bytes: 0 });
        assert!(toml::from_str::<LoraConfig>("cache_size = 1").is_err(), "unknown keys are refused");
    }

    #[test]
    fn bad_values_name_their_setting() {
        for (toml, setting) in [("prefix = \"../x\"", "lora.prefix"), ("prefix = \"/\"", "lora.prefix"), ("cache_max_mib = 0", "lora.cache_max_mib")] {
            let config: LoraConfig = toml::from_str(toml).unwrap();
            assert_eq!(config.validate().unwrap_err().0, setting, "{toml}");
        }
        LoraConfig::default().validate().unwrap();
    }
}
