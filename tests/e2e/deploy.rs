//! The shipped deploy files: nats-server configs parse (`nats-server -t`) with the environment
//! they document, the producer entries are what `add-project.sh` prints, the Kubernetes
//! manifests scale on every consumer their pods serve, and the systemd units (one worker per
//! GPU, or one supervisor per box) pass `systemd-analyze verify` with their hardening in place.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use serde_json::Value;
use shotfleet_schema::nats::Topology;
use shotfleet_schema::subject::{self, Priority};
use shotfleet_testkit::{ServerBinary, TestCa, paths};

fn nats_dir() -> std::path::PathBuf {
    paths::repo_root().join("deploy/nats")
}

#[test]
fn shipped_nats_configs_are_valid() {
    let ca = TestCa::new();
    let node = ca.server("nats-1");
    let mut checked = 0;
    for entry in std::fs::read_dir(nats_dir()).unwrap() {
        let path = entry.unwrap().path();
        // The server configs; the account file is checked through their `include`.
        if path.extension().is_none_or(|e| e != "conf") || path.ends_with("shotfleet-account.conf") {
            continue;
        }
        for binary in ServerBinary::available() {
            let out = Command::new(binary.path())
                .args(["-t", "-c"])
                .arg(&path)
                .env("NATS_TLS_CERT", &node.cert)
                .env("NATS_TLS_KEY", &node.key)
                .env("NATS_TLS_CA", ca.ca_file())
                .env("SHOTFLEET_WORKER_PASSWORD", "w")
                .env("SHOTFLEET_OPERATOR_PASSWORD", "o")
                .env("SHOTFLEET_PRODUCER_PASSWORD_TIDE", "t")
                .env("SHOTFLEET_PRODUCER_PASSWORD_MOTH", "m")
                .output()
                .unwrap();
            let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "{} ({binary:?}): {said}", path.display());
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\ninclude shotfleet-account.conf"), "{}: clients authenticate as a role", path.display());
        assert!(text.contains("\nhttp: 127.0.0.1:8222"), "{}: monitoring on loopback", path.display());
        assert!(text.contains("\ntls {"), "{}: clients speak TLS", path.display());
        if text.contains("cluster {") {
            assert!(text.contains("verify: true"), "{}: routes authenticate by certificate", path.display());
        }
        checked += 1;
    }
    assert_eq!(checked, 4);
}

#[test]
fn shipped_producers_are_what_add_project_prints() {
    let account = std::fs::read_to_string(nats_dir().join("shotfleet-account.conf")).unwrap();
    for project in ["tide", "moth"] {
        let out = Command::new("bash").arg(nats_dir().join("add-project.sh")).arg(project).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let entry = String::from_utf8(out.stdout).unwrap();
        assert!(account.contains(&entry), "the entry of {project} differs from add-project.sh's:\n{entry}");
    }
    let bad = Command::new("bash").arg(nats_dir().join("add-project.sh")).arg("a.b").output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("must be one subject token"));
}

/// Every document of every manifest under deploy/k8s.
fn manifests() -> Vec<Value> {
    let mut documents = Vec::new();
    for entry in std::fs::read_dir(paths::repo_root().join("deploy/k8s")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            let text = std::fs::read_to_string(&path).unwrap();
            let parsed: Vec<Value> =
                serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            documents.extend(parsed.into_iter().filter(|d| !d.is_null()));
        }
    }
    documents
}

fn str_at<'a>(value: &'a Value, pointer: &str) -> &'a str {
    value.pointer(pointer).and_then(Value::as_str).unwrap_or_default()
}

