//! LoRA files as people have them: the fixtures `onnx/make_lora_fixtures.py` made with peft and
//! diffusers for the tiny SDXL, and files built here for each way a file can be wrong.

use std::collections::HashMap;
use std::path::PathBuf;

use shotfleet_schema::lora::library::{self, LoraEntry};
use shotfleet_schema::lora::{Arch, FileLimits, Format, LoraFile, LoraFileError, Part};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../onnx/tiny/lora").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn parse(bytes: &[u8]) -> Result<LoraFile, LoraFileError> {
    LoraFile::parse(bytes, &FileLimits::default())
}

/// A safetensors file of float32 tensors.
fn file(tensors: &[(&str, Vec<usize>)]) -> Vec<u8> {
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let bytes = (0..n).flat_map(|i| (0.01 * i as f32).to_le_bytes()).collect();
            (name.to_string(), bytes, shape.clone())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(name, bytes, shape)| {
            (name.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes).unwrap())
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

#[test]
fn kohya_file_with_sgm_names_reads_as_sdxl_targets() {
    let lora = parse(&fixture("kohya_sgm.safetensors")).unwrap();
    assert_eq!(lora.format, Format::Kohya);
    assert_eq!((lora.count(Part::Unet), lora.count(Part::TextEncoder), lora.count(Part::TextEncoder2)), (177, 30, 30));
    assert_eq!(lora.rank(), 4);
    let by_module: HashMap<(Part, &str), _> = lora.targets.iter().map(|t| ((t.part, t.module.as_str()), t)).collect();
    // SGM input_blocks.4.1 is diffusers' down_blocks.1.attentions.0; alpha 2 over rank 4.
    let q = by_module[&(Part::Unet, "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")];
    assert_eq!((q.down.shape.as_slice(), q.up.shape.as_slice(), q.scale), ([4, 32].as_slice(), [32, 4].as_slice(), 0.5));
    // Convolutions: 3x3 resnet convs, the 1x1 shortcut, the samplers.
    let conv = by_module[&(Part::Unet, "up_blocks.1.resnets.0.conv1")];
    assert!(conv.is_conv());
    assert_eq!(conv.weight_shape(), [16, 48, 3, 3]);
    assert_eq!(by_module[&(Part::Unet, "down_blocks.1.resnets.0.conv_shortcut")].weight_shape(), [32, 16, 1, 1]);
    assert!(by_module.contains_key(&(Part::Unet, "down_blocks.0.downsamplers.0.conv")));
    assert!(by_module.contains_key(&(Part::Unet, "up_blocks.0.upsamplers.0.conv")));
    assert!(by_module.contains_key(&(Part::Unet, "mid_block.resnets.1.time_emb_proj")));
    assert!(by_module.contains_key(&(Part::TextEncoder, "text_model.encoder.layers.4.mlp.fc2")));
    assert!(by_module.contains_key(&(Part::TextEncoder2, "text_model.encoder.layers.0.self_attn.out_proj")));
}

#[test]
fn kohya_diffusers_names_read_as_the_same_targets_as_sgm_names() {
    let sgm = parse(&fixture("kohya_sgm.safetensors")).unwrap();
    let named = parse(&fixture("kohya_diffusers_names.safetensors")).unwrap();
    assert!(named.targets.len() > 20);
    for target in &named.targets {
        let same = sgm.targets.iter().find(|t| t.part == target.part && t.module == target.module);
        assert_eq!(same, Some(target), "{}:{}", target.part, target.module);
    }
}

#[test]
fn peft_file_reads_alpha_from_diffusers_metadata() {
    let lora = parse(&fixture("peft.safetensors")).unwrap();
    assert_eq!(lora.format, Format::Peft);
    assert_eq!((lora.count(Part::Unet), lora.count(Part::TextEncoder), lora.count(Part::TextEncoder2)), (120, 20, 20));
    // lora_alpha 3 over r 2.
    assert!(lora.targets.iter().all(|t| t.scale == 1.5 && t.rank() == 2));
    assert!(lora.targets.iter().any(|t| t.module == "down_blocks.0.resnets.0.conv1" && t.is_conv()));
}

#[test]
fn files_made_for_other_models_are_refused_saying_for_which() {
    let err = parse(&fixture("sd15.safetensors")).unwrap_err();
    assert!(matches!(err, LoraFileError::WrongArchitecture { arch: Arch::Sd1, .. }), "{err}");
    assert!(err.to_string().contains("Stable Diffusion 1.x/2.x") && err.to_string().contains("SDXL version"), "{err}");
    let err = parse(&fixture("sd3.safetensors")).unwrap_err();
    assert!(matches!(err, LoraFileError::WrongArchitecture { arch: Arch::Sd3OrFlux, .. }), "{err}");
    assert!(err.to_string().contains("SD3 or Flux"), "{err}");
    // A PEFT file for SD 1.5's UNet (attention at the first level).
    let sd15_unet = file(&[
        ("unet.down_blocks.0.attentions.0.proj_in.lora_A.weight", vec![2, 8]),
        ("unet.down_blocks.0.attentions.0.proj_in.lora_B.weight", vec![8, 2]),
    ]);
    assert!(matches!(parse(&sd15_unet), Err(LoraFileError::WrongArchitecture { arch: Arch::Sd1, .. })));
    let nothing_known = file(&[("model.diffusion.weight", vec![2, 2])]);
    let err = parse(&nothing_known).unwrap_err();
    assert!(matches!(err, LoraFileError::WrongArchitecture { arch: Arch::Unknown, .. }), "{err}");
    assert!(err.to_string().contains("lora_unet_"), "{err}");
}

#[test]
fn pickles_are_never_read() {
    let err = parse(&fixture("pickle.pt")).unwrap_err();
    assert!(matches!(err, LoraFileError::Pickle { .. }));
    assert!(err.to_string().contains("pickle files can run code") && err.to_string().contains("convert it to safetensors"), "{err}");
    let raw_pickle = [0x80, 0x04, 0x95, 0x10, 0, 0, 0, 0, 0, 0, 0, b'}'];
    assert!(matches!(parse(&raw_pickle), Err(LoraFileError::Pickle { .. })));
}

#[test]
fn truncated_or_oversized_files_are_refused() {
    let bytes = fixture("kohya_sgm.safetensors");
    let err = parse(&bytes[..bytes.len() / 2]).unwrap_err();
    assert!(matches!(err, LoraFileError::NotSafetensors { .. }), "{err}");
    assert!(err.to_string().contains("download cut short"), "{err}");
    let err = LoraFile::parse(&bytes, &FileLimits { max_bytes: 1000 }).unwrap_err();
    assert_eq!(err, LoraFileError::TooLarge { bytes: bytes.len() as u64, limit: 1000 });
    assert!(matches!(parse(b"hello"), Err(LoraFileError::NotSafetensors { .. })));
}

#[test]
fn modules_sdxl_lacks_and_other_adapter_kinds_are_refused_by_name() {
    let norm = file(&[
        ("lora_unet_down_blocks_1_attentions_0_norm.lora_down.weight", vec![2, 8]),
        ("lora_unet_down_blocks_1_attentions_0_norm.lora_up.weight", vec![8, 2]),
    ]);
    let err = parse(&norm).unwrap_err();
    assert!(err.to_string().contains("`down_blocks.1.attentions.0.norm` (unet) is not a module of SDXL's unet"), "{err}");
    let loha = file(&[("lora_unet_down_blocks_1_attentions_0_proj_in.hada_w1_a", vec![8, 2])]);
    let err = parse(&loha).unwrap_err();
    assert!(err.to_string().contains("LoHa"), "{err}");
    let dora = file(&[("unet.down_blocks.1.attentions.0.proj_in.lora_magnitude_vector", vec![8])]);
    assert!(matches!(parse(&dora), Err(LoraFileError::Unsupported { what: "DoRA", .. })));
}

#[test]
fn broken_pairs_are_refused_by_key() {
    let no_up = file(&[("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", vec![2, 16])]);
    let err = parse(&no_up).unwrap_err();
    assert!(err.to_string().contains("text_encoder:text_model.encoder.layers.0.mlp.fc1") && err.to_string().contains("no up"), "{err}");
    let wrong_rank = file(&[
        ("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", vec![2, 16]),
        ("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", vec![37, 3]),
    ]);
    let err = parse(&wrong_rank).unwrap_err();
    assert!(err.to_string().contains("rank 2"), "{err}");
    let mixed = file(&[
        ("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", vec![2, 16]),
        ("lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", vec![37, 2]),
        ("unet.down_blocks.1.attentions.0.proj_in.lora_A.weight", vec![2, 8]),
        ("unet.down_blocks.1.attentions.0.proj_in.lora_B.weight", vec![8, 2]),
    ]);
    assert!(parse(&mixed).unwrap_err().to_string().contains("mixes kohya keys"));
}

#[test]
fn library_entries_describe_the_file() {
    let bytes = fixture("peft.safetensors");
    let lora = parse(&bytes).unwrap();
    let entry = LoraEntry::describe("hero.v1", &bytes, &lora, 1_700_000_000);
    assert_eq!((entry.rank, entry.targets, entry.bytes), (2, 160, bytes.len() as u64));
    assert_eq!(entry.sha256, library::sha256_hex(&bytes));
    assert_eq!(entry.parts[&Part::Unet], 120);
    let json = serde_json::to_string(&entry).unwrap();
    assert!(json.contains(r#""format":"peft""#) && json.contains(r#""arch":"sdxl""#), "{json}");
    assert_eq!(serde_json::from_str::<LoraEntry>(&json).unwrap(), entry);
    assert_eq!((library::file_key("hero.v1"), library::sidecar_key("hero.v1")), ("hero.v1.safetensors".into(), "hero.v1.json".into()));
    assert_eq!(library::name_of_sidecar("hero.v1.json"), Some("hero.v1"));
    assert!(library::check_name("a..b").unwrap_err().contains("`..`"));
    assert!(library::check_name("a/b").unwrap_err().contains("'/'"));
}
