"""Fused kernels for the torch form of a stage: runs of ONNX ops replaced by the one torch function
that computes them in one kernel.

- attention: MatMul(Q, Kᵀ), a scalar scale, an additive mask, Softmax, MatMul(·, V) as
  scaled_dot_product_attention (flash or memory-efficient attention on a GPU: the scores never
  reach memory);
- linear: MatMul by a constant weight and Add of a constant bias as F.linear (the bias added in the
  product's epilogue);
- sibling linears: several MatMuls of one activation by constant weights (each with or without its
  bias) as one F.linear by the weights side by side, its output split: a decoder step's q, k and v
  projections, its gate and up, one kernel each group where a step of one token spends most of a
  product's time starting it;
- fp8 linear: MatMul of an FP8-quantized activation (QuantizeLinear, then DequantizeLinear at one
  scale) by an FP8 weight (DequantizeLinear, a scale per output channel), with or without a bias, as
  one FP8 matrix product (torch._scaled_mm: E4M3 operands, fast accumulation, the scales and the
  bias in its epilogue) where the ONNX spells it as an fp16 product of dequantized operands;
- an elementwise function of one tensor (GELU in its erf or tanh form, SiLU), whatever ops the
  exporter spelled it with: the region is recognised by its values on a grid, not by its shape.

Each match is checked when its stage is loaded, and its nodes' intermediate tensors must be used by
nothing else, so a stage computes the same function with or without the fusions.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import onnx

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Tanh", "Erf", "Sigmoid", "Sqrt", "Exp", "Neg", "Reciprocal"}
REGION_NODES = 16   # an elementwise function spelled in more ops than this is left alone


@dataclass
class Fused:
    kind: str                       # attention, linear, linears, fp8_linear, gelu, gelu_tanh, silu
    fn: Callable
    inputs: list[str]
    outputs: list[str]
    nodes: list[onnx.NodeProto] = field(repr=False)
    drops: list[str] = field(default_factory=list)   # constants only the fused nodes read, freed once fused
    anchor: int = -1                # the node (of `nodes`, in stage order) whose place the step takes
    plain: Callable | None = None   # the same function in the ops' own terms, where the fused kernel is not
    #                                 always the faster (attention of few rows: TorchGraph.unfused runs it)


@dataclass
class Nodes:
    """A stage's nodes, with who makes and who reads each tensor."""
    order: list[onnx.NodeProto]
    values: dict                    # constants: torch tensors
    lower: Callable                 # a node -> the torch function that computes it
    folded: dict = field(default_factory=dict)   # constants computed at load: the node that made each
    shapes: dict = field(default_factory=dict)   # static shapes the stage's file records
    producer: dict = field(default_factory=dict)
    consumers: dict = field(default_factory=dict)
    uses: Counter = field(default_factory=Counter)
    position: dict = field(default_factory=dict)   # id(node) -> its place in the stage

    def __post_init__(self):
        self.position = {id(n): k for k, n in enumerate(self.order)}
        for n in self.order:
            self.producer.update({o: n for o in n.output})
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
                    self.uses[i] += 1


def plan(nodes: list[onnx.NodeProto], values: dict, keep: set[str], lower: Callable, folded: dict | None = None,
         shapes: dict | None = None) -> list:
    """The stage's steps: each node, or a Fused in place of the last node of the run it replaces; a
    node whose outputs nothing reads any more (an activation's DequantizeLinear once every linear
    reading it runs in FP8) is left out. `values` holds the constants (torch tensors), `keep` the
    tensors that must exist (stage outputs), `lower` gives a node's torch function, `folded` the node
    that made each constant computed at load, `shapes` the static shapes the stage's file records."""
    stage = Nodes(nodes, values, lower, folded or {}, shapes or {})
    stage.uses.update(keep)
    taken: dict[int, Fused] = {}
    matched: list[Fused] = []
    for node in nodes:
        for matcher in MATCHERS:
            found = matcher(node, stage)
            if found is not None and not any(id(n) in taken for n in found.nodes):
                taken.update({id(n): found for n in found.nodes})
                matched.append(found)
                break
    for name in (name for f in matched for name in f.drops):   # after matching: matchers read the constants
        values.pop(name, None)
    anchors = {id(f.nodes[f.anchor]) for f in matched}   # a fusion's nodes are in stage order: its last one,
    # or for sibling linears the first (each sibling's readers may come before the next sibling)
    steps = [taken[id(n)] if id(n) in anchors else n for n in nodes if id(n) not in taken or id(n) in anchors]
    needed, live = set(keep), []
    for step in reversed(steps):
        outputs = step.outputs if isinstance(step, Fused) else step.output
        if any(o in needed for o in outputs):
            live.append(step)
            needed.update(i for i in (step.inputs if isinstance(step, Fused) else step.input) if i)
    return live[::-1]


