//! Keys to targets: kohya and diffusers/PEFT names to one canonical module path per target.

use std::collections::BTreeMap;

use super::arch::{self, Arch};
use super::read::RawFile;
use super::{Format, LoraFileError, LoraFile, Part, Target, Tensor};

/// What a key holds for its module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Down,
    Up,
    Alpha,
}

/// A key read: whose tensor it is.
struct Key {
    part: Part,
    module: String,
    role: Role,
    format: Format,
}

/// The tensors of one module, as found.
#[derive(Default)]
struct Found {
    down: Option<(String, Tensor)>,
    up: Option<(String, Tensor)>,
    alpha: Option<f32>,
}

pub(super) fn targets(raw: RawFile) -> Result<LoraFile, LoraFileError> {
    if let Some((key, arch)) = raw.tensors.iter().find_map(|(k, _)| arch::foreign_key(k).map(|a| (k, a))) {
        return Err(LoraFileError::WrongArchitecture { arch, detail: format!("keys like `{key}`") });
    }
    let metadata = PeftMetadata::read(&raw.metadata);
    let mut modules: BTreeMap<(Part, String), Found> = BTreeMap::new();
    let mut formats = Vec::new();
    let mut unknown = Vec::new();
    for (name, tensor) in raw.tensors {
        let Some(key) = parse_key(&name)? else {
            unknown.push(name);
            continue;
        };
        if key.part == Part::Unet && arch::sd1_module(&key.module) {
            return Err(LoraFileError::WrongArchitecture { arch: Arch::Sd1, detail: format!("keys like `{name}`") });
        }
        if !formats.contains(&key.format) {
            formats.push(key.format);
        }
        let found = modules.entry((key.part, key.module)).or_default();
        match key.role {
            Role::Down => found.down = Some((name, tensor)),
            Role::Up => found.up = Some((name, tensor)),
            Role::Alpha => {
                if tensor.data.len() != 1 {
                    return Err(LoraFileError::Malformed { key: name, detail: format!("an alpha must be one number, not shape {:?}", tensor.shape) });
                }
                found.alpha = Some(tensor.data[0]);
            }
        }
    }
    if modules.is_empty() {
        let detail = match unknown.first() {
            Some(first) => format!("first key `{first}`"),
            None => "no tensors".into(),
        };
        return Err(LoraFileError::WrongArchitecture { arch: Arch::Unknown, detail });
    }
    if let Some(key) = unknown.into_iter().next() {
        return Err(LoraFileError::Malformed {
            key,
            detail: "not a LoRA tensor of SDXL's UNet or text encoders (expected lora_down/lora_up/alpha or lora_A/lora_B)".into(),
        });
    }
    let [format] = formats[..] else {
        return Err(LoraFileError::Malformed {
            key: String::new(),
            detail: "the file mixes kohya keys (lora_unet_*) and diffusers/PEFT keys (unet.*); save it in one format".into(),
        });
    };
    let mut targets = Vec::with_capacity(modules.len());
    for ((part, module), found) in modules {
        if !arch::sdxl_has(part, &module) {
            return Err(LoraFileError::UnknownModule { part: part.as_str(), module });
        }
        targets.push(target(part, module, found, &metadata)?);
    }
    Ok(LoraFile { format, targets })
}

