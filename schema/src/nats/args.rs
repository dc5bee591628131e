//! The connection flags both binaries take, and the environment variables beside them.
//!
//! Precedence: a flag, then its environment variable, then what was there before (the worker's
//! TOML `[nats]` table, or the defaults). A secret is never only a flag: passwords and tokens come
//! from the environment or a file (`--password-file`, `--token-file`, `--nkey`, `--creds`);
//! `--password` exists for a quick try by hand, and shows in `ps` like any argument.

use std::path::PathBuf;

use super::NatsOptions;

/// NATS connection flags (`#[command(flatten)]` them).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma separated; tls:// requires TLS [env: NATS_URL; default nats://127.0.0.1:4222].
    #[arg(long, global = true, value_name = "URL")]
    pub server: Option<String>,
    /// NATS credentials file, JWT + NKey [env: NATS_CREDS].
    #[arg(long, global = true, value_name = "FILE")]
    pub creds: Option<PathBuf>,
    /// File holding an NKey seed, for a user listed by its public key [env: NATS_NKEY].
    #[arg(long, global = true, value_name = "FILE")]
    pub nkey: Option<PathBuf>,
    /// NATS user; the password comes from NATS_PASSWORD or --password-file [env: NATS_USER].
    #[arg(long, global = true)]
    pub user: Option<String>,
    /// The password itself. Shows in `ps`: prefer NATS_PASSWORD or --password-file.
    #[arg(long, global = true, hide_short_help = true)]
    pub password: Option<String>,
    /// File whose first line is the NATS password [env: NATS_PASSWORD_FILE].
    #[arg(long, global = true, value_name = "FILE")]
    pub password_file: Option<PathBuf>,
    /// File whose first line is a NATS token (or set NATS_TOKEN) [env: NATS_TOKEN_FILE].
    #[arg(long, global = true, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// PEM file of CA certificates to trust; turns TLS on [env: NATS_CA].
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), where the server verifies clients [env: NATS_CERT].
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The key of --tls-cert (PEM) [env: NATS_KEY].
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Reply subjects start with this (deploy/nats gives each user _INBOX_<user>) [env: NATS_INBOX_PREFIX].
    #[arg(long, global = true, value_name = "PREFIX")]
    pub inbox_prefix: Option<String>,
}

impl NatsArgs {
    /// Applies the flags, then for each one not given its environment variable (`env` looks one
    /// up; tests pass their own), over `options`.
    pub fn apply(self, options: &mut NatsOptions, env: impl Fn(&str) -> Option<String>) {
        let var = |name: &str| env(name).filter(|v| !v.is_empty());
        let path = |name: &str| var(name).map(PathBuf::from);
        let set = |slot: &mut Option<PathBuf>, flag: Option<PathBuf>, name: &str| {
            if let Some(v) = flag.or_else(|| path(name)) {
                *slot = Some(v);
            }
        };
        if let Some(v) = self.server.or_else(|| var("NATS_URL")) {
            options.server = v;
        }
        set(&mut options.creds, self.creds, "NATS_CREDS");
        set(&mut options.nkey, self.nkey, "NATS_NKEY");
        if let Some(v) = self.user.or_else(|| var("NATS_USER")) {
            options.user = Some(v);
        }
        if let Some(v) = self.password.or_else(|| var("NATS_PASSWORD")) {
            options.password = Some(v);
        }
        set(&mut options.password_file, self.password_file, "NATS_PASSWORD_FILE");
        if let Some(v) = var("NATS_TOKEN") {
            options.token = Some(v);
        }
        set(&mut options.token_file, self.token_file, "NATS_TOKEN_FILE");
        set(&mut options.tls_ca, self.tls_ca, "NATS_CA");
        set(&mut options.tls_cert, self.tls_cert, "NATS_CERT");
        set(&mut options.tls_key, self.tls_key, "NATS_KEY");
        if let Some(v) = self.inbox_prefix.or_else(|| var("NATS_INBOX_PREFIX")) {
            options.inbox_prefix = Some(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_environment_which_wins_over_the_file() {
        let env = |name: &str| match name {
            "NATS_URL" => Some("nats://env:4222".to_owned()),
            "NATS_PASSWORD_FILE" => Some("/run/secrets/pw".to_owned()),
            "NATS_TOKEN" => Some(String::new()),
            "NATS_INBOX_PREFIX" => Some("_INBOX_worker".to_owned()),
            _ => None,
        };
        let mut options = NatsOptions { user: Some("from-file".into()), ..NatsOptions::default() };
        let flags = NatsArgs { server: Some("nats://flag:4222".into()), tls_ca: Some("/ca.pem".into()), ..Default::default() };
        flags.apply(&mut options, env);
        assert_eq!(options.server, "nats://flag:4222");
        assert_eq!(options.user.as_deref(), Some("from-file"));
        assert_eq!(options.password_file, Some(PathBuf::from("/run/secrets/pw")));
        assert_eq!(options.token, None, "an empty variable is not a token");
        assert_eq!(options.tls_ca, Some(PathBuf::from("/ca.pem")));
        assert_eq!(options.inbox_prefix.as_deref(), Some("_INBOX_worker"));
    }
}
