//! A worker's share of its card (`[budget] max_mib`): the card as the worker may use it.
//!
//! A worker given `max` bytes of a larger card plans as if its card were `max` large and held
//! only this process's memory: another worker sharing the card has a share of its own, and its
//! usage says nothing about how full ours is. Others still count where they leave less free than
//! our share would (a card is only as free as it is). Where the driver cannot tell our own usage,
//! all the card's free memory is taken to be ours up to the share, so the share fills as the card
//! does: on the safe side, as the budget is elsewhere.

use super::probe::GpuSnapshot;

/// `snapshot` seen through a share of `max` bytes: the total is the share, used is this
/// process's own usage, free is what is left of the share and free on the card. A share as
/// large as the card is the card.
pub(crate) fn within(snapshot: GpuSnapshot, max: u64) -> GpuSnapshot {
    if max >= snapshot.total {
        return snapshot;
    }
    let total = max;
    let used = match snapshot.own_used {
        Some(own) => own.min(total),
        None => total - snapshot.free.min(total),
    };
    GpuSnapshot { total, used, free: snapshot.free.min(total - used), ..snapshot }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::MIB;

    fn card(total: u64, used: u64, own: Option<u64>) -> GpuSnapshot {
        GpuSnapshot {
            device: "card".into(),
            total: total * MIB,
            used: used * MIB,
            free: (total - used) * MIB,
            own_used: own.map(|o| o * MIB),
            utilization: None,
            temperature_c: None,
        }
    }

    #[test]
    fn a_share_holds_only_our_usage() {
        // 12 GiB of an H200 that another worker fills to 100 GiB; we hold 9 GiB of it.
        let seen = within(card(143_771, 109_000, Some(9000)), 12_288 * MIB);
        assert_eq!((seen.total, seen.used, seen.free), (12_288 * MIB, 9000 * MIB, 3288 * MIB));
        assert_eq!(seen.own_used, Some(9000 * MIB));
        assert!((seen.used_fraction() - 9000.0 / 12_288.0).abs() < 1e-12, "the water level is of the share");
    }

    #[test]
    fn a_crowded_card_leaves_the_share_less_free() {
        // The card has 2 GiB free: that much, not the 3 GiB left of the share.
        let seen = within(card(143_771, 141_723, Some(9000)), 12_288 * MIB);
        assert_eq!(seen.free, 2048 * MIB);
        // Our usage unknown: the card's free memory is all the share has.
        let blind = within(card(143_771, 141_723, None), 12_288 * MIB);
        assert_eq!((blind.used, blind.free), ((12_288 - 2048) * MIB, 2048 * MIB));
        let roomy = within(card(143_771, 600, None), 12_288 * MIB);
        assert_eq!((roomy.used, roomy.free), (0, 12_288 * MIB));
    }

    #[test]
    fn a_share_as_large_as_the_card_is_the_card() {
        let plain = card(24_576, 10_000, Some(9000));
        assert_eq!(within(plain.clone(), 80 * 1024 * MIB), plain);
        assert_eq!(within(plain.clone(), 24_576 * MIB), plain);
    }
}
