//! The UNet graph rewritten by `onnx/graph_passes.py` (`tune_unet.py rewrite`: the Transposes at
//! the fused UNet's layout borders moved, cancelled and deduplicated, Shape ops read before the
//! Transposes): the rewrites are exact on a graph of such borders, and the pipeline renders the
//! same image through a rewritten tiny UNet as through the original. Also the CPU paths of
//! `tune_unet.py streams` (two UNet calls in flight, on one session and on two, give what one call
//! gives) and `tune_unet.py time` (variants timed against the original).

mod pipeline_support;

use pipeline_support::{lighthouse_pixels, load, model_dir, onnx_script, pixel_difference, tiny_pipeline};
use shotfleet_testkit::paths::copy_dir;

#[test]
fn the_graph_passes_keep_every_output_of_a_graph_of_layout_borders() {
    onnx_script("tune_unet.py", &["selftest".as_ref()]);
}

#[test]
fn unet_calls_in_flight_at_once_give_the_outputs_of_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("streams.json");
    let unet = model_dir().join("unet/model.onnx");
    let args = ["streams", "--device", "cpu", "--size", "128", "--calls", "6", "--warmup", "1"];
    let mut args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
    args.extend(["--model".as_ref(), unet.as_os_str(), "--out".as_ref(), out.as_os_str()]);
    onnx_script("tune_unet.py", &args);
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let ways = doc["ways"].as_array().unwrap();
    let names: Vec<&str> = ways.iter().map(|w| w["way"].as_str().unwrap()).collect();
    assert_eq!(names, ["one thread, one session", "two threads, one session", "two threads, two sessions"]);
    for way in ways {
        assert_eq!(way["status"], "ok", "{way}");
        assert!(way["calls_per_s"].as_f64().unwrap() > 0.0, "{way}");
        // The same inputs through the same graph on the CPU: the same bits, however many run at once.
        assert!(way["max_abs_diff"].as_f64().unwrap() < 1e-6, "{way}");
    }
}

/// `tune_unet.py time`'s CPU path: a rewrite and a provider-option variant (`opt:`, the same
/// graph in a session with other options: on the CPU the CUDA options do nothing) each timed
/// against the original with outputs that agree, and the original graph left in place.
#[test]
fn tune_times_a_rewrite_and_an_option_variant_against_the_original() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_dir(&model_dir(), &model);
    let unet = model.join("unet/model.onnx");
    let out = dir.path().join("tune.json");
    let variants = "none,opt:sdpa_kernel=1;cudnn_conv_algo_search=HEURISTIC";
    let args = ["time", "--device", "cpu", "--size", "128", "--warmup", "1", "--iters", "1", "--rounds", "2", "--variants", variants];
    let mut args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
    args.extend(["--model".as_ref(), unet.as_os_str(), "--out".as_ref(), out.as_os_str()]);
    onnx_script("tune_unet.py", &args);
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let rows = doc["variants"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{doc}");
    for row in rows {
        assert_eq!(row["status"], "ok", "{row}");
        assert!(row["speedup"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["max_abs_diff"].as_f64().unwrap() < 1e-6, "{row}");
    }
    assert_eq!(rows[1]["cuda_options"], serde_json::json!({"sdpa_kernel": "1", "cudnn_conv_algo_search": "HEURISTIC"}));
    assert!(unet.is_file(), "an option variant runs the original graph and keeps it");
    let left: Vec<_> = std::fs::read_dir(model.join("unet")).unwrap().map(|e| e.unwrap().file_name()).filter(|n| n.to_string_lossy().contains("tune")).collect();
    assert!(left.is_empty(), "the rewritten variant's file is removed: {left:?}");
}

#[test]
fn a_rewritten_unet_renders_the_same_image() {
    let reference = lighthouse_pixels(&tiny_pipeline());
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_dir(&model_dir(), &model);
    let unet = model.join("unet/model.onnx");
    onnx_script("tune_unet.py", &["rewrite".as_ref(), unet.as_os_str(), unet.as_os_str()]);
    let original = std::fs::read(model_dir().join("unet/model.onnx")).unwrap();
    assert_ne!(std::fs::read(&unet).unwrap(), original, "the rewrite changed nothing in the tiny UNet");

    let pixels = lighthouse_pixels(&load(&model));
    let (max, mean) = pixel_difference(&reference, &pixels);
    assert!(max <= 1 && mean < 0.01, "the rewritten UNet renders another image: largest difference {max}, mean {mean}");
}
