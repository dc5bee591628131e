//! The UNet graph rewritten by `onnx/graph_passes.py` (`tune_unet.py rewrite`: the Transposes at
//! the fused UNet's layout borders moved, cancelled and deduplicated, Shape ops read before the
//! Transposes): the rewrites are exact on a graph of such borders, and the pipeline renders the
//! same image through a rewritten tiny UNet as through the original.

mod pipeline_support;

use pipeline_support::{lighthouse_pixels, load, model_dir, onnx_script, pixel_difference, tiny_pipeline};
use shotfleet_testkit::paths::copy_dir;

#[test]
fn the_graph_passes_keep_every_output_of_a_graph_of_layout_borders() {
    onnx_script("tune_unet.py", &["selftest".as_ref()]);
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
