//! The shotfleet worker.
pub mod pipeline;
