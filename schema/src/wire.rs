//! How a job's fields are read from what producers in other languages really send, where the
//! derive alone would refuse a payload a person meant well, or name its value wrongly:
//!
//! - `null` for a field that may be left out reads as left out (`images: null` as one image,
//!   `loras: null` as none): Python's `None` and JavaScript's `null` are how many clients write
//!   "not set", and `negative_prompt` and `floor` read it so already.
//! - A whole number written as a float (`128.0`, Python's `768 * 1.0`) reads as that integer:
//!   JSON has one number type, and JSON Schema's `integer` is any number without a fraction.
//!   Floats past 2^53 are refused, since the digits the producer meant are already gone.
//! - A number past its field's type is named as it was sent (`1e308 is past a 32-bit float`),
//!   rather than as what a cast made of it (`inf`), or as a float when it was an integer too
//!   large for 64 bits (serde_json reads those as floats).
//!
//! Each is a `deserialize_with` function for [`crate::job`]'s fields.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// 2^53: from here on a 64-bit float no longer holds every integer (2^53 + 1 reads as 2^53).
const EXACT_IN_FLOAT: f64 = 9_007_199_254_740_992.0;

/// An unsigned integer field's type: its largest value.
pub(crate) trait Unsigned: TryFrom<u64> + Copy {
    const MAX: u64;
}

impl Unsigned for u32 {
    const MAX: u64 = u32::MAX as u64;
}

impl Unsigned for u64 {
    const MAX: u64 = u64::MAX;
}

/// An unsigned integer, from an integer or a float without a fraction.
pub(crate) fn whole<'de, D: Deserializer<'de>, T: Unsigned>(deserializer: D) -> Result<T, D::Error> {
    deserializer.deserialize_any(WholeVisitor(PhantomData))
}

/// `images`: absent or `null` is one image.
pub(crate) fn images<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    Ok(Option::<Whole<u32>>::deserialize(deserializer)?.map_or(1, |images| images.0))
}

/// A field whose absence reads as its default: `null` reads so too.
pub(crate) fn null_as_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(deserializer: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// A 32-bit float field (`guidance`, a LoRA's weight): a number past what one holds is refused
/// as sent. Not-a-number and infinities (MessagePack can carry them) pass to validation, which
/// names them with the field's bounds.
pub(crate) fn float32<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f32, D::Error> {
    let value = f64::deserialize(deserializer)?;
    #[allow(clippy::cast_possible_truncation)] // Rounds to the nearest; past the range, infinite.
    let narrowed = value as f32;
    // A finite value that rounds to infinity, not one printed as `3.4028235e38` (the largest
    // 32-bit float as every language prints it, a hair above it as a 64-bit float).
    if value.is_finite() && narrowed.is_infinite() {
        return Err(de::Error::custom(format!("{value:e} is past what a 32-bit float holds (about ±3.4e38)")));
    }
    Ok(narrowed)
}

/// A whole number, for fields read through [`Option`].
pub(crate) struct Whole<T>(pub T);

impl<'de, T: Unsigned> Deserialize<'de> for Whole<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        whole(deserializer).map(Whole)
    }
}

struct WholeVisitor<T>(PhantomData<T>);

impl<T: Unsigned> WholeVisitor<T> {
    fn past_max<E: de::Error>(shown: impl fmt::Display) -> E {
        E::custom(format!("{shown} is past the largest value this field holds, {}", T::MAX))
    }
}

impl<T: Unsigned> Visitor<'_> for WholeVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a whole number in 0..={}", T::MAX)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<T, E> {
        T::try_from(value).map_err(|_| Self::past_max(value))
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<T, E> {
        match u64::try_from(value) {
            Ok(value) => self.visit_u64(value),
            Err(_) => Err(E::custom(format!("{value} is negative; expected {}", Expecting(&self)))),
        }
    }

    fn visit_u128<E: de::Error>(self, value: u128) -> Result<T, E> {
        u64::try_from(value).map_or_else(|_| Err(Self::past_max(value)), |value| self.visit_u64(value))
    }

    fn visit_i128<E: de::Error>(self, value: i128) -> Result<T, E> {
        match u64::try_from(value) {
            Ok(value) => self.visit_u64(value),
            Err(_) if value < 0 => Err(E::custom(format!("{value} is negative; expected {}", Expecting(&self)))),
            Err(_) => Err(Self::past_max(value)),
        }
    }

    fn visit_f64<E: de::Error>(self, value: f64) -> Result<T, E> {
        // `{:?}`: 1e-320 or -1e300 in a few characters, not hundreds of digits that would push
        // the reason off the end of a detail cut at 300 bytes.
        if value.is_nan() || value.fract() != 0.0 {
            return Err(E::custom(format!("{value:?} is not a whole number; expected {}", Expecting(&self))));
        }
        if value < 0.0 {
            return Err(E::custom(format!("{value:?} is negative; expected {}", Expecting(&self))));
        }
        // An integer too large for 64 bits reaches here too, as serde_json reads it. `MAX + 1`
        // is exact as a float (a power of two), where u64's `MAX` itself rounds up to it.
        #[allow(clippy::cast_precision_loss)]
        if value >= T::MAX as f64 + 1.0 {
            return Err(Self::past_max(format_args!("{value:e}")));
        }
        if value >= EXACT_IN_FLOAT {
            return Err(E::custom(format!(
                "{value:e} was sent as a float, which holds every integer only below 2^53: send the integer itself, without a decimal point or exponent"
            )));
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // Whole, 0..2^53.
        self.visit_u64(value as u64)
    }

    fn visit_f32<E: de::Error>(self, value: f32) -> Result<T, E> {
        self.visit_f64(f64::from(value))
    }
}

