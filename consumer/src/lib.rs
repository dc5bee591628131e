//! The shotfleet worker.
