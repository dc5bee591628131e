"""Graph rewrites for the fused SDXL UNet that ONNX Runtime's optimizer leaves undone.

ONNX Runtime's UNet fusion (optimize_unet.py) runs convolutions (NhwcConv) and group norms
(GroupNorm, SkipGroupNorm) in NHWC, and leaves the rest of the graph in NCHW, so a Transpose
stands at every border between the two: around each residual Add, each skip Concat of the up
blocks, each upsampling Resize, and in front of the Shape ops that read a tensor's size. Each
moves a whole activation (21 MB at 1024x1024 in the first block). These passes work only on the
graph, never on weights, so a rewritten model.onnx sits beside its model.onnx_data; the last two
write new initializers (a summed bias, the split projection weights) into the graph itself.

    transposes_of_shapes   Shape(Transpose(x, p)) -> Gather(Shape(x), p): the size without the move
    sink_transposes        Add/Mul/Sub/Div of two Transposes with one perm, Concat of Transposes,
                           and a Resize whose result is transposed back: the op runs on the
                           untransposed tensors and one Transpose follows it, which the next pass
                           often cancels against its inverse
    cancel_transposes      Transpose(Transpose(x, p), inverse of p) -> x
    dedupe_transposes      two Transposes of one tensor with one perm -> one
    fold_conv_bias         an NhwcConv whose every consumer is a SkipGroupNorm leaves its bias to
                           them (SkipGroupNorm adds X + skip + bias before normalising): cuDNN adds
                           a convolution's bias in a pass of its own over the output (its cost:
                           deploy/gpu/RESULTS.md, the UNet's profile), the group norm reads it for free
    unpack_qkv             a MultiHeadAttention fed one packed projection (MatMul, then Reshape to
                           [B, S, N, 3, H], or [B, S, N, 2, H] for cross attention's key and value)
                           gets three (two) MatMuls feeding its query, key and value as [B, S, N*H]:
                           ONNX Runtime unpacks a packed input with a kernel of its own (AddBiasUnpack,
                           1.0 ms of a 34 ms UNet call on the H200) before cuDNN's or flash attention,
                           which read separate [B, S, N*H] inputs in place (no bias input)

Each returns how many nodes it changed; `optimize` runs them to a fixed point. Every rewrite is
exact: the same numbers in another layout. onnx/tune_unet.py times the result against the
original on the GPU and checks that the outputs agree.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np
from onnx import ModelProto, NodeProto, helper, numpy_helper

ELEMENTWISE = {"Add", "Mul", "Sub", "Div"}


class Graph:
    """Producer and consumer indexes over a model's main graph, kept up to date by the edits."""

    def __init__(self, model: ModelProto, base_dir: str | None = None):
        self.model = model
        self.g = model.graph
        self.base_dir = base_dir  # where external weights are read from
        self.names = (f"sf_pass_{i}" for i in itertools.count())
        self.reindex()

    def reindex(self) -> None:
        self.producer: dict[str, NodeProto] = {o: n for n in self.g.node for o in n.output}
        self.consumers: dict[str, list[NodeProto]] = collections.defaultdict(list)
        for n in self.g.node:
            for i in n.input:
                if i:
                    self.consumers[i].append(n)
        self.outputs = {o.name for o in self.g.output}
        self.initializers = {t.name: t for t in self.g.initializer}

    def fresh(self) -> str:
        """A name no tensor, initializer or node of the graph has (an earlier run of these passes
        may have taken some: optimize_unet.py folds biases before tune_unet.py rewrites)."""
        if not hasattr(self, "taken"):
            self.taken = {t.name for t in self.g.initializer} | {i.name for i in self.g.input}
            self.taken |= {name for n in self.g.node for name in (*n.input, *n.output, n.name)}
        while (name := next(self.names)) in self.taken:
            pass
        self.taken.add(name)
        return name

    def perm(self, node: NodeProto) -> tuple[int, ...] | None:
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            return None
        for a in node.attribute:
            if a.name == "perm":
                return tuple(a.ints)
        return None

    def transposed(self, tensor: str) -> tuple[NodeProto, tuple[int, ...]] | None:
        """The Transpose that produced `tensor`, with its perm."""
        node = self.producer.get(tensor)
        if node is None:
            return None
        perm = self.perm(node)
        return (node, perm) if perm else None

    def constant(self, tensor: str):
        """The value of `tensor` where it is fixed: an initializer, a Constant, or a Cast of one."""
        if tensor in self.initializers:
            return numpy_helper.to_array(self.initializers[tensor], self.base_dir or "")
        node = self.producer.get(tensor)
        if node is None:
            return None
        if node.op_type == "Constant":
            value = next((a for a in node.attribute if a.name == "value"), None)
            return numpy_helper.to_array(value.t) if value is not None else None
        if node.op_type == "Cast":
            inner = self.constant(node.input[0])
            to = next(a.i for a in node.attribute if a.name == "to")
            return None if inner is None else inner.astype(helper.tensor_dtype_to_np_dtype(to))
        return None

    def only_used_by(self, tensor: str, node: NodeProto) -> bool:
        return tensor not in self.outputs and all(c is node for c in self.consumers[tensor])

    def insert_after(self, anchor: NodeProto, new: list[NodeProto]) -> None:
        """Puts `new` right after `anchor`, so the node list stays topologically sorted."""
        at = list(self.g.node).index(anchor) + 1
        for k, n in enumerate(new):
            self.g.node.insert(at + k, n)

    def remove_dead(self) -> int:
        """Drops nodes none of whose outputs is used (a graph output counts as a use), and the
        initializers left unread."""
        removed = 0
        while True:
            self.reindex()
            dead = [n for n in self.g.node
                    if all(not self.consumers.get(o) and o not in self.outputs for o in n.output if o)]
            if not dead:
                # Then the initializers no node reads any more (a folded bias, a split weight);
                # one that is also a graph input stays (a caller may feed it).
                inputs = {i.name for i in self.g.input}
                for t in [t for t in self.g.initializer
                          if not self.consumers.get(t.name) and t.name not in self.outputs and t.name not in inputs]:
                    self.g.initializer.remove(t)
                self.reindex()
                return removed
            for n in dead:
                self.g.node.remove(n)
            removed += len(dead)


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return tuple(out)


