"""User-facing errors.

Every error a user can cause (bad file, bad flag, corrupt bundle) is an `EdgekitError`: the CLI prints it as one
line naming the file and the reason and exits non-zero; the daemon maps its `code` to a 4xx JSON error. Anything
else escaping is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class EdgekitError(Exception):
    """An error caused by user input. `code` is stable (API clients switch on it); `path` names the culprit."""

    code = "invalid_input"
    http_status = 400

    def __init__(self, reason: str, path: str | Path | None = None, *, code: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.path = str(path) if path is not None else None
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason

    def to_json(self) -> dict:
        out = {"code": self.code, "message": self.reason}
        if self.path:
            out["file"] = Path(self.path).name  # a basename only: full paths can carry patient names
        return out


class StudyError(EdgekitError):
    """A study (DICOM file, series folder, archive or video) that cannot be read."""

    code = "invalid_study"


class StudyTooLargeError(StudyError):
    """A study that would take more memory to decode than the ingest budget allows; refused before decoding."""

    code = "study_too_large"
    http_status = 413


class UnsupportedTransferSyntaxError(StudyError):
    code = "unsupported_transfer_syntax"
    http_status = 415


class BundleError(EdgekitError):
    """A bundle that is missing, corrupt, truncated or from a newer schema."""

    code = "invalid_bundle"


class ConfigError(EdgekitError):
    """A bad flag, recipe, machine description or config file."""

    code = "invalid_config"


class TextModelError(EdgekitError):
    """Images for a text model's bundle (a decoder alone, no vision graph): it writes reports from a prompt only."""

    code = "text_model"
    http_status = 422

    @classmethod
    def no_vision_graph(cls) -> TextModelError:
        """What a backend's `encode_images` raises on a text model's bundle."""
        return cls("this bundle is a text model: it has no vision graph to encode images with")


class StudyRequiredError(EdgekitError):
    """A prompt alone for a vision-language model's bundle: it writes reports of a study."""

    code = "study_required"
    http_status = 422


class ContextExceededError(EdgekitError):
    """A row that would grow past the positions the decoder was built for (the reporter's context budget keeps
    requests within them; this is what a run side says to a caller that does not)."""

    code = "context_exceeded"
    http_status = 422
