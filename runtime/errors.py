"""Errors of the runtime (configuration, data directory, embedded services)."""

from __future__ import annotations


class RuntimeFailure(Exception):
    """Base of the runtime's errors: a stable ``code``, the facts in ``message``, and a ``hint``."""

    code = "runtime_error"

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.code}: {self.message} ({self.hint})"


class ConfigError(RuntimeFailure):
    code = "invalid_config"

    def __init__(self, message: str, hint: str, field: str | None = None) -> None:
        super().__init__(message, hint)
        self.field = field


class DataDirInUse(RuntimeFailure):
    code = "data_dir_in_use"


class EmbeddedServiceFailed(RuntimeFailure):
    code = "embedded_service_failed"
