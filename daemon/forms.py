"""The upload form, declared once for `/v1/reports` and `/v1/jobs`.

Both routes take the same study and the same generation fields; declaring them twice let the two drift apart (one
checked the variant before the upload, the other did not). FastAPI reads this dependency's parameters into the
multipart body of each route's OpenAPI operation, so the documented forms are identical too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import File, Form, UploadFile

from edgekit.generate import MAX_NEW_TOKENS, MAX_TEMPERATURE

from .options import RequestOptions

MAX_PROMPT_CHARS = 2000
MAX_VARIANT_CHARS = 128


@dataclass(frozen=True)
class ReportForm:
    """A study upload plus what to do with it, as the client sent it (types and ranges already checked)."""

    files: list[UploadFile]
    prompt: str
    variant: str | None
    options: RequestOptions
    quality: str | None = None  # "max": the policy's best-quality point for this request


def report_form(
    files: Annotated[list[UploadFile], File(description="DICOM file(s), one zip of a series, or one video")],
    prompt: Annotated[str, Form(max_length=MAX_PROMPT_CHARS, description="Clinical indication or question")] = "",
    variant: Annotated[
        str | None,
        Form(
            min_length=1,
            max_length=MAX_VARIANT_CHARS,
            description="The variant to write the report (default: the active one)",
        ),
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        Form(
            ge=1,
            description=f"At most the daemon's limits.max_new_tokens (itself at most {MAX_NEW_TOKENS}); "
            "lowered, with a warning, to what the model's context leaves",
        ),
    ] = None,
    temperature: Annotated[float, Form(ge=0.0, le=MAX_TEMPERATURE)] = 0.0,
    top_p: Annotated[float, Form(gt=0.0, le=1.0)] = 1.0,
    seed: Annotated[int | None, Form(ge=0, le=2**32 - 1)] = None,
    quality: Annotated[
        Literal["max"] | None,
        Form(
            description='"max": the best-quality variant the policy has, for this request (where the policy '
            "allows overrides)"
        ),
    ] = None,
) -> ReportForm:
    return ReportForm(
        files=files,
        prompt=prompt,
        variant=variant,
        options=RequestOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed),
        quality=quality,
    )
