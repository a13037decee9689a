"""What every config section shares: unknown keys refused, and where the repository's files are."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
