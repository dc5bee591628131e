//! Running the `shotfleet` binary from tests.

use std::process::Output;

/// Runs `shotfleet ARGS` against `server` with no credentials from the environment.
pub async fn shotfleet(server: &str, args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_shotfleet"))
        .args(args)
        .env("NATS_URL", server)
        .env_remove("NATS_CREDS")
        .env_remove("NATS_USER")
        .env_remove("NATS_PASSWORD")
        .output()
        .await
        .expect("run shotfleet")
}

/// Everything it printed, stdout then stderr.
pub fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}
