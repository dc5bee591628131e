//! Payload encoding: MessagePack with named fields, or JSON, chosen by the `Content-Type` header.
//!
//! JSON is the default when the header is absent, so `nats pub` and curl-like tools work as
//! they are. Decoding is strict about what matters (the version, types, size) and lenient about
//! what does not (unknown fields are ignored, for forward compatibility).

use std::ops::Range;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::VERSION;
use crate::job::{self, FIELDS, JobIds, ShotJob, UnknownField};
use crate::validate::{Limits, MAX_ID_BYTES, ValidationError, id_problem};
use crate::{shallow, wire};

/// The `Content-Type` header's name.
pub const HEADER: &str = "Content-Type";

/// A UTF-8 byte order mark, which JSON must not start with (RFC 8259) but Windows tools write.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// No payload may be larger than this: a job is a prompt and a few numbers.
pub const MAX_PAYLOAD_BYTES: usize = 64 * 1024;

/// The two encodings a payload may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContentType {
    #[default]
    Json,
    MessagePack,
}

impl ContentType {
    /// The header value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Json => "application/json",
            Self::MessagePack => "application/msgpack",
        }
    }

    /// The format's name, for messages.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Json => "JSON",
            Self::MessagePack => "MessagePack",
        }
    }

    /// The other format: the one a payload sent under this one's name may really be.
    pub const fn other(self) -> Self {
        match self {
            Self::Json => Self::MessagePack,
            Self::MessagePack => Self::Json,
        }
    }

    /// Reads the header value; `None` (no header) means JSON. Parameters such as
    /// `; charset=utf-8` are ignored, and `application/x-msgpack` is accepted as an alias.
    ///
    /// # Errors
    /// [`DecodeError::UnsupportedContentType`] for anything else.
    pub fn from_header(value: Option<&str>) -> Result<Self, DecodeError> {
        let Some(value) = value else { return Ok(Self::Json) };
        let essence = value.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        match essence.as_str() {
            "application/json" | "" => Ok(Self::Json),
            "application/msgpack" | "application/x-msgpack" | "application/vnd.msgpack" => {
                Ok(Self::MessagePack)
            }
            _ => Err(DecodeError::UnsupportedContentType(value.to_owned())),
        }
    }
}

/// Why a payload could not be turned into a value.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeError {
    #[error("payload is {bytes} bytes; the limit is {limit} (a job is a prompt and a few numbers)")]
    TooLarge { bytes: usize, limit: usize },
    #[error("payload is empty")]
    Empty,
    #[error(
        "unsupported Content-Type `{0}`; use application/json (the default) or application/msgpack"
    )]
    UnsupportedContentType(String),
    #[error("JSON payload starts with a UTF-8 byte order mark; send UTF-8 without a BOM")]
    ByteOrderMark,
    #[error("malformed {format} payload at `{path}`: {detail}")]
    Malformed { format: &'static str, path: String, detail: String },
    #[error("contract version {found} is not supported; this side speaks v{VERSION}")]
    UnsupportedVersion { found: u64 },
    #[error("field `v` (contract version) is missing; set \"v\": {VERSION}")]
    MissingVersion,
}

/// A job that cannot be used, for either reason. Both are final: retrying does not help.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum InvalidJob {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    Invalid(#[from] ValidationError),
}

/// Encodes a value; MessagePack keeps field names so other languages read it as a map.
pub fn encode<T: Serialize>(content_type: ContentType, value: &T) -> Vec<u8> {
    match content_type {
        ContentType::Json => serde_json::to_vec(value).expect("contract types always serialize"),
        ContentType::MessagePack => {
            rmp_serde::to_vec_named(value).expect("contract types always serialize")
        }
    }
}

