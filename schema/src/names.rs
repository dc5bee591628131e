//! Enums whose variants are names on the wire and on the command line (priorities, memory
//! classes, failure reasons): strum derives their names, their list and their parsing; this
//! module gives a parse failure the message a person can act on ("expected p0, p1 or p2").
//!
//! An enum takes part with `#[derive(strum::EnumString, strum::IntoStaticStr,
//! strum::Display, strum::VariantArray)]`, `#[strum(serialize_all = "...", parse_err_ty =
//! String, parse_err_fn = crate::names::unknown::<Type>)]` and `named!(Type, "what it is")`,
//! which gives it `Type::ALL` and `as_str()` from the derive.

use strum::VariantArray;

/// A wire enum: its variants, names and what it is called in messages.
pub trait Named: VariantArray + Copy + Into<&'static str> + 'static {
    /// What one value is, for messages: `priority`, `memory class`.
    const WHAT: &'static str;
}

/// `impl Named` for a strum-derived enum, and the inherent `ALL` (every variant, in declaration
/// order) and `as_str()` (the wire name) its users call.
#[macro_export]
macro_rules! named {
    ($type:ty, $what:literal) => {
        impl $crate::names::Named for $type {
            const WHAT: &'static str = $what;
        }

        impl $type {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$type] = <$type as strum::VariantArray>::VARIANTS;

            /// The wire name.
            pub fn as_str(self) -> &'static str {
                self.into()
            }
        }
    };
}

/// The parse error of a [`Named`] enum: `unknown priority `p3`; expected p0, p1 or p2`.
pub fn unknown<T: Named>(text: &str) -> String {
    format!("unknown {} `{text}`; expected {}", T::WHAT, listed::<T>())
}

/// The known name nearest to `unknown` (case aside), when it is a typo or two away and the two
/// share more than they differ (so `id` or `n` is not taken for `v`): for "did you mean" in
/// messages about a misspelt field or column.
pub fn nearest<'a>(unknown: &str, known: &[&'a str]) -> Option<&'a str> {
    let unknown = unknown.to_lowercase();
    let near = known.iter().map(|known| (strsim::levenshtein(&unknown, known), *known)).min_by_key(|(distance, _)| *distance);
    near.filter(|(distance, known)| *distance <= 2 && distance * 2 < unknown.chars().count().max(known.len())).map(|(_, known)| known)
}

/// The names, `a, b or c`.
pub fn listed<T: Named>() -> String {
    let names: Vec<&str> = T::VARIANTS.iter().map(|v| (*v).into()).collect();
    match names.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::nearest;

    #[test]
    fn a_typo_is_near_its_field_and_a_short_name_is_near_nothing() {
        let known = ["v", "width", "images", "loras", "negative_prompt"];
        assert_eq!(nearest("lora", &known), Some("loras"));
        assert_eq!(nearest("Widht", &known), Some("width"));
        assert_eq!(nearest("negativ_prompt", &known), Some("negative_prompt"));
        for far in ["id", "n", "", "ts", "client_ref"] {
            assert_eq!(nearest(far, &known), None, "{far}");
        }
    }
}
