"""tile_attention (nano-tiling): attention as exporters write it, rewritten into query tiles, and
where the key length itself breaks a limit, key tiles merged exactly with log-sum-exp.

Found: MatMul(Q, K^T) -> [Mul or Div by a constant] -> [Add mask] -> Softmax(last axis) -> [Cast]
-> MatMul(., V), 3-D or 4-D, whatever produced Q, K^T and V (the transposes and reshapes that
transformers and torch emit, a pre-scaled Q). Each query tile is the same chain on rows of Q (and
of the mask): exact. A key tile j gives m_j = max(s_j), e_j = exp(s_j - m_j), l_j = sum(e_j),
o_j = e_j @ V_j; the tiles merge as sum(exp(m_j - m) o_j) / sum(exp(m_j - m) l_j), m = max m_j.

--tile-attention auto tiles only where the attention, built alone by the toolkit, fails, and
picks the largest query tile (then key tile) that builds clean; force tiles every attention with
the profile's softmax row limit for its key length; off leaves attention alone.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from shard.graph import as_model
from shard.passes.context import PassContext
from shard.passes.fit import HARD_FAILURES
from shard.passes.legalize import bounds
from shard.passes.rewrite import Rewriter

MODES = ("auto", "off", "force")
MAX_TILES = 64   # query tiles x key tiles of one attention that auto may make
TILE_MARK = "/tile"


@dataclass
class Attention:
    qk: gs.Node
    softmax: gs.Node
    pv: gs.Node
    pre: list[gs.Node] = field(default_factory=list)    # scale and mask nodes between qk and softmax, in order
    post: list[gs.Node] = field(default_factory=list)   # casts between softmax and pv

    @property
    def q(self) -> gs.Tensor:
        return self.qk.inputs[0]

    @property
    def kt(self) -> gs.Tensor:
        return self.qk.inputs[1]

    @property
    def v(self) -> gs.Tensor:
        return self.pv.inputs[1]

    @property
    def out(self) -> gs.Variable:
        return self.pv.outputs[0]


def only_consumer(t: gs.Tensor) -> gs.Node | None:
    return t.outputs[0] if len(t.outputs) == 1 else None


def is_scalar_const(t: gs.Tensor) -> bool:
    return isinstance(t, gs.Constant) and t.values.size == 1


def find_attention(graph: gs.Graph) -> list[Attention]:
    found = []
    for sm in [n for n in graph.nodes if n.op == "Softmax"]:
        rank = len(sm.inputs[0].shape or [])
        if rank not in (3, 4) or sm.attrs.get("axis", -1) % rank != rank - 1:
            continue
        pre, t = [], sm.inputs[0]
        while t.inputs and len(pre) < 3:
            node = t.inputs[0]
            if node.op == "MatMul":
                break
            if node.op in ("Mul", "Div") and is_scalar_const(node.inputs[1]) or node.op == "Add":
                pre.insert(0, node)
                t = node.inputs[0]
                if node.op == "Add" and t.inputs and t.inputs[0].op not in ("MatMul", "Mul", "Div"):
                    t = node.inputs[1]  # the mask came first: Add(mask, scores)
                continue
            break
        if not t.inputs or t.inputs[0].op != "MatMul":
            continue
        qk = t.inputs[0]
        chain = [qk, *pre]
        if any(only_consumer(n.outputs[0]) is None for n in chain):
            continue
        post, u = [], sm.outputs[0]
        while (c := only_consumer(u)) is not None and c.op == "Cast":
            post.append(c)
            u = c.outputs[0]
        pv = only_consumer(u)
        if pv is None or pv.op != "MatMul" or pv.inputs[0] is not u or len(qk.outputs[0].shape) != rank:
            continue
        found.append(Attention(qk, sm, pv, pre, post))
    return found


def mask_input(node: gs.Node, scores: gs.Tensor) -> tuple[int, gs.Tensor]:
    """(position, tensor) of an Add's other input than `scores`."""
    k = 1 if node.inputs[0] is scores else 0
    return k, node.inputs[k]


