//! Enums whose variants are names on the wire and on the command line (priorities, memory
//! classes, failure reasons): strum derives their names, their list and their parsing; this
//! module gives a parse failure the message a person can act on ("expected p0, p1 or p2").
//!
//! An enum takes part with `#[derive(strum::EnumString, strum::IntoStaticStr,
//! strum::Display, strum::VariantArray)]`, `#[strum(serialize_all = "...", parse_err_ty =
//! String, parse_err_fn = crate::names::unknown::<Type>)]` and an `impl Named`.

use strum::VariantArray;

/// A wire enum: its variants, names and what it is called in messages.
pub trait Named: VariantArray + Copy + Into<&'static str> + 'static {
    /// What one value is, for messages: `priority`, `memory class`.
    const WHAT: &'static str;

    /// The wire name.
    fn as_str(self) -> &'static str {
        self.into()
    }

    /// Every variant, in declaration order.
    fn all() -> &'static [Self] {
        Self::VARIANTS
    }
}

/// The parse error of a [`Named`] enum: `unknown priority `p3`; expected p0, p1 or p2`.
pub fn unknown<T: Named>(text: &str) -> String {
    format!("unknown {} `{text}`; expected {}", T::WHAT, listed::<T>())
}

/// The names, `a, b or c`.
pub fn listed<T: Named>() -> String {
    let names: Vec<&str> = T::all().iter().map(|v| v.as_str()).collect();
    match names.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// Parses a name (the strum derive does the matching, [`unknown`] the message).
///
/// # Errors
/// A message listing the names.
pub fn parse<T: Named + std::str::FromStr<Err = String>>(text: &str) -> Result<T, String> {
    text.parse()
}
