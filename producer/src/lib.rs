//! Producer library.