/// A visitor's `expecting` as text, for messages of its own.
struct Expecting<'a, V>(&'a V);

impl<'de, V: Visitor<'de>> fmt::Display for Expecting<'_, V> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.0.expecting(f)
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    struct Fields {
        #[serde(deserialize_with = "super::whole")]
        small: u32,
        #[serde(default, deserialize_with = "super::whole")]
        seed: u64,
        #[serde(default = "nan", deserialize_with = "super::float32")]
        scale: f32,
    }

    fn nan() -> f32 {
        f32::NAN
    }

    fn read(json: &str) -> Result<Fields, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn whole_numbers_are_read_from_integers_and_floats_without_a_fraction() {
        assert_eq!(read(r#"{"small": 128}"#).unwrap().small, 128);
        assert_eq!(read(r#"{"small": 128.0}"#).unwrap().small, 128);
        assert_eq!(read(r#"{"small": 1.28e2}"#).unwrap().small, 128);
        assert_eq!(read(r#"{"small": 1, "seed": 18446744073709551615}"#).unwrap().seed, u64::MAX);
        assert_eq!(read(r#"{"small": 1, "seed": 9007199254740991.0}"#).unwrap().seed, (1 << 53) - 1);
        assert_eq!(read(r#"{"small": -0.0}"#).unwrap().small, 0);
        assert_eq!(read(r#"{"small": 4294967295.0}"#).unwrap().small, u32::MAX);
    }

    #[test]
    fn numbers_that_are_no_field_value_are_named_as_sent() {
        let refused = |json: &str, says: &str| {
            let error = read(json).expect_err(json);
            assert!(error.contains(says), "{json}: {error}");
        };
        refused(r#"{"small": 128.5}"#, "128.5 is not a whole number; expected a whole number in 0..=4294967295");
        refused(r#"{"small": -3}"#, "-3 is negative");
        refused(r#"{"small": -3.0}"#, "-3.0 is negative");
        refused(r#"{"small": 1e-320}"#, "1e-320 is not a whole number");
        refused(r#"{"small": -1e300}"#, "-1e300 is negative");
        refused(r#"{"small": 4294967296.0}"#, "past the largest value this field holds, 4294967295");
        // 2^53 + 1 written as a float reads as 2^53: neither is taken.
        refused(r#"{"small": 1, "seed": 9007199254740993.0}"#, "below 2^53");
        refused(r#"{"small": 4294967296}"#, "4294967296 is past the largest value this field holds, 4294967295");
        refused(r#"{"small": "128"}"#, "expected a whole number");
        // 2^64: an integer serde_json can only read as a float.
        refused(r#"{"small": 1, "seed": 18446744073709551616}"#, "1.8446744073709552e19 is past the largest value this field holds, 18446744073709551615");
        refused(r#"{"small": 1, "seed": 1e19}"#, "was sent as a float");
        refused(r#"{"small": 1, "scale": 1e308}"#, "1e308 is past what a 32-bit float holds");
    }

    #[test]
    fn a_32_bit_float_keeps_its_value() {
        assert!((read(r#"{"small": 1, "scale": 7.5}"#).unwrap().scale - 7.5).abs() < f32::EPSILON);
        // The largest 32-bit float, as serde_json, Python and JavaScript print it.
        let largest = serde_json::to_string(&f32::MAX).unwrap();
        assert_eq!(read(&format!(r#"{{"small": 1, "scale": {largest}}}"#)).unwrap().scale, f32::MAX);
        assert!((read(r#"{"small": 1, "scale": 3}"#).unwrap().scale - 3.0).abs() < f32::EPSILON);
    }
}
