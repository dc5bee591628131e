"""Shared pieces for exporting SDXL to ONNX in Hugging Face Optimum's folder layout.

Used by make_tiny.py (the committed CPU fixture) and export_sdxl.py (real checkpoints and
random-weight full-size models), so both walk the same code path.

Layout written under OUT:
    model_index.json
    scheduler/scheduler_config.json
    text_encoder/{model.onnx,config.json}
    text_encoder_2/{model.onnx,config.json}
    unet/{model.onnx[,model.onnx_data],config.json}
    vae_decoder/{model.onnx,config.json}
    tokenizer/ and tokenizer_2/ {vocab.json,merges.txt,special_tokens_map.json,tokenizer_config.json}

Input/output names follow Optimum's exporter (optimum/exporters/onnx/model_configs.py):
    text_encoder:   input_ids (int32) -> last_hidden_state, pooler_output, hidden_states.0..N
    text_encoder_2: input_ids (int32) -> text_embeds, last_hidden_state, hidden_states.0..N
    unet:           sample, timestep (0-d scalar), encoder_hidden_states, text_embeds, time_ids -> out_sample
    vae_decoder:    latent_sample -> sample
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

OPSET = 17
# Anything above this goes to one external data file next to model.onnx (protobuf's limit is 2 GiB).
EXTERNAL_DATA_THRESHOLD = 1_900_000_000

# ---------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------

# SDXL's scheduler, as stabilityai/stable-diffusion-xl-base-1.0 ships it.
SDXL_SCHEDULER = {
    "_class_name": "EulerDiscreteScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
}

# Real SDXL-base architecture (UNet about 2.6B parameters, CLIP ViT-L text, OpenCLIP bigG text, VAE).
SDXL_BASE = {
    "text_encoder": {
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "hidden_act": "quick_gelu",
        "hidden_size": 768,
        "intermediate_size": 3072,
        "layer_norm_eps": 1e-5,
        "max_position_embeddings": 77,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "projection_dim": 768,
        "vocab_size": 49408,
    },
    "text_encoder_2": {
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "hidden_act": "gelu",
        "hidden_size": 1280,
        "intermediate_size": 5120,
        "layer_norm_eps": 1e-5,
        "max_position_embeddings": 77,
        "num_attention_heads": 20,
        "num_hidden_layers": 32,
        "projection_dim": 1280,
        "vocab_size": 49408,
    },
    "unet": {
        "act_fn": "silu",
        "addition_embed_type": "text_time",
        "addition_embed_type_num_heads": 64,
        "addition_time_embed_dim": 256,
        "attention_head_dim": [5, 10, 20],
        "block_out_channels": [320, 640, 1280],
        "center_input_sample": False,
        "cross_attention_dim": 2048,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "downsample_padding": 1,
        "flip_sin_to_cos": True,
        "freq_shift": 0,
        "in_channels": 4,
        "layers_per_block": 2,
        "mid_block_scale_factor": 1,
        "norm_eps": 1e-5,
        "norm_num_groups": 32,
        "out_channels": 4,
        "projection_class_embeddings_input_dim": 2816,
        "sample_size": 128,
        "transformer_layers_per_block": [1, 2, 10],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "use_linear_projection": True,
    },
    "vae": {
        "act_fn": "silu",
        "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "force_upcast": True,
        "in_channels": 3,
        "latent_channels": 4,
        "layers_per_block": 2,
        "norm_num_groups": 32,
        "out_channels": 3,
        "sample_size": 1024,
        "scaling_factor": 0.13025,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
    },
}

# Tiny SDXL-architecture model for CPU tests. The two text encoders have different widths
# (16 and 20) so that swapping them, or concatenating in the wrong order, fails loudly.
# The VAE keeps four blocks so its scale factor is 8, as in real SDXL.
TINY_TE1_HIDDEN = 16
TINY_TE2_HIDDEN = 20
TINY_TE2_PROJECTION = 24
TINY_TIME_EMBED = 8
SDXL_TINY = {
    "text_encoder": {
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "hidden_act": "quick_gelu",
        "hidden_size": TINY_TE1_HIDDEN,
        "intermediate_size": 37,
        "layer_norm_eps": 1e-5,
        "max_position_embeddings": 77,
        "num_attention_heads": 2,
        "num_hidden_layers": 5,
        "projection_dim": TINY_TE1_HIDDEN,
        "vocab_size": 49408,
    },
    "text_encoder_2": {
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "hidden_act": "gelu",
        "hidden_size": TINY_TE2_HIDDEN,
        "intermediate_size": 37,
        "layer_norm_eps": 1e-5,
        "max_position_embeddings": 77,
        "num_attention_heads": 2,
        "num_hidden_layers": 5,
        "projection_dim": TINY_TE2_PROJECTION,
        "vocab_size": 49408,
    },
    "unet": {
        "act_fn": "silu",
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": TINY_TIME_EMBED,
        "attention_head_dim": [2, 4],
        "block_out_channels": [16, 32],
        "cross_attention_dim": TINY_TE1_HIDDEN + TINY_TE2_HIDDEN,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "in_channels": 4,
        "layers_per_block": 2,
        "norm_num_groups": 8,
        "out_channels": 4,
        "projection_class_embeddings_input_dim": 6 * TINY_TIME_EMBED + TINY_TE2_PROJECTION,
        "sample_size": 8,
        "transformer_layers_per_block": [1, 2],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "use_linear_projection": True,
    },
    "vae": {
        "act_fn": "silu",
        "block_out_channels": [8, 16, 16, 16],
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "force_upcast": True,
        "in_channels": 3,
        "latent_channels": 4,
        "layers_per_block": 1,
        "norm_num_groups": 4,
        "out_channels": 3,
        "sample_size": 64,
        "scaling_factor": 0.13025,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
    },
}


def build_random_models(configs: dict, seed: int, device: str = "cpu", dtype=None):
    """Builds the four networks from configs with a seeded random init (PyTorch/diffusers defaults)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    dtype = dtype or torch.float32
    with torch.device(device):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(CLIPTextConfig(**configs["text_encoder"]))
        torch.manual_seed(seed + 1)
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**configs["text_encoder_2"]))
        torch.manual_seed(seed + 2)
        unet = UNet2DConditionModel(**configs["unet"])
        torch.manual_seed(seed + 3)
        vae = AutoencoderKL(**configs["vae"])
    models = {"text_encoder": text_encoder, "text_encoder_2": text_encoder_2, "unet": unet, "vae": vae}
    for m in models.values():
        m.to(dtype=dtype).eval().requires_grad_(False)
    return models


