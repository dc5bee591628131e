//! Connecting to NATS with every usual credential and TLS, and errors that say what failed.
//!
//! Secrets never reach a log: credentials written into a server URL are taken out of it before
//! the client sees the URL (async-nats logs addresses at debug level), and every address this
//! module prints is [`redact`]ed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_nats::{ConnectErrorKind, ServerAddr};

/// Where and how to connect. Both binaries fill it from the worker's TOML `[nats]` table (the
/// CLI has none), then the environment, then flags ([`super::NatsArgs`]).
///
/// At most one kind of credential: a `.creds` file, an NKey seed file, a token, or a user and
/// password (which may also be written into the URL). A client certificate goes with any of them.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsOptions {
    /// One URL or several, comma separated (a cluster's seed list). `tls://` requires TLS.
    pub server: String,
    /// A `.creds` file (JWT + NKey seed).
    pub creds: Option<PathBuf>,
    /// A file holding an NKey seed (`SU...`), for servers that list the user's public key.
    pub nkey: Option<PathBuf>,
    pub user: Option<String>,
    /// Never logged; `Debug` of this struct redacts it.
    #[serde(skip_serializing)]
    pub password: Option<String>,
    /// A file whose first line is the password (a mounted secret).
    pub password_file: Option<PathBuf>,
    /// Never logged; `Debug` of this struct redacts it.
    #[serde(skip_serializing)]
    pub token: Option<String>,
    /// A file whose first line is the token.
    pub token_file: Option<PathBuf>,
    /// A PEM file of CA certificates to trust for TLS (turns TLS on).
    pub tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), for servers that verify clients (`tls { verify: true }`).
    pub tls_cert: Option<PathBuf>,
    /// The key of `tls_cert` (PEM).
    pub tls_key: Option<PathBuf>,
    /// Replies come to `<inbox_prefix>.<random>`: a user allowed only its own prefix cannot read
    /// other users' replies (deploy/nats gives each role `_INBOX_<user>`). Default `_INBOX`.
    pub inbox_prefix: Option<String>,
    /// The connection's name, shown by `nats server report connections`.
    pub name: String,
}

impl std::fmt::Debug for NatsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hidden = |secret: &Option<String>| secret.as_ref().map(|_| "<redacted>");
        f.debug_struct("NatsOptions")
            .field("server", &redact(&self.server))
            .field("creds", &self.creds)
            .field("nkey", &self.nkey)
            .field("user", &self.user)
            .field("password", &hidden(&self.password))
            .field("password_file", &self.password_file)
            .field("token", &hidden(&self.token))
            .field("token_file", &self.token_file)
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("inbox_prefix", &self.inbox_prefix)
            .field("name", &self.name)
            .finish()
    }
}

impl Default for NatsOptions {
    fn default() -> Self {
        Self {
            server: "nats://127.0.0.1:4222".into(),
            creds: None,
            nkey: None,
            user: None,
            password: None,
            password_file: None,
            token: None,
            token_file: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            inbox_prefix: None,
            name: "shotfleet".into(),
        }
    }
}

