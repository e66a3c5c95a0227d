"""The upload form, declared once for `/v1/reports` and `/v1/jobs`.

Both routes take the same study and the same generation fields; declaring them twice let the two drift apart (one
checked the variant before the upload, the other did not).

The form is read here, not by FastAPI: for `File()` parameters FastAPI parses the body with Starlette's defaults,
which stop at 1000 files with an opaque 400, so `limits.max_files` (4000 by default) could never be reached. This
dependency parses it with the configured limit (read per request, so a reload applies) and checks the fields with
FastAPI's rules (an empty field is an absent one, the last of repeated values counts, the same 422 messages).
`UPLOAD_OPENAPI` documents the same body for each route's OpenAPI operation.

The files are required unless the variant is a text model's (a decoder alone), which writes its report from the
prompt: which it is, is known only once the variant is chosen, so the service asks `ReportForm.require_files` then,
and a request without files to a VLM gets the same 422 it got when the form itself required them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException

from edgekit.errors import EdgekitError
from edgekit.generate import MAX_NEW_TOKENS, MAX_TEMPERATURE

from .options import RequestOptions

MAX_PROMPT_CHARS = 2000
MAX_VARIANT_CHARS = 128
# Seven fields are documented. Starlette holds each text field in memory (up to 1 MiB), so the default of 1000
# fields let one request hold up to 1 GB; more than this is refused (400) before it is read further.
MAX_FIELDS = 64
FILES = "files"
FILES_DESCRIPTION = (
    "DICOM file(s), one zip of a series, or one video; required, unless the variant is a text model's (a decoder "
    "alone, which reports on the prompt and refuses files)"
)


class TooManyFilesError(EdgekitError):
    code = "too_many_files"
    http_status = 413


@dataclass(frozen=True)
class ReportForm:
    """A study upload plus what to do with it, as the client sent it (types and ranges already checked)."""

    files: list[UploadFile]
    prompt: str
    variant: str | None
    options: RequestOptions
    quality: str | None = None  # "max": the policy's best-quality point for this request

    def require_files(self) -> None:
        """The request's study is required (the variant reads images): FastAPI's own 422 for a missing field."""
        if not self.files:
            raise RequestValidationError([_MISSING_FILES])


class FormFields(BaseModel):
    """The form's fields besides the files: what is checked, and what the OpenAPI document says."""

    prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS, description="Clinical indication or question")] = ""
    variant: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=MAX_VARIANT_CHARS,
            description="The variant to write the report (default: the active one)",
        ),
    ] = None
    max_new_tokens: Annotated[
        int | None,
        Field(
            ge=1,
            description=f"At most the daemon's limits.max_new_tokens (itself at most {MAX_NEW_TOKENS}); "
            "lowered, with a warning, to what the model's context leaves",
        ),
    ] = None
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int | None, Field(ge=0, le=2**32 - 1)] = None
    quality: Annotated[
        Literal["max"] | None,
        Field(
            description='"max": the best-quality variant the policy has, for this request (where the policy '
            "allows overrides)"
        ),
    ] = None


def _upload_schema() -> dict[str, Any]:
    fields = FormFields.model_json_schema()
    files = {
        "type": "array",
        "items": {"type": "string", "contentMediaType": "application/octet-stream"},
        "title": "Files",
        "description": FILES_DESCRIPTION,
    }
    return {
        "type": "object",
        "title": "Upload",
        "properties": {FILES: files, **fields["properties"]},
    }


# The route's `openapi_extra`: the request body FastAPI would document for `File()`/`Form()` parameters.
UPLOAD_OPENAPI: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _upload_schema()}}}
}


async def report_form(request: Request) -> AsyncIterator[ReportForm]:
    """The dependency both routes take: the form parsed with the configured file limit, checked; its spooled
    files are closed when the request is done."""
    form = await _read(request, request.app.state.daemon.cfg.max_files)
    try:
        yield _checked(form)
    finally:
        await form.close()


async def _read(request: Request, max_files: int) -> FormData:
    try:
        return await request.form(max_files=max_files, max_fields=MAX_FIELDS)
    except HTTPException as exc:  # Starlette's refusal of the multipart body (its message names its limit)
        if str(exc.detail).startswith("Too many files"):
            raise TooManyFilesError(
                f"more than {max_files} files in one upload (limits.max_files): send a zip of the series"
            ) from None
        raise
    except EdgekitError:  # the upload limit, from the middleware
        raise
    except Exception as exc:  # what FastAPI answers for a body it cannot parse (a client gone, broken framing)
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from exc


def _checked(form: FormData) -> ReportForm:
    errors: list[dict[str, Any]] = []
    given = [f for f in form.getlist(FILES) if not _empty_file(f)]  # none: `require_files`, once the variant is known
    uploads = [f for f in given if isinstance(f, UploadFile)]  # all of them, or an error below
    for i, upload in enumerate(given):
        if not isinstance(upload, UploadFile):
            msg = f"Value error, Expected UploadFile, received: {type(upload)}"
            errors.append({"type": "value_error", "loc": ("body", FILES, i), "msg": msg, "input": None})
    values = {name: form[name] for name in FormFields.model_fields if form.get(name) not in (None, "")}
    try:
        fields = FormFields.model_validate(values)
    except ValidationError as err:
        errors += [{**e, "loc": ("body", *e["loc"])} for e in err.errors(include_url=False, include_input=False)]
    if errors:
        raise RequestValidationError(errors)
    return ReportForm(
        files=uploads,
        prompt=fields.prompt,
        variant=fields.variant,
        options=RequestOptions(
            max_new_tokens=fields.max_new_tokens, temperature=fields.temperature, top_p=fields.top_p, seed=fields.seed
        ),
        quality=fields.quality,
    )


_MISSING_FILES = {"type": "missing", "loc": ("body", FILES), "msg": "Field required", "input": None}


def _empty_file(value: object) -> bool:
    """What a browser sends for a file input left empty (FastAPI drops it too)."""
    return isinstance(value, UploadFile) and value.filename == "" and value.size == 0
