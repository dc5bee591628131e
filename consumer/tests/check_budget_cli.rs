//! `shotfleet-consumer --check-budget` on the tiny model and a simulated card: one JSON line per
//! shape with its predicted and observed peak, then a summary; a bad shape list is refused.
//! (On the CPU the simulated card's peaks are the process's resident memory, which does not
//! shrink back: the numbers are not a budget test, the command's contract is.)

mod pipeline_support;

use std::process::Command;

use pipeline_support::{model_dir, require_ort};

fn consumer(config: &std::path::Path, shapes: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_shotfleet-consumer"))
        .args(["--config", config.to_str().unwrap(), "--check-budget", shapes])
        .env_remove("SHOTFLEET_CONFIG")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn the_check_prints_a_line_per_shape_and_a_summary() {
    require_ort();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("worker.toml");
    std::fs::write(
        &config,
        format!(
            "device = \"cpu\"\nmodel = {:?}\nstate_dir = {:?}\nintra_threads = 2\n\n[calibration]\nshapes = [[64, 64, 1], [96, 96, 1], [128, 128, 1]]\nsteps = 1\n\n[budget.simulate]\ntotal_mib = 4096\n",
            model_dir(),
            dir.path().join("state"),
        ),
    )
    .unwrap();

    let out = consumer(&config, "64x64x1, 128x96x2");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    for (row, (w, h, n)) in lines.iter().zip([(64, 64, 1), (128, 96, 2)]) {
        assert_eq!((row["width"].as_u64(), row["height"].as_u64(), row["images"].as_u64()), (Some(w), Some(h), Some(n)));
        let (predicted, observed) = (row["predicted_mib"].as_f64().unwrap(), row["observed_mib"].as_f64().unwrap());
        assert!(predicted > 0.0 && observed > 0.0, "{row}");
        assert!(row["planned_mib"].as_f64().unwrap() > predicted, "the safety margin is on top: {row}");
        assert!((row["error"].as_f64().unwrap() - (observed - predicted) / predicted).abs() < 1e-9, "{row}");
        // A second cold render of the shape has a peak of its own.
        assert!(row["observed_again_mib"].as_f64().unwrap() > 0.0, "{row}");
        // The timed last render includes its VAE decode.
        let (again, vae) = (row["again_ms"].as_f64().unwrap(), row["again_vae_ms"].as_f64().unwrap());
        assert!(row["first_ms"].as_f64().unwrap() > 0.0 && again > 0.0 && vae > 0.0 && vae < again, "{row}");
        // Each graph's arena after the first render: the UNet's and the VAE's hold its tensors.
        let arenas = row["arenas_mib"].as_object().unwrap();
        assert!(["unet", "vae_decoder"].iter().all(|g| arenas[*g].as_f64().unwrap() > 0.0), "{row}");
    }
    let summary = &lines[2]["summary"];
    assert_eq!(summary["shapes"], 2);
    assert_eq!(summary["calibration"].as_array().unwrap().len(), 3, "{summary}");

    let bad = consumer(&config, "64x64");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("`64x64` is not three numbers"));
}
