//! `CUDA_VISIBLE_DEVICES` read as CUDA reads it: which card is CUDA's device N.
//!
//! NVML numbers every card of the machine in PCI bus order whatever the variable says; CUDA
//! numbers only the cards the variable lists, in its order. With `CUDA_VISIBLE_DEVICES=2,3` a
//! worker's `--gpu 0` (CUDA's numbering: what ONNX Runtime is given) is NVML's card 2, so the
//! budget must read card 2. An entry is a card index (NVML's, which is CUDA's own only under
//! `CUDA_DEVICE_ORDER=PCI_BUS_ID`: CUDA's default order puts the fastest card first) or a card's
//! UUID (`GPU-…`, or a unique prefix of it), which names one card under any order. The box
//! supervisor gives each worker one UUID.

/// The variable CUDA reads.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";

/// One entry of `CUDA_VISIBLE_DEVICES`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CardRef {
    /// A card by its index in PCI bus order (NVML's index).
    Index(u32),
    /// A card by its UUID (`GPU-8e2f…`) or a unique prefix of it.
    Uuid(String),
    /// A MIG instance (`MIG-…`): a slice of a card, which the budget cannot read on its own.
    Mig(String),
}

/// The cards CUDA sees, in CUDA's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Visible {
    /// The variable is unset: every card; CUDA's device N is NVML's card N under
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID`.
    All,
    /// The cards the variable lists.
    Listed(Vec<CardRef>),
}

impl Visible {
    /// The variable's value as CUDA reads it: entries separated by commas; the first entry that
    /// is neither an index nor a UUID ends the list (CUDA ignores the rest, so `0,-1,1` is card
    /// 0 alone); an empty value hides every card.
    pub fn parse(value: Option<&str>) -> Self {
        let Some(value) = value else { return Self::All };
        let mut cards = Vec::new();
        for entry in value.split(',').map(str::trim) {
            let card = if let Ok(index) = entry.parse::<u32>() {
                CardRef::Index(index)
            } else if entry.starts_with("GPU-") {
                CardRef::Uuid(entry.to_owned())
            } else if entry.starts_with("MIG-") {
                CardRef::Mig(entry.to_owned())
            } else {
                break;
            };
            cards.push(card);
        }
        Self::Listed(cards)
    }

    /// This process's `CUDA_VISIBLE_DEVICES`: the one CUDA reads here, so the one that says which
    /// card this process's ONNX Runtime renders on.
    pub fn of_this_process() -> Self {
        Self::parse(std::env::var(CUDA_VISIBLE_DEVICES).ok().as_deref())
    }

    /// The card CUDA calls device `ordinal`.
    ///
    /// # Errors
    /// The variable lists fewer cards; the message says how many.
    pub fn card(&self, ordinal: u32) -> Result<CardRef, String> {
        match self {
            Self::All => Ok(CardRef::Index(ordinal)),
            Self::Listed(cards) => cards.get(ordinal as usize).cloned().ok_or_else(|| {
                format!(
                    "{CUDA_VISIBLE_DEVICES} makes {} card(s) visible (CUDA numbers them from 0), so there is no CUDA device {ordinal}",
                    cards.len()
                )
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_means_every_card_by_its_own_number() {
        assert_eq!(Visible::parse(None), Visible::All);
        assert_eq!(Visible::All.card(3), Ok(CardRef::Index(3)));
    }

    #[test]
    fn cuda_numbers_the_listed_cards_in_their_order() {
        let visible = Visible::parse(Some("2, 3"));
        assert_eq!(visible.card(0), Ok(CardRef::Index(2)));
        assert_eq!(visible.card(1), Ok(CardRef::Index(3)));
        let missing = visible.card(2).unwrap_err();
        assert!(missing.contains("makes 2 card(s) visible") && missing.contains("no CUDA device 2"), "{missing}");
    }

    #[test]
    fn uuids_and_mig_instances_are_named_as_given() {
        let visible = Visible::parse(Some("GPU-8e2f1c4a,MIG-5d1e"));
        assert_eq!(visible.card(0), Ok(CardRef::Uuid("GPU-8e2f1c4a".into())));
        assert_eq!(visible.card(1), Ok(CardRef::Mig("MIG-5d1e".into())));
    }

    #[test]
    fn the_first_entry_cuda_cannot_read_ends_the_list() {
        assert_eq!(Visible::parse(Some("0,-1,1")), Visible::Listed(vec![CardRef::Index(0)]));
        assert_eq!(Visible::parse(Some("")), Visible::Listed(vec![]));
        assert_eq!(Visible::parse(Some("none")), Visible::Listed(vec![]));
    }
}
