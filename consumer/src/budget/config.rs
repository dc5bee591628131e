//! The `[budget]` section of the worker's config.

use serde::{Deserialize, Serialize};

use super::probe::GpuSnapshot;
use super::share;

/// Bytes in a mebibyte; config speaks MiB, the budget bytes.
pub const MIB: u64 = 1024 * 1024;

/// How much of the card the worker may plan with, and when to hold back.
///
/// Fractions are of the card's total memory as NVML reports it (or the simulation's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BudgetConfig {
    /// The worker never plans beyond this fraction of the card.
    pub max_fill: f64,
    /// Held back from the card on top of the resident models: CUDA context growth, cuDNN
    /// workspaces, fragmentation.
    pub reserve_mib: u64,
    /// Kept free on the card whatever the plan says, so another process's small allocation
    /// does not fail because of us.
    pub margin_mib: u64,
    /// Above this used fraction stop fetching (and shrink the arena).
    pub stop_fetch_at: f64,
    /// Above this used fraction render smaller batches.
    pub lower_batch_at: f64,
    /// Added on top of every estimated need, as a fraction of it.
    pub safety: f64,
    /// The side of the largest square an `xl` job may ask for (the schema's `max_side`); the
    /// class has no upper bound of its own.
    pub xl_max_side: u32,
    /// How many recent observed peaks the estimate keeps fitting on.
    pub learn_window: usize,
    /// How long one GPU snapshot answers queries; NVML calls are cheap but not free.
    pub snapshot_max_age_ms: u64,
    /// Let the VAE decoder keep its arena between decodes (`PipelineOptions::vae_keeps_arena`):
    /// about 5% faster per 1024x1024 image on an H200, but a decode's peak then depends on what
    /// ran before, and the estimate, fitted to probes that start from shrunk arenas, can run
    /// low (+40% at 768x768 x 4 on 2026-11-30). Off by default: the budget's figures hold.
    pub vae_keeps_arena: bool,
    /// Every job's render gives its arenas back at its end, so the next one starts from the
    /// models alone and its observed peak is its own: with `concurrency = 1` the estimate then
    /// learns from every job and `shotfleet_estimate_error_ratio{start="cold"}` covers them all.
    /// The UNet's arena goes back before the VAE decodes, so a job's peak is the larger of the
    /// two, not their sum; the calibration probes render the same way. Costs the arenas'
    /// regrowth per job. Off by default; for measuring the budget on a card (the GPU lease's
    /// 1,000-job run).
    pub cold_renders: bool,
    /// The most of its card this worker may use, MiB: its models, its renders and `reserve_mib`
    /// together. For sharing one large card between workers (give each its share) or for
    /// behaving as a smaller card on a large one. The worker then takes its card to be
    /// `min(card, max_mib)` large, with only this process's own usage in it (others' usage counts
    /// only where it leaves less free): the budget, the water levels, the metrics' card size and
    /// the arenas' limits (the CUDA arena's `gpu_mem_limit`; on the CPU, the capped arena, see
    /// `cpu_arena_max_mib`) all follow it ([`BudgetConfig::view`]). Unset: the whole card.
    pub max_mib: Option<u64>,
    /// A simulated GPU for CPU runs and tests. Required with `device = "cpu"`, never implied.
    pub simulate: Option<SimulateConfig>,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        Self {
            max_fill: 0.90,
            reserve_mib: 512,
            margin_mib: 256,
            stop_fetch_at: 0.92,
            lower_batch_at: 0.85,
            safety: 0.10,
            xl_max_side: 2048,
            learn_window: 64,
            snapshot_max_age_ms: 75,
            vae_keeps_arena: false,
            cold_renders: false,
            max_mib: None,
            simulate: None,
        }
    }
}

/// The most a simulated card may hold, MiB (1 TiB).
const SIMULATED_MAX_MIB: u64 = 1 << 20;

/// More memory than any card holds (the largest in 2026 hold 288 GB), MiB: a bound for slips.
const LARGEST_CARD_MIB: u64 = 512 * 1024;

/// A "GPU" of `total_mib` whose used memory is this process's resident memory plus
/// `others_used_mib` that other processes are pretending to hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimulateConfig {
    pub total_mib: u64,
    #[serde(default)]
    pub others_used_mib: u64,
}

/// A config value outside what the budget can work with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("budget.{field}: {message}")]
pub struct ConfigError {
    pub field: &'static str,
    pub message: String,
}

