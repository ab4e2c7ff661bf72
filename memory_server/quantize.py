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

The per-row zero point costs three passes over every product's output (the outer product
z * colsum, its subtraction, the row scale) on top of the product itself: on an AVX-512 VNNI / AMX
processor the integer products were only a quarter of the model's time. Most inputs do not need
it: the inputs that follow a LayerNorm or the attention are roughly centred on zero, row by row, so
they are quantised symmetrically (the zero point a fixed 128, which ONNX Runtime's kernel applies
itself) and only the row scale remains. Which inputs are centred is measured, not assumed: the
per-tensor model runs a few generic sentences (CALIBRATION) and an input whose rows are typically
skewed (|max + min| / (max - min), median over the tokens, above SKEWED) keeps its per-row zero
point; for MiniLM that is the six GELU outputs (median skew 0.83-0.91; every other input 0.07-0.50).
Their correction is one Gemm (z (x) colsum subtracted in the same pass: the same vectors as a
separate product and subtraction, to the bit, and ~3% faster) and the row scale. 12-14% more texts
a second on one core of an Intel Xeon with AMX, cosine to full precision mean 0.9962 (min 0.9925)
against 0.9975 (0.9915) with per-row zero points everywhere (bench/analysis.md, round 15).
`centred=False` makes the earlier model (every input with its own zero points), kept for stores
embedded with it (MEMORY_SERVER_EMBEDDING_QUANTIZE=int8-asymmetric).
"""

import logging
from pathlib import Path

import numpy as np


# Generic sentences of the kinds a memory service embeds (facts, questions, notes, chat): they only
# tell which of the model's inputs are centred (a wide margin for MiniLM), not any scale.
CALIBRATION = (
    "The meeting moved to Thursday afternoon.", "She prefers tea over coffee in the morning.",
    "What did I say about my sister's wedding?", "Order O-1002 ships on 3 May to Berlin.",
    "I adopted a dog named Pepper last spring!", "The API returns 404 when the key is revoked.",
    "We hiked the trail near the lake and saw two deer.", "Remind me to call the dentist",
    "My favourite book is a novel about a lighthouse keeper.", "How many users signed up last week?",
)
SKEWED = 0.6  # median row skew above which an input keeps per-row zero points


def quantize_per_token(source: Path, target: Path, tokenizer, *, centred: bool = True) -> None:
    """Write the per-token int8 model of the full-precision ONNX model at `source` to `target`.
    `tokenizer` (texts -> the model's inputs as arrays) runs the calibration that finds the
    centred inputs; with `centred=False` every input keeps per-row zero points."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    per_tensor = target.with_name(target.name + ".per-tensor")
    logging.disable(logging.WARNING)  # the quantiser logs advice meant for image models to the root logger
    try:
        # Per-channel weights: per-tensor ones fall to cosine 0.93 against full precision.
        # reduce_range: 7-bit weights (see above; the model's name says so: embedding.INT8_KINDS).
        quantize_dynamic(str(source), str(per_tensor), per_channel=True, weight_type=QuantType.QInt8,
                         reduce_range=True)
    finally:
        logging.disable(logging.NOTSET)
    try:
        model = onnx.load(str(per_tensor))
        symmetric = _centred_inputs(model, tokenizer) if centred else set()
        _per_token_activations(model, symmetric)
        onnx.save(model, str(target))
    finally:
        per_tensor.unlink(missing_ok=True)


def _centred_inputs(model, tokenizer) -> set[str]:
    """The quantised inputs (by their per-tensor zero point's name) whose rows are centred: median
    skew over CALIBRATION's tokens at most SKEWED."""
    import onnxruntime
    from onnx import TensorProto, helper

    quantizers = [n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear"]
    probe = type(model)()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(n.input[0], TensorProto.FLOAT, None) for n in quantizers)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    encoded = tokenizer(list(CALIBRATION))
    feeds = {i.name: encoded[i.name] for i in session.get_inputs()}
    tokens = encoded["attention_mask"].astype(bool)
    centred = set()
    for n, x in zip(quantizers, session.run([n.input[0] for n in quantizers], feeds)):
        rows = x[tokens] if x.shape[:2] == tokens.shape else x.reshape(-1, x.shape[-1])
        lo, hi = np.minimum(rows.min(axis=-1), 0), np.maximum(rows.max(axis=-1), 0)
        if float(np.median(np.abs(hi + lo) / np.maximum(hi - lo, 1e-12))) <= SKEWED:
            centred.add(n.output[2])
    return centred


def _per_token_activations(model, centred: set[str] = frozenset()) -> None:
    """Rewrites every DynamicQuantizeLinear (one scale and zero point for the whole tensor) and the
    products it feeds: per-row scales, and per-row zero points unless the input is in `centred`."""
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
                 "pt_flat": np.array([-1], np.int64), "pt_tiny": np.array(1e-12, np.float32),
                 "pt_127": np.array(127.0, np.float32), "pt_128_u8": np.array(128, np.uint8)}
    # per-tensor zero point -> (row zero point or None where centred, row scale, old scale)
    rows: dict[str, tuple[str | None, str, str]] = {}
    replaced: set[int] = set()  # ids of nodes folded into a replacement
    nodes = []
    node = helper.make_node
    for n in graph.node:
        if id(n) in replaced:
            continue
        if n.op_type == "DynamicQuantizeLinear":
            x, (quantized, scale, zero_point), p = n.input[0], n.output, n.name + "_pt"
            if zero_point in centred:
                # q = round(x / s) + 128 with s = max|x| / 127: one row scale, the zero point fixed.
                nodes += [
                    node("Abs", [x], [p + "_abs"]),
                    node("ReduceMax", [p + "_abs"], [p + "_max"], keepdims=1, axes=[-1]),
                    node("Div", [p + "_max", "pt_127"], [p + "_step"]),
                    node("Max", [p + "_step", "pt_tiny"], [p + "_scale"]),  # [..., rows, 1]
                    node("Shape", [p + "_max"], [p + "_rows_shape"]),
                    node("Expand", ["pt_128_u8", p + "_rows_shape"], [p + "_zero_u8"]),
                ]
                rows[zero_point] = (None, p + "_scale", scale)
            else:
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
                ]
                rows[zero_point] = (p + "_zero", p + "_scale", scale)
            nodes += [  # QuantizeLinear takes one scale per row of a 2-D input (axis 0).
                node("Shape", [x], [p + "_shape"]),
                node("Flatten", [x], [p + "_rows"], axis=-1),
                node("Reshape", [p + "_scale", "pt_flat"], [p + "_row_scale"]),
                node("Reshape", [p + "_zero_u8", "pt_flat"], [p + "_row_zero"]),
                node("QuantizeLinear", [p + "_rows", p + "_row_scale", p + "_row_zero"], [p + "_q"], axis=0),
                node("Reshape", [p + "_q", p + "_shape"], [quantized]),
            ]
        elif n.op_type == "MatMulInteger" and n.input[2] in rows:
            # MatMulInteger -> Cast -> Mul(a_scale * w_scale) becomes one MatMulIntegerToFloat (weight
            # scales applied inside), then the per-row zero point (unless centred) and scale.
            a, b, a_zero, b_zero = n.input
            row_zero, row_scale, old_scale = rows[a_zero]
            cast = consumers[n.output[0]][0]
            scaled = consumers[cast.output[0]][0]
            scales = producers[next(name for name in scaled.input if name != cast.output[0])]
            assert (cast.op_type, scaled.op_type, scales.op_type) == ("Cast", "Mul", "Mul"), "unexpected quantised graph"
            b_scale = next(name for name in scales.input if name != old_scale)
            replaced.update({id(cast), id(scaled), id(scales)})
            out = n.output[0] + "_f"
            product = node("MatMulIntegerToFloat", [a, b, "pt_one", b_scale, "pt_zero_u8" if row_zero else "pt_128_u8",
                                                    b_zero], [out], domain="com.microsoft", name=n.name)
            if row_zero is None:  # centred: the kernel applies the fixed zero point itself
                nodes += [product, node("Mul", [out, row_scale], [scaled.output[0]])]
                continue
            w = numpy_helper.to_array(weights[b]).astype(np.int64) - numpy_helper.to_array(weights[b_zero]).astype(np.int64)
            colsum = n.name + "_colsum"  # [1, columns]
            graph.initializer.append(numpy_helper.from_array(
                (w.sum(axis=0, keepdims=True) * numpy_helper.to_array(weights[b_scale])).astype(np.float32), colsum))
            # out - z (x) colsum in one pass (a Gemm with K = 1 adding into its C), on 2-D views.
            nodes += [
                product,
                node("Shape", [out], [out + "_shape"]),
                node("Flatten", [out], [out + "_2d"], axis=-1),
                node("Flatten", [row_zero], [out + "_zero_2d"], axis=-1),
                node("Flatten", [row_scale], [out + "_scale_2d"], axis=-1),
                node("Gemm", [out + "_zero_2d", colsum, out + "_2d"], [out + "_centred"], alpha=-1.0, beta=1.0),
                node("Mul", [out + "_centred", out + "_scale_2d"], [out + "_scaled"]),
                node("Reshape", [out + "_scaled", out + "_shape"], [scaled.output[0]]),
            ]
        else:
            nodes.append(n)
    nodes = [n for n in nodes if id(n) not in replaced]  # a folded node may precede its MatMulInteger
    used = {name for n in nodes for name in n.input}
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in constants.items() if name in used)
    del graph.value_info[:]  # shapes of the scales changed; ONNX Runtime infers them again
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
