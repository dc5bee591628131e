//! `--gpus`: which cards of the box get a worker, and what each is called.
//!
//! `all` is every card CUDA sees; a list (`0,2`) counts as CUDA does (with
//! `CUDA_VISIBLE_DEVICES=2,3` set, `0` is card 2); `sim:4096,1024` is a box of simulated cards
//! for a CPU run, MiB each: explicit, never a fallback for a machine without NVML.
//!
//! A card's number N (`gpuN`: the worker's id, state folder, default port) is NVML's index, the
//! one `nvidia-smi` shows, whatever `CUDA_VISIBLE_DEVICES` says: a card keeps its name, its
//! calibrations and its port when the selection changes. A simulated card's number is its place
//! in the list.

use std::str::FromStr;

use crate::budget::{CardInfo, MIB, ProbeError, Visible};
use crate::config::DeviceKind;

/// What `--gpus` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    All,
    /// Cards by CUDA's numbering.
    Listed(Vec<u32>),
    /// Simulated cards of these totals, MiB.
    Simulated(Vec<u64>),
}

impl FromStr for Selection {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text == "all" {
            return Ok(Self::All);
        }
        let (list, simulated) = match text.strip_prefix("sim:") {
            Some(rest) => (rest, true),
            None => (text, false),
        };
        let numbers: Vec<u64> = list
            .split(',')
            .map(|n| n.trim().parse::<u64>())
            .collect::<Result<_, _>>()
            .map_err(|_| format!("`{text}` is not `all`, GPU numbers (`0,2`) or simulated GPUs in MiB (`sim:4096,1024`)"))?;
        if simulated {
            if numbers.contains(&0) {
                return Err(format!("`{text}`: a simulated GPU needs some memory, e.g. `sim:4096,1024`"));
            }
            return Ok(Self::Simulated(numbers));
        }
        let listed: Vec<u32> = numbers.iter().map(|&n| u32::try_from(n)).collect::<Result<_, _>>().map_err(|_| format!("`{text}`: not a GPU number"))?;
        if let Some(twice) = listed.iter().enumerate().find_map(|(i, n)| listed[..i].contains(n).then_some(*n)) {
            return Err(format!("`{text}` lists GPU {twice} twice; one worker per GPU"));
        }
        Ok(Self::Listed(listed))
    }
}

/// One card of the box.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Card {
    /// N of `gpuN`.
    pub number: u32,
    /// What the card's worker gets as its only visible card (`CUDA_VISIBLE_DEVICES`); `None` for
    /// a simulated card.
    pub uuid: Option<String>,
    pub name: String,
    pub total_mib: u64,
}

impl Card {
    pub fn label(&self) -> String {
        format!("gpu{}", self.number)
    }

    pub fn simulated(&self) -> bool {
        self.uuid.is_none()
    }
}

