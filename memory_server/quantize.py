"""An int8 copy of the exported embedding model whose activations are quantised per token.

ONNX Runtime's dynamic quantisation stores int8 weights (one scale per output channel) and
quantises each matrix product's input on the fly with one scale for the whole tensor: every token
of every text in the call. A text's vector then depends on what else is in the call (~1e-2), and a
few tokens with large values coarsen the others. Here each token (row) gets its own scale and zero
point instead:

    q = round(x / s) + z            s = (max(x, 0) - min(x, 0)) / 255,  z = round(-min(x, 0) / s)
    x @ W = s * (q @ Wq * w_scale - z * colsum(Wq) * w_scale)

so a text's vector is the same whatever it is batched with (to ~1e-7), and it is closer to the
full-precision model's (cosine >= 0.997 against >= 0.988 per tensor; docs/benchmarks.md).
ONNX Runtime's integer matrix products take a single zero point for their first input, hence
the explicit `z * colsum` correction.

Weights use 7 of their 8 bits (-64..64). x86 processors without VNNI (AVX2 only) multiply uint8 by
int8 with an instruction that adds each pair of products into a saturating int16: 255 * 127 * 2
overflows it, 255 * 64 * 2 does not. With full-range weights those processors computed other
vectors than VNNI ones (cosine to full precision down to 0.961 on a Zen 3); with 7-bit weights the
integer products are exact with or without VNNI (cosine >= 0.995, mean 0.997, on that Zen 3).
"""

import logging
from pathlib import Path

import numpy as np


def quantize_per_token(source: Path, target: Path) -> None:
    """Write the per-token int8 model of the full-precision ONNX model at `source` to `target`."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    per_tensor = target.with_name(target.name + ".per-tensor")
    logging.disable(logging.WARNING)  # the quantiser logs advice meant for image models to the root logger
    try:
        # Per-channel weights: per-tensor ones fall to cosine 0.93 against full precision.
        # reduce_range: 7-bit weights (see above; the model's name says so: embedding.QUANTIZED_SUFFIX).
        quantize_dynamic(str(source), str(per_tensor), per_channel=True, weight_type=QuantType.QInt8,
                         reduce_range=True)
    finally:
        logging.disable(logging.NOTSET)
    try:
        model = onnx.load(str(per_tensor))
        _per_token_activations(model)
        onnx.save(model, str(target))
    finally:
        per_tensor.unlink(missing_ok=True)


def _per_token_activations(model) -> None:
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    weights = {tensor.name: tensor for tensor in graph.initializer}
    producers = {name: n for n in graph.node for name in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    constants = {"pt_zero_u8": np.array(0, np.uint8), "pt_255": np.array(255.0, np.float32),
                 "pt_one": np.array(1.0, np.float32), "pt_0": np.array(0.0, np.float32),
                 "pt_flat": np.array([-1], np.int64), "pt_tiny": np.array(1e-12, np.float32)}
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in constants.items())
    rows: dict[str, tuple[str, str, str]] = {}  # per-tensor zero point -> (row zero point, row scale, old scale)
    replaced: set[int] = set()  # ids of nodes folded into a replacement
    nodes = []
    node = helper.make_node
    for n in graph.node:
        if id(n) in replaced:
            continue
        if n.op_type == "DynamicQuantizeLinear":
            x, (quantized, scale, zero_point), p = n.input[0], n.output, n.name + "_pt"
            nodes += [
                node("ReduceMin", [x], [p + "_min"], keepdims=1, axes=[-1]),
                node("ReduceMax", [x], [p + "_max"], keepdims=1, axes=[-1]),
                node("Min", [p + "_min", "pt_0"], [p + "_lo"]),
                node("Max", [p + "_max", "pt_0"], [p + "_hi"]),
                node("Sub", [p + "_hi", p + "_lo"], [p + "_range"]),
                node("Div", [p + "_range", "pt_255"], [p + "_step"]),
                node("Max", [p + "_step", "pt_tiny"], [p + "_scale"]),  # [..., rows, 1]
                node("Div", [p + "_lo", p + "_scale"], [p + "_lo_steps"]),
                node("Neg", [p + "_lo_steps"], [p + "_neg"]),
                node("Round", [p + "_neg"], [p + "_rounded"]),
                node("Clip", [p + "_rounded", "pt_0", "pt_255"], [p + "_zero"]),
                node("Cast", [p + "_zero"], [p + "_zero_u8"], to=TensorProto.UINT8),
                # QuantizeLinear takes one scale per row of a 2-D input (axis 0).
                node("Shape", [x], [p + "_shape"]),
                node("Flatten", [x], [p + "_rows"], axis=-1),
                node("Reshape", [p + "_scale", "pt_flat"], [p + "_row_scale"]),
                node("Reshape", [p + "_zero_u8", "pt_flat"], [p + "_row_zero"]),
                node("QuantizeLinear", [p + "_rows", p + "_row_scale", p + "_row_zero"], [p + "_q"], axis=0),
                node("Reshape", [p + "_q", p + "_shape"], [quantized]),
            ]
            rows[zero_point] = (p + "_zero", p + "_scale", scale)
        elif n.op_type == "MatMulInteger" and n.input[2] in rows:
            # MatMulInteger -> Cast -> Mul(a_scale * w_scale) becomes one MatMulIntegerToFloat (weight
            # scales applied inside), then the per-row zero point and scale.
            a, b, a_zero, b_zero = n.input
            row_zero, row_scale, old_scale = rows[a_zero]
            cast = consumers[n.output[0]][0]
            scaled = consumers[cast.output[0]][0]
            scales = producers[next(name for name in scaled.input if name != cast.output[0])]
            assert (cast.op_type, scaled.op_type, scales.op_type) == ("Cast", "Mul", "Mul"), "unexpected quantised graph"
            b_scale = next(name for name in scales.input if name != old_scale)
            replaced.update({id(cast), id(scaled), id(scales)})
            w = numpy_helper.to_array(weights[b]).astype(np.int64) - numpy_helper.to_array(weights[b_zero]).astype(np.int64)
            colsum = n.name + "_colsum"
            graph.initializer.append(numpy_helper.from_array(
                (w.sum(axis=0) * numpy_helper.to_array(weights[b_scale])).astype(np.float32), colsum))
            out = n.output[0] + "_f"
            nodes += [
                node("MatMulIntegerToFloat", [a, b, "pt_one", b_scale, "pt_zero_u8", b_zero], [out],
                     domain="com.microsoft", name=n.name),
                node("Mul", [row_zero, colsum], [out + "_correction"]),
                node("Sub", [out, out + "_correction"], [out + "_centred"]),
                node("Mul", [out + "_centred", row_scale], [scaled.output[0]]),
            ]
        else:
            nodes.append(n)
    nodes = [n for n in nodes if id(n) not in replaced]  # a folded node may precede its MatMulInteger
    del graph.value_info[:]  # shapes of the scales changed; ONNX Runtime infers them again
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
