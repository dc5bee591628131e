//! Connecting to NATS with the usual credentials, and errors that say what failed.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::{ConnectErrorKind, ServerAddr};

/// Where and how to connect. Both binaries fill it from flags and the environment
/// (`NATS_URL`, `NATS_CREDS`, `NATS_USER`, `NATS_PASSWORD`, `NATS_CA`).
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsOptions {
    /// One URL or several, comma separated (a cluster's seed list).
    pub server: String,
    /// A `.creds` file (JWT + NKey seed).
    pub creds: Option<PathBuf>,
    pub user: Option<String>,
    /// Never logged; `Debug` of this struct redacts it.
    #[serde(skip_serializing)]
    pub password: Option<String>,
    /// A PEM file of CA certificates to trust for TLS.
    pub tls_ca: Option<PathBuf>,
    /// The connection's name, shown by `nats server report connections`.
    pub name: String,
}

impl std::fmt::Debug for NatsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsOptions")
            .field("server", &self.server)
            .field("creds", &self.creds)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls_ca", &self.tls_ca)
            .field("name", &self.name)
            .finish()
    }
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            server: "nats://127.0.0.1:4222".into(),
            creds: None,
            user: None,
            password: None,
            tls_ca: None,
            name: "shotfleet".into(),
        }
    }
}

/// Why a connection could not be made, with what to check.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    #[error("invalid NATS server address `{server}`: {detail}")]
    BadAddress { server: String, detail: String },
    #[error("cannot read NATS credentials file {}: {source}", path.display())]
    Credentials { path: PathBuf, source: std::io::Error },
    #[error("cannot read TLS CA file {}: it does not exist", path.display())]
    TlsCa { path: PathBuf },
    #[error("--user and --password go together; only one was given")]
    HalfUserPassword,
    #[error("cannot connect to NATS at {server}: {kind}; {hint}")]
    Failed { server: String, kind: ConnectErrorKind, hint: &'static str, detail: String },
}

impl NatsOptions {
    /// The server list, parsed.
    ///
    /// # Errors
    /// [`ConnectError::BadAddress`] naming the address that does not parse.
    pub fn addresses(&self) -> Result<Vec<ServerAddr>, ConnectError> {
        self.server
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<ServerAddr>().map_err(|e| ConnectError::BadAddress {
                    server: s.to_owned(),
                    detail: e.to_string(),
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .and_then(|addrs| {
                if addrs.is_empty() {
                    Err(ConnectError::BadAddress { server: self.server.clone(), detail: "no address given".into() })
                } else {
                    Ok(addrs)
                }
            })
    }

    /// Connects. Reconnects forever afterwards (async-nats' default), but the first connection
    /// must succeed within 5 s so a wrong address fails fast with a clear message.
    ///
    /// # Errors
    /// A [`ConnectError`] naming the server and what to check.
    pub async fn connect(&self) -> Result<async_nats::Client, ConnectError> {
        let addresses = self.addresses()?;
        let mut options = async_nats::ConnectOptions::new()
            .name(&self.name)
            .connection_timeout(Duration::from_secs(5));
        if let Some(path) = &self.creds {
            options = options
                .credentials_file(path)
                .await
                .map_err(|source| ConnectError::Credentials { path: path.clone(), source })?;
        }
        match (&self.user, &self.password) {
            (Some(user), Some(password)) => {
                options = options.user_and_password(user.clone(), password.clone());
            }
            (None, None) => {}
            _ => return Err(ConnectError::HalfUserPassword),
        }
        if let Some(ca) = &self.tls_ca {
            if !ca.exists() {
                return Err(ConnectError::TlsCa { path: ca.clone() });
            }
            options = options.add_root_certificates(ca.clone()).require_tls(true);
        }
        options.connect(addresses).await.map_err(|e| {
            let kind = e.kind();
            ConnectError::Failed {
                server: self.server.clone(),
                kind,
                hint: hint(kind),
                detail: e.to_string(),
            }
        })
    }
}

fn hint(kind: ConnectErrorKind) -> &'static str {
    match kind {
        ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
            "check --creds or --user/--password (NATS_CREDS, NATS_USER, NATS_PASSWORD)"
        }
        ConnectErrorKind::Tls => "check --tls-ca (NATS_CA) and that the server speaks TLS",
        ConnectErrorKind::TimedOut | ConnectErrorKind::Io | ConnectErrorKind::MaxReconnects => {
            "is nats-server running there? set --server or NATS_URL"
        }
        ConnectErrorKind::Dns | ConnectErrorKind::ServerParse => "check the host name in --server / NATS_URL",
    }
}