def transposes_of_shapes(graph: Graph) -> int:
    changed = 0
    for t in [n for n in graph.g.node if graph.perm(n)]:
        users = graph.consumers[t.output[0]]
        shapes = [u for u in users if u.op_type == "Shape" and u.domain in ("", "ai.onnx") and not u.attribute]
        for s in shapes:
            raw = graph.fresh()
            perm = numpy_helper.from_array(np.array(graph.perm(t), dtype=np.int64), graph.fresh())
            graph.g.initializer.append(perm)
            gather = helper.make_node("Gather", [raw, perm.name], [s.output[0]], name=graph.fresh(), axis=0)
            s.input[0] = t.input[0]
            s.output[0] = raw
            graph.insert_after(s, [gather])
            changed += 1
        if shapes:
            graph.reindex()
    return changed


def _sink(graph: Graph, op: NodeProto, inputs: list[tuple[str, NodeProto]], perm: tuple[int, ...], rewire) -> bool:
    """Runs `op` on the tensors before their Transposes (`rewire` adjusts its inputs and
    attributes) and transposes its result once instead, unless that adds Transposes: the inputs'
    Transposes that only fed `op` go, and so will the consumers of `op` that transpose its result
    back (the cancel pass); one Transpose is added unless every consumer is such an inverse. A
    tie moves the Transpose one op on, where it may meet its inverse; it never moves back, so the
    passes end."""
    out = op.output[0]
    users = graph.consumers[out]
    back = [u for u in users if graph.perm(u) == inverse(perm)]
    adds = int(out in graph.outputs or len(back) < len(users))
    dead = sum(1 for name in {name for name, _ in inputs} if graph.only_used_by(name, op))
    if dead + len(back) == 0 or dead + len(back) < adds:
        return False
    rewire(op)
    fresh = graph.fresh()
    op.output[0] = fresh
    graph.insert_after(op, [helper.make_node("Transpose", [fresh], [out], name=graph.fresh(), perm=list(perm))])
    graph.reindex()
    return True