impl BudgetConfig {
    /// Checks the values once at start, so a typo'd fraction fails loudly instead of admitting
    /// nothing (or everything).
    ///
    /// # Errors
    ///
    /// The first field out of range, with the range it must lie in.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fraction = |field, value: f64| {
            if value > 0.0 && value <= 1.0 {
                Ok(())
            } else {
                Err(ConfigError { field, message: format!("{value} is not a fraction in (0, 1]") })
            }
        };
        fraction("max_fill", self.max_fill)?;
        fraction("stop_fetch_at", self.stop_fetch_at)?;
        fraction("lower_batch_at", self.lower_batch_at)?;
        if self.lower_batch_at >= self.stop_fetch_at {
            return Err(ConfigError {
                field: "lower_batch_at",
                message: format!(
                    "water levels must rise: lower_batch_at ({}) < stop_fetch_at ({})",
                    self.lower_batch_at, self.stop_fetch_at
                ),
            });
        }
        if !(0.0..=4.0).contains(&self.safety) {
            return Err(ConfigError { field: "safety", message: format!("{} is outside 0..=4", self.safety) });
        }
        if self.xl_max_side == 0 {
            return Err(ConfigError { field: "xl_max_side", message: "must be positive".into() });
        }
        if self.learn_window == 0 {
            return Err(ConfigError { field: "learn_window", message: "must keep at least one observation".into() });
        }
        // Held back from every card: more than any card holds is a slip, which would else
        // surface after the models loaded as "this card holds nothing".
        for (field, value) in [("reserve_mib", self.reserve_mib), ("margin_mib", self.margin_mib)] {
            if value > LARGEST_CARD_MIB {
                return Err(ConfigError { field, message: format!("{value} is more than any card holds ({LARGEST_CARD_MIB} MiB)") });
            }
        }
        if let Some(max) = self.max_mib
            && max <= self.reserve_mib + self.margin_mib
        {
            return Err(ConfigError {
                field: "max_mib",
                message: format!(
                    "{max} leaves nothing for renders beside reserve_mib ({}) and margin_mib ({}); give the worker more of the card",
                    self.reserve_mib, self.margin_mib
                ),
            });
        }
        if let Some(sim) = &self.simulate {
            // The largest card sold holds 192 GiB; a simulation far above any is a slip (and
            // its bytes would overflow).
            if sim.total_mib == 0 || sim.total_mib > SIMULATED_MAX_MIB {
                return Err(ConfigError { field: "simulate.total_mib", message: format!("{} is outside 1..={SIMULATED_MAX_MIB}", sim.total_mib) });
            }
            if sim.others_used_mib >= sim.total_mib {
                return Err(ConfigError {
                    field: "simulate.others_used_mib",
                    message: format!("{} leaves nothing of total_mib {}", sim.others_used_mib, sim.total_mib),
                });
            }
            if self.reserve_mib + self.margin_mib >= sim.total_mib {
                return Err(ConfigError {
                    field: "reserve_mib",
                    message: format!(
                        "reserve_mib ({}) and margin_mib ({}) leave nothing of the simulated card's total_mib ({})",
                        self.reserve_mib, self.margin_mib, sim.total_mib
                    ),
                });
            }
        }
        Ok(())
    }

    /// The card as this worker may use it: `snapshot` itself, or with `max_mib` this worker's
    /// share of it (see `share.rs`).
    pub fn view(&self, snapshot: GpuSnapshot) -> GpuSnapshot {
        match self.max_mib {
            Some(max) => share::within(snapshot, max * MIB),
            None => snapshot,
        }
    }

    /// What ONNX Runtime's arena may grow to on the card of `snapshot` (taken before the models
    /// load): all the budget could ever plan with, `min(total x max_fill, free - margin) -
    /// reserve` of the worker's [view](Self::view), so the arena and the budget agree on the
    /// card's size. The models are not taken off: their weights live outside the arena.
    pub fn arena_limit(&self, snapshot: GpuSnapshot) -> u64 {
        let card = self.view(snapshot);
        let cap = ((card.total as f64 * self.max_fill) as u64).min(card.free.saturating_sub(self.margin_bytes()));
        cap.saturating_sub(self.reserve_bytes())
    }

    pub(crate) fn reserve_bytes(&self) -> u64 {
        self.reserve_mib * MIB
    }

    pub(crate) fn margin_bytes(&self) -> u64 {
        self.margin_mib * MIB
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_unknown_keys_are_refused() {
        BudgetConfig::default().validate().unwrap();
        let parsed: BudgetConfig = toml::from_str("simulate = { total_mib = 4096 }").unwrap();
        assert_eq!(parsed.simulate, Some(SimulateConfig { total_mib: 4096, others_used_mib: 0 }));
        assert_eq!(parsed.max_fill, 0.90);
        assert!(toml::from_str::<BudgetConfig>("max_fil = 0.5").is_err());
        assert!(toml::from_str::<BudgetConfig>("[simulate]\ntotal_mib = 1\nx = 1").is_err());
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        let bad = BudgetConfig { max_fill: 1.5, ..BudgetConfig::default() };
        assert_eq!(bad.validate().unwrap_err().field, "max_fill");
        let upside_down = BudgetConfig { lower_batch_at: 0.95, ..BudgetConfig::default() };
        assert_eq!(upside_down.validate().unwrap_err().field, "lower_batch_at");
        let full = BudgetConfig {
            simulate: Some(SimulateConfig { total_mib: 100, others_used_mib: 100 }),
            ..BudgetConfig::default()
        };
        assert_eq!(full.validate().unwrap_err().field, "simulate.others_used_mib");
        let no_room = BudgetConfig { max_mib: Some(768), ..BudgetConfig::default() };
        assert_eq!(no_room.validate().unwrap_err().field, "max_mib");
        assert!(toml::from_str::<BudgetConfig>("max_mib = 12288").unwrap().validate().is_ok());
    }

    #[test]
    fn the_arena_limit_follows_the_share() {
        let card = |total_mib: u64, used_mib: u64| GpuSnapshot {
            device: "card".into(),
            total: total_mib * MIB,
            used: used_mib * MIB,
            free: (total_mib - used_mib) * MIB,
            own_used: None,
            utilization: None,
            temperature_c: None,
        };
        let whole = BudgetConfig::default();
        // 0.9 of 143771 MiB, less the 512 MiB reserve.
        assert_eq!(whole.arena_limit(card(143_771, 600)), (143_771.0 * 0.9 * MIB as f64) as u64 - 512 * MIB);
        // 0.9 of a 12 GiB share, less the reserve, whatever the card.
        let share = BudgetConfig { max_mib: Some(12_288), ..BudgetConfig::default() };
        assert_eq!(share.arena_limit(card(143_771, 600)), (12_288.0 * 0.9 * MIB as f64) as u64 - 512 * MIB);
        // Another tenant leaves 5 GiB free: free less the margin binds, share or not.
        assert_eq!(share.arena_limit(card(143_771, 143_771 - 5120)), (5120 - 256 - 512) * MIB);
    }
}
