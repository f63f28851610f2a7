"""Errors of the runtime (configuration, data directory, embedded services)."""

from __future__ import annotations

from eventstore.errors import DispachError


class RuntimeFailure(DispachError):
    code = "runtime_error"


class ConfigError(RuntimeFailure):
    code = "invalid_config"


class DataDirInUse(RuntimeFailure):
    code = "data_dir_in_use"


class EmbeddedServiceFailed(RuntimeFailure):
    code = "embedded_service_failed"
