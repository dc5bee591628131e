//! An S3-protocol server for object store tests: moto's standalone server from the venv.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::paths;
use crate::ports::free_port;
use crate::process::{Guarded, wait_for_port};

/// A moto S3 server on a free port; in-memory, gone on `Drop`.
#[derive(Debug)]
pub struct S3Server {
    port: u16,
    process: Option<Guarded>,
}

impl S3Server {
    pub fn start() -> Self {
        let mut server = Self { port: free_port(), process: None };
        server.launch();
        server
    }

    fn launch(&mut self) {
        let binary = paths::require(paths::venv().join("bin/moto_server"), "moto_server");
        let mut command = Command::new(binary);
        command
            .args(["-H", "127.0.0.1", "-p", &self.port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.process = Some(Guarded::spawn(command).expect("spawn moto_server"));
        assert!(wait_for_port(self.port, Duration::from_secs(30)), "moto_server did not listen on {}", self.port);
    }

    /// `http://127.0.0.1:<port>`: a path-style endpoint.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Takes the endpoint down (everything stored is lost: moto keeps it in memory).
    pub fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill();
        }
    }

    /// Brings it back on the same port, empty.
    pub fn start_again(&mut self) {
        if self.process.is_none() {
            self.launch();
        }
    }

    /// Creates a bucket with a bare `PUT /<bucket>`: object_store cannot create buckets, and
    /// moto accepts unsigned requests.
    pub fn create_bucket(&self, bucket: &str) {
        let response = self.request("PUT", &format!("/{bucket}"));
        assert!(response.starts_with("HTTP/1.1 200"), "create bucket {bucket}: {response}");
    }

    /// Deletes every bucket with its objects (moto's reset), as an operator removing the bucket
    /// under running workers would.
    pub fn delete_all_buckets(&self) {
        let response = self.request("POST", "/moto-api/reset");
        assert!(response.starts_with("HTTP/1.1 200"), "reset moto: {response}");
    }

    fn request(&self, method: &str, path: &str) -> String {
        use std::io::{Read, Write};
        let address = format!("127.0.0.1:{}", self.port);
        let mut stream = std::net::TcpStream::connect(&address).expect("connect to moto");
        stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        write!(stream, "{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .expect("send");
        let mut response = String::new();
        stream.read_to_string(&mut response).expect("read");
        response
    }

    /// Credentials moto accepts; any values work, the tests use these.
    pub fn credentials() -> [(&'static str, &'static str); 3] {
        [
            ("AWS_ACCESS_KEY_ID", "shotfleet-test"),
            ("AWS_SECRET_ACCESS_KEY", "shotfleet-test-secret"),
            ("AWS_REGION", "us-east-1"),
        ]
    }
}