fn target(part: Part, module: String, found: Found, metadata: &PeftMetadata) -> Result<Target, LoraFileError> {
    let missing = |what: &str| LoraFileError::Malformed {
        key: format!("{part}:{module}"),
        detail: format!("has no {what} tensor"),
    };
    let (down_key, down) = found.down.ok_or_else(|| missing("down (lora_down / lora_A)"))?;
    let (up_key, mut up) = found.up.ok_or_else(|| missing("up (lora_up / lora_B)"))?;
    let bad = |key: &str, detail: String| LoraFileError::Malformed { key: key.to_owned(), detail };
    if !matches!(down.shape.len(), 2 | 4) || down.shape.contains(&0) {
        return Err(bad(&down_key, format!("shape {:?}; a down weight is [rank, in] or [rank, in, kh, kw]", down.shape)));
    }
    let rank = down.shape[0];
    // A convolution's up weight is a 1x1 convolution [out, rank, 1, 1].
    if up.shape.len() == 4 && up.shape[2..] == [1, 1] {
        up.shape.truncate(2);
    }
    if up.shape.len() != 2 || up.shape[1] != rank || up.shape[0] == 0 {
        return Err(bad(&up_key, format!("shape {:?} does not fit the down weight's rank {rank} (expected [out, {rank}])", up.shape)));
    }
    let alpha = found.alpha.or_else(|| metadata.alpha(part, &module));
    let scale = match alpha {
        Some(alpha) if metadata.rslora(part) => alpha / (rank as f32).sqrt(),
        Some(alpha) => alpha / rank as f32,
        None => 1.0,
    };
    Ok(Target { part, module, down, up, scale })
}

/// Reads one key: `Ok(None)` when it is not a LoRA key of SDXL's parts at all.
fn parse_key(key: &str) -> Result<Option<Key>, LoraFileError> {
    refuse_other_adapters(key)?;
    if let Some(rest) = key.strip_prefix("lora_") {
        return Ok(parse_kohya(rest));
    }
    Ok(parse_peft(key))
}

/// LyCORIS (LoHa, LoKr, Tucker), DoRA and biases: keys a plain LoRA merge would get wrong.
fn refuse_other_adapters(key: &str) -> Result<(), LoraFileError> {
    const INSIDE: [(&str, &str); 5] = [
        ("hada_w", "LoHa (LyCORIS)"),
        ("lokr_w", "LoKr (LyCORIS)"),
        (".lora_mid.", "a Tucker-decomposed LoCon (lora_mid, LyCORIS)"),
        ("dora_scale", "DoRA"),
        ("lora_magnitude_vector", "DoRA"),
    ];
    const ENDING: [(&str, &str); 3] = [
        (".diff", "a full weight difference (LyCORIS `diff`)"),
        (".diff_b", "a full bias difference (LyCORIS `diff_b`)"),
        (".bias", "a bias"),
    ];
    let inside = INSIDE.iter().find(|(fragment, _)| key.contains(fragment));
    match inside.or_else(|| ENDING.iter().find(|(suffix, _)| key.ends_with(suffix))) {
        Some((_, what)) => Err(LoraFileError::Unsupported { key: key.to_owned(), what }),
        None => Ok(()),
    }
}

/// `unet_<name>.lora_down.weight` and the like (the `lora_` prefix already gone).
fn parse_kohya(rest: &str) -> Option<Key> {
    let (name, suffix) = rest.split_once('.')?;
    let role = match suffix {
        "lora_down.weight" => Role::Down,
        "lora_up.weight" => Role::Up,
        "alpha" => Role::Alpha,
        _ => return None,
    };
    let (part, name) = if let Some(n) = name.strip_prefix("unet_") {
        (Part::Unet, n)
    } else if let Some(n) = name.strip_prefix("te1_") {
        (Part::TextEncoder, n)
    } else if let Some(n) = name.strip_prefix("te2_") {
        (Part::TextEncoder2, n)
    } else {
        return None;
    };
    let dotted = dot_kohya_name(name);
    let module = if part == Part::Unet { sgm_to_diffusers(&dotted).unwrap_or(dotted) } else { dotted };
    Some(Key { part, module, role, format: Format::Kohya })
}

