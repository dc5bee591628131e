//! Which memory classes a worker serves: the `classes` setting, and what the calibrated budget
//! can hold of each ([`ClassReport`]).
//!
//! A worker serves a class only if its budget, idle and fresh from calibration, holds one image
//! of the class's largest size (the shape admission asks about before each fetch) and no probe
//! at or below that size ran out of memory. With `classes = "auto"` that decides which classes
//! it serves; with a list, which of the listed ones. Decided once at start: a worker started on
//! a crowded card serves more after a restart on an emptier one.

use std::fmt;
use std::ops::Deref;
use std::str::FromStr;

use serde::Deserialize;
use shotfleet_schema::MemoryClass;

use super::calibration::Calibration;
use super::estimate::Shape;
use super::probe::ProbeError;
use super::{Budget, MIB};

/// The `classes` setting: the classes a worker may serve, or `"auto"` for every class its card
/// can hold. Dereferences to the candidates (every class for `auto`), which calibration narrows
/// down to what the worker serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Classes {
    /// Every class one image of whose largest size the calibrated budget holds.
    Auto,
    /// These classes, of which those the card can hold are served.
    List(Vec<MemoryClass>),
}

impl Default for Classes {
    fn default() -> Self {
        Self::List(MemoryClass::ALL.to_vec())
    }
}

impl Deref for Classes {
    type Target = [MemoryClass];

    fn deref(&self) -> &[MemoryClass] {
        match self {
            Self::Auto => MemoryClass::ALL,
            Self::List(classes) => classes,
        }
    }
}

impl fmt::Display for Classes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::List(classes) => f.write_str(&classes.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(",")),
        }
    }
}

impl FromStr for Classes {
    type Err = String;

    /// `auto`, or classes separated by commas: `xs,s,m`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.trim() == "auto" {
            return Ok(Self::Auto);
        }
        Self::list(text.split(','))
    }
}

impl Classes {
    fn list<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        let classes = names
            .into_iter()
            .map(|name| name.trim().parse::<MemoryClass>().map_err(|e| format!("{e}, or write \"auto\" alone")))
            .collect::<Result<_, _>>()?;
        Ok(Self::List(classes))
    }
}

impl<'de> Deserialize<'de> for Classes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Word(String),
            List(Vec<String>),
        }
        match Written::deserialize(d) {
            Ok(Written::Word(word)) => word.parse(),
            Ok(Written::List(names)) => Self::list(names.iter().map(String::as_str)),
            Err(_) => Err("write \"auto\" or a list of classes such as [\"xs\", \"s\", \"m\"]".to_owned()),
        }
        .map_err(serde::de::Error::custom)
    }
}

/// Whether the worker serves a class, and why not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// One image of the class's largest size is planned to need `planned` bytes of `room`.
    Serves { planned: u64, room: u64 },
    /// `classes` lists other classes only.
    NotConfigured,
    /// The probe of `probe`, which fits within the class's largest size, ran out of memory: the
    /// card's ceiling.
    OutOfMemory { probe: Shape },
    /// One image of the class's largest size is planned to need `planned` bytes: more than the
    /// `room` beside the models.
    OverBudget { planned: u64, room: u64 },
}

impl Hold {
    /// The metric label: `fits`, `not_configured`, `out_of_memory`, `over_budget`.
    pub const fn reason(&self) -> &'static str {
        match self {
            Self::Serves { .. } => "fits",
            Self::NotConfigured => "not_configured",
            Self::OutOfMemory { .. } => "out_of_memory",
            Self::OverBudget { .. } => "over_budget",
        }
    }
}

/// One class and whether the worker serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassHold {
    pub class: MemoryClass,
    /// The class's largest one-image shape: what admission asks about.
    pub shape: Shape,
    pub hold: Hold,
}

impl fmt::Display for ClassHold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (class, w, h) = (self.class, self.shape.width, self.shape.height);
        match self.hold {
            Hold::Serves { planned, room } => {
                write!(f, "{class}: served (one {w}x{h} image plans {} MiB of {} MiB of room)", planned / MIB, room / MIB)
            }
            Hold::NotConfigured => write!(f, "{class}: not served (not in `classes`)"),
            Hold::OutOfMemory { probe } => write!(
                f,
                "{class}: not served (out of memory: the {}x{}x{} probe ran out at start, so {w}x{h} is past this card's ceiling)",
                probe.width, probe.height, probe.images
            ),
            Hold::OverBudget { planned, room } => write!(
                f,
                "{class}: not served (over budget: one {w}x{h} image plans {} MiB, the room beside the models is {} MiB)",
                planned / MIB,
                room / MIB
            ),
        }
    }
}

/// Every class and whether the worker serves it, smallest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassReport {
    pub holds: Vec<ClassHold>,
}

impl ClassReport {
    /// What `budget`, fresh from `calibration` and idle (arenas shrunk), holds of each class
    /// that `classes` allows.
    ///
    /// # Errors
    ///
    /// The card could not be read.
    pub fn of(classes: &Classes, budget: &Budget, calibration: &Calibration) -> Result<Self, ProbeError> {
        let room = budget.status()?.available;
        let holds = MemoryClass::ALL
            .iter()
            .map(|&class| {
                let shape = budget.class_shape(class);
                let planned = budget.planned(shape.width, shape.height, shape.images);
                let hold = if !classes.contains(&class) {
                    Hold::NotConfigured
                } else if let Some(probe) = calibration.ceiling_under(shape) {
                    Hold::OutOfMemory { probe }
                } else if planned > room {
                    Hold::OverBudget { planned, room }
                } else {
                    Hold::Serves { planned, room }
                };
                ClassHold { class, shape, hold }
            })
            .collect();
        Ok(Self { holds })
    }

    /// The classes served, smallest first.
    pub fn served(&self) -> Vec<MemoryClass> {
        self.holds.iter().filter(|h| matches!(h.hold, Hold::Serves { .. })).map(|h| h.class).collect()
    }

    /// One line per class, for `/readyz` and error messages.
    pub fn lines(&self) -> String {
        self.holds.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_is_auto_or_a_list() {
        #[derive(Deserialize)]
        struct Config {
            classes: Classes,
        }
        let parse = |text: &str| toml::from_str::<Config>(text).map(|c| c.classes).map_err(|e| e.to_string());
        assert_eq!(parse("classes = \"auto\"").unwrap(), Classes::Auto);
        assert_eq!(parse("classes = [\"xs\", \"m\"]").unwrap(), Classes::List(vec![MemoryClass::Xs, MemoryClass::M]));
        assert!(parse("classes = \"automatic\"").unwrap_err().contains("unknown memory class `automatic`"));
        assert!(parse("classes = [\"xs\", \"huge\"]").unwrap_err().contains("unknown memory class `huge`"));
        assert!(parse("classes = 3").unwrap_err().contains("write \"auto\" or a list"));
        assert_eq!("auto".parse::<Classes>().unwrap(), Classes::Auto);
        assert_eq!("xs, s".parse::<Classes>().unwrap(), Classes::List(vec![MemoryClass::Xs, MemoryClass::S]));
        // The candidates: every class for auto.
        assert_eq!(&*Classes::Auto, MemoryClass::ALL);
        assert_eq!(Classes::List(vec![MemoryClass::S]).to_string(), "s");
    }
}
