//! NATS plumbing shared by producers and workers: how to connect (`connect`, and with the `cli`
//! feature the flags for it, `args`), and the topology.
//!
//! This is the one part of the contract that needs a NATS client, so it sits behind the `nats`
//! feature; the rest of the crate stays usable from a fuzz target or a tool with no network.

#[cfg(feature = "cli")]
pub mod args;
pub mod connect;
pub mod outcome;
pub mod ping;
pub mod topology;

#[cfg(feature = "cli")]
pub use args::NatsArgs;
pub use connect::{ConnectError, NatsOptions, redact};
pub use ping::ping;
pub use topology::{Topology, TopologyError, TopologyReport};

/// The value of header `name` in `headers`, the name's case ignored: NATS keeps names as
/// written, and clients in other languages write `content-type` (a Python dict, Node's
/// `headers.set`). The name as written here wins where both are present.
pub fn header_value(headers: &async_nats::HeaderMap, name: &str) -> Option<String> {
    let value = headers.get(name).or_else(|| {
        let mut named = headers.iter().filter(|(key, _)| AsRef::<str>::as_ref(*key).eq_ignore_ascii_case(name));
        named.next().and_then(|(_, values)| values.first())
    });
    value.map(|v| v.as_str().to_owned())
}

/// Deletes the message at `sequence` of `stream`. One already gone (deleted by another client
/// first, as two replays or a replay and a worker may) is no error: it is gone either way. The
/// server's code for a missing message differs between versions, so it is looked for instead.
///
/// # Errors
/// The delete's own error, when the message is still there or cannot be looked for.
pub async fn delete_stored(stream: &async_nats::jetstream::stream::Stream, sequence: u64) -> Result<(), String> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    match stream.delete_message(sequence).await {
        Ok(_) => Ok(()),
        Err(e) => match stream.get_raw_message(sequence).await {
            Err(gone) if gone.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(()),
            _ => Err(e.to_string()),
        },
    }
}

/// The Content-Type of a message ([`crate::encoding::HEADER`], any case).
pub fn content_type(headers: &async_nats::HeaderMap) -> Option<String> {
    header_value(headers, crate::encoding::HEADER)
}

/// A header map from `(name, value)` pairs, never panicking: async-nats panics on a value with
/// a CR or LF, so a value that is not a valid header value (it never should be: build values
/// with [`crate::failure::header_safe`] or from validated ids) is made safe first.
pub fn header_map<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    for (name, value) in pairs {
        let value = value
            .parse::<async_nats::HeaderValue>()
            .unwrap_or_else(|_| crate::failure::header_safe(value).parse().expect("header_safe values are header values"));
        headers.insert(name, value);
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_is_found_whatever_the_case_of_its_name() {
        let headers = header_map([("content-type", "application/msgpack")]);
        assert_eq!(content_type(&headers).as_deref(), Some("application/msgpack"));
        let both = header_map([("CONTENT-TYPE", "text/plain"), ("Content-Type", "application/json")]);
        assert_eq!(content_type(&both).as_deref(), Some("application/json"), "the exact name wins");
        assert_eq!(content_type(&header_map([])), None);
    }
}