def sliced_mask(b: Rewriter, att: Attention, node: gs.Node, scores: gs.Tensor, rows: tuple[int, int],
                cols: tuple[int, int], name: str) -> list:
    """The Add's inputs for one tile: the mask cut to the tile's rows and columns where it has them."""
    k, mask = mask_input(node, scores)
    rank, mrank = len(scores.shape), len(mask.shape)
    for axis, (lo, hi) in ((rank - 2, rows), (rank - 1, cols)):
        m_axis = axis - (rank - mrank)
        if m_axis >= 0 and int(mask.shape[m_axis]) != 1:
            mask = b.take(mask, m_axis, lo, hi, f"{name}/mask_{axis}")
    return [None, mask] if k == 1 else [mask, None]


def scores_tile(b: Rewriter, att: Attention, q: gs.Tensor, rows: tuple[int, int], cols: tuple[int, int],
                name: str) -> gs.Tensor:
    """MatMul(Q rows, K^T cols) and the scale/mask nodes, for one tile."""
    kt = b.take(att.kt, len(att.kt.shape) - 1, *cols, f"{name}/kt")
    shape = list(att.qk.outputs[0].shape[:-2]) + [rows[1] - rows[0], cols[1] - cols[0]]
    s = b.node("MatMul", f"{name}/qk", [q, kt], shape, att.qk.outputs[0])
    prev = att.qk.outputs[0]
    for node in att.pre:
        if node.op == "Add":
            ins = sliced_mask(b, att, node, prev, rows, cols, name)
            ins = [s if t is None else t for t in ins]
        else:
            ins = [s, node.inputs[1]]
        s = b.node(node.op, f"{name}/{node.op.lower()}", ins, shape, node.outputs[0], **node.attrs)
        prev = node.outputs[0]
    return s


def tile(graph: gs.Graph, att: Attention, query_tile: int, key_tile: int | None, label: str) -> dict:
    """Replace one attention by its tiles; returns what was done."""
    b = Rewriter(graph)
    out = att.out
    rank = len(out.shape)
    t_len, s_len = int(att.qk.outputs[0].shape[-2]), int(att.qk.outputs[0].shape[-1])
    q_rows = bounds(t_len, math.ceil(t_len / query_tile))
    k_cols = bounds(s_len, math.ceil(s_len / key_tile)) if key_tile and key_tile < s_len else [(0, s_len)]
    pieces = []
    for i, rows in enumerate(q_rows):
        name = f"{label}{TILE_MARK}{i}"
        q = b.take(att.q, len(att.q.shape) - 2, *rows, f"{name}/q")
        o_shape = list(out.shape[:-2]) + [rows[1] - rows[0], int(out.shape[-1])]
        if len(k_cols) == 1:
            s = scores_tile(b, att, q, rows, k_cols[0], name)
            p = b.node("Softmax", f"{name}/softmax", [s], list(s.shape), att.softmax.outputs[0], axis=-1)
            for cast in att.post:
                p = b.node("Cast", f"{name}/cast", [p], list(p.shape), cast.outputs[0], **cast.attrs)
            pieces.append(b.node("MatMul", f"{name}/pv", [p, att.v], o_shape, out))
            continue
        maxes, sums, outs = [], [], []
        for j, cols in enumerate(k_cols):
            kname = f"{name}/key{j}"
            s = scores_tile(b, att, q, rows, cols, kname)
            m = b.reduce("ReduceMax", s, len(s.shape) - 1, f"{kname}/max")
            e = b.node("Exp", f"{kname}/exp", [b.node("Sub", f"{kname}/sub", [s, m], list(s.shape), s)], list(s.shape), s)
            sums.append(b.reduce("ReduceSum", e, len(e.shape) - 1, f"{kname}/sum"))
            v = b.take(att.v, len(att.v.shape) - 2, *cols, f"{kname}/v")
            outs.append(b.node("MatMul", f"{kname}/pv", [e, v], o_shape, out))
            maxes.append(m)
        m_all = b.node("Max", f"{name}/lse/max", maxes, list(maxes[0].shape), maxes[0])
        num = den = None
        for j, (m, l, o) in enumerate(zip(maxes, sums, outs)):
            w = b.node("Exp", f"{name}/lse/w{j}", [b.node("Sub", f"{name}/lse/d{j}", [m, m_all], list(m.shape), m)],
                       list(m.shape), m)
            wo = b.node("Mul", f"{name}/lse/wo{j}", [o, w], o_shape, o)
            wl = b.node("Mul", f"{name}/lse/wl{j}", [l, w], list(l.shape), l)
            num = wo if num is None else b.node("Add", f"{name}/lse/num{j}", [num, wo], o_shape, o)
            den = wl if den is None else b.node("Add", f"{name}/lse/den{j}", [den, wl], list(l.shape), l)
        pieces.append(b.node("Div", f"{name}/lse/out", [num, den], o_shape, out))
    att.pv.outputs.clear()
    b.join(pieces, out, rank - 2, f"{label}/join_tiles")
    return {"query_tiles": len(q_rows), "key_tiles": len(k_cols), "query_tile": query_tile,
            "key_tile": key_tile if len(k_cols) > 1 else None, "nodes_added": b.count + 1}


