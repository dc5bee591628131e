//! A child process that dies with its owner, and waiting for a port.

use std::net::TcpStream;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// A child process killed (SIGKILL) and reaped on `Drop`.
#[derive(Debug)]
pub struct Guarded {
    child: Option<Child>,
}

impl Guarded {
    /// Spawns `command`.
    pub fn spawn(mut command: Command) -> std::io::Result<Self> {
        Ok(Self { child: Some(command.spawn()?) })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends a signal (`libc` names, e.g. `TERM`, `KILL`) with kill(1).
    pub fn signal(&self, signal: &str) {
        if let Some(pid) = self.pid() {
            let _ = Command::new("kill").arg(format!("-{signal}")).arg(pid.to_string()).status();
        }
    }

    /// Kills the process outright and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends SIGTERM and waits up to `grace` for the process to exit; kills it after that.
    /// Returns the exit code when it exited by itself.
    pub fn terminate(&mut self, grace: Duration) -> Option<i32> {
        self.signal("TERM");
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        None
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits for the process to exit by itself, up to `timeout`; `None` if it did not.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits until something accepts TCP connections on `port`.
pub fn wait_for_port(port: u16, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    false
}

/// A plain HTTP/1.0 GET on loopback: status code and body. Enough for health endpoints.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Some((status, body))
}
