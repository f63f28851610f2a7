"""What every part of an agent manifest shares, the runtime's own fields and those of the model
providers and tool sources the gateways declare: the error of a manifest that cannot work, and
the constrained numbers its fields use."""

from __future__ import annotations

from typing import Annotated

import msgspec

from eventstore.errors import DispachError

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class ManifestError(DispachError):
    code = "invalid_manifest"
