"""canonicalize: fixed input shapes, folded constants, no Identity, Dropout or no-op Cast, every
tensor's shape known.

Models exported years ago by other tools come first through `prepare_model`: an old opset is
upgraded (opset 6-12 models crash inside the vendor's loader, and the rewrites emit Slice and
ReduceSum in their opset-13 form), initializers listed as graph inputs stop being inputs. Where
onnx's shape inference gives up, one onnxruntime run at the fixed input shapes reads every shape.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard.calibration import ort_session
from shard.errors import ModelError
from shard.passes.control_flow import refuse_control_flow, unroll_loops
from shard.graph import default_opset, infer_shapes, is_static, replace_uses, toposort
from shard.passes.context import PassContext

MIN_OPSET = 13   # Slice takes its bounds as inputs from 10, ReduceSum and Split their axes from 13


def prepare_model(model: onnx.ModelProto, min_opset: int = MIN_OPSET) -> tuple[onnx.ModelProto, dict]:
    """The model in the form the passes and the toolkit take: opset >= min_opset (the target's; at least
    MIN_OPSET) where the onnx version converter can lift it, no initializer listed as a graph input.
    Returns what changed."""
    notes = {}
    opset = default_opset(model)
    if 0 < opset < 7:
        notes["prelu_slopes_per_channel"] = channel_slopes(model)
    if 0 < opset < min_opset:
        try:
            model = onnx.version_converter.convert_version(model, min_opset)
            notes["opset"] = f"{opset} -> {min_opset}"
        except Exception as exc:  # noqa: BLE001 - the converter raises bare RuntimeErrors of many kinds
            notes["opset"] = f"{opset} kept: the onnx version converter failed ({str(exc).splitlines()[0][:160]})"
    inits = {i.name for i in model.graph.initializer}
    listed = [i for i in model.graph.input if i.name in inits]
    if listed:
        kept = [i for i in model.graph.input if i.name not in inits]
        del model.graph.input[:]
        model.graph.input.extend(kept)
        notes["initializer_inputs_removed"] = len(listed)
    model.ir_version = max(model.ir_version, onnx.helper.find_min_ir_version_for(list(model.opset_import),
                                                                                 ignore_unknown=True))
    return model, notes


def channel_slopes(model: onnx.ModelProto) -> int:
    """PRelu's slope broadcast from the channel axis before opset 7 and from the last one after: a
    per-channel slope [C] of an [N, C, ...] input becomes [C, 1, ...], which means the same in both
    (the version converter leaves it as is, and onnxruntime then refuses the model). Returns how many."""
    inits = {i.name: i for i in model.graph.initializer}
    ranks = {v.name: len(v.type.tensor_type.shape.dim)
             for v in [*model.graph.input, *onnx.shape_inference.infer_shapes(model).graph.value_info]}
    changed = 0
    for node in model.graph.node:
        if node.op_type == "PRelu" and node.input[1] in inits and ranks.get(node.input[0], 0) > 2:
            slope = onnx.numpy_helper.to_array(inits[node.input[1]])
            if slope.ndim == 1 and slope.size > 1:
                shaped = slope.reshape([slope.size] + [1] * (ranks[node.input[0]] - 2))
                inits[node.input[1]].CopyFrom(onnx.numpy_helper.from_array(shaped, node.input[1]))
                for value in model.graph.input:  # an initializer listed as an input (IR 3) says its shape too
                    if value.name == node.input[1]:
                        dims = value.type.tensor_type.shape.dim
                        del dims[:]
                        dims.extend(onnx.TensorShapeProto.Dimension(dim_value=d) for d in shaped.shape)
                changed += 1
    return changed


def format_shape(shape) -> str:
    return "[" + ",".join(str(d) if d is not None else "?" for d in shape) + "]"


def fix_input_shapes(graph: gs.Graph, overrides: dict[str, tuple[int, ...]]) -> list[str]:
    """Apply `--input-shape` overrides; a dimension still dynamic afterwards is a ModelError."""
    names = [t.name for t in graph.inputs]
    for name in overrides:
        if name not in names:
            raise ModelError(f"--input-shape names {name!r}, but the model's inputs are: {', '.join(names)}")
    changed = []
    for tensor in graph.inputs:
        if tensor.name in overrides:
            new = list(overrides[tensor.name])
            if tensor.shape is not None and len(tensor.shape) != len(new):
                raise ModelError(f"--input-shape {tensor.name}: model input has rank {len(tensor.shape)}, "
                                 f"given {format_shape(new)}")
            fixed = [(a, d, n) for a, (d, n) in enumerate(zip(tensor.shape or [], new)) if isinstance(d, int) and d > 0
                     and d != n]
            if fixed:   # the model's own Reshapes and weights hold that size: another would be read wrongly
                axis, dim, given = fixed[0]
                raise ModelError(f"--input-shape {tensor.name}={','.join(map(str, new))}: dimension {axis} of the model's "
                                 f"input {format_shape(tensor.shape)} is fixed at {dim}, not {given}; only dynamic "
                                 f"dimensions can be set")
            if any(n <= 0 for n in new):
                raise ModelError(f"--input-shape {tensor.name}={','.join(map(str, new))}: every dimension must be "
                                 f"at least 1")
            tensor.shape = new
            changed.append(tensor.name)
        if tensor.shape is None:
            raise ModelError(f"input {tensor.name!r} has no shape; give one with --input-shape {tensor.name}=1,3,224,224")
        if 0 in tensor.shape:
            raise ModelError(f"input {tensor.name!r} has shape {format_shape(tensor.shape)}, with no element: "
                             f"nothing to compute")
        for axis, dim in enumerate(tensor.shape):
            if not (isinstance(dim, int) and dim >= 0):
                example = ",".join(str(d) if isinstance(d, int) and d >= 0 else "N" for d in tensor.shape)
                raise ModelError(f"input {tensor.name!r} has a dynamic dimension {axis} ({dim!r}) in shape "
                                 f"{format_shape(tensor.shape)}; fix it with --input-shape {tensor.name}={example}")
    return changed


def is_noop(node: gs.Node) -> bool:
    """Identity, Dropout (inference) whose mask nobody reads, or a Cast to the dtype its input
    already has (exporters leave these in)."""
    if node.op == "Identity":
        return True
    if node.op == "Dropout":
        return all(not t.outputs for t in node.outputs[1:])
    if node.op == "Cast" and node.inputs and node.inputs[0].dtype is not None:
        to = onnx.helper.tensor_dtype_to_np_dtype(node.attrs["to"])
        return np.dtype(node.inputs[0].dtype) == to
    return False


def remove_identities(graph: gs.Graph) -> int:
    """Bypass Identity, Dropout and no-op Casts, keeping the output's name where it is a graph output."""
    outputs = set(id(t) for t in graph.outputs)
    removed = 0
    for node in [n for n in graph.nodes if is_noop(n)]:
        src, dst = node.inputs[0], node.outputs[0]
        if any(id(t) in outputs for t in node.outputs):
            continue
        replace_uses(dst, src)
        node.outputs.clear()
        removed += 1
    return removed


