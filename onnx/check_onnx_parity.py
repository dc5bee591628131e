"""Re-implements the SDXL loop over the exported ONNX parts (onnxruntime CPU, numpy) and compares
every stage with the diffusers reference in tiny/reference/.

    /work/venv-onnx/bin/python onnx/check_onnx_parity.py [--model onnx/tiny/model] [--reference onnx/tiny/reference]

This is the same algorithm the Rust consumer implements, written as plainly as possible:

  tokens    tokenizer / tokenizer_2, padding to 77 (tokenizer pads with 49407, tokenizer_2 with 0 = "!")
  embeds    concat(text_encoder hidden_states.{L-1}, text_encoder_2 hidden_states.{L-1}) on the last axis
            (the penultimate layer, as diffusers' hidden_states[-2]); pooled = text_encoder_2 text_embeds;
            an empty negative prompt gives all-zero negative embeds and pooled (force_zeros_for_empty_prompt)
  time_ids  [height, width, 0, 0, height, width] per row, float
  schedule  EulerDiscrete, scaled_linear betas, leading spacing, steps_offset 1
  loop      x = latents * init_noise_sigma; per step: in = cat([x, x]) / sqrt(sigma^2 + 1) (batch rows:
            negatives first), eps = unet(...), eps = eps_neg + g * (eps_pos - eps_neg), x += eps * (sigma_next - sigma)
  decode    image = vae_decoder(x / scaling_factor); rgb = clip(image / 2 + 0.5, 0, 1); u8 = round(rgb * 255)

It reports two kinds of differences: "chained" runs the whole pipeline from the prompt and the initial
noise only (what an independent implementation sees), "staged" feeds each stage the reference's own input
(isolates one stage's error). Results go to stdout and to tiny/parity.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

HERE = Path(__file__).resolve().parent


class Parts:
    def __init__(self, model_dir: Path):
        opts = ort.SessionOptions()
        opts.log_severity_level = 3

        def sess(name):
            return ort.InferenceSession(str(model_dir / name / "model.onnx"), opts, providers=["CPUExecutionProvider"])

        self.te1, self.te2 = sess("text_encoder"), sess("text_encoder_2")
        self.unet, self.vae = sess("unet"), sess("vae_decoder")
        # float16 models (to_fp16.py) take and give float16: cast at the session boundary only.
        self.float_type = {
            id(s): {i.name: (np.float16 if i.type == "tensor(float16)" else np.float32) for i in s.get_inputs()}
            for s in (self.te1, self.te2, self.unet, self.vae)
        }
        self.sched = json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text())
        self.vae_cfg = json.loads((model_dir / "vae_decoder" / "config.json").read_text())
        index = json.loads((model_dir / "model_index.json").read_text())
        self.force_zeros = index.get("force_zeros_for_empty_prompt", True)
        from transformers import CLIPTokenizer

        self.tok1 = CLIPTokenizer.from_pretrained(model_dir / "tokenizer")
        self.tok2 = CLIPTokenizer.from_pretrained(model_dir / "tokenizer_2")

    @staticmethod
    def _penultimate(session) -> str:
        layers = sorted(int(o.name.split(".")[1]) for o in session.get_outputs() if o.name.startswith("hidden_states."))
        return f"hidden_states.{layers[-2]}"

    def encode(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        ids1 = self.tok1(prompt, padding="max_length", max_length=77, truncation=True).input_ids
        ids2 = self.tok2(prompt, padding="max_length", max_length=77, truncation=True).input_ids
        h1 = self._run(self.te1, [self._penultimate(self.te1)], {"input_ids": np.array([ids1], dtype=np.int32)})[0]
        h2, pooled = self._run(self.te2,
            [self._penultimate(self.te2), "text_embeds"], {"input_ids": np.array([ids2], dtype=np.int32)}
        )
        return np.concatenate([h1, h2], axis=-1), pooled

    def schedule(self, steps: int) -> tuple[np.ndarray, np.ndarray, np.float32]:
        c = self.sched
        assert c["beta_schedule"] == "scaled_linear" and c["timestep_spacing"] == "leading"
        n = c["num_train_timesteps"]
        betas = np.linspace(c["beta_start"] ** 0.5, c["beta_end"] ** 0.5, n, dtype=np.float32) ** 2
        alphas_cumprod = np.cumprod(1.0 - betas, dtype=np.float32)
        train_sigmas = np.sqrt((1 - alphas_cumprod) / alphas_cumprod).astype(np.float32)
        ratio = n // steps
        timesteps = (np.arange(steps) * ratio).round()[::-1].astype(np.float32) + c["steps_offset"]
        sigmas = np.interp(timesteps, np.arange(n), train_sigmas)
        sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        init_sigma = np.sqrt(sigmas.max() ** 2 + np.float32(1))
        return timesteps, sigmas, init_sigma

    def _run(self, session, outputs, feeds):
        types = self.float_type.get(id(session), {})
        feeds = {k: np.asarray(v) for k, v in feeds.items()}
        feeds = {k: v.astype(types[k]) if v.dtype.kind == "f" else v for k, v in feeds.items()}
        return [o.astype(np.float32) for o in session.run(outputs, feeds)]

    def unet_eps(self, x, t, embeds, pooled, time_ids):
        return self._run(self.unet, ["out_sample"], {
            "sample": x, "timestep": np.array(t, dtype=np.float32),
            "encoder_hidden_states": embeds, "text_embeds": pooled, "time_ids": time_ids,
        })[0]

    def decode(self, latents: np.ndarray) -> np.ndarray:
        image = self._run(self.vae, ["sample"], {"latent_sample": latents / np.float32(self.vae_cfg["scaling_factor"])})[0]
        rgb = np.clip(image / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)
        return (rgb * 255).round().clip(0, 255).astype(np.uint8)


def euler_step(x, eps, sigma, sigma_next):
    # Same operations, in float32, as diffusers' EulerDiscreteScheduler.step with s_churn = 0.
    denoised = x - sigma * eps
    derivative = (x - denoised) / sigma
    return x + derivative * (sigma_next - sigma)


def diff(a, b) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def run_case(parts: Parts, case: dict, ref: Path) -> dict:
    load = lambda name: np.load(ref / f"{name}.npy")  # noqa: E731
    n, g = case["images"], np.float32(case["guidance"])
    cfg = case["guidance"] > 1.0
    out = {}

    pos_e, pos_p = parts.encode(case["prompt"])
    if case["negative_prompt"] == "" and parts.force_zeros:
        neg_e, neg_p = np.zeros_like(pos_e), np.zeros_like(pos_p)
    else:
        neg_e, neg_p = parts.encode(case["negative_prompt"])
    pos_e, pos_p, neg_e, neg_p = (np.repeat(a, n, axis=0) for a in (pos_e, pos_p, neg_e, neg_p))
    out["prompt_embeds"] = diff(pos_e, load("prompt_embeds"))
    out["pooled_prompt_embeds"] = diff(pos_p, load("pooled_prompt_embeds"))
    out["negative_prompt_embeds"] = diff(neg_e, load("negative_prompt_embeds"))
    out["negative_pooled_prompt_embeds"] = diff(neg_p, load("negative_pooled_prompt_embeds"))

    timesteps, sigmas, init_sigma = parts.schedule(case["steps"])
    out["timesteps"] = diff(timesteps, load("timesteps"))
    out["sigmas"] = diff(sigmas, load("sigmas"))
    out["init_noise_sigma"] = abs(float(init_sigma) - case["init_noise_sigma"])

    row = np.array([case["height"], case["width"], 0, 0, case["height"], case["width"]], dtype=np.float32)
    time_ids = np.tile(row, (2 * n if cfg else n, 1))
    out["add_time_ids"] = diff(time_ids, load("add_time_ids"))
    if cfg:
        embeds, pooled = np.concatenate([neg_e, pos_e]), np.concatenate([neg_p, pos_p])
    else:
        embeds, pooled = pos_e, pos_p

    def denoise(x, embeds, pooled, staged: bool):
        errs = []
        for i, t in enumerate(timesteps):
            if staged and i > 0:
                x = load(f"latents_step_{i - 1}")
            inp = np.concatenate([x, x]) if cfg else x
            inp = inp / np.sqrt(sigmas[i] ** 2 + np.float32(1))
            eps = parts.unet_eps(inp, t, embeds, pooled, time_ids)
            if cfg:
                e_neg, e_pos = eps[:n], eps[n:]
                eps = e_neg + g * (e_pos - e_neg)
            x = euler_step(x, eps, sigmas[i], sigmas[i + 1])
            errs.append(diff(x, load(f"latents_step_{i}")))
        return x, errs

    x0 = load("latents_init") * init_sigma
    latents, chained = denoise(x0, embeds, pooled, staged=False)
    out["chained_latents_per_step"] = chained
    image = parts.decode(latents)
    ref_image = load("image")
    d = np.abs(image.astype(np.int16) - ref_image.astype(np.int16))
    out["chained_image_max_levels"] = int(d.max())
    out["chained_image_pixels_off"] = int((d > 0).sum())
    out["image_values"] = int(d.size)

    # Staged: reference embeddings and reference latents into each step; reference final latents into the VAE.
    if cfg:
        r_embeds = np.concatenate([load("negative_prompt_embeds"), load("prompt_embeds")])
        r_pooled = np.concatenate([load("negative_pooled_prompt_embeds"), load("pooled_prompt_embeds")])
    else:
        r_embeds, r_pooled = load("prompt_embeds"), load("pooled_prompt_embeds")
    _, staged = denoise(x0, r_embeds, r_pooled, staged=True)
    out["staged_latents_per_step"] = staged
    d2 = np.abs(parts.decode(load("latents_final")).astype(np.int16) - ref_image.astype(np.int16))
    out["staged_image_max_levels"] = int(d2.max())
    out["staged_image_pixels_off"] = int((d2 > 0).sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=HERE / "tiny" / "model")
    ap.add_argument("--reference", type=Path, default=HERE / "tiny" / "reference")
    ap.add_argument("--out", type=Path, default=HERE / "tiny" / "parity.json")
    args = ap.parse_args()

    parts = Parts(args.model)
    results = {}
    for case in json.loads((args.reference / "cases.json").read_text()):
        results[case["name"]] = r = run_case(parts, case, args.reference / case["name"])
        print(f"{case['name']}:")
        for k, v in r.items():
            print(f"  {k:32} {v}")
    results["_versions"] = {"onnxruntime": ort.__version__, "numpy": np.__version__}
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