def single_use(tensor: str, uses: Counter) -> bool:
    return uses[tensor] == 1


def scalar(values: dict, name: str) -> float | None:
    value = values.get(name)
    return float(value.reshape(-1)[0]) if value is not None and value.numel() == 1 else None


def attention(node, stage: Nodes) -> Fused | None:
    """MatMul(Softmax([Mul|Div](MatMul(q, kt), c) [+ mask]), v), the softmax over the last axis."""
    producer, uses, values = stage.producer, stage.uses, stage.values
    if node.op_type != "MatMul" or any(i in values for i in node.input):
        return None
    probs, v = node.input
    soft = producer.get(probs)
    if soft is None or soft.op_type != "Softmax" or not single_use(probs, uses):
        return None
    if attributes(soft).get("axis", -1) != -1:
        return None
    chain, mask, scale = [soft, node], None, 1.0
    scores = soft.input[0]
    add = producer.get(scores)
    if add is not None and add.op_type == "Add" and single_use(scores, uses):
        for k in (0, 1):
            inner = producer.get(add.input[k])
            if inner is not None and inner.op_type in ("Mul", "Div", "MatMul"):   # the mask: an input or a constant
                chain, mask, scores = [add, *chain], add.input[1 - k], add.input[k]
                break
    scaled = producer.get(scores)
    if scaled is not None and scaled.op_type in ("Mul", "Div") and single_use(scores, uses):
        constant = [i for i in scaled.input if scalar(values, i) is not None]
        if len(constant) == 1 and (scaled.op_type == "Mul" or scaled.input[1] == constant[0]):
            c = scalar(values, constant[0])
            scale = c if scaled.op_type == "Mul" else 1.0 / c
            chain, scores = [scaled, *chain], next(i for i in scaled.input if i != constant[0])
    product = producer.get(scores)
    if product is None or product.op_type != "MatMul" or not single_use(scores, uses) \
            or any(i in values for i in product.input):
        return None
    q, kt = product.input
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run(q, kt, v, mask=None):
        k = kt.transpose(-1, -2)
        if q.dim() < 3 or k.shape[:-2] != q.shape[:-2] or v.shape[:-2] != q.shape[:-2] or v.dtype != q.dtype \
                or (mask is not None and mask.dtype not in (q.dtype, torch.bool)):
            return plain(q, kt, v, mask, scale)   # batch dims broadcast (one key head for several)
        return sdpa(q, k, v, attn_mask=mask, scale=scale)
    chain = [product, *chain]
    shared = shared_key_heads(kt, v, stage)
    if shared is not None:   # each key head repeated for its query heads: the as-ops form takes it once
        k, v, groups, repeats = shared
        chain = sorted(chain + repeats, key=lambda n: stage.position[id(n)])

        def repeated(q, k, v, mask=None):
            return run(q, k.repeat_interleave(groups, 1).transpose(-1, -2), v.repeat_interleave(groups, 1), mask)
        return Fused("attention", repeated, [q, k, v] + ([mask] if mask else []), list(node.output), chain,
                     plain=lambda q, k, v, mask=None: grouped(*(aligned_keys if q.is_cuda else unaligned)(
                         q, k.transpose(-1, -2), v, mask), scale, groups))
    return Fused("attention", run, [q, kt, v] + ([mask] if mask else []), list(node.output), chain,
                 plain=lambda q, kt, v, mask=None: plain(*(aligned_keys if q.is_cuda else unaligned)(q, kt, v, mask),
                                                         scale))


def shared_key_heads(kt: str, v: str, stage: Nodes) -> tuple | None:
    """(k, v, G, the nodes that repeat them) where kt is the transpose of the last two axes of k's heads
    each repeated G times, and v of v's the same (torch's repeat_interleave on the heads, transformers'
    repeat_kv: Unsqueeze at axis 2, Tile or Expand to G, Reshape merging the two head axes), every tensor
    between read by nothing else; else None."""
    transpose = stage.producer.get(kt)
    if transpose is None or transpose.op_type != "Transpose" or not single_use(kt, stage.uses) \
            or list(attributes(transpose).get("perm", [])) != [0, 1, 3, 2]:
        return None
    keys, values = repeated_heads(transpose.input[0], stage), repeated_heads(v, stage)
    if keys is None or values is None or keys[1] != values[1]:
        return None
    return keys[0], values[0], keys[1], [transpose, *keys[2], *values[2]]