def canonicalize(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    nodes_before = len(graph.nodes)
    fixed = fix_input_shapes(graph, ctx.options.input_shapes)
    graph = infer_shapes(graph)
    folding_failed, unrolled = None, []
    # Shape ops fold only once shapes are known, and folding them reveals more shapes (and a Loop's
    # trip count, which unrolls it): iterate.
    for _ in range(4):
        count = len(graph.nodes)
        try:
            toposort(graph).fold_constants(fold_shapes=True, error_ok=True).cleanup()
        except Exception as exc:  # noqa: BLE001 - graphsurgeon's folding fails on sequence values
            folding_failed = f"{type(exc).__name__}: {exc}"
            break
        unrolled += unroll_loops(graph)
        graph = infer_shapes(graph)
        if len(graph.nodes) == count:
            break
    refuse_control_flow(graph)
    # Bypassing an Identity changes no shape: the shapes inferred above still hold.
    identities = remove_identities(graph)
    toposort(graph.cleanup())
    report = {"fixed_inputs": fixed, "nodes_before": nodes_before, "nodes_after": len(graph.nodes),
              "identities_removed": identities}
    if unrolled:
        report["changes"] = unrolled
    if folding_failed:
        report["constant_folding"] = f"stopped: {folding_failed}"
    if unknown_shapes(graph):
        report["shapes_from_onnxruntime"] = infer_shapes_by_running(graph)
        if not folding_failed:   # the Shape ops those shapes make constant (PP-OCR's classifier: a Reshape's)
            try:
                toposort(graph).fold_constants(fold_shapes=True, error_ok=True).cleanup()
                toposort(graph)
            except Exception as exc:  # noqa: BLE001 - as above
                report["constant_folding"] = f"stopped: {type(exc).__name__}: {exc}"
            report["nodes_after"] = len(graph.nodes)
    unknown = [t.name for t in graph.outputs if not is_static(t.shape)]
    if unknown:
        raise ModelError(f"cannot infer a static shape for output(s) {', '.join(unknown)}, "
                         f"not even by running the model once in onnxruntime")
    return graph, report


def unknown_shapes(graph: gs.Graph) -> list[gs.Variable]:
    return [t for t in graph.tensors().values()
            if isinstance(t, gs.Variable) and t.name and (not is_static(t.shape) or t.dtype is None)]


def infer_shapes_by_running(graph: gs.Graph) -> int:
    """Where onnx's inference gives up (custom domains, ops it cannot propagate through): run the
    model once in onnxruntime on inputs of the fixed shapes and read every tensor's shape and dtype.
    Returns how many tensors got theirs this way."""
    missing = {t.name: t for t in unknown_shapes(graph)}
    try:
        session = ort_session(gs.export_onnx(graph.copy(), do_type_check=False), list(missing))
        feeds = {t.name: example_input(t) for t in graph.inputs}
        names = [o.name for o in session.get_outputs()]
        values = dict(zip(names, session.run(names, feeds)))
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        if all(is_static(t.shape) for t in graph.outputs):
            return 0  # the outputs are known; the passes leave tensors of unknown shape alone
        raise ModelError(f"cannot infer static shapes for {len(missing)} tensors (first: {next(iter(missing))}); "
                         f"onnx's inference gave up and onnxruntime could not run the model: "
                         f"{str(exc).splitlines()[0][:200]}") from None
    found = 0
    for name, tensor in missing.items():
        if isinstance(values.get(name), np.ndarray):  # sequences come back as lists: no tensor shape
            tensor.shape, tensor.dtype = list(values[name].shape), values[name].dtype
            found += 1
    return found


def example_input(tensor: gs.Variable) -> np.ndarray:
    """Values of the input's shape and dtype: small random floats, zeros for integers (valid indices)."""
    dtype = np.dtype(tensor.dtype)
    if dtype.kind == "f":
        return np.random.default_rng(0).uniform(-1, 1, tensor.shape).astype(dtype)
    return np.zeros(tensor.shape, dtype)