/// Words of module paths that contain underscores, as kohya's flattened names split them.
const COMPOUNDS: [&[&str]; 30] = [
    &["time", "emb", "proj"],
    &["down", "blocks"],
    &["up", "blocks"],
    &["mid", "block"],
    &["transformer", "blocks"],
    &["to", "q"],
    &["to", "k"],
    &["to", "v"],
    &["to", "out"],
    &["proj", "in"],
    &["proj", "out"],
    &["conv", "shortcut"],
    &["conv", "in"],
    &["conv", "out"],
    &["time", "embedding"],
    &["add", "embedding"],
    &["linear", "1"],
    &["linear", "2"],
    &["input", "blocks"],
    &["output", "blocks"],
    &["middle", "block"],
    &["in", "layers"],
    &["out", "layers"],
    &["emb", "layers"],
    &["skip", "connection"],
    &["time", "embed"],
    &["label", "emb"],
    &["text", "model"],
    &["self", "attn"],
    &["text", "projection"],
];
/// `q_proj` and its kin: a letter or word, then `proj`.
const PROJ_HEADS: [&str; 4] = ["q", "k", "v", "out"];

/// `down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q` to
/// `down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`.
fn dot_kohya_name(name: &str) -> String {
    let words: Vec<&str> = name.split('_').collect();
    let mut out: Vec<String> = Vec::with_capacity(words.len());
    let mut i = 0;
    while i < words.len() {
        let compound = COMPOUNDS.iter().find(|c| words[i..].starts_with(c)).map(|c| c.len()).or_else(|| {
            (PROJ_HEADS.contains(&words[i]) && words.get(i + 1) == Some(&"proj")).then_some(2)
        });
        let n = compound.unwrap_or(1);
        out.push(words[i..i + n].join("_"));
        i += n;
    }
    out.join(".")
}

/// SDXL's layers per UNet block in the SGM layout kohya trains SDXL on (up blocks have one more).
const SGM_LAYERS_PER_BLOCK: usize = 2;

/// An SGM (LDM) UNet path, as kohya names SDXL's modules, to diffusers' (what
/// diffusers' `_maybe_map_sgm_blocks_to_diffusers` and `_convert_unet_lora_key` do); `None` for a
/// path that is not SGM.
fn sgm_to_diffusers(path: &str) -> Option<String> {
    let per = SGM_LAYERS_PER_BLOCK + 1;
    let resnet = |tail: &str| -> String {
        match tail {
            "in_layers.2" => "conv1",
            "out_layers.3" => "conv2",
            "emb_layers.1" => "time_emb_proj",
            "skip_connection" => "conv_shortcut",
            other => other,
        }
        .to_owned()
    };
    let fixed = match path {
        "input_blocks.0.0" => Some("conv_in"),
        "out.2" => Some("conv_out"),
        "time_embed.0" => Some("time_embedding.linear_1"),
        "time_embed.2" => Some("time_embedding.linear_2"),
        "label_emb.0.0" => Some("add_embedding.linear_1"),
        "label_emb.0.2" => Some("add_embedding.linear_2"),
        _ => None,
    };
    if let Some(fixed) = fixed {
        return Some(fixed.to_owned());
    }
    let (head, rest) = path.split_once('.')?;
    let (index, rest) = rest.split_once('.')?;
    let index: usize = index.parse().ok()?;
    if head == "middle_block" {
        return Some(match index {
            0 => format!("mid_block.resnets.0.{}", resnet(rest)),
            1 => format!("mid_block.attentions.0.{rest}"),
            2 => format!("mid_block.resnets.1.{}", resnet(rest)),
            _ => return None,
        });
    }
    let (inner, tail) = rest.split_once('.')?;
    let inner: usize = inner.parse().ok()?;
    Some(match head {
        "input_blocks" if index >= 1 => {
            let (block, layer) = ((index - 1) / per, (index - 1) % per);
            match (inner, tail) {
                (0, "op") => format!("down_blocks.{block}.downsamplers.0.conv"),
                (0, tail) => format!("down_blocks.{block}.resnets.{layer}.{}", resnet(tail)),
                (1, tail) => format!("down_blocks.{block}.attentions.{layer}.{tail}"),
                _ => return None,
            }
        }
        "output_blocks" => {
            let (block, layer) = (index / per, index % per);
            match (inner, tail) {
                (0, tail) => format!("up_blocks.{block}.resnets.{layer}.{}", resnet(tail)),
                // A block without attention has its upsampler second.
                (1 | 2, "conv") => format!("up_blocks.{block}.upsamplers.0.conv"),
                (1, tail) => format!("up_blocks.{block}.attentions.{layer}.{tail}"),
                _ => return None,
            }
        }
        _ => return None,
    })
}

