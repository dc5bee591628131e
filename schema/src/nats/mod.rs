//! NATS plumbing shared by producers and workers: how to connect, and the topology.
//!
//! This is the one part of the contract that needs a NATS client, so it sits behind the `nats`
//! feature; the rest of the crate stays usable from a fuzz target or a tool with no network.

pub mod connect;
pub mod topology;

pub use connect::{ConnectError, NatsOptions};
pub use topology::{Topology, TopologyError, TopologyReport};
