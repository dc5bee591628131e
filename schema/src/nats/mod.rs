//! NATS plumbing shared by producers and workers: how to connect (`connect`, and with the `cli`
//! feature the flags for it, `args`), and the topology.
//!
//! This is the one part of the contract that needs a NATS client, so it sits behind the `nats`
//! feature; the rest of the crate stays usable from a fuzz target or a tool with no network.

#[cfg(feature = "cli")]
pub mod args;
pub mod connect;
pub mod topology;

#[cfg(feature = "cli")]
pub use args::NatsArgs;
pub use connect::{ConnectError, NatsOptions, redact};
pub use topology::{Topology, TopologyError, TopologyReport};