def repeated_heads(tensor: str, stage: Nodes) -> tuple | None:
    """(x, G, the nodes) where `tensor` [B, H*G, T, D] is x [B, H, T, D] with each head repeated G times
    (G > 1) by Unsqueeze at axis 2, Tile or Expand to G on that axis, and Reshape, each read once."""
    producer, uses, values, shapes = stage.producer, stage.uses, stage.values, stage.shapes
    reshape = producer.get(tensor)
    repeat = producer.get(reshape.input[0]) if reshape is not None and reshape.op_type == "Reshape" else None
    unsqueeze = producer.get(repeat.input[0]) if repeat is not None and repeat.op_type in ("Tile", "Expand") \
        else None
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" \
            or not all(single_use(t, uses) for t in (tensor, reshape.input[0], repeat.input[0])):
        return None
    x = unsqueeze.input[0]
    before, after = shapes.get(x), shapes.get(tensor)
    axes = values.get(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else attributes(unsqueeze).get("axes")
    factor = values.get(repeat.input[1])
    if before is None or after is None or len(before) != 4 or len(after) != 4 or axes is None or factor is None \
            or [int(a) for a in (axes.tolist() if hasattr(axes, "tolist") else axes)] not in ([2], [-3]):
        return None
    groups = after[1] // before[1] if before[1] else 0
    factor = [int(f) for f in factor.reshape(-1).tolist()]
    wanted = [1, 1, groups, 1, 1] if repeat.op_type == "Tile" else [before[0], before[1], groups, *before[2:]]
    if groups < 2 or after != [before[0], before[1] * groups, *before[2:]] or len(factor) != 5 \
            or any(f != w and not (repeat.op_type == "Expand" and f == 1 and k != 2)
                   for k, (f, w) in enumerate(zip(factor, wanted))):
        return None
    return x, groups, [unsqueeze, repeat, reshape]


def attributes(node) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def unaligned(q, kt, v, mask) -> tuple:
    return q, kt, v, mask


def grouped(q, kt, v, mask, scale: float, groups: int):
    """plain's attention where each key head (kt [B, H, D, T], v [B, H, T, D']) serves `groups` query heads
    in turn (q [B, H*groups, N, D]): every query head of a key head in one product against it, where the
    repeated keys would be as many products against copies (one layer of Pi0's denoising step, compiled
    and captured on an H100: 20.77 us against 25.22; bench/attention_alignment.py)."""
    b, heads, rows, _ = q.shape if q.dim() == 4 else (None, None, None, None)
    if heads is None or heads != kt.shape[1] * groups or kt.shape[0] != b or v.shape[:2] != kt.shape[:2]:
        return plain(q, kt.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), mask, scale)
    stacked = (b, kt.shape[1], groups * rows, -1)
    if mask is None:   # the scale on q, as plain has it
        return ((q * scale).reshape(stacked) @ kt).softmax(-1).matmul(v).view(b, heads, rows, -1)
    scores = ((q.reshape(stacked) @ kt).view(b, heads, rows, -1) * scale + mask).softmax(-1)
    return (scores.view(b, kt.shape[1], groups * rows, -1) @ v).view(b, heads, rows, -1)


def plain(q, kt, v, mask, scale: float):
    """Attention as its ops say: the scores, the mask added, softmax, the values (batch dims broadcast).
    Unmasked, the scale goes on q: torch.compile's attention pattern for scores scaled after the product
    (inductor's fuse_attention, replacement 2; its serialized form matches a permute whatever its axes:
    pytorch/pytorch issue 195282) takes the keys of an exported ViT's kt, a permute of four axes, for a
    transpose of the last two, and fails to compile (SigLIP-so400m on an H100, every zoo encoder on the
    CPU: "Attempting to broadcast a dimension of length 729")."""
    if mask is None:
        return ((q * scale) @ kt).softmax(-1) @ v
    return ((q @ kt) * scale + mask).softmax(-1) @ v


KEY_ALIGNMENT = 8   # half-precision elements in 16 bytes


