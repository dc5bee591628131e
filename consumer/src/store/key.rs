//! Object keys: `<prefix>/<project>/<job_id>/<shot_id>-<index>-<sha8>.png`.
//!
//! The schema already restricts ids to letters, digits, `_` and `-`, but a key is where a bad id
//! would do damage (`../other-project`, a `/` that invents a folder), so the store checks every
//! part again. Bad parts are rejected, not escaped: escaping `a/b` to `a_b` would let two jobs
//! share a key.

use object_store::path::Path;
use sha2::{Digest, Sha256};

use super::StoreError;

/// Longest key part (project, job id, shot id), bytes. The schema allows at most 96.
pub const MAX_PART_BYTES: usize = 128;

/// Checks one input-supplied key part: ASCII letters, digits, `_`, `-` and `.`, never `..` and
/// never a leading `.` (hidden files, `.` and `..` as folder names).
///
/// # Errors
///
/// [`StoreError::InvalidKeyPart`] naming the field and what is wrong with it.
pub fn check_part(field: &'static str, value: &str) -> Result<(), StoreError> {
    let reason = if value.is_empty() {
        Some("is empty")
    } else if value.len() > MAX_PART_BYTES {
        Some("is longer than 128 bytes")
    } else if value.chars().any(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))) {
        Some("contains a character other than ASCII letters, digits, `_`, `-` and `.`")
    } else if value.starts_with('.') || value.contains("..") {
        Some("starts with `.` or contains `..`")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(StoreError::InvalidKeyPart { field, value: value.escape_debug().to_string(), reason }),
        None => Ok(()),
    }
}

/// The folder holding every image of one job: `<prefix>/<project>/<job_id>`.
///
/// # Errors
///
/// [`StoreError::InvalidKeyPart`] when `project` or `job_id` is not a safe key part.
pub fn job_prefix(prefix: &Path, project: &str, job_id: &str) -> Result<Path, StoreError> {
    check_part("project", project)?;
    check_part("job_id", job_id)?;
    Ok(prefix.clone().join(project).join(job_id))
}

/// The key of one image: the job's folder, then `<shot_id>-<index>-<sha8>.png` where `sha8` is the
/// first 8 hex digits of the PNG's SHA-256. Equal bytes give equal keys, so a retried upload
/// overwrites itself and never a different render of the same image.
///
/// # Errors
///
/// [`StoreError::InvalidKeyPart`] when `project`, `job_id` or `shot_id` is not a safe key part.
pub fn image_key(
    prefix: &Path,
    project: &str,
    job_id: &str,
    shot_id: &str,
    index: u32,
    sha256: &[u8; 32],
) -> Result<Path, StoreError> {
    check_part("shot_id", shot_id)?;
    let sha8 = hex::encode(&sha256[..4]);
    Ok(job_prefix(prefix, project, job_id)?.join(format!("{shot_id}-{index}-{sha8}.png").as_str()))
}

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreErrorKind;

    const SHA: &[u8; 32] = &[
        0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0,
    ];

    #[test]
    fn key_has_every_part_in_order() {
        let key = image_key(&Path::from("renders/v1"), "acme", "job-7", "shot_3", 2, SHA).unwrap();
        assert_eq!(key.as_ref(), "renders/v1/acme/job-7/shot_3-2-01234567.png");
    }

    #[test]
    fn empty_prefix_is_the_root() {
        let key = image_key(&Path::ROOT, "acme", "job-7", "s1", 0, SHA).unwrap();
        assert_eq!(key.as_ref(), "acme/job-7/s1-0-01234567.png");
    }

    #[test]
    fn equal_bytes_give_equal_keys() {
        let png = b"\x89PNG fake bytes";
        let a = image_key(&Path::ROOT, "p", "j", "s", 0, &sha256(png)).unwrap();
        let b = image_key(&Path::ROOT, "p", "j", "s", 0, &sha256(png)).unwrap();
        let c = image_key(&Path::ROOT, "p", "j", "s", 0, &sha256(b"other bytes")).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn sha256_is_the_standard_digest() {
        assert_eq!(hex::encode(sha256(b"abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn traversal_and_separators_are_rejected() {
        for bad in ["..", "../x", "a/../b", "a/b", "/abs", ".hidden", ".", "a..b", "a\\b"] {
            let err = image_key(&Path::ROOT, bad, "j", "s", 0, SHA).unwrap_err();
            assert_eq!(err.kind(), StoreErrorKind::InvalidKey, "{bad:?}");
            assert!(err.to_string().contains("project"), "{err}");
        }
    }

    #[test]
    fn control_characters_and_non_ascii_are_rejected() {
        for bad in ["a\nb", "a\0b", "tab\there", "caf\u{e9}", "a b", "a%2Fb", "a?b"] {
            assert!(check_part("shot_id", bad).is_err(), "{bad:?}");
        }
        // The message shows the value escaped, so a newline cannot forge a log line.
        let err = check_part("shot_id", "a\nb").unwrap_err().to_string();
        assert!(err.contains("a\\nb"), "{err}");
    }

    #[test]
    fn empty_and_overlong_parts_are_rejected() {
        assert!(check_part("job_id", "").is_err());
        assert!(check_part("job_id", &"x".repeat(MAX_PART_BYTES)).is_ok());
        assert!(check_part("job_id", &"x".repeat(MAX_PART_BYTES + 1)).is_err());
    }

    #[test]
    fn every_input_part_is_checked() {
        assert!(image_key(&Path::ROOT, "p", "../j", "s", 0, SHA).unwrap_err().to_string().contains("job_id"));
        assert!(image_key(&Path::ROOT, "p", "j", "s/1", 0, SHA).unwrap_err().to_string().contains("shot_id"));
    }

    #[test]
    fn job_prefix_is_the_folder_of_its_keys() {
        let folder = job_prefix(&Path::from("pre"), "p", "j").unwrap();
        let key = image_key(&Path::from("pre"), "p", "j", "s", 1, SHA).unwrap();
        assert!(key.prefix_matches(&folder));
        // Segment-wise: job `j` is not a prefix of job `j1`.
        let other = image_key(&Path::from("pre"), "p", "j1", "s", 1, SHA).unwrap();
        assert!(!other.prefix_matches(&folder));
    }
}