/// Decodes a job: size, encoding, version, then the fields. Does not validate bounds.
///
/// # Errors
/// A [`DecodeError`] naming the field or the byte that is wrong.
pub fn decode_job(content_type: Option<&str>, payload: &[u8]) -> Result<ShotJob, DecodeError> {
    let content_type = ContentType::from_header(content_type)?;
    if !is_a_map(content_type, payload) {
        // Checked first: serde would read an array as the fields in order, and its errors name
        // the probe's internals (`expected struct VersionProbe`, `array had incorrect length`).
        let detail = "a job is a map of named fields (a JSON object, or MessagePack written with field names)".into();
        return Err(DecodeError::Malformed { format: content_type.name(), path: ".".into(), detail });
    }
    let probe: VersionProbe = decode(content_type, payload)?;
    match probe.v.map(|v| v.0) {
        None => return Err(DecodeError::MissingVersion),
        Some(v) if v != u64::from(VERSION) => {
            return Err(DecodeError::UnsupportedVersion { found: v });
        }
        Some(_) => {}
    }
    decode(content_type, payload)
}

/// The ids of a job whose payload does not decode (a field of the wrong type, another version,
/// a wrong `Content-Type`), so that its producer can still be told why it failed: `job_id`
/// and `shot_id` where they are strings that are valid ids (`shot_id` is left empty
/// otherwise), and `project` as `subject_project`, the project the job was published under
/// (where its outcome belongs, whatever the payload says). Reads the payload as its header
/// says, else as JSON, else as MessagePack; `None` when no `job_id` can be read.
pub fn read_ids(content_type: Option<&str>, payload: &[u8], subject_project: &str) -> Option<JobIds> {
    let probe = probe_ids(content_type, payload)?;
    // Values, not strings, so that a wrongly typed id does not hide the other one.
    let id = |value: Option<serde_json::Value>| {
        value.and_then(|v| v.as_str().map(str::to_owned)).filter(|id| id_problem(id, MAX_ID_BYTES).is_none())
    };
    let job_id = id(probe.job_id)?;
    Some(JobIds { job_id, project: subject_project.to_owned(), shot_id: id(probe.shot_id).unwrap_or_default() })
}

/// The `job_id` a payload holds as a string, valid id or not, read as [`read_ids`] reads: for
/// naming a failed job whose id is no id (`a.b`, too long), which [`read_ids`] leaves out.
pub fn read_job_id_as_sent(content_type: Option<&str>, payload: &[u8]) -> Option<String> {
    probe_ids(content_type, payload)?.job_id.and_then(|id| id.as_str().map(str::to_owned))
}

/// A payload's ids, as values.
#[derive(Deserialize)]
struct IdsProbe {
    #[serde(default)]
    job_id: Option<serde_json::Value>,
    #[serde(default)]
    shot_id: Option<serde_json::Value>,
}

/// Reads a payload's ids leniently: as its header says, else as JSON, else as MessagePack; a
/// payload refused for its size or for bytes after the job, holding Python's `NaN`, or nesting
/// MessagePack deeper than a decode goes, still names its job.
fn probe_ids(content_type: Option<&str>, payload: &[u8]) -> Option<IdsProbe> {
    let payload = payload.strip_prefix(BOM).unwrap_or(payload);
    let declared = ContentType::from_header(content_type).ok();
    let probe = |payload: &[u8]| -> Option<IdsProbe> {
        [declared, Some(ContentType::Json), Some(ContentType::MessagePack)]
            .into_iter()
            .flatten()
            // A map, not fields in order: an array's first strings name no job.
            .filter(|content_type| starts_as_map(*content_type, payload))
            .find_map(|content_type| parse(content_type, payload, Rest::Ignored).ok())
    };
    probe(payload)
        .or_else(|| {
            let nulled = non_finite_as_null(payload)?;
            parse(ContentType::Json, &nulled, Rest::Ignored).ok()
        })
        .or_else(|| {
            // MessagePack nested deeper than a decode may go (JSON's ids are read past any
            // nesting: serde_json skips unknown values without recursion).
            let job_id = shallow::top_level_str(payload, "job_id")?;
            let shot_id = shallow::top_level_str(payload, "shot_id");
            Some(IdsProbe { job_id: Some(job_id.into()), shot_id: shot_id.map(Into::into) })
        })
}

