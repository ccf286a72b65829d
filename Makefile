# `make test` and `make demo` create everything they need first: the project venv (.venv) and the
# rknn-toolkit2 environment (`shard toolkit install rk3588`, one for every Rockchip chip, in
# ~/.cache/shard/toolkits unless SHARD_TOOLKIT_HOME says otherwise). `make demo TARGET=rk3576`
# compiles and verifies the demo for another chip. On a machine where plain pip picks a CUDA build of torch,
# run with TORCH_INDEX_URL set to PyTorch's CPU wheel index.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH_INDEX_URL ?=
export SHARD_TORCH_INDEX_URL ?= $(TORCH_INDEX_URL)
DEMO := build/siglip-base-512
# Any Rockchip chip with fp16 (rk3588, rk3576, rk3568, rk3566, rk3562, rk2118, rv1126b): its shipped profile.
TARGET ?= rk3588
DEMO_BUNDLE := $(DEMO)$(if $(filter rk3588,$(TARGET)),,-$(TARGET)).shard

.PHONY: test demo demo-tiles toolkit bench corpus fidelity clean

$(BIN)/shard: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) 'torch==2.13.0'
	$(BIN)/pip install --disable-pip-version-check -q -e '.[zoo,test,ray]'
	touch $@

toolkit: $(BIN)/shard
	$(BIN)/shard toolkit install $(TARGET)

# The suite in TEST_WORKERS processes (pytest-xdist), each test file in one of them (its module's fixtures
# built once); the toolkit's builds use a core each, so more processes than cores buy little.
TEST_WORKERS ?= 2

test: toolkit
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

demo: toolkit
	mkdir -p build
	test -f $(DEMO).onnx || $(BIN)/shard zoo export siglip-base-512 -o $(DEMO).onnx
	$(BIN)/shard compile $(DEMO).onnx --target $(TARGET) -o $(DEMO_BUNDLE)
	$(BIN)/shard verify $(DEMO_BUNDLE) --reference $(DEMO).onnx --backend sim --min-cosine 0.9999

# The same model with every attention cut into query tiles (nano-tiling), checked on the simulator.
demo-tiles: toolkit
	mkdir -p build
	test -f $(DEMO).onnx || $(BIN)/shard zoo export siglip-base-512 -o $(DEMO).onnx
	$(BIN)/shard compile $(DEMO).onnx --target rk3588 --tile-attention force -o $(DEMO)-tiles.shard
	$(BIN)/shard verify $(DEMO)-tiles.shard --reference $(DEMO).onnx --backend sim --min-cosine 0.9999

bench: demo
	$(BIN)/python bench/compile.py --model $(DEMO).onnx
	$(BIN)/python bench/runtime.py --bundle $(DEMO).shard --model $(DEMO).onnx
	$(BIN)/python bench/probe.py

# Models nobody on the team wrote, shard and the vendor alone side by side (about 10 s a small model).
corpus: toolkit
	$(BIN)/python bench/corpus.py

# A trained transformer's accuracy per precision, the vendor's options and shard's (about 30 minutes).
fidelity: toolkit
	$(BIN)/python bench/fidelity.py --work build/fidelity

clean:
	rm -rf build .pytest_cache
