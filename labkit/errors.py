"""The errors labkit raises. Every message names what was wrong, the value given and the fix."""

from __future__ import annotations


class LabkitError(Exception):
    """Base class of every error labkit raises on purpose."""


class ConfigError(LabkitError, ValueError):
    """A setting, parameter or model configuration is invalid."""


class ServerError(LabkitError, RuntimeError):
    """The Triton server could not be found, started, reached or stopped."""


class ServerTimeoutError(ServerError, TimeoutError):
    """The server did not become ready (or stop) within its bound."""


class StalledStartError(ServerTimeoutError):
    """The server's start stopped moving: no log line and no CPU spent for a while
    (:mod:`labkit.server.stall`)."""


class PortInUseError(ServerError, OSError):
    """A port the server was asked to bind is taken."""


class ToolError(LabkitError, RuntimeError):
    """An external tool (perf_analyzer, model-analyzer, a compiler) failed or is missing."""


class ToolTimeoutError(ToolError, TimeoutError):
    """An external tool ran past its time bound and was stopped."""


class MissingFileError(LabkitError, FileNotFoundError):
    """A file or folder labkit needs does not exist."""


class MissingDependencyError(LabkitError, ImportError):
    """A Python package or shared library is not installed; the message says how to install it."""


class InferenceError(LabkitError, RuntimeError):
    """The server refused or failed a request; the message carries the server's reason."""