# ---------------------------------------------------------------------------------------------
# Tokenizer files (the real CLIP BPE vocabulary, from the open-clip-torch package)
# ---------------------------------------------------------------------------------------------

CLIP_MERGES = 49152 - 256 - 2  # 48,894 merges, as OpenAI's CLIP uses
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _byte_alphabet() -> list[str]:
    """GPT-2/CLIP reversible byte->unicode alphabet, in the order CLIP numbers it.

    Printable bytes map to themselves and come first; the other 68 bytes map to U+0100.. and follow.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    chars = [chr(b) for b in printable]
    extra = 0
    for b in range(256):
        if b not in printable:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def clip_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("open-clip-torch is needed for the CLIP vocabulary (pip install open-clip-torch)")
    gz = Path(list(spec.submodule_search_locations)[0]) / "bpe_simple_vocab_16e6.txt.gz"
    lines = gzip.open(gz, "rt", encoding="utf-8").read().split("\n")
    merges = lines[1 : 1 + CLIP_MERGES]
    alphabet = _byte_alphabet()
    tokens = alphabet + [c + "</w>" for c in alphabet]
    tokens += ["".join(m.split(" ")) for m in merges]
    tokens += [BOS, EOS]
    assert len(tokens) == 49408, len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == 49408
    return vocab, merges


def _special(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}


def write_clip_tokenizer(out_dir: Path, pad_token: str, vocab=None, merges=None) -> None:
    """Writes vocab.json, merges.txt, special_tokens_map.json, tokenizer_config.json as SDXL repos have them.

    tokenizer pads with <|endoftext|> (49407); tokenizer_2 pads with "!" (id 0), like real SDXL.
    """
    if vocab is None:
        vocab, merges = clip_vocab_and_merges()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    pad = _special(pad_token) if pad_token != EOS else pad_token
    special = {"bos_token": _special(BOS), "eos_token": _special(EOS), "pad_token": pad, "unk_token": _special(EOS)}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    config = {
        "add_prefix_space": False,
        "bos_token": {"__type": "AddedToken", **_special(BOS)},
        "clean_up_tokenization_spaces": True,
        "do_lower_case": True,
        "eos_token": {"__type": "AddedToken", **_special(EOS)},
        "errors": "replace",
        "model_max_length": 77,
        "pad_token": pad if isinstance(pad, str) else {"__type": "AddedToken", **pad},
        "tokenizer_class": "CLIPTokenizer",
        "unk_token": {"__type": "AddedToken", **_special(EOS)},
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_tokenizers(out: Path) -> None:
    vocab, merges = clip_vocab_and_merges()
    write_clip_tokenizer(out / "tokenizer", EOS, vocab, merges)
    write_clip_tokenizer(out / "tokenizer_2", "!", vocab, merges)


# ---------------------------------------------------------------------------------------------
# Configs next to each model.onnx
# ---------------------------------------------------------------------------------------------


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_configs(out: Path, models: dict, scheduler_config: dict, force_zeros_for_empty_prompt: bool = True):
    import diffusers

    for name in ("text_encoder", "text_encoder_2"):
        cfg = models[name].config.to_dict()
        cfg.pop("_name_or_path", None)
        cfg["architectures"] = [type(models[name]).__name__]
        cfg["torch_dtype"] = "float32"
        write_json(out / name / "config.json", cfg)
    unet_cfg = dict(models["unet"].config)
    unet_cfg["_class_name"] = "UNet2DConditionModel"
    write_json(out / "unet" / "config.json", _plain(unet_cfg))
    vae_cfg = dict(models["vae"].config)
    vae_cfg["_class_name"] = "AutoencoderKL"
    write_json(out / "vae_decoder" / "config.json", _plain(vae_cfg))
    sched = dict(scheduler_config)
    sched["_class_name"] = "EulerDiscreteScheduler"
    write_json(out / "scheduler" / "scheduler_config.json", _plain(sched))
    write_json(
        out / "model_index.json",
        {
            "_class_name": "StableDiffusionXLPipeline",
            "_diffusers_version": diffusers.__version__,
            "force_zeros_for_empty_prompt": force_zeros_for_empty_prompt,
            "requires_aesthetics_score": False,
            "scheduler": ["diffusers", "EulerDiscreteScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "tokenizer_2": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae_decoder": ["diffusers", "AutoencoderKL"],
        },
    )


def _plain(obj):
    """JSON-safe copy of a diffusers FrozenDict config (tuples -> lists), without diffusers' bookkeeping."""
    obj = {k: v for k, v in obj.items() if k != "_use_default_values"}
    return json.loads(json.dumps(obj, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


# ---------------------------------------------------------------------------------------------
# torch -> ONNX
# ---------------------------------------------------------------------------------------------


def _wrappers():
    import torch

    class TextEncoder(torch.nn.Module):
        def __init__(self, model, with_projection: bool):
            super().__init__()
            self.model = model
            self.with_projection = with_projection

        def forward(self, input_ids):
            out = self.model(input_ids=input_ids, output_hidden_states=True, return_dict=True)
            if self.with_projection:
                head = [out.text_embeds, out.last_hidden_state]
            else:
                head = [out.last_hidden_state, out.pooler_output]
            return tuple(head + list(out.hidden_states))

    class UNet(torch.nn.Module):
        def __init__(self, unet):
            super().__init__()
            self.unet = unet

        def forward(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
            return self.unet(
                sample,
                timestep,
                encoder_hidden_states=encoder_hidden_states,
                added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids},
                return_dict=False,
            )[0]

    class VaeDecoder(torch.nn.Module):
        def __init__(self, vae):
            super().__init__()
            self.vae = vae

        def forward(self, latent_sample):
            return self.vae.decode(latent_sample, return_dict=False)[0]

    return TextEncoder, UNet, VaeDecoder


def _export(module, args, path: Path, input_names, output_names, dynamic_axes) -> None:
    """torch.onnx.export (TorchScript exporter) into a scratch folder, then one tidy model file.

    Models over ~2 GB are saved with all weights in one external file, model.onnx_data.
    """
    import onnx
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        raw = Path(tmp) / "model.onnx"
        with torch.no_grad():
            torch.onnx.export(
                module,
                args,
                str(raw),
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                opset_version=OPSET,
                do_constant_folding=True,
                dynamo=False,
            )
        save_onnx(onnx.load(str(raw)), path)


def save_onnx(model, path: Path) -> None:
    """Saves an onnx ModelProto as path (+ path_data for weights when it is too big for one file)."""
    import onnx

    for stale in (path, path.with_name(path.name + "_data")):
        if stale.exists():
            stale.unlink()
    size = sum(len(t.raw_data) for t in model.graph.initializer)
    if size > EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + "_data",
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(path))


def export_text_encoder(model, path: Path, with_projection: bool, device="cpu", batch=1) -> None:
    import torch

    TextEncoder, _, _ = _wrappers()
    n = model.config.num_hidden_layers
    ids = torch.full((batch, 77), 49407, dtype=torch.int32, device=device)
    ids[:, 0] = 49406
    ids[:, 1:6] = torch.tensor([320, 1125, 539, 320, 2368], dtype=torch.int32)
    ids[:, 6] = 49407
    seq = {0: "batch_size", 1: "sequence_length"}
    head = ["text_embeds", "last_hidden_state"] if with_projection else ["last_hidden_state", "pooler_output"]
    outputs = head + [f"hidden_states.{i}" for i in range(n + 1)]
    axes = {"input_ids": seq}
    for name in outputs:
        axes[name] = {0: "batch_size"} if name in ("text_embeds", "pooler_output") else seq
    _export(TextEncoder(model, with_projection), (ids,), path, ["input_ids"], outputs, axes)


def export_unet(unet, path: Path, device="cpu", dtype=None, batch=2) -> None:
    import torch

    _, UNet, _ = _wrappers()
    dtype = dtype or torch.float32
    cfg = unet.config
    size = cfg.sample_size if isinstance(cfg.sample_size, int) else cfg.sample_size[0]
    pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    g = torch.Generator().manual_seed(0)
    args = (
        torch.randn(batch, cfg.in_channels, size, size, generator=g).to(device, dtype),
        torch.tensor(801.0).to(device, dtype),  # 0-d: Optimum exports timestep as a scalar
        torch.randn(batch, 77, cfg.cross_attention_dim, generator=g).to(device, dtype),
        torch.randn(batch, pooled, generator=g).to(device, dtype),
        torch.tensor([[size * 8.0, size * 8.0, 0.0, 0.0, size * 8.0, size * 8.0]] * batch).to(device, dtype),
    )
    names = ["sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"]
    axes = {
        "sample": {0: "batch_size", 2: "height", 3: "width"},
        "encoder_hidden_states": {0: "batch_size", 1: "sequence_length"},
        "text_embeds": {0: "batch_size"},
        "time_ids": {0: "batch_size"},
        "out_sample": {0: "batch_size", 2: "height", 3: "width"},
    }
    _export(UNet(unet), args, path, names, ["out_sample"], axes)


def export_vae_decoder(vae, path: Path, device="cpu", dtype=None, latent_size=8) -> None:
    import torch

    _, _, VaeDecoder = _wrappers()
    dtype = dtype or torch.float32
    z = torch.randn(1, vae.config.latent_channels, latent_size, latent_size, generator=torch.Generator().manual_seed(0))
    axes = {
        "latent_sample": {0: "batch_size", 2: "latent_height", 3: "latent_width"},
        "sample": {0: "batch_size", 2: "height", 3: "width"},
    }
    _export(VaeDecoder(vae), (z.to(device, dtype),), path, ["latent_sample"], ["sample"], axes)


def export_all(models: dict, out: Path, device="cpu", dtype=None, parts=None) -> None:
    parts = parts or ("text_encoder", "text_encoder_2", "unet", "vae_decoder")
    if "text_encoder" in parts:
        export_text_encoder(models["text_encoder"], out / "text_encoder" / "model.onnx", False, device)
    if "text_encoder_2" in parts:
        export_text_encoder(models["text_encoder_2"], out / "text_encoder_2" / "model.onnx", True, device)
    if "unet" in parts:
        export_unet(models["unet"], out / "unet" / "model.onnx", device, dtype)
    if "vae_decoder" in parts:
        export_vae_decoder(models["vae"], out / "vae_decoder" / "model.onnx", device, dtype)


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def copy_tree_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file():
            shutil.copy2(p, dst / p.name)


def describe_onnx(path: Path) -> list[str]:
    """One line per graph input/output: name, dtype, shape (symbolic dims by name)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    # Inputs that are also initializers (LoRA overrides, lora_ready.py) are weights, not I/O.
    weights = {t.name for t in m.graph.initializer}
    lines = []
    for kind, values in (("in", m.graph.input), ("out", m.graph.output)):
        for v in values:
            if v.name in weights:
                continue
            t = v.type.tensor_type
            dims = [d.dim_param or str(d.dim_value) for d in t.shape.dim]
            lines.append(f"{kind:3} {v.name:24} {onnx.TensorProto.DataType.Name(t.elem_type).lower():8} [{', '.join(dims)}]")
    return lines


if __name__ == "__main__":
    print(os.path.basename(__file__), "is a library; run make_tiny.py or export_sdxl.py")