def aligned_keys(q, kt, v, mask, alignment: int = KEY_ALIGNMENT) -> tuple:
    """(q, kt, v, mask) with the keys' count padded to a multiple of `alignment` by keys no query sees
    (zero keys and values, -inf in the mask), the same attention: on a GPU the scores' and the
    probabilities' rows then start 16-byte aligned, where an odd count (a cache of 816 plus 51 of the
    suffix's own) leaves cuBLAS only its align-1 kernels for the two products. Left as they are where
    the mask is not an additive one over the keys."""
    import torch

    keys = kt.shape[-1]
    pad = -keys % alignment
    if not pad or kt.dim() < 2 or v.shape[-2] != keys \
            or (mask is not None and (mask.dtype == torch.bool or mask.dim() == 0 or mask.shape[-1] not in (1, keys))):
        return q, kt, v, mask
    return (q, torch.nn.functional.pad(kt, (0, pad)), torch.nn.functional.pad(v, (0, 0, 0, pad)),
            unseen(mask, keys, pad, q))


def unseen(mask, keys: int, pad: int, q):
    """The additive mask over `keys` keys widened by `pad` keys no query sees (-inf)."""
    import torch

    if mask is None:
        mask = torch.zeros(keys, dtype=q.dtype, device=q.device)
    elif mask.shape[-1] != keys:   # one column broadcast over the keys
        mask = mask.expand(*mask.shape[:-1], keys)
    return torch.nn.functional.pad(mask, (0, pad), value=float("-inf"))


def linear(node, stage: Nodes) -> Fused | None:
    """Add(MatMul(x, W), b) with W a constant matrix and b a constant vector of its width."""
    producer, uses, values = stage.producer, stage.uses, stage.values
    if node.op_type != "Add":
        return None
    for k in (0, 1):
        product, bias = producer.get(node.input[k]), values.get(node.input[1 - k])
        if product is None or product.op_type != "MatMul" or bias is None or not single_use(node.input[k], uses):
            continue
        x, w = product.input
        weight = values.get(w)
        if x in values or weight is None or weight.dim() != 2 or bias.numel() != weight.shape[1] \
                or bias.dim() > 1 and bias.shape[-1] != bias.numel() or bias.dtype != weight.dtype:
            continue
        import torch

        packed, b = weight.t().contiguous(), bias.reshape(-1).contiguous()
        return Fused("linear", lambda x: torch.nn.functional.linear(x, packed, b), [x], list(node.output),
                     [product, node], [name for name in (w, node.input[1 - k]) if single_use(name, uses)])
    return None


def sibling_linears(node, stage: Nodes) -> Fused | None:
    """MatMul(x, W_i) [+ b_i] for several constant matrices W_i of one x (`node` the first of them in
    stage order), as one product by [W_1 ... W_n] (and [b_1 ... b_n], zeros where a sibling has none),
    split into the siblings' outputs. Its step takes the first sibling's place: everything it reads
    (x and constants) is there by then."""
    producer, uses, values = stage.producer, stage.uses, stage.values
    if node.op_type != "MatMul" or node.input[0] in values or node.input[0] not in stage.consumers:
        return None
    x = node.input[0]
    if getattr(producer.get(x), "op_type", None) == "DequantizeLinear":   # an FP8 activation: fp8_linear's
        return None

    def weight(n):
        w = values.get(n.input[1]) if n.op_type == "MatMul" and n.input[0] == x else None
        return w if w is not None and w.dim() == 2 and w.dtype == values[node.input[1]].dtype else None

    if weight(node) is None:
        return None
    siblings = [n for n in stage.consumers[x] if weight(n) is not None]
    if len(siblings) < 2 or siblings[0] is not node:
        return None
    import torch

    parts, nodes, outputs, drops = [], [], [], []
    for mm in siblings:
        w, reader = weight(mm), stage.consumers.get(mm.output[0], [])
        bias, out, run = None, mm.output[0], [mm]
        if len(reader) == 1 and reader[0].op_type == "Add" and single_use(mm.output[0], uses):
            add = reader[0]
            b = values.get(add.input[1] if add.input[0] == mm.output[0] else add.input[0])
            if b is not None and b.numel() == w.shape[1] and b.dtype == w.dtype \
                    and (b.dim() <= 1 or b.shape[-1] == b.numel()):
                bias, out, run = b.reshape(-1), add.output[0], [mm, add]
        parts.append((w, bias))
        nodes += run
        outputs.append(out)
        drops += [i for n in run for i in n.input if i in values and single_use(i, uses)]
    packed = torch.cat([w for w, _ in parts], 1).t().contiguous()
    b = torch.cat([b if b is not None else w.new_zeros(w.shape[1]) for w, b in parts]) \
        if any(b is not None for _, b in parts) else None
    sizes = [w.shape[1] for w, _ in parts]
    nodes.sort(key=lambda n: stage.position[id(n)])
    return Fused("linears", lambda x: tuple(torch.nn.functional.linear(x, packed, b).split(sizes, -1)), [x],
                 outputs, nodes, drops, anchor=nodes.index(node))