/// The fields of a job payload that contract v1 does not know ([`job::unknown_fields`]),
/// sorted: ignored when the job is read (a newer producer's optional fields), and
/// named by a worker in the result's notes, so that a misspelt optional field (`lora`,
/// `negativePrompt`, `floor.min_step`) is not dropped unsaid. Empty for a payload that is no map.
pub fn unknown_job_fields(content_type: Option<&str>, payload: &[u8]) -> Vec<UnknownField> {
    let Ok(content_type) = ContentType::from_header(content_type) else { return Vec::new() };
    if let Ok(fields) = decode::<serde_json::Map<String, serde_json::Value>>(content_type, payload) {
        return job::unknown_fields(&fields, &FIELDS);
    }
    // A MessagePack value JSON has no form for (bytes, an extension, a map keyed by numbers)
    // in a field of the producer's own: the top level's names still.
    let Ok(fields) = decode::<std::collections::BTreeMap<String, serde::de::IgnoredAny>>(content_type, payload) else { return Vec::new() };
    let top: serde_json::Map<String, serde_json::Value> = fields.into_keys().map(|name| (name, serde_json::Value::Null)).collect();
    job::unknown_fields(&top, &FIELDS)
}

/// Decodes then validates a job: what a worker does with every message it fetches.
///
/// # Errors
/// [`InvalidJob`]: why the job can never be rendered.
pub fn parse_job(
    content_type: Option<&str>,
    payload: &[u8],
    limits: &Limits,
) -> Result<ShotJob, InvalidJob> {
    let job = decode_job(content_type, payload)?;
    job.validate(limits)?;
    Ok(job)
}

/// Decodes any contract value (results, for example) with the same checks as jobs.
///
/// # Errors
/// A [`DecodeError`] naming the field that is wrong.
pub fn decode<T: DeserializeOwned>(
    content_type: ContentType,
    payload: &[u8],
) -> Result<T, DecodeError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::TooLarge { bytes: payload.len(), limit: MAX_PAYLOAD_BYTES });
    }
    if payload.is_empty() {
        return Err(DecodeError::Empty);
    }
    parse(content_type, payload, Rest::Refused)
}

/// Whether bytes may follow the value: a job is one value per message, but its ids may still be
/// read from a payload with something after it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rest {
    Refused,
    Ignored,
}

fn parse<T: DeserializeOwned>(content_type: ContentType, payload: &[u8], rest: Rest) -> Result<T, DecodeError> {
    let after = |bytes: usize| DecodeError::Malformed {
        format: content_type.name(),
        path: ".".into(),
        detail: format!("{bytes} byte(s) follow the value; send one value per message"),
    };
    // Each format, sent under the other's name, is said to be so.
    let misnamed = |error: DecodeError| {
        let other = content_type.other();
        let header = match other {
            ContentType::Json => "application/json (or none)",
            ContentType::MessagePack => other.as_str(),
        };
        match error {
            DecodeError::Malformed { format, path, detail } if starts_as_map(other, payload) => DecodeError::Malformed {
                format,
                path,
                detail: format!("{detail} (this looks like {}: send it with `{HEADER}: {header}`)", other.name()),
            },
            error => error,
        }
    };
    match content_type {
        ContentType::Json => {
            if payload.starts_with(BOM) {
                return Err(DecodeError::ByteOrderMark);
            }
            let mut de = serde_json::Deserializer::from_slice(payload);
            let value = serde_path_to_error::deserialize(&mut de)
                .map_err(|e| not_json_numbers(misnamed(malformed(content_type, e)), payload))?;
            if rest == Rest::Refused {
                de.end().map_err(|e| DecodeError::Malformed { format: content_type.name(), path: ".".into(), detail: e.to_string() })?;
            }
            Ok(value)
        }
        ContentType::MessagePack => {
            let mut unread = payload;
            let value = {
                let mut de = rmp_serde::Deserializer::new(&mut unread);
                de.set_max_depth(MAX_MSGPACK_DEPTH);
                serde_path_to_error::deserialize(&mut de)
                    .map_err(|e| misnamed(malformed(content_type, e)))?
            };
            if rest == Rest::Refused && !unread.is_empty() {
                return Err(after(unread.len()));
            }
            Ok(value)
        }
    }
}

/// How deep MessagePack arrays and maps may nest, unknown fields included (a job nests three
/// levels). rmp-serde's own limit, 1,024, is deeper than a Tokio worker thread's 2 MiB stack
/// holds: 1,000 nested arrays, a 1 KB payload, would overflow it and abort the process
/// (serde_json stops at 128).
const MAX_MSGPACK_DEPTH: usize = 32;

