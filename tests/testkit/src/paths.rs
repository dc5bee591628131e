//! Where the repository's test dependencies live (installed by `scripts/setup.sh`).

use std::path::PathBuf;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

/// The venv `scripts/setup.sh` creates.
pub fn venv() -> PathBuf {
    repo_root().join(".venv")
}

/// The venv's Python, or `SHOTFLEET_PYTHON`.
pub fn python() -> PathBuf {
    std::env::var_os("SHOTFLEET_PYTHON").map(PathBuf::from).unwrap_or_else(|| venv().join("bin/python"))
}

/// Panics with the command that fixes it when `path` is missing.
pub fn require(path: PathBuf, what: &str) -> PathBuf {
    assert!(
        path.exists(),
        "{what} not found at {}; run `bash scripts/setup.sh` (the README's test command does)",
        path.display()
    );
    path
}