/// Why a connection could not be made, with what to check. Addresses in it are redacted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    #[error("invalid NATS server address `{server}`: {detail}")]
    BadAddress { server: String, detail: String },
    #[error("cannot read NATS credentials file {}: {source}", path.display())]
    Credentials { path: PathBuf, source: std::io::Error },
    #[error("cannot read {what} file {}: {detail}", path.display())]
    SecretFile { what: &'static str, path: PathBuf, detail: String },
    #[error("cannot read TLS {what} file {}: it does not exist", path.display())]
    TlsFile { what: &'static str, path: PathBuf },
    #[error("--tls-cert and --tls-key (NATS_CERT, NATS_KEY) go together; only one was given")]
    HalfClientCertificate,
    #[error("--user and a password (--password-file, NATS_PASSWORD) go together; only one was given")]
    HalfUserPassword,
    #[error("more than one kind of NATS credential given ({0}); give one")]
    SeveralCredentials(String),
    #[error("the server URLs carry different credentials; write them once, or use --user and --password-file")]
    MixedUrlCredentials,
    #[error("cannot connect to NATS at {server}: {detail}; {hint}")]
    Failed { server: String, kind: ConnectErrorKind, hint: &'static str, detail: String },
}

impl ConnectError {
    /// The settings are wrong (a bad address, a missing file, credentials that do not go
    /// together): fix them, retrying will not help. Otherwise the server could not be reached or
    /// refused.
    pub fn is_setting(&self) -> bool {
        !matches!(self, Self::Failed { .. })
    }
}

/// `nats://user:secret@host` as `nats://user:***@host`, and `nats://token@host` as
/// `nats://***@host`, for each of a comma-separated list; anything else unchanged.
pub fn redact(servers: &str) -> String {
    servers.split(',').map(redact_one).collect::<Vec<_>>().join(",")
}

fn redact_one(server: &str) -> String {
    let (scheme, rest) = match server.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), server),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else { return server.to_owned() };
    let userinfo = match rest[..at].split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_owned(),
    };
    format!("{scheme}{userinfo}@{}", &rest[at + 1..])
}

/// The credentials written into server URLs, taken out of them.
#[derive(Default, PartialEq, Eq)]
enum UrlCredentials {
    #[default]
    None,
    Token(String),
    UserPassword(String, String),
}

/// The first line of a secret file, which must not be empty.
fn read_secret(what: &'static str, path: &Path) -> Result<String, ConnectError> {
    let error = |detail: String| ConnectError::SecretFile { what, path: path.to_owned(), detail };
    let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
    let line = text.lines().next().unwrap_or_default().trim_end_matches('\r').to_owned();
    if line.is_empty() {
        return Err(error("it is empty".into()));
    }
    Ok(line)
}

fn tls_file(what: &'static str, path: &Path) -> Result<PathBuf, ConnectError> {
    if path.exists() { Ok(path.to_owned()) } else { Err(ConnectError::TlsFile { what, path: path.to_owned() }) }
}

impl NatsOptions {
    /// The server list, parsed, with any credentials taken out of the URLs.
    ///
    /// # Errors
    /// [`ConnectError::BadAddress`] naming the (redacted) address that does not parse;
    /// [`ConnectError::MixedUrlCredentials`] when URLs carry different credentials.
    pub fn addresses(&self) -> Result<Vec<ServerAddr>, ConnectError> {
        self.split_addresses().map(|(addresses, _)| addresses)
    }