#[test]
fn keda_scales_on_every_consumer_the_pods_serve() {
    let documents = manifests();
    let consumers: BTreeSet<String> =
        Topology::default().consumers().into_iter().filter_map(|c| c.durable_name).collect();
    let deployments: BTreeMap<&str, &Value> = documents
        .iter()
        .filter(|d| str_at(d, "/kind") == "Deployment")
        .map(|d| (str_at(d, "/metadata/name"), d))
        .collect();
    let mut scaled = 0;
    for object in documents.iter().filter(|d| str_at(d, "/kind") == "ScaledObject") {
        let target = str_at(object, "/spec/scaleTargetRef/name");
        let deployment = deployments.get(target).unwrap_or_else(|| panic!("ScaledObject scales {target}, which is not shipped"));
        let container = deployment.pointer("/spec/template/spec/containers/0").expect("a container");
        let args: Vec<&str> = container["args"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
        let classes = args.iter().position(|a| *a == "--classes").map(|i| args[i + 1]).expect("--classes");
        let mut triggered = BTreeSet::new();
        for trigger in object.pointer("/spec/triggers").and_then(Value::as_array).unwrap() {
            assert_eq!(str_at(trigger, "/type"), "nats-jetstream");
            let name = str_at(trigger, "/metadata/consumer");
            assert!(consumers.contains(name), "{target}: trigger on `{name}`, which `shotfleet setup` does not create");
            assert_eq!(str_at(trigger, "/metadata/stream"), subject::JOBS_STREAM);
            assert_eq!(str_at(trigger, "/metadata/account"), "SHOTFLEET", "the account of deploy/nats");
            triggered.insert(name.to_owned());
        }
        for &priority in Priority::ALL {
            for class in classes.split(',').chain(["auto"]) {
                let wanted = format!("render-{priority}-{class}");
                assert!(triggered.contains(&wanted), "{target} serves {class} but has no trigger on {wanted}");
            }
        }
        scaled += 1;
    }
    assert!(scaled > 0, "no ScaledObject under deploy/k8s");
}

#[test]
fn worker_pods_keep_state_on_a_volume_and_credentials_in_secrets() {
    let documents = manifests();
    for deployment in documents.iter().filter(|d| str_at(d, "/kind") == "Deployment") {
        let name = str_at(deployment, "/metadata/name");
        let pod = deployment.pointer("/spec/template/spec").unwrap();
        let container = &pod["containers"][0];
        let env: BTreeMap<&str, &str> = container["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (str_at(e, "/name"), str_at(e, "/value")))
            .collect();
        let volumes: BTreeMap<&str, &Value> =
            pod["volumes"].as_array().unwrap().iter().map(|v| (str_at(v, "/name"), v)).collect();
        let mounted_from = |path: &str| {
            let mount = container["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| Path::new(path).starts_with(str_at(m, "/mountPath")))
                .max_by_key(|m| str_at(m, "/mountPath").len())
                .unwrap_or_else(|| panic!("{name}: nothing mounted at {path}"));
            volumes[str_at(mount, "/name")]
        };
        let state = mounted_from(env["SHOTFLEET_STATE_DIR"]);
        assert!(state.get("persistentVolumeClaim").is_some(), "{name}: the state folder must outlive the pod: {state}");
        let password = mounted_from(env["NATS_PASSWORD_FILE"]);
        assert!(password.get("secret").is_some(), "{name}: the NATS password comes from a Secret: {password}");
        assert!(!env.contains_key("NATS_PASSWORD"), "{name}: no password in the manifest");
        assert_eq!(env["NATS_INBOX_PREFIX"], "_INBOX_worker");
        assert!(env["SHOTFLEET_METRICS_ADDR"].ends_with(":9400"), "{name}: probes need the metrics port on the pod IP");
    }
}

#[test]
fn systemd_units_are_hardened_and_verify() {
    let per_gpu = ["StateDirectory=shotfleet/gpu%i", "Environment=SHOTFLEET_STATE_DIR=/var/lib/shotfleet/gpu%i", "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID"];
    check_unit("shotfleet-consumer@.service", "shotfleet-consumer@0.service", &per_gpu);
    // The box: one supervisor, SIGTERM to it alone (it passes it on), its workers' folders under one.
    let per_box = ["StateDirectory=shotfleet", "Environment=SHOTFLEET_STATE_DIR=/var/lib/shotfleet", "KillMode=mixed", "RestartPreventExitStatus=2 78"];
    check_unit("shotfleet-box.service", "shotfleet-box.service", &per_box);
}

/// deploy/systemd/`file` has the hardening and `own` settings, and verifies as `instance`.
fn check_unit(file: &str, instance: &str, own: &[&str]) {
    let unit = paths::repo_root().join("deploy/systemd").join(file);
    let text = std::fs::read_to_string(&unit).unwrap();
    for setting in [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "DevicePolicy=closed",
        "DeviceAllow=char-nvidia-frontend rw",
        "DeviceAllow=char-nvidia-uvm rw",
        "LoadCredential=nats-password:/etc/shotfleet/nats-password",
        "Environment=NATS_PASSWORD_FILE=%d/nats-password",
        "Environment=SHOTFLEET_METRICS_HOST=127.0.0.1",
    ]
    .iter()
    .chain(own)
    {
        assert!(text.lines().any(|l| l == *setting), "{file} lacks `{setting}`");
    }
    assert!(!text.contains("PrivateDevices=yes"), "{file}: PrivateDevices would hide the GPU");
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        eprintln!("systemd-analyze is not installed here: the unit's syntax is not verified");
        return;
    }
    // A template verifies as one of its instances.
    let dir = tempfile::tempdir().unwrap();
    let instance = dir.path().join(instance);
    std::fs::copy(&unit, &instance).unwrap();
    let out = Command::new("systemd-analyze").arg("verify").arg(&instance).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.trim().is_empty(), "{file}: systemd-analyze verify: {said}");
    // Exposure 0 (locked down) .. 10 (none); the unit stays well inside systemd's "OK" band.
    let out = Command::new("systemd-analyze").args(["security", "--offline=yes", "--threshold=40"]).arg(&instance).output().unwrap();
    assert!(out.status.success(), "{file}: exposure above 4.0: {}", String::from_utf8_lossy(&out.stdout));
}
