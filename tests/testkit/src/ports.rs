//! Free TCP ports on the loopback interface.

use std::net::TcpListener;

/// A port nobody listens on right now. The kernel hands out ports in sequence, so the window in
/// which another process could take it before the server binds is small.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind a loopback port")
}