def sink_transposes(graph: Graph) -> int:
    changed = 0
    for op in list(graph.g.node):
        if op.domain not in ("", "ai.onnx") or not op.output:
            continue
        if op.op_type in ELEMENTWISE and len(op.input) == 2:
            a, b = (graph.transposed(i) for i in op.input)
            if not a or not b or a[1] != b[1]:
                continue
            perm = a[1]
            ins = [(op.input[0], a[0]), (op.input[1], b[0])]

            def rewire(node, a=a, b=b):
                node.input[0], node.input[1] = a[0].input[0], b[0].input[0]

            changed += _sink(graph, op, ins, perm, rewire)
        elif op.op_type == "Concat":
            found = [graph.transposed(i) for i in op.input]
            if not found or any(f is None for f in found) or len({f[1] for f in found}) != 1:
                continue
            perm = found[0][1]
            axis = next(a.i for a in op.attribute if a.name == "axis")
            axis = axis % len(perm)

            def rewire(node, found=found, perm=perm, axis=axis):
                for k, f in enumerate(found):
                    node.input[k] = f[0].input[0]
                for a in node.attribute:
                    if a.name == "axis":
                        a.i = perm[axis]

            changed += _sink(graph, op, [(i, f[0]) for i, f in zip(op.input, found)], perm, rewire)
        elif op.op_type == "Resize" and len(op.input) >= 3:
            found = graph.transposed(op.input[0])
            values = graph.constant(op.input[2]) if op.input[2] else None
            if not found or values is None or (len(op.input) > 3 and op.input[3]):
                continue
            perm = found[1]
            users = graph.consumers[op.output[0]]
            # A Transpose after an upsample moves four times the bytes: only where it cancels.
            if not users or any(graph.perm(u) != inverse(perm) for u in users) or op.output[0] in graph.outputs:
                continue

            def rewire(node, found=found, perm=perm, values=values):
                moved = numpy_helper.from_array(values[list(inverse(perm))].astype(values.dtype), graph.fresh())
                graph.g.initializer.append(moved)
                node.input[0] = found[0].input[0]
                node.input[2] = moved.name

            changed += _sink(graph, op, [(op.input[0], found[0])], perm, rewire)
    return changed


def cancel_transposes(graph: Graph) -> int:
    changed = 0
    for t in [n for n in graph.g.node if graph.perm(n)]:
        inner = graph.transposed(t.input[0])
        if not inner or inverse(inner[1]) != graph.perm(t) or t.output[0] in graph.outputs:
            continue
        source = inner[0].input[0]
        for user in graph.consumers[t.output[0]]:
            for k, name in enumerate(user.input):
                if name == t.output[0]:
                    user.input[k] = source
        changed += 1
        graph.reindex()
    return changed


def dedupe_transposes(graph: Graph) -> int:
    changed = 0
    seen: dict[tuple, str] = {}
    for t in [n for n in graph.g.node if graph.perm(n)]:
        key = (t.input[0], graph.perm(t))
        if key not in seen:
            seen[key] = t.output[0]
            continue
        if t.output[0] in graph.outputs:
            continue
        for user in graph.consumers[t.output[0]]:
            for k, name in enumerate(user.input):
                if name == t.output[0]:
                    user.input[k] = seen[key]
        changed += 1
    graph.reindex()
    return changed