/// Why the cards could not be chosen.
#[derive(Debug, thiserror::Error)]
pub enum CardsError {
    /// `--gpus` does not fit the device or the machine.
    #[error("--gpus: {0}")]
    Selection(String),
    /// NVML could not list the cards.
    #[error("cannot list the GPUs: {0}")]
    Nvml(#[from] ProbeError),
}

/// The cards `selection` names on a box of `device`s, CUDA seeing `visible`.
///
/// # Errors
/// A selection that does not fit the device or the cards there are; NVML unavailable.
pub fn select(selection: &Selection, device: DeviceKind, visible: &Visible) -> Result<Vec<Card>, CardsError> {
    match (selection, device) {
        (Selection::Simulated(totals), DeviceKind::Cpu) => Ok(totals
            .iter()
            .enumerate()
            .map(|(i, &total_mib)| Card { number: i as u32, uuid: None, name: "simulated".into(), total_mib })
            .collect()),
        (Selection::Simulated(_), DeviceKind::Cuda) => Err(CardsError::Selection(
            "simulated GPUs (`sim:...`) are for `device = \"cpu\"`; a CUDA box lists its cards: `--gpus all` or `--gpus 0,1`".into(),
        )),
        (_, DeviceKind::Cpu) => Err(CardsError::Selection(
            "a CPU box has no GPUs to find: give it simulated ones, e.g. `--gpus sim:4096,1024` (MiB each), or `device = \"cuda\"`".into(),
        )),
        (Selection::All, DeviceKind::Cuda) => {
            let cards = crate::budget::visible_cards(visible)?;
            if cards.is_empty() {
                return Err(CardsError::Selection("no GPU is visible (CUDA_VISIBLE_DEVICES may hide them all)".into()));
            }
            Ok(cards.into_iter().map(card).collect())
        }
        (Selection::Listed(ordinals), DeviceKind::Cuda) => {
            let cards = crate::budget::visible_cards(visible)?;
            pick(ordinals, cards)
        }
    }
}

fn card(info: CardInfo) -> Card {
    Card { number: info.index, uuid: Some(info.uuid), name: info.name, total_mib: info.total_bytes / MIB }
}

/// The cards at CUDA's `ordinals` among `visible`, CUDA's device 0 first.
fn pick(ordinals: &[u32], visible: Vec<CardInfo>) -> Result<Vec<Card>, CardsError> {
    ordinals
        .iter()
        .map(|&ordinal| {
            visible.get(ordinal as usize).cloned().map(card).ok_or_else(|| {
                let seen: Vec<String> =
                    visible.iter().enumerate().map(|(i, c)| format!("{i}: {} (nvidia-smi {}, {})", c.name, c.index, c.uuid)).collect();
                CardsError::Selection(format!(
                    "there is no GPU {ordinal}; CUDA sees {} here{}{}",
                    visible.len(),
                    if seen.is_empty() { "" } else { ": " },
                    seen.join(", ")
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_parse_or_say_what_is_wanted() {
        assert_eq!("all".parse(), Ok(Selection::All));
        assert_eq!(" 0,2 ".parse(), Ok(Selection::Listed(vec![0, 2])));
        assert_eq!("sim:4096, 1024".parse(), Ok(Selection::Simulated(vec![4096, 1024])));
        let bad = "gpu0".parse::<Selection>().unwrap_err();
        assert!(bad.contains("is not `all`, GPU numbers (`0,2`) or simulated GPUs"), "{bad}");
        assert!("1,1".parse::<Selection>().unwrap_err().contains("lists GPU 1 twice"));
        assert!("sim:0".parse::<Selection>().unwrap_err().contains("needs some memory"));
        assert!("".parse::<Selection>().is_err());
    }

    #[test]
    fn simulated_cards_are_numbered_in_order_and_only_on_the_cpu() {
        let cards = select(&Selection::Simulated(vec![4096, 1024]), DeviceKind::Cpu, &Visible::All).unwrap();
        assert_eq!(cards.iter().map(Card::label).collect::<Vec<_>>(), ["gpu0", "gpu1"]);
        assert_eq!((cards[1].total_mib, cards[1].simulated()), (1024, true));
        let on_cuda = select(&Selection::Simulated(vec![4096]), DeviceKind::Cuda, &Visible::All).unwrap_err();
        assert!(on_cuda.to_string().contains("are for `device = \"cpu\"`"), "{on_cuda}");
        let all_on_cpu = select(&Selection::All, DeviceKind::Cpu, &Visible::All).unwrap_err();
        assert!(all_on_cpu.to_string().contains("--gpus sim:4096,1024"), "{all_on_cpu}");
    }

    #[test]
    fn a_list_counts_as_cuda_does_and_names_cards_as_nvidia_smi_does() {
        // CUDA_VISIBLE_DEVICES=2,3 on an eight-card box: CUDA's 1 is nvidia-smi's 3.
        let visible = vec![
            CardInfo { index: 2, uuid: "GPU-aa".into(), name: "NVIDIA H200".into(), total_bytes: 143_771 * MIB },
            CardInfo { index: 3, uuid: "GPU-bb".into(), name: "NVIDIA H200".into(), total_bytes: 143_771 * MIB },
        ];
        let cards = pick(&[1], visible.clone()).unwrap();
        assert_eq!(cards, [Card { number: 3, uuid: Some("GPU-bb".into()), name: "NVIDIA H200".into(), total_mib: 143_771 }]);
        let missing = pick(&[2], visible).unwrap_err().to_string();
        assert!(missing.contains("there is no GPU 2; CUDA sees 2 here: 0: NVIDIA H200 (nvidia-smi 2, GPU-aa)"), "{missing}");
    }
}