    fn split_addresses(&self) -> Result<(Vec<ServerAddr>, UrlCredentials), ConnectError> {
        let mut addresses = Vec::new();
        let mut found: Option<UrlCredentials> = None;
        for server in self.server.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let bad = |detail: String| ConnectError::BadAddress { server: redact_one(server), detail };
            let mut url = server.parse::<ServerAddr>().map_err(|e| bad(e.to_string()))?.into_inner();
            let credentials = match (url.username(), url.password()) {
                ("", None) => UrlCredentials::None,
                (token, None) => UrlCredentials::Token(token.to_owned()),
                (user, Some(password)) => UrlCredentials::UserPassword(user.to_owned(), password.to_owned()),
            };
            if credentials != UrlCredentials::None {
                if found.as_ref().is_some_and(|seen| *seen != credentials) {
                    return Err(ConnectError::MixedUrlCredentials);
                }
                found = Some(credentials);
            }
            // Neither can fail on a URL that has a host, which a parsed ServerAddr has.
            let _ = url.set_username("");
            let _ = url.set_password(None);
            addresses.push(ServerAddr::from_url(url).map_err(|e| bad(e.to_string()))?);
        }
        if addresses.is_empty() {
            return Err(ConnectError::BadAddress { server: redact(&self.server), detail: "no address given".into() });
        }
        Ok((addresses, found.unwrap_or_default()))
    }

    /// Connects. Reconnects forever afterwards (async-nats' default), but the first connection
    /// must succeed within 5 s so a wrong address fails fast with a clear message. Requests the
    /// server refuses (a permissions violation) are logged with what to check.
    ///
    /// # Errors
    /// A [`ConnectError`] naming the (redacted) server and what to check.
    pub async fn connect(&self) -> Result<async_nats::Client, ConnectError> {
        let (addresses, in_url) = self.split_addresses()?;
        use_ring_for_tls();
        let inbox = self.inbox_prefix.clone().unwrap_or_else(|| "_INBOX".into());
        let mut options = async_nats::ConnectOptions::new()
            .name(&self.name)
            .connection_timeout(Duration::from_secs(5))
            .custom_inbox_prefix(&inbox)
            .event_callback(move |event| {
                let inbox = inbox.clone();
                async move { log_event(&event, &inbox) }
            });
        options = self.with_credentials(options, in_url).await?;
        let tls = self.tls_ca.is_some() || self.tls_cert.is_some();
        if let Some(ca) = &self.tls_ca {
            options = options.add_root_certificates(tls_file("CA", ca)?).require_tls(true);
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                options = options
                    .add_client_certificate(tls_file("certificate", cert)?, tls_file("key", key)?)
                    .require_tls(true);
            }
            (None, None) => {}
            _ => return Err(ConnectError::HalfClientCertificate),
        }
        options.connect(addresses).await.map_err(|e| {
            let detail = e.to_string();
            let kind = e.kind();
            ConnectError::Failed { server: redact(&self.server), kind, hint: hint(kind, &detail, tls), detail }
        })
    }

    /// Adds the one kind of credential given, after checking that only one was.
    async fn with_credentials(
        &self,
        options: async_nats::ConnectOptions,
        in_url: UrlCredentials,
    ) -> Result<async_nats::ConnectOptions, ConnectError> {
        let password = match (&self.password, &self.password_file) {
            (Some(_), Some(_)) => return Err(ConnectError::SeveralCredentials("a password and a password file".into())),
            (Some(p), None) => Some(p.clone()),
            (None, Some(path)) => Some(read_secret("password", path)?),
            (None, None) => None,
        };
        let token = match (&self.token, &self.token_file) {
            (Some(_), Some(_)) => return Err(ConnectError::SeveralCredentials("a token and a token file".into())),
            (Some(t), None) => Some(t.clone()),
            (None, Some(path)) => Some(read_secret("token", path)?),
            (None, None) => None,
        };
        let given: Vec<&str> = [
            (self.creds.is_some(), "a creds file"),
            (self.nkey.is_some(), "an nkey seed"),
            (token.is_some(), "a token"),
            (self.user.is_some() || password.is_some(), "a user and password"),
            (in_url != UrlCredentials::None, "credentials in the server URL"),
        ]
        .into_iter()
        .filter_map(|(present, what)| present.then_some(what))
        .collect();
        if given.len() > 1 {
            return Err(ConnectError::SeveralCredentials(given.join(", ")));
        }
        if let Some(path) = &self.creds {
            return options
                .credentials_file(path)
                .await
                .map_err(|source| ConnectError::Credentials { path: path.clone(), source });
        }
        if let Some(path) = &self.nkey {
            return Ok(options.nkey(read_secret("nkey seed", path)?));
        }
        if let Some(token) = token {
            return Ok(options.token(token));
        }
        Ok(match (&self.user, password, in_url) {
            (Some(user), Some(password), _) => options.user_and_password(user.clone(), password),
            (None, None, UrlCredentials::UserPassword(user, password)) => options.user_and_password(user, password),
            (None, None, UrlCredentials::Token(token)) => options.token(token),
            (None, None, UrlCredentials::None) => options,
            _ => return Err(ConnectError::HalfUserPassword),
        })
    }
}

/// Picks rustls' process-wide crypto provider once. A binary that also links the S3 client has
/// both of rustls' backends (aws-lc-rs beside async-nats' ring), and rustls then refuses to
/// choose: any TLS connection, even one the server asks for, would panic.
fn use_ring_for_tls() {
    use async_nats::rustls::crypto::{CryptoProvider, ring};
    if CryptoProvider::get_default().is_none() {
        // Err only when another thread installed one first, which serves as well.
        let _ = ring::default_provider().install_default();
    }
}

