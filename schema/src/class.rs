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

use serde::{Deserialize, Serialize};


/// A job's memory class, smallest first (the order is meaningful: `Xs < S < ... < Xl`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::Display,
    strum::VariantArray,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase", parse_err_ty = String, parse_err_fn = crate::names::unknown::<MemoryClass>)]
pub enum MemoryClass {
    Xs,
    S,
    M,
    L,
    Xl,
}

crate::named!(MemoryClass, "memory class");

impl MemoryClass {
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
            .iter()
            .copied()
            .find(|class| class.max_pixels().is_none_or(|max| pixels <= max))
            .unwrap_or(Self::Xl)
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
        for &class in MemoryClass::ALL {
            assert_eq!(class.as_str().parse::<MemoryClass>(), Ok(class));
        }
        assert_eq!("auto".parse::<MemoryClass>().unwrap_err(), "unknown memory class `auto`; expected xs, s, m, l or xl");
    }
}