def region_model(att: Attention, rows: int | None = None, cols: int | None = None) -> onnx.ModelProto:
    """This attention alone (optionally one tile of it), inputs in place of Q, K^T, V and the mask."""
    g = gs.Graph(opset=17)
    tensors = {}

    def var(t: gs.Tensor, axis_sizes: dict[int, int]) -> gs.Tensor:
        if isinstance(t, gs.Constant):  # a copy: the model's own tensors must not gain consumers here
            return gs.Constant(f"c{len(g.nodes)}_{len(g.inputs)}", t.values)
        shape = [axis_sizes.get(a, int(d)) for a, d in enumerate(t.shape)]
        v = gs.Variable(f"in{len(g.inputs)}", dtype=np.float32, shape=shape)
        g.inputs.append(v)
        return v

    rank = len(att.qk.outputs[0].shape)
    t_len, s_len = int(att.qk.outputs[0].shape[-2]), int(att.qk.outputs[0].shape[-1])
    r, c = rows or t_len, cols or s_len
    tensors["q"] = var(att.q, {len(att.q.shape) - 2: r})
    tensors["kt"] = var(att.kt, {len(att.kt.shape) - 1: c})
    tensors["v"] = var(att.v, {len(att.v.shape) - 2: c})
    shape = list(att.qk.outputs[0].shape[:-2]) + [r, c]

    def add(op, ins, shp, **attrs):
        o = gs.Variable(f"t{len(g.nodes)}", dtype=np.float32, shape=shp)
        g.nodes.append(gs.Node(op, f"n{len(g.nodes)}", attrs, ins, [o]))
        return o

    s = add("MatMul", [tensors["q"], tensors["kt"]], shape)
    prev = att.qk.outputs[0]
    for node in att.pre:
        if node.op == "Add":
            k, mask = mask_input(node, prev)
            mrank = len(mask.shape)
            sizes = {a - (rank - mrank): n for a, n in ((rank - 2, r), (rank - 1, c))
                     if a - (rank - mrank) >= 0 and int(mask.shape[a - (rank - mrank)]) != 1}
            m = var(mask, sizes) if not isinstance(mask, gs.Constant) else gs.Constant(
                "mask", np.zeros([sizes.get(a, int(d)) for a, d in enumerate(mask.shape)], np.float32))
            s = add("Add", [s, m] if k == 1 else [m, s], shape)
        else:
            s = add(node.op, [s, var(node.inputs[1], {})], shape)
        prev = node.outputs[0]
    p = add("Softmax", [s], shape, axis=-1)
    g.outputs = [add("MatMul", [p, tensors["v"]], shape[:-1] + [int(att.out.shape[-1])])]
    return as_model(g)


def forced_rows(ctx: PassContext, s_len: int, t_len: int) -> int:
    """Query rows per tile for --tile-attention force: the profile's Softmax row limit at this key
    length, else an even share per NPU core."""
    limit = ctx.profile.limits.get(f"softmax-rows@w{s_len}")
    if limit is not None and 0 < limit.value < t_len:
        return limit.value
    return math.ceil(t_len / max(2, ctx.profile.cores))