/// diffusers / PEFT keys: `unet.<module>.lora_A.weight` and diffusers' older spellings.
fn parse_peft(key: &str) -> Option<Key> {
    const ROLES: [(&str, Role); 9] = [
        (".lora_A.weight", Role::Down),
        (".lora_B.weight", Role::Up),
        (".lora.down.weight", Role::Down),
        (".lora.up.weight", Role::Up),
        (".lora_linear_layer.down.weight", Role::Down),
        (".lora_linear_layer.up.weight", Role::Up),
        ("_lora.down.weight", Role::Down),
        ("_lora.up.weight", Role::Up),
        (".alpha", Role::Alpha),
    ];
    let (stem, role) = ROLES.iter().find_map(|(suffix, role)| key.strip_suffix(suffix).map(|s| (s, *role)))?;
    let (part, module) = if let Some(m) = stem.strip_prefix("text_encoder_2.") {
        (Part::TextEncoder2, m)
    } else if let Some(m) = stem.strip_prefix("text_encoder.") {
        (Part::TextEncoder, m)
    } else if let Some(m) = stem.strip_prefix("unet.") {
        (Part::Unet, m)
    } else if ["down_blocks.", "up_blocks.", "mid_block.", "conv_in", "conv_out", "time_embedding.", "add_embedding."]
        .iter()
        .any(|p| stem.starts_with(p))
    {
        // A UNet-only file saved without the `unet.` prefix.
        (Part::Unet, stem)
    } else {
        return None;
    };
    // diffusers' attention-processor era: `attn1.processor.to_q_lora.down.weight`, `to_out_lora`.
    let mut module = module.replace(".processor.", ".");
    if module.ends_with(".to_out") {
        module.push_str(".0");
    }
    let module = match part {
        // transformers 5 saves CLIPTextModel's modules without the `text_model` level.
        Part::TextEncoder | Part::TextEncoder2 if module.starts_with("encoder.") => format!("text_model.{module}"),
        _ => module,
    };
    Some(Key { part, module, role, format: Format::Peft })
}

/// diffusers' `lora_adapter_metadata`: PEFT's LoraConfig per part (`unet.lora_alpha`, ...).
#[derive(Default)]
struct PeftMetadata {
    config: serde_json::Map<String, serde_json::Value>,
}

impl PeftMetadata {
    fn read(metadata: &std::collections::HashMap<String, String>) -> PeftMetadata {
        let config = metadata
            .get("lora_adapter_metadata")
            .and_then(|text| serde_json::from_str::<serde_json::Value>(text).ok())
            .and_then(|v| v.as_object().cloned())
            .unwrap_or_default();
        PeftMetadata { config }
    }

    fn get(&self, part: Part, field: &str) -> Option<&serde_json::Value> {
        self.config.get(&format!("{part}.{field}"))
    }

    /// The module's alpha: `alpha_pattern` (a module path or its suffix), else `lora_alpha`.
    fn alpha(&self, part: Part, module: &str) -> Option<f32> {
        let pattern = self.get(part, "alpha_pattern").and_then(|p| p.as_object()).and_then(|patterns| {
            patterns
                .iter()
                .find(|(key, _)| module == key.as_str() || module.ends_with(&format!(".{key}")))
                .and_then(|(_, v)| v.as_f64())
        });
        pattern.or_else(|| self.get(part, "lora_alpha").and_then(|v| v.as_f64())).map(|a| a as f32)
    }

