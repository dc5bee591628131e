//! Calibrated estimates survive a restart for the same card, model and runtime, and only then.

use std::sync::Arc;

use shotfleet_consumer::budget::{
    Budget, BudgetConfig, Estimate, FingerprintKey, FingerprintStore, MIB, Sample, Shape, SimulateConfig, SimulatedGpu,
};

fn key(runtime: &str) -> FingerprintKey {
    FingerprintKey { device: "NVIDIA H200".into(), model: "sdxl-base-1.0 fp16".into(), runtime: runtime.into() }
}

fn calibrated() -> Estimate {
    let samples = [(512, 700), (1024, 1100)]
        .map(|(side, mib)| Sample { shape: Shape::new(side, side, 1), peak_bytes: mib * MIB });
    Estimate::calibrate(&samples).unwrap()
}

#[test]
fn a_fingerprint_round_trips_under_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let store = FingerprintStore::new(dir.path().join("state"));
    assert_eq!(store.load(&key("1.31.1")).unwrap(), None, "nothing stored yet");
    let estimate = calibrated();
    let path = store.save(&key("1.31.1"), &estimate).unwrap();
    assert!(path.starts_with(dir.path().join("state")));
    assert_eq!(store.load(&key("1.31.1")).unwrap(), Some(estimate));
    // The file says what it is for, for a person reading the state directory.
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("NVIDIA H200") && text.contains("1.31.1"), "{text}");
}

#[test]
fn another_key_does_not_match_and_both_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let store = FingerprintStore::new(dir.path());
    let old = calibrated();
    store.save(&key("1.31.1"), &old).unwrap();
    assert_eq!(store.load(&key("1.32.0")).unwrap(), None, "a runtime upgrade recalibrates");
    let other_card = FingerprintKey { device: "NVIDIA L4".into(), ..key("1.31.1") };
    assert_eq!(store.load(&other_card).unwrap(), None);
    let mut new = calibrated();
    new.raise_floor(Shape::new(1024, 1024, 1), 2000 * MIB);
    store.save(&key("1.32.0"), &new).unwrap();
    assert_eq!(store.load(&key("1.31.1")).unwrap(), Some(old));
    assert_eq!(store.load(&key("1.32.0")).unwrap(), Some(new));
}

#[test]
fn a_damaged_or_foreign_file_means_recalibrating() {
    let dir = tempfile::tempdir().unwrap();
    let store = FingerprintStore::new(dir.path());
    let path = store.save(&key("1.31.1"), &calibrated()).unwrap();
    std::fs::write(&path, "{ half a file").unwrap();
    assert_eq!(store.load(&key("1.31.1")).unwrap(), None);
    // A file copied by hand under another key's name is not trusted either.
    let other = store.save(&key("1.32.0"), &calibrated()).unwrap();
    std::fs::copy(&other, &path).unwrap();
    assert_eq!(store.load(&key("1.31.1")).unwrap(), None);
}

#[test]
fn what_a_budget_learned_is_what_a_restart_gets() {
    let dir = tempfile::tempdir().unwrap();
    let store = FingerprintStore::new(dir.path());
    let config = BudgetConfig {
        simulate: Some(SimulateConfig { total_mib: 8192, others_used_mib: 0 }),
        ..BudgetConfig::default()
    };
    let gpu = Arc::new(SimulatedGpu::new(config.simulate.as_ref().unwrap()).unwrap());
    let budget = Budget::new(config.clone(), gpu.clone(), calibrated(), 0).unwrap();
    let before = budget.planned(1024, 1024, 4);
    budget.observe(1024, 1024, 4, 4000 * MIB);
    assert!(budget.planned(1024, 1024, 4) > before);
    store.save(&key("1.31.1"), &budget.estimate()).unwrap();

    let restarted = Budget::new(config, gpu, store.load(&key("1.31.1")).unwrap().unwrap(), 0).unwrap();
    for (width, height, batch) in [(1024, 1024, 4), (512, 512, 1), (2048, 2048, 2)] {
        assert_eq!(restarted.planned(width, height, batch), budget.planned(width, height, batch));
    }
}
