"""What every section of the run config shares: unknown keys are errors, assignments are
validated, and a model name that is spelt as a path must exist."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def names_a_missing_folder(name_or_path: str) -> bool:
    """Whether a model name is spelt as a local path (`./x`, `/x`, `~/x`, or `a/b/c`: a hub name
    has one slash at most) that does not exist: such a name can only mean a folder."""
    spelt_as_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    return spelt_as_path and not Path(name_or_path).expanduser().exists()
