"""Rockchip NPUs: everything rknn-toolkit2. One target class for every chip the toolkit builds for;
what differs between chips is data (shard.targets.chips: the facts no probe measures, each with its
source; the chip's profile: the limits and peak rates `shard probe --target CHIP` measured).

    target.py       RknnTarget (what shard compile and probe ask of the chip) and ToolkitBuilds
    env.py          the toolkit's own virtual environment (it pins old numpy/onnx/torch)
    worker.py       the client of a toolkit worker process (standard library only: the simulator
                    executor uses it too); rknn_worker.py, the script the toolkit's interpreter runs
    log.py          the build log: its layer table, REGTASK and error lines, what runs on the CPU
    classify.py     a build's failure classes; cache.py, the probe points kept by content
    memory.py       how much memory a build takes (how many shards a large model needs)
    ops.py          small builds the passes and `shard probe` ask for (ToolkitOps)

This package's own module imports nothing: the runtime's simulator executor and the board's runtime
read worker.py and simulate.py in an environment that holds numpy and the toolkit only, without
the compiler's passes that target.py brings in.
"""