def fold_conv_bias(graph: Graph) -> int:
    changed = 0
    for conv in [n for n in graph.g.node if n.op_type == "NhwcConv" and n.domain == "com.microsoft"]:
        if len(conv.input) < 3 or not conv.input[2] or conv.input[2] not in graph.initializers:
            continue
        out = conv.output[0]
        users = graph.consumers[out]
        if out in graph.outputs or not users or any(u.op_type != "SkipGroupNorm" or u.domain != "com.microsoft" for u in users):
            continue
        bias = graph.constant(conv.input[2])
        if bias is None:
            continue
        # X (0) and skip (3) are summed with bias (4): the conv's bias joins them as many times
        # as the conv's output does. Every user is checked before any changes.
        totals = []
        for user in users:
            times = sum(1 for k in (0, 3) if k < len(user.input) and user.input[k] == out)
            total = bias.astype(np.float32) * times
            if len(user.input) > 4 and user.input[4]:
                existing = graph.constant(user.input[4])
                if existing is None:
                    break
                total = total + existing.astype(np.float32)
            totals.append(total)
        else:
            for user, total in zip(users, totals):
                while len(user.input) < 5:
                    user.input.append("")
                summed = numpy_helper.from_array(total.astype(bias.dtype), graph.fresh())
                graph.g.initializer.append(summed)
                user.input[4] = summed.name
            del conv.input[2]
            changed += 1
            graph.reindex()
    return changed


def unpack_qkv(graph: Graph) -> int:
    changed = 0
    for mha in [n for n in graph.g.node if n.op_type == "MultiHeadAttention" and n.domain == "com.microsoft"]:
        inputs = list(mha.input)
        # Packed: self attention's one input [B, S, N, 3, H], or cross attention's query and
        # [B, S_kv, N, 2, H]; nothing else (bias, mask, past) beside them.
        if inputs and inputs[0] and not any(inputs[1:]):
            packed_at, parts = 0, 3
        elif len(inputs) >= 2 and inputs[0] and inputs[1] and not any(inputs[2:]):
            packed_at, parts = 1, 2
        else:
            continue
        packed = inputs[packed_at]
        reshape = graph.producer.get(packed)
        if reshape is None or reshape.op_type != "Reshape" or not graph.only_used_by(packed, mha):
            continue
        shape = graph.constant(reshape.input[1])
        if shape is None or shape.shape != (5,) or list(shape[[0, 1, 3]]) != [0, 0, parts]:
            continue
        heads, head_size = int(shape[2]), int(shape[4])
        matmul = graph.producer.get(reshape.input[0])
        if matmul is None or matmul.op_type != "MatMul" or not graph.only_used_by(reshape.input[0], reshape):
            continue
        weight = graph.constant(matmul.input[1]) if matmul.input[1] in graph.initializers else None
        if weight is None or weight.ndim != 2 or weight.shape[1] != heads * parts * head_size:
            continue
        # The packed columns run head by head, each head's q, k, v (or k, v) side by side.
        split = weight.reshape(weight.shape[0], heads, parts, head_size)
        projections = []
        for part in range(parts):
            w = numpy_helper.from_array(np.ascontiguousarray(split[:, :, part, :]).reshape(weight.shape[0], -1), graph.fresh())
            graph.g.initializer.append(w)
            projections.append(helper.make_node("MatMul", [matmul.input[0], w.name], [graph.fresh()], name=graph.fresh()))
        graph.insert_after(matmul, projections)
        kept = [inputs[0]] if parts == 2 else []
        del mha.input[:]
        mha.input.extend(kept + [p.output[0] for p in projections])
        changed += 1
        graph.reindex()
    return changed


PASSES = {"shapes": transposes_of_shapes, "sink": sink_transposes, "cancel": cancel_transposes,
          "dedupe": dedupe_transposes, "conv_bias": fold_conv_bias, "unpack_qkv": unpack_qkv}


def optimize(model: ModelProto, passes: list[str], base_dir: str | None = None) -> dict:
    """Runs the named passes in turn until none changes anything; returns the changes per pass
    and the Transposes before and after. `base_dir` is the model's folder, where passes that
    read weights find its external data."""
    graph = Graph(model, base_dir)
    before = sum(1 for n in graph.g.node if graph.perm(n))
    counts = collections.Counter()
    for _ in range(50):
        round_changes = 0
        for name in passes:
            n = PASSES[name](graph)
            counts[name] += n
            round_changes += n
        counts["removed_dead"] += graph.remove_dead()
        if not round_changes:
            break
    after = sum(1 for n in graph.g.node if graph.perm(n))
    return {"transposes_before": before, "transposes_after": after, **counts}