def auto_tiles(ctx: PassContext, att: Attention) -> tuple[int | None, int | None, str] | None:
    """None if the attention builds clean alone; else the largest (query tile, key tile) that does,
    or (None, None, why) where none does within MAX_TILES tiles (a 1-row tiling of a 1024-token
    attention is 4096 tiles: 650,000 nodes over SigLIP, more than the compile's memory holds)."""
    whole = ctx.ops.build(region_model(att))
    if whole.ok or whole.failure not in HARD_FAILURES:
        return None
    t_len, s_len = int(att.qk.outputs[0].shape[-2]), int(att.qk.outputs[0].shape[-1])
    rows = t_len
    while rows > 1 and math.ceil(t_len / math.ceil(rows / 2)) <= MAX_TILES:
        rows = math.ceil(rows / 2)
        if ctx.ops.build(region_model(att, rows=rows)).ok:
            return rows, None, f"alone it fails ({whole.failure}: {whole.evidence[:160]}); {rows} query rows build clean"
    cols = s_len
    while cols > 1 and math.ceil(t_len / rows) * math.ceil(s_len / math.ceil(cols / 2)) <= MAX_TILES:
        cols = math.ceil(cols / 2)
        if ctx.ops.build(region_model(att, rows=rows, cols=cols)).ok:
            return rows, cols, f"alone it fails ({whole.failure}); {rows} query rows x {cols} keys build clean"
    return None, None, (f"alone it fails ({whole.failure}: {whole.evidence[:160]}); no tiling into at most "
                        f"{MAX_TILES} tiles builds clean")


def tile_attention(graph: gs.Graph, ctx: PassContext) -> tuple[gs.Graph, dict]:
    mode = ctx.options.tile_attention
    found = find_attention(graph)
    # tried: attentions that fail built alone where no tiling builds clean, left whole. The model's own
    # build often holds them (ViT-S: the vendor's SDPA fusion rule crashes on the region alone, not in
    # the model), so they are no warning; the build's figures say what the model got.
    report = {"mode": mode, "found": len(found), "changes": [], "not_fixed": [], "tried": []}
    if mode == "off":
        return graph, report
    for k, att in enumerate(found):
        t_len, s_len = int(att.qk.outputs[0].shape[-2]), int(att.qk.outputs[0].shape[-1])
        label = att.qk.name or f"attention{k}"
        if mode == "force":
            rows, cols = forced_rows(ctx, s_len, t_len), None
            reason = f"--tile-attention force: {rows} query rows per tile (profile softmax-rows@w{s_len} or cores)"
        else:
            if ctx.ops is None:
                continue
            choice = auto_tiles(ctx, att)
            if choice is None:
                continue
            rows, cols, reason = choice
            if rows is None:
                report["tried"].append({"node": label, "op": "attention", "reason": reason,
                                        "action": "left as is: the vendor builds it whole"})
                continue
        done = tile(graph, att, rows, cols, label)
        report["changes"].append({"node": label, "op": "attention", "shape": [t_len, s_len], "reason": reason,
                                  "action": f"{done['query_tiles']} query tiles x {done['key_tiles']} key tiles",
                                  **done})
    return graph, report


def tiled(reports: dict, undone: set[str]) -> list[dict]:
    """The attentions this pass tiled (its changes in a compile's pass reports), less those `undone`."""
    return [c for c in (reports.get("tile_attention") or {}).get("changes", []) if c["node"] not in undone]


def confirm_tiles(reports: dict, layer_names: list[str], undone: set[str] = frozenset()) -> None:
    """After the build: how many tiles of each attention the vendor's layer table still shows as
    layers of their own (fused back, they would share one layer); recorded in each change."""
    text = "\n".join(layer_names)
    for change in tiled(reports, undone):
        found = set(re.findall(re.escape(change["node"] + TILE_MARK) + r"(\d+)/", text))
        change["tiles_in_layer_table"] = len(found)
        change["tiles_survived"] = len(found) == change["query_tiles"]
