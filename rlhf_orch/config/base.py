"""The base of every config section: extra keys are errors (a typo never passes silently), assignments are
validated (a benchmark's `model_copy` / override stays inside the field's bounds). Nothing else lives here."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
