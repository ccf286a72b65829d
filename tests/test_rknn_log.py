"""The build-log reader on real rknn-toolkit2 2.5.0 output captured on x86."""

from conftest import DATA

from shard.targets.rknn.log import crashed_rule, edge_reshapes, in_common_words, parse_build_log


def test_regtask_lines_are_counted_and_quoted():
    diag = parse_build_log((DATA / "regtask-add-131072.txt").read_text())
    text = (DATA / "regtask-add-131072.txt").read_text()
    assert diag.regtask_lines == text.count("REGTASK: The bit width")
    assert diag.regtask_lines > 0
    assert diag.first_regtask.startswith("E RKNN:") and "limit: 0x1fff" in diag.first_regtask
    assert diag.error_lines >= diag.regtask_lines


def test_layer_table_cycles_fallbacks_and_memory():
    diag = parse_build_log((DATA / "siglip-512-layer-table.txt").read_text())
    assert diag.regtask_lines == 0 and diag.error_lines == 0
    ops = {layer.op for layer in diag.layers}
    assert {"Conv", "exSDPAttention", "exNorm", "exGelu", "ConvAdd"} <= ops
    patch = next(layer for layer in diag.layers if layer.name.endswith("patch_embedding/Conv_split"))
    assert patch.cycles == 192086016 and patch.target == "NPU"
    assert diag.estimated_cycles == sum(layer.cycles for layer in diag.layers)
    assert diag.single_core_fallbacks == ["Conv:/m/embeddings/patch_embedding/Conv_select"]
    assert diag.cpu_ops == []  # InputOperator is listed on the CPU but is not an op that runs there
    assert diag.internal_memory_kb == 35328 and diag.weight_memory_kb == 170830


def test_cpu_ops_and_colour_codes():
    log = ("D RKNN: [00:21:01.771] 7    Transpose          FLOAT16  CPU    (1,8,9000)                               "
           "(1,9000,8)             0/0/0                    140          Transpose:/t\n"
           "\x1b[1;31mE\x1b[0m \x1b[1;31mbuild: something broke\x1b[0m\n")
    diag = parse_build_log(log)
    assert diag.cpu_ops == ["Transpose Transpose:/t"]
    assert diag.first_error == "E build: something broke"


def test_ops_the_estimate_leaves_at_zero_are_costed_by_the_bytes_they_move():
    from shard.targets.rknn.log import unestimated_cost

    diag = parse_build_log((DATA / "siglip-512-layer-table.txt").read_text())
    reshape = next(layer for layer in diag.layers if layer.op == "Reshape")
    assert (reshape.cycles, reshape.rw_kb) == (0, 1536)
    rated = [layer for layer in diag.layers if layer.ddr_cycles]
    rate = sum(layer.ddr_cycles for layer in rated) / sum(layer.rw_kb for layer in rated)
    cycles, used = unestimated_cost(diag.layers)
    zero_kb = sum(layer.rw_kb for layer in diag.layers if layer.cycles == 0 and "Operator" not in layer.op)
    assert used == rate and cycles == round(zero_kb * rate) > 0
    assert unestimated_cost(diag.layers, 10.0) == (zero_kb * 10, 10.0)


def test_edge_reshapes_the_vendor_runs_on_the_cpu():
    # MatMul on a [4,10] graph input: the vendor reshapes it to (1,4,1,10) on the CPU before its Conv.
    layers = parse_build_log((DATA / "linear-2d-input-reshape.txt").read_text()).layers
    assert edge_reshapes(layers, {"x": [4, 10]}, {"y": [4, 8]}) == ({"x": [1, 4, 1, 10]}, {})
    # The output side's Reshape runs on the NPU there, and a shape no edge has matches nothing.
    assert edge_reshapes(layers, {"x": [40]}, {"y": [4, 8]}) == ({}, {})
    # Two edges of one shape: the table cannot say which the row belongs to.
    assert edge_reshapes(layers, {"x": [4, 10], "z": [4, 10]}, {}) == ({}, {})


def test_rk3576_layer_table_with_its_sparse_ratio_column():
    """RK3576 and RV1126B print a SparseRatio column (empty on host rows): once read as no layers
    at all, so their CPU ops and cycles went unseen. Captured from a toolkit 2.5.0 build on x86."""
    diag = parse_build_log((DATA / "rk3576-layer-table.txt").read_text())
    assert [(layer.op, layer.target, layer.cycles, layer.rw_kb) for layer in diag.layers] == [
        ("InputOperator", "CPU", 0, 0), ("Conv", "NPU", 16007168, 8704), ("Conv", "NPU", 289882, 1953),
        ("OutputOperator", "CPU", 0, 160)]
    assert diag.estimated_cycles == 16007168 + 289882 and diag.cpu_ops == []
    two_cores = "W RKNN: Failed to config layer: 'Conv:/m/c' using 2Core fallback to single core mode"
    assert parse_build_log(two_cores).single_core_fallbacks == ["Conv:/m/c"]


def test_the_rule_a_crash_names_is_read_through_the_colour_codes():
    line = ("\x1b[1;33mW\x1b[0m \x1b[1;33mYou can add disable_rules=['fuse_conv_conv_add'] in rknn.config() to "
            "temporarily disable the error rule!\x1b[0m\n")
    assert crashed_rule("I build begin\n" + line) == "fuse_conv_conv_add"
    assert crashed_rule("E build: TypeError: 'NoneType' object is unsliceable\n") is None


def test_a_build_reports_its_figures_in_the_common_words():
    """What a build hands the compile (ShardBuild.diagnostics) names no toolkit term: REGTASK lines are
    overflow lines, single-core fallbacks are fallbacks; a build kept in the old words reads the same."""
    diag = parse_build_log((DATA / "regtask-add-131072.txt").read_text()).summary()
    assert diag["overflow_lines"] > 0 and diag["first_overflow"].startswith("E RKNN:") and diag["fallbacks"] == []
    assert not {"regtask_lines", "first_regtask", "single_core_fallbacks"} & set(diag)
    old = {"regtask_lines": 3, "single_core_fallbacks": ["Conv:/m/c"], "cpu_ops": []}
    assert in_common_words(old) == {"overflow_lines": 3, "fallbacks": ["Conv:/m/c"], "cpu_ops": []}