def fp8_linear(node, stage: Nodes) -> Fused | None:
    """MatMul(DequantizeLinear(q, s), W) [+ b]: q an FP8 tensor, s one scale, W a constant made at load
    by DequantizeLinear(W8, one scale or one per column) from an FP8 [K, N] weight; K and N multiples of 16 (the
    FP8 products' own rule)."""
    producer, values = stage.producer, stage.values
    if node.op_type != "MatMul" or node.input[0] in values:
        return None
    dequantize, made = producer.get(node.input[0]), stage.folded.get(node.input[1])
    if dequantize is None or dequantize.op_type != "DequantizeLinear" or made is None \
            or made.op_type != "DequantizeLinear":
        return None
    scale = scalar(values, dequantize.input[1])
    if scale is None:
        return None
    import torch

    if values[dequantize.input[1]].dtype != torch.float16:   # the product is fp16, as the ONNX's
        return None
    w8, scales = values.get(made.input[0]), values.get(made.input[1])
    attrs = attributes(made)
    if w8 is None or w8.dtype != torch.float8_e4m3fn or w8.dim() != 2 or attrs.get("axis", 1) != 1 \
            or scales is None or scales.numel() not in (1, w8.shape[1]) or w8.shape[0] % 16 or w8.shape[1] % 16:
        return None
    nodes, output, bias = [node], node.output[0], None
    readers = stage.consumers.get(output, [])
    if len(readers) == 1 and readers[0].op_type == "Add" and single_use(output, stage.uses):
        other = values.get(next((i for i in readers[0].input if i != output), ""))
        if other is not None and other.numel() == w8.shape[1] and other.shape[-1] == other.numel() \
                and other.dtype == torch.float16:
            nodes, output, bias = [node, readers[0]], readers[0].output[0], other.reshape(-1).contiguous()
    shape = stage.shapes.get(dequantize.input[0]) or stage.shapes.get(node.input[0])
    rows = math.prod(shape[:-1]) if shape else None
    run = scaled_product(w8, scales.float().reshape(1, -1), scale, bias, rows)
    constants = [node.input[1], *made.input, *(i for i in nodes[-1].input if bias is not None and i in values)]
    drops = [name for name in constants if stage.uses[name] <= 1]   # read by these nodes alone, or by none live
    return Fused("fp8_linear", run, [dequantize.input[0]], [output], nodes, drops)


def scaled_product(w8, column_scales, scale: float, bias, rows: int | None) -> Callable:
    """q [..., K] (E4M3, `rows` rows of K where known) -> q x w8 (E4M3 [K, N]) scaled by `scale` per row
    and `column_scales` per column (or one for the whole weight), plus `bias`, in fp16: with one weight
    scale, one torch._scaled_mm with the bias in its epilogue; with one per column, one with a scale
    per row and per column where this torch and device take it, else one scale for the whole weight
    (its smallest: no output can overflow) and the rest in one fused multiply-add."""
    import torch

    b = w8.t().contiguous().t()   # column-major, as the FP8 products read their second operand
    k, n = w8.shape
    if column_scales.numel() == 1:
        one, whole = torch.tensor(scale, device=w8.device), column_scales.reshape(())
        return lambda q: torch._scaled_mm(q.reshape(-1, k), b, one, whole, bias=bias, out_dtype=torch.float16,
                                          use_fast_accum=True).reshape(*q.shape[:-1], n)
    if rows and rowwise_scales(w8.device):
        per_row = torch.full((rows, 1), scale, dtype=torch.float32, device=w8.device)
        return lambda q: rowwise(q.reshape(rows, k), b, per_row, column_scales, bias).reshape(*q.shape[:-1], n)
    least = column_scales.min().reshape(())
    ratio, one = (column_scales / least).reshape(-1).to(torch.float16), torch.tensor(scale, device=w8.device)

    def run(q):
        y = torch._scaled_mm(q.reshape(-1, k), b, one, least, out_dtype=torch.float16)
        y = y * ratio if bias is None else torch.addcmul(bias, y, ratio)
        return y.reshape(*q.shape[:-1], n)
    return run


