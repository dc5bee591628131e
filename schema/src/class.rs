//! Memory classes: a job's footprint, known before its payload is opened.
//!
//! The class is computed from one image's pixel count (`width x height`); a worker renders a
//! job's images in sub-batches its budget can hold, so the image count does not enter. The
//! thresholds follow the common SDXL sizes, so each class holds one family of shapes:
//!
//! | class | one image's pixels up to | typical sizes |
//! | --- | --- | --- |
//! | `xs` | 262,144 (512 x 512) | 512x512, 384x640 |
//! | `s` | 589,824 (768 x 768) | 768x768, 640x896 |
//! | `m` | 1,048,576 (1024 x 1024) | 1024x1024, 896x1152, 832x1216 |
//! | `l` | 2,359,296 (1536 x 1536) | 1536x1536, 1216x1824 |
//! | `xl` | anything larger | 2048x2048 |

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A job's memory class, smallest first (the order is meaningful: `Xs < S < ... < Xl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryClass {
    Xs,
    S,
    M,
    L,
    Xl,
}

impl MemoryClass {
    /// Every class, smallest first.
    pub const ALL: [MemoryClass; 5] = [Self::Xs, Self::S, Self::M, Self::L, Self::Xl];

    /// The largest pixel count of one image in this class (`None` for `xl`: unbounded).
    pub const fn max_pixels(self) -> Option<u64> {
        match self {
            Self::Xs => Some(512 * 512),
            Self::S => Some(768 * 768),
            Self::M => Some(1024 * 1024),
            Self::L => Some(1536 * 1536),
            Self::Xl => None,
        }
    }

    /// The class of one `width x height` image.
    pub fn of_size(width: u32, height: u32) -> Self {
        let pixels = u64::from(width) * u64::from(height);
        Self::ALL
            .into_iter()
            .find(|class| class.max_pixels().is_none_or(|max| pixels <= max))
            .unwrap_or(Self::Xl)
    }

    /// The subject token.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Xs => "xs",
            Self::S => "s",
            Self::M => "m",
            Self::L => "l",
            Self::Xl => "xl",
        }
    }
}

impl fmt::Display for MemoryClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MemoryClass {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|class| class.as_str() == s)
            .ok_or_else(|| format!("unknown memory class `{s}`; expected one of xs, s, m, l, xl"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_are_inclusive_upper_bounds() {
        assert_eq!(MemoryClass::of_size(512, 512), MemoryClass::Xs);
        assert_eq!(MemoryClass::of_size(512, 520), MemoryClass::S);
        assert_eq!(MemoryClass::of_size(768, 768), MemoryClass::S);
        assert_eq!(MemoryClass::of_size(1024, 1024), MemoryClass::M);
        assert_eq!(MemoryClass::of_size(832, 1216), MemoryClass::M);
        assert_eq!(MemoryClass::of_size(1024, 1032), MemoryClass::L);
        assert_eq!(MemoryClass::of_size(1536, 1536), MemoryClass::L);
        assert_eq!(MemoryClass::of_size(2048, 2048), MemoryClass::Xl);
        assert_eq!(MemoryClass::of_size(64, 64), MemoryClass::Xs);
    }

    #[test]
    fn classes_are_ordered_by_size_and_round_trip() {
        assert!(MemoryClass::Xs < MemoryClass::Xl);
        for class in MemoryClass::ALL {
            assert_eq!(class.as_str().parse::<MemoryClass>(), Ok(class));
        }
        assert!("auto".parse::<MemoryClass>().is_err());
    }
}
