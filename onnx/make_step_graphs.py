"""Builds the tiny graphs that keep the denoising loop on the device: guidance + one Euler step.

    .venv/bin/python onnx/make_step_graphs.py      # writes onnx/ops/euler_step_<dtype>_<guided|plain>.onnx

Between two UNet calls, diffusers combines the guidance batch and takes an Euler step on the
latents. Done on the host, the noise prediction comes to the host and the next sample goes back
at every step. These graphs do the same arithmetic on the UNet's own execution provider, so the
consumer binds their outputs as the next UNet call's inputs and nothing leaves the device.

Inputs:  noise_pred  [b, c, h, w] in the UNet's float type (b = 2n guided: [uncond; text])
         latents     [n, c, h, w] float32
         params      [4] float32 = guidance, sigma, dt = sigma_next - sigma, and the next
                     sample's divisor sqrt(sigma_next^2 + 1) (Euler's scale_model_input)
Outputs: latents_next [n, c, h, w] float32: the Euler step, written as diffusers writes it
         (pred_original = x - sigma * eps, derivative = (x - pred_original) / sigma,
         x + derivative * dt) with eps = uncond + g * (text - uncond), so the rounding matches
         sample_next  [b, c, h, w] in the UNet's type = cat([latents_next] * (b / n)) / divisor

Epsilon prediction with gamma = 0 (s_churn 0), as SDXL's scheduler config has it: then diffusers'
derivative (sample - pred_original) / sigma is the noise prediction itself. Other configurations
keep the host path. The arithmetic is float32, as diffusers upcasts the latents.
"""

from pathlib import Path

import onnx
from onnx import TensorProto, helper

OUT = Path(__file__).resolve().parent / "ops"


def graph(dtype: int, guided: bool) -> onnx.ModelProto:
    n, c, h, w = "n", "c", "h", "w"
    b = "b"
    noise = helper.make_tensor_value_info("noise_pred", dtype, [b, c, h, w])
    latents = helper.make_tensor_value_info("latents", TensorProto.FLOAT, [n, c, h, w])
    params = helper.make_tensor_value_info("params", TensorProto.FLOAT, [4])
    latents_next = helper.make_tensor_value_info("latents_next", TensorProto.FLOAT, [n, c, h, w])
    sample_next = helper.make_tensor_value_info("sample_next", dtype, [b, c, h, w])
    nodes = [
        helper.make_node("Cast", ["noise_pred"], ["noise32"], to=TensorProto.FLOAT),
        helper.make_node("Split", ["params", "split4"], ["g", "sigma", "dt", "divisor"], axis=0),
    ]
    inits = [helper.make_tensor("split4", TensorProto.INT64, [4], [1, 1, 1, 1])]
    if guided:
        nodes += [
            helper.make_node("Split", ["noise32"], ["uncond", "text"], axis=0, num_outputs=2),
            helper.make_node("Sub", ["text", "uncond"], ["diff"]),
            helper.make_node("Mul", ["diff", "g"], ["scaled"]),
            helper.make_node("Add", ["uncond", "scaled"], ["eps"]),
        ]
    else:
        nodes += [helper.make_node("Identity", ["noise32"], ["eps"])]
    nodes += [
        helper.make_node("Mul", ["eps", "sigma"], ["sigma_eps"]),
        helper.make_node("Sub", ["latents", "sigma_eps"], ["pred_original"]),
        helper.make_node("Sub", ["latents", "pred_original"], ["towards"]),
        helper.make_node("Div", ["towards", "sigma"], ["derivative"]),
        helper.make_node("Mul", ["derivative", "dt"], ["step"]),
        helper.make_node("Add", ["latents", "step"], ["latents_next"]),
        helper.make_node("Div", ["latents_next", "divisor"], ["scaled_next"]),
    ]
    if guided:
        nodes.append(helper.make_node("Concat", ["scaled_next", "scaled_next"], ["both"], axis=0))
        nodes.append(helper.make_node("Cast", ["both"], ["sample_next"], to=dtype))
    else:
        nodes.append(helper.make_node("Cast", ["scaled_next"], ["sample_next"], to=dtype))
    g = helper.make_graph(nodes, "euler_step", [noise, latents, params], [latents_next, sample_next], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], producer_name="shotfleet")
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, dtype in (("f32", TensorProto.FLOAT), ("f16", TensorProto.FLOAT16)):
        for guided in (True, False):
            path = OUT / f"euler_step_{name}_{'guided' if guided else 'plain'}.onnx"
            onnx.save(graph(dtype, guided), path)
            print(path, path.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
