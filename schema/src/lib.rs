//! The wire contract.
