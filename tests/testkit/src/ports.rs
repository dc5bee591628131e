//! Free TCP ports on the loopback interface, never handed out twice while a test process lives.
//!
//! Binding port 0 and dropping the listener is not enough: the kernel may hand the same
//! ephemeral port to the next bind (a CI run got a NATS server whose client and monitor ports
//! were one port, and the server died on "address already in use"), and another test process,
//! or any outgoing connection, may take it before the server binds. So a port comes from below
//! the kernel's ephemeral range (no outgoing connection is given one of those), and a test
//! process reserves it with a lock file that it holds until it exits: two test processes running
//! side by side never pick the same port, and a server restarted on its port finds it still ours.

use std::collections::hash_map::RandomState;
use std::fs::File;
use std::hash::BuildHasher;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Mutex;

/// The lock files of the ports this process holds; kept open (and so locked) until it exits.
static RESERVED: Mutex<Vec<File>> = Mutex::new(Vec::new());

/// Ports below the ephemeral range the tests draw from.
const LOWEST: u16 = 20_000;

/// A port nobody listens on, reserved for this process until it exits.
pub fn free_port() -> u16 {
    let ephemeral = ephemeral_start();
    assert!(ephemeral > LOWEST + 1_000, "the ephemeral port range starts at {ephemeral}: too low to draw test ports below it");
    let highest = ephemeral - 1;
    let span = u64::from(highest - LOWEST);
    let start = RandomState::new().hash_one(std::process::id()) % span;
    let dir = lock_dir();
    for step in 0..span {
        let port = LOWEST + ((start + step) % span) as u16;
        let Ok(lock) = File::create(dir.join(format!("{port}.lock"))) else { continue };
        if lock.try_lock().is_err() {
            continue; // another test process holds it
        }
        let mut reserved = RESERVED.lock().unwrap();
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            reserved.push(lock);
            return port;
        }
        // Taken by something outside the tests: leave its lock file unlocked and move on.
    }
    panic!("no free loopback port between {LOWEST} and {highest}");
}

/// The first port of the kernel's ephemeral range (`ip_local_port_range`), 32768 where unreadable.
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// Where the lock files live: one folder for every test process of the machine's user.
fn lock_dir() -> PathBuf {
    let dir = std::env::temp_dir().join("shotfleet-test-ports");
    std::fs::create_dir_all(&dir).expect("create the test ports' lock folder");
    dir
}
