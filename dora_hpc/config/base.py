"""What every config section shares: unknown keys are refused, a built config never changes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A bad config file or override; the message names the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
