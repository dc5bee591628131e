//! The shipped nats-server configs parse (`nats-server -t`).

use shotfleet_testkit::{paths, ServerBinary};

#[test]
fn shipped_nats_configs_are_valid() {
    let dir = paths::repo_root().join("deploy/nats");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let out = std::process::Command::new(ServerBinary::Current.path())
            .args(["-t", "-c"])
            .arg(&path)
            .env("SHOTFLEET_PRODUCER_PASSWORD", "p")
            .env("SHOTFLEET_WORKER_PASSWORD", "w")
            .env("SHOTFLEET_ADMIN_PASSWORD", "a")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}: {}{}", path.display(), String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        checked += 1;
    }
    assert_eq!(checked, 4);
}