fn malformed<E: std::fmt::Display>(
    content_type: ContentType,
    error: serde_path_to_error::Error<E>,
) -> DecodeError {
    DecodeError::Malformed {
        format: content_type.name(),
        path: error.path().to_string(),
        detail: error.inner().to_string(),
    }
}

/// Where a JSON payload holds `NaN`, `Infinity` or `-Infinity` as a value: no JSON, but what
/// Python's `json.dumps` writes for such floats unless told `allow_nan=False`.
fn non_finite_literals(payload: &[u8]) -> Vec<Range<usize>> {
    const LITERALS: [&[u8]; 3] = [b"NaN", b"Infinity", b"-Infinity"];
    let mut found = Vec::new();
    let (mut in_string, mut escaped) = (false, false);
    let mut at = 0;
    while at < payload.len() {
        let byte = payload[at];
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if byte == b'"' {
            in_string = true;
        } else if let Some(literal) = LITERALS.iter().find(|literal| payload[at..].starts_with(literal)) {
            found.push(at..at + literal.len());
            at += literal.len();
            continue;
        }
        at += 1;
    }
    found
}

/// A JSON payload with each of its [`non_finite_literals`] read as `null`; `None` when it has
/// none, or is no JSON map (MessagePack's strings have no quotes to skip them by).
fn non_finite_as_null(payload: &[u8]) -> Option<Vec<u8>> {
    if !starts_as_map(ContentType::Json, payload) {
        return None;
    }
    let literals = non_finite_literals(payload);
    if literals.is_empty() {
        return None;
    }
    let mut nulled = Vec::with_capacity(payload.len());
    let mut from = 0;
    for literal in literals {
        nulled.extend_from_slice(&payload[from..literal.start]);
        nulled.extend_from_slice(b"null");
        from = literal.end;
    }
    nulled.extend_from_slice(&payload[from..]);
    Some(nulled)
}

/// A JSON error, told why when the payload holds [`non_finite_literals`].
fn not_json_numbers(error: DecodeError, payload: &[u8]) -> DecodeError {
    match error {
        DecodeError::Malformed { format, path, detail }
            if starts_as_map(ContentType::Json, payload) && !non_finite_literals(payload).is_empty() =>
        {
            DecodeError::Malformed {
            format,
            path,
            detail: format!(
                    "{detail} (NaN and Infinity are no JSON numbers: Python's json.dumps writes them unless given allow_nan=False; send finite numbers)"
                ),
            }
        }
        error => error,
    }
}

/// Whether the payload starts as a map: `{` in JSON (after white space), a map marker in
/// MessagePack (fixmap, map 16, map 32).
fn starts_as_map(content_type: ContentType, payload: &[u8]) -> bool {
    match content_type {
        ContentType::Json => payload.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{'),
        ContentType::MessagePack => payload.first().is_some_and(|b| matches!(b, 0x80..=0x8f | 0xde | 0xdf)),
    }
}

/// Whether a job payload is a map, or something [`decode`] names better (an empty or oversized
/// payload, a byte order mark, one format sent under the other's name).
fn is_a_map(content_type: ContentType, payload: &[u8]) -> bool {
    let named_by_decode = payload.is_empty()
        || payload.len() > MAX_PAYLOAD_BYTES
        || payload.starts_with(BOM)
        || starts_as_map(content_type.other(), payload);
    named_by_decode || starts_as_map(content_type, payload)
}

/// Reads only `v`, so a payload of another version is named as such rather than failing on
/// whichever field changed.
#[derive(Deserialize)]
struct VersionProbe {
    #[serde(default)]
    v: Option<wire::Whole<u64>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_type_header_is_read_leniently() {
        assert_eq!(ContentType::from_header(None), Ok(ContentType::Json));
        assert_eq!(
            ContentType::from_header(Some("Application/MsgPack; q=1")),
            Ok(ContentType::MessagePack)
        );
        assert!(matches!(
            ContentType::from_header(Some("text/plain")),
            Err(DecodeError::UnsupportedContentType(_))
        ));
    }
}
