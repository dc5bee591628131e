//! NATS plumbing shared by producers and workers: how to connect (`connect`, and with the `cli`
//! feature the flags for it, `args`), and the topology.
//!
//! This is the one part of the contract that needs a NATS client, so it sits behind the `nats`
//! feature; the rest of the crate stays usable from a fuzz target or a tool with no network.

#[cfg(feature = "cli")]
pub mod args;
pub mod connect;
pub mod ping;
pub mod topology;

#[cfg(feature = "cli")]
pub use args::NatsArgs;
pub use connect::{ConnectError, NatsOptions, redact};
pub use ping::ping;
pub use topology::{Topology, TopologyError, TopologyReport};

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
