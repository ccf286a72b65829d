"""User and environment errors: the CLI prints the message and exits 1, without a traceback."""


class ShardError(Exception):
    """Root of every error that is the user's or the environment's, not a bug in shard."""


class ModelError(ShardError):
    """The input model cannot be read or used as given."""


class TargetError(ShardError):
    """Unknown target or backend."""


class ToolkitMissing(ShardError):
    """A vendor toolkit environment is not installed."""


class CompileError(ShardError):
    """A shard failed to compile, or compiled into something that will not run."""


class BundleError(ShardError):
    """A bundle is missing, incomplete or from an unknown schema."""


class RunError(ShardError):
    """A shard failed while executing."""


class VerifyError(ShardError):
    """Verification could not be carried out (not: it ran and failed the threshold)."""
