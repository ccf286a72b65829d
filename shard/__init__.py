"""shard: make models that edge NPUs choke on compile, run and stay accurate on them.

The public API is flat and imported lazily, so `import shard.runtime` on a device pulls in
nothing beyond numpy and the executor's own library.
"""

from shard.packed import check_runtime, own_pack

if (_pack := own_pack()) is not None:   # a pack's own copy: as it was packed, or nothing of it runs
    check_runtime(_pack)

__version__ = "0.1.0"

_API = {
    "compile": ("shard.compilation", "compile_model"),
    "CompileOptions": ("shard.options", "CompileOptions"),
    "load": ("shard.runtime", "load"),
    "verify": ("shard.verifier", "verify_bundle"),
    "ShardError": ("shard.errors", "ShardError"),
}

__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        import importlib

        module, attr = _API[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'shard' has no attribute {name!r}")
