//! A TCP proxy that can take a service off the network and bring it back, while the service
//! itself (and what it stores) stays up: an outage as clients see it. It can also slow the
//! service down to a given rate, as a congested link would.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use crate::ports::free_port;

/// Forwards `127.0.0.1:<port>` to `target` while up; refuses and cuts connections while down.
pub struct TcpProxy {
    port: u16,
    target: String,
    up: Arc<AtomicBool>,
    /// Bytes per second each direction of each connection may carry; 0: as fast as it goes.
    rate: Arc<AtomicU64>,
    connections: Arc<Mutex<Vec<TcpStream>>>,
    listener: Option<(Arc<AtomicBool>, thread::JoinHandle<()>)>,
}

impl TcpProxy {
    pub fn start(target: &str) -> Self {
        let mut proxy = Self {
            port: free_port(),
            target: target.trim_start_matches("http://").to_owned(),
            up: Arc::new(AtomicBool::new(false)),
            rate: Arc::new(AtomicU64::new(0)),
            connections: Arc::new(Mutex::new(Vec::new())),
            listener: None,
        };
        proxy.up();
        proxy
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops listening and cuts every open connection: connections are refused until `up`.
    pub fn down(&mut self) {
        self.up.store(false, Ordering::SeqCst);
        if let Some((stop, handle)) = self.listener.take() {
            stop.store(true, Ordering::SeqCst);
            // Wake the accept loop so it sees the stop flag.
            let _ = TcpStream::connect(("127.0.0.1", self.port));
            let _ = handle.join();
        }
        for stream in self.connections.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Limits each direction of every connection, open or new, to `bytes_per_second` (`None`:
    /// no limit).
    pub fn throttle(&self, bytes_per_second: Option<u64>) {
        self.rate.store(bytes_per_second.unwrap_or(0), Ordering::SeqCst);
    }

    /// Listens again on the same port.
    pub fn up(&mut self) {
        if self.listener.is_some() {
            return;
        }
        let listener = loop {
            match TcpListener::bind(("127.0.0.1", self.port)) {
                Ok(l) => break l,
                Err(_) => thread::sleep(Duration::from_millis(50)),
            }
        };
        self.up.store(true, Ordering::SeqCst);
        let stop = Arc::new(AtomicBool::new(false));
        let (stop_flag, target, connections, rate) =
            (stop.clone(), self.target.clone(), self.connections.clone(), self.rate.clone());
        let handle = thread::spawn(move || {
            for client in listener.incoming() {
                if stop_flag.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(&target) else { continue };
                let mut all = connections.lock().unwrap();
                all.push(client.try_clone().unwrap());
                all.push(server.try_clone().unwrap());
                drop(all);
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap(), rate.clone());
                pipe(server, client, rate.clone());
            }
        });
        self.listener = Some((stop, handle));
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, rate: Arc<AtomicU64>) {
    thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let limit = rate.load(Ordering::SeqCst);
            // Throttled: small reads, each followed by the time it would take at the rate.
            let chunk = if limit == 0 { buf.len() } else { 1024 };
            match from.read(&mut buf[..chunk]) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    if limit > 0 {
                        thread::sleep(Duration::from_secs_f64(n as f64 / limit as f64));
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.down();
    }
}
