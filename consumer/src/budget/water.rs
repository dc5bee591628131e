//! Water levels: how full the card is, from everyone's usage, whatever the plan says.
//!
//! The budget plans from estimates; the water level is the check against what the card really
//! holds (an estimate that was wrong, another process that grew, an arena that did not shrink).

use super::config::BudgetConfig;

/// What the card's fill asks of the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Water {
    Normal,
    /// Above `lower_batch_at`: render smaller batches.
    Lower,
    /// Above `stop_fetch_at`: fetch nothing, shrink the arena.
    Stop,
}

impl Water {
    /// The level at `used_fraction` of the card.
    pub fn at(used_fraction: f64, config: &BudgetConfig) -> Self {
        if used_fraction > config.stop_fetch_at {
            Self::Stop
        } else if used_fraction > config.lower_batch_at {
            Self::Lower
        } else {
            Self::Normal
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_follow_the_configured_thresholds() {
        let config = BudgetConfig::default();
        assert_eq!(Water::at(0.10, &config), Water::Normal);
        assert_eq!(Water::at(0.70, &config), Water::Normal);
        assert_eq!(Water::at(0.85, &config), Water::Normal);
        assert_eq!(Water::at(0.86, &config), Water::Lower);
        assert_eq!(Water::at(0.92, &config), Water::Lower);
        assert_eq!(Water::at(0.93, &config), Water::Stop);
        let strict = BudgetConfig { stop_fetch_at: 0.5, lower_batch_at: 0.4, ..config };
        assert_eq!(Water::at(0.6, &strict), Water::Stop);
    }
}
