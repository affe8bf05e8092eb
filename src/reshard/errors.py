"""One family of errors for every user mistake.

Every class is also a built-in exception type where that fits (``ValueError`` /
``TypeError``) so callers that already catch those keep working. Messages say
what was expected, what came, and which tensor or parameter it concerns.
"""

from __future__ import annotations


class ReshardError(Exception):
    """Base class of every error this library raises on purpose."""


class LayoutError(ReshardError, ValueError):
    """A mesh, placement or layout is malformed."""


class PlanError(ReshardError, ValueError):
    """The two sides of a transfer cannot be matched (shapes, dtypes, names)."""


class TensorMismatchError(ReshardError, ValueError):
    """A tensor handed in does not match its layout (shape, dtype, device, contiguity)."""


class FingerprintMismatchError(ReshardError, RuntimeError):
    """The ranks of a transfer built different plans; nothing was moved."""


class TransferError(ReshardError, RuntimeError):
    """A transfer failed while running (peer lost, timeout, corrupted data)."""


class AuthError(ReshardError, PermissionError):
    """A meeting refused this rank's token, or a peer did not prove it holds it (see
    ``docs/security.md``)."""


class TokenRefused(AuthError):
    """The gate refused this rank's token: the two jobs hold different tokens."""


def error_class(name: str, default: type[ReshardError]) -> type[ReshardError]:
    """The error class of this family called ``name`` (as a rank reported it to the
    others, so that every rank raises the same class), else ``default``."""
    found = globals().get(name)
    return found if isinstance(found, type) and issubclass(found, ReshardError) else default


class ConfigError(ReshardError, ValueError):
    """An option has a value the library does not accept (method, budget, staging...)."""


class MappingError(ReshardError, ValueError):
    """A Hugging Face tensor has no rule, or vLLM's shapes disagree with the config."""


class ClusterError(ReshardError, ValueError):
    """A cluster description is malformed or unknown."""


class Fp8BlockError(MappingError):
    """A tensor does not fit FP8 block quantization: not 2-D, or an engine rank's split of
    it is not a multiple of the block (what vLLM refuses for a linear layer; MoE experts it
    loads onto a finer scale grid, which reshard does not build)."""
