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

/// Every file under `from`, copied to the same place under `to` (made as needed): a model
/// folder a test may break without touching the repository's.
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("make the copy's folder");
    for entry in std::fs::read_dir(from).expect("read the folder to copy").flatten() {
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy a file");
        }
    }
}