def rowwise(a, b, rows, columns, bias):
    """a x b in FP8, scaled by `rows` ([M, 1]) and `columns` ([1, N]), fp16 out. Fast accumulation: on
    an H200 0.94-1.47x the products without it at SigLIP's linear shapes, at least 1.10x on 9 of 12
    (bench/fp8_products.py); bench/thor.py checks the cosine it gives."""
    import torch

    return torch._scaled_mm(a, b, rows, columns, bias=bias, out_dtype=torch.float16, use_fast_accum=True)


@functools.cache
def rowwise_scales(device) -> bool:
    """Whether torch._scaled_mm takes a scale per row and per column with an fp16 result and a bias
    on this device (not every torch build and device does), tried once on small operands."""
    import torch

    a = torch.ones(32, 16, device=device).to(torch.float8_e4m3fn)
    try:
        y = rowwise(a, a[:16].t(), torch.ones(32, 1, device=device), torch.ones(1, 16, device=device),
                    torch.zeros(16, dtype=torch.float16, device=device))
        return bool((y == 16).all())
    except (RuntimeError, NotImplementedError, ValueError):
        return False


def elementwise_function(node, stage: Nodes) -> Fused | None:
    """A region of elementwise ops over one tensor x, with scalar constants only, ending in one tensor,
    seeded at its Tanh, Erf or Sigmoid, whose values on a grid are those of a function torch has."""
    if node.op_type not in ("Tanh", "Erf", "Sigmoid"):
        return None
    producer, uses, values = stage.producer, stage.uses, stage.values
    is_op = lambda n: n is not None and n.op_type in ELEMENTWISE and all(  # noqa: E731
        i not in values or values[i].numel() == 1 for i in n.input)
    cone, stack, leaves = set(), [node], set()
    while stack:   # the seed's elementwise ancestors; what feeds them from outside is x
        n = stack.pop()
        if id(n) in cone:
            continue
        cone.add(id(n))
        for i in n.input:
            if i in values:
                continue
            if is_op(producer.get(i)) and len(cone) < REGION_NODES:
                stack.append(producer[i])
            else:
                leaves.add(i)
    if len(leaves) != 1:
        return None
    x = leaves.pop()
    region = grow(x, stage, is_op)
    if region is None or all(n is not node for n in region):
        return None
    sinks = [o for n in region for o in n.output
             if uses[o] > sum(i == o for m in region for i in m.input)]
    if len(sinks) != 1:
        return None
    kind = identify(region, x, sinks[0], stage)
    if kind is None:
        return None
    return Fused(kind, function(kind), [x], sinks, region)


def grow(x: str, stage: Nodes, is_op) -> list | None:
    """Every op reachable from x whose inputs are x, constants or the region's own tensors, in stage order."""
    region, known, frontier = {}, {x}, [x]
    while frontier:
        for n in stage.consumers.get(frontier.pop(), []):
            if id(n) in region or not is_op(n) or not all(i in known or i in stage.values for i in n.input):
                continue
            region[id(n)] = n
            if len(region) > REGION_NODES:
                return None
            known.update(n.output)
            frontier.extend(n.output)
    order = {id(n): k for k, n in enumerate(stage.order)}
    return sorted(region.values(), key=lambda n: order[id(n)])


FUNCTIONS = ("gelu", "gelu_tanh", "silu")


def function(kind: str) -> Callable:
    """The torch function of one of FUNCTIONS."""
    import functools

    import torch

    F = torch.nn.functional
    return {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "silu": F.silu}[kind]


def identify(region: list, x: str, y: str, stage: Nodes) -> str | None:
    """Which of FUNCTIONS the region computes, from its values on [-8, 8] in float64 (fp16 constants
    are rounded: the tolerance is fp16's)."""
    import torch

    grid = torch.linspace(-8, 8, 2001, dtype=torch.float64)
    env = {x: grid}
    for n in region:
        for i in n.input:
            if i not in env and i in stage.values and stage.values[i].is_floating_point():
                env[i] = stage.values[i].double().cpu()
        if any(i not in env for i in n.input):
            return None
        env[n.output[0]] = stage.lower(n)(*[env[i] for i in n.input])
    got = env[y]
    wanted = {kind: function(kind)(grid) for kind in FUNCTIONS}
    errors = {kind: float(((got - want).abs() / want.abs().clamp(min=1.0)).max()) for kind, want in wanted.items()}
    kind = min(errors, key=errors.get)   # GELU's two forms differ by 5e-4 at most: the nearer one
    return kind if errors[kind] <= 2e-3 else None


MATCHERS = (elementwise_function, attention, fp8_linear, linear, sibling_linears)
