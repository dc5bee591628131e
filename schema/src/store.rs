//! A `file://` store's folder, as the workers and `shotfleet lora push` open it: both must agree
//! on it, or the CLI fills a library no worker reads.

use std::io;
use std::path::Path;

/// Makes `root` when it is missing, but only inside a folder that exists: a slip in the path
/// (or a share not mounted under a missing folder) is refused, not filled on the local disk.
///
/// # Errors
/// The folder cannot be made; a missing parent is named, with what to do.
pub fn make_folder(root: &Path) -> io::Result<()> {
    if root.is_dir() {
        return Ok(());
    }
    std::fs::create_dir(root).map_err(|e| {
        let parent = root.parent().map(|p| p.display().to_string()).unwrap_or_default();
        match e.kind() {
            // The parent is the cause only where it is missing: /proc and other special file
            // systems answer "not found" to a mkdir too.
            io::ErrorKind::NotFound if !root.parent().is_some_and(Path::is_dir) => io::Error::new(
                e.kind(),
                format!(
                    "its parent folder {parent} does not exist (a slip in the path, or a share not mounted?); create it first if this is the folder meant"
                ),
            ),
            _ => io::Error::new(e.kind(), format!("it cannot be made in {parent}: {e}")),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_is_made_only_inside_one_that_exists() {
        let dir = tempfile::tempdir().unwrap();
        make_folder(&dir.path().join("images")).unwrap();
        assert!(dir.path().join("images").is_dir());
        make_folder(&dir.path().join("images")).unwrap();
        let deep = dir.path().join("a/b");
        let refused = make_folder(&deep).unwrap_err().to_string();
        assert!(refused.contains("does not exist") && refused.contains("create it first"), "{refused}");
        assert!(!dir.path().join("a").exists());
        if Path::new("/proc").is_dir() {
            let special = make_folder(Path::new("/proc/shotfleet-images")).unwrap_err().to_string();
            assert!(special.contains("cannot be made in /proc") && !special.contains("does not exist"), "{special}");
        }
    }
}