/// Logs what the server refused after the connection was made: a permissions violation names
/// the subject, which says which role's permission is missing.
fn log_event(event: &async_nats::Event, inbox: &str) {
    use async_nats::{Event, ServerError};
    match event {
        Event::ServerError(ServerError::Other(message)) if message.to_lowercase().contains("permissions violation") => {
            if message.to_lowercase().contains(&format!("subscription to \"{}.", inbox.to_lowercase())) {
                tracing::error!(error = %message, inbox, "the NATS server refused this user the reply inbox; set --inbox-prefix (NATS_INBOX_PREFIX) to the prefix its permissions allow, e.g. _INBOX_<user>");
            } else {
                tracing::warn!(error = %message, "the NATS server refused: this user's permissions do not allow it (deploy/nats/README.md lists each role's)");
            }
        }
        Event::ServerError(error) => tracing::warn!(error = %error, "NATS server error"),
        Event::ClientError(error) => tracing::warn!(error = %error, "NATS client error"),
        Event::Disconnected => tracing::warn!("disconnected from NATS; reconnecting"),
        Event::Connected => tracing::debug!("connected to NATS"),
        other => tracing::debug!(event = %other, "NATS connection event"),
    }
}

fn hint(kind: ConnectErrorKind, detail: &str, tls: bool) -> &'static str {
    let lower = detail.to_ascii_lowercase();
    let about_tls = ["certificate", "tls", "handshake", "alert"].iter().any(|word| lower.contains(word));
    match kind {
        ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
            "check the credentials: --creds, --nkey, --token-file, --user with --password-file (NATS_CREDS, NATS_NKEY, NATS_TOKEN, NATS_USER, NATS_PASSWORD)"
        }
        _ if about_tls && !tls => {
            "the server requires TLS: give its CA with --tls-ca (NATS_CA), and a client certificate with --tls-cert and --tls-key (NATS_CERT, NATS_KEY) where it verifies clients"
        }
        ConnectErrorKind::Tls | ConnectErrorKind::Io if about_tls => {
            "TLS failed: check that --tls-ca (NATS_CA) signed the server's certificate for this host name, and give --tls-cert and --tls-key (NATS_CERT, NATS_KEY) where the server verifies clients"
        }
        ConnectErrorKind::Tls => "check --tls-ca (NATS_CA) and that the server speaks TLS",
        ConnectErrorKind::TimedOut | ConnectErrorKind::Io | ConnectErrorKind::MaxReconnects => {
            "is nats-server running there? set --server or NATS_URL"
        }
        ConnectErrorKind::Dns | ConnectErrorKind::ServerParse => "check the host name in --server / NATS_URL",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_hides_passwords_and_tokens_in_every_url() {
        assert_eq!(redact("nats://render:s3cret@h:4222"), "nats://render:***@h:4222");
        assert_eq!(redact("tls://tok3n@h"), "tls://***@h");
        assert_eq!(redact("nats://a:x@n1:4222,nats://n2:4222"), "nats://a:***@n1:4222,nats://n2:4222");
        assert_eq!(redact("n1:4222"), "n1:4222");
        assert_eq!(redact("u:p@n1:4222"), "u:***@n1:4222");
        assert_eq!(redact("nats://h:4222/x@y"), "nats://h:4222/x@y");
    }

    #[test]
    fn credentials_leave_the_url_before_the_client_sees_it() {
        let options = NatsOptions { server: "nats://render:s3cret@h:4222,nats://render:s3cret@h2".into(), ..Default::default() };
        let (addresses, found) = options.split_addresses().unwrap();
        assert!(addresses.iter().all(|a| !a.has_user_pass()));
        assert!(found == UrlCredentials::UserPassword("render".into(), "s3cret".into()));
        let first_only = NatsOptions { server: "nats://a:b@h,nats://h2".into(), ..Default::default() };
        assert!(first_only.split_addresses().is_ok());
        let mixed = NatsOptions { server: "nats://a:b@h,nats://c:d@h2".into(), ..Default::default() };
        assert!(matches!(mixed.split_addresses(), Err(ConnectError::MixedUrlCredentials)));
    }
}