    fn rslora(&self, part: Part) -> bool {
        self.get(part, "use_rslora").and_then(|v| v.as_bool()).unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kohya_names_get_their_dots_back() {
        for (kohya, dotted) in [
            ("down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"),
            ("up_blocks_0_attentions_2_transformer_blocks_9_attn2_to_out_0", "up_blocks.0.attentions.2.transformer_blocks.9.attn2.to_out.0"),
            ("mid_block_attentions_0_transformer_blocks_0_ff_net_0_proj", "mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj"),
            ("down_blocks_0_resnets_1_time_emb_proj", "down_blocks.0.resnets.1.time_emb_proj"),
            ("up_blocks_1_resnets_0_conv_shortcut", "up_blocks.1.resnets.0.conv_shortcut"),
            ("text_model_encoder_layers_11_self_attn_out_proj", "text_model.encoder.layers.11.self_attn.out_proj"),
            ("text_model_encoder_layers_0_mlp_fc2", "text_model.encoder.layers.0.mlp.fc2"),
            ("input_blocks_4_1_proj_in", "input_blocks.4.1.proj_in"),
            ("output_blocks_2_0_out_layers_3", "output_blocks.2.0.out_layers.3"),
            ("label_emb_0_2", "label_emb.0.2"),
        ] {
            assert_eq!(dot_kohya_name(kohya), dotted);
        }
    }

    #[test]
    fn sgm_paths_map_to_diffusers() {
        for (sgm, diffusers) in [
            ("input_blocks.4.1.transformer_blocks.0.attn1.to_q", "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"),
            ("input_blocks.8.1.proj_out", "down_blocks.2.attentions.1.proj_out"),
            ("input_blocks.1.0.in_layers.2", "down_blocks.0.resnets.0.conv1"),
            ("input_blocks.4.0.skip_connection", "down_blocks.1.resnets.0.conv_shortcut"),
            ("input_blocks.3.0.op", "down_blocks.0.downsamplers.0.conv"),
            ("middle_block.0.emb_layers.1", "mid_block.resnets.0.time_emb_proj"),
            ("middle_block.1.transformer_blocks.3.ff.net.2", "mid_block.attentions.0.transformer_blocks.3.ff.net.2"),
            ("middle_block.2.out_layers.3", "mid_block.resnets.1.conv2"),
            ("output_blocks.5.1.proj_in", "up_blocks.1.attentions.2.proj_in"),
            ("output_blocks.2.2.conv", "up_blocks.0.upsamplers.0.conv"),
            ("output_blocks.8.0.out_layers.3", "up_blocks.2.resnets.2.conv2"),
            ("input_blocks.0.0", "conv_in"),
            ("out.2", "conv_out"),
            ("label_emb.0.0", "add_embedding.linear_1"),
        ] {
            assert_eq!(sgm_to_diffusers(sgm).as_deref(), Some(diffusers), "{sgm}");
        }
        assert_eq!(sgm_to_diffusers("down_blocks.1.attentions.0.proj_in"), None);
    }

    #[test]
    fn peft_keys() {
        let key = parse_peft("unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_out_lora.up.weight").unwrap();
        assert_eq!(key.module, "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0");
        assert_eq!(key.role, Role::Up);
        let key = parse_peft("text_encoder.encoder.layers.0.self_attn.q_proj.lora_A.weight").unwrap();
        assert_eq!((key.part, key.module.as_str()), (Part::TextEncoder, "text_model.encoder.layers.0.self_attn.q_proj"));
        let key = parse_peft("text_encoder_2.text_model.encoder.layers.0.mlp.fc1.lora_linear_layer.down.weight").unwrap();
        assert_eq!((key.part, key.role), (Part::TextEncoder2, Role::Down));
        assert!(parse_peft("vae.decoder.conv_in.lora_A.weight").is_none());
    }
}
