//! NVML on whatever machine runs the tests: on one without a GPU, opening it must fail with a
//! message that tells the operator what to do; on one with a GPU, it must read the card.

use shotfleet_consumer::budget::{BudgetConfig, GpuProbe, NvmlProbe, PeakWindow, ProbeError, open_probe};

#[test]
fn nvml_opens_the_card_or_says_how_to_run_without_one() {
    match NvmlProbe::open(0) {
        Err(err @ ProbeError::NvmlUnavailable { .. }) => {
            let message = err.to_string();
            assert!(message.starts_with("NVML unavailable: "), "{message}");
            assert!(
                message.contains(r#"use `device = "cpu"` with an explicit `[budget.simulate]` section"#),
                "{message}"
            );
            assert!(err.nvml_error().is_some(), "NVML's own error is kept for the worker to classify");
            // The worker's way in says the same.
            let via_config = open_probe(&BudgetConfig::default(), Some(0)).err().unwrap();
            assert!(matches!(via_config, ProbeError::NvmlUnavailable { .. }));
        }
        Err(other) => panic!("NVML loaded but GPU 0 cannot be read: {other}"),
        Ok(probe) => {
            let snapshot = probe.snapshot().unwrap();
            assert!(!snapshot.device.is_empty());
            assert!(snapshot.total > 0 && snapshot.used <= snapshot.total && snapshot.free <= snapshot.total);
            let window = PeakWindow::start(&probe).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(50));
            window.finish().unwrap();
            eprintln!("{snapshot:?}");
        }
    }
}

#[test]
fn a_missing_gpu_index_is_named() {
    match NvmlProbe::open(999) {
        Err(ProbeError::NoDevice { index, source }) => {
            assert_eq!(index, 999);
            eprintln!("{source}");
        }
        Err(ProbeError::NvmlUnavailable { .. }) => {} // no NVML here: the test above covers it
        Err(other) => panic!("unexpected: {other}"),
        Ok(_) => panic!("no machine has 1000 GPUs"),
    }
}
