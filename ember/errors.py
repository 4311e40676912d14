"""ember's exception types. Every user-facing error names the argument or hook
and, where there is a fixed set, the valid choices."""


class EmberError(Exception):
    """Base class of every error ember raises on purpose."""


class MisconfigurationError(EmberError, ValueError):
    """A bad argument, option or configuration value."""


class CheckpointError(EmberError, RuntimeError):
    """A checkpoint that is missing, truncated, unsafe or incompatible."""


class DeviceMapError(MisconfigurationError):
    """A device map or ``max_memory`` that cannot work for this model (``ember.big_modeling``)."""


class NonFiniteLossError(EmberError, FloatingPointError):
    """The training loss became NaN or infinite."""


class DistributedOperationError(EmberError, RuntimeError):
    """Debug mode: the processes called different collectives, or one with tensors that do not fit."""


class NotPortedError(EmberError, ImportError):
    """A name of Lightning or Accelerate that ember does not offer (``from ember import
    cpu_offload``): the message names ember's equivalent."""


class UsageError(Exception):
    """A bad command-line value or config entry: reported as one line, exit code 2."""


def invalid_choice(arg: str, value, choices) -> MisconfigurationError:
    """The standard message for a value outside a fixed set of choices."""
    opts = ", ".join(repr(c) for c in choices)
    return MisconfigurationError(f"{arg}={value!r} is not valid; choose one of: {opts}")
