"""Generation options a request may set, and the one place they are merged with a variant's defaults.

A request's options are stored with its job and hashed into its idempotency fingerprint, so `as_dict()` keeps the
shape those already have: `max_new_tokens` only when the client set it. Whatever the client left out comes from the
variant that writes the report (its bundle's generation config), which is known only when the report starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edgekit.errors import EdgekitError

if TYPE_CHECKING:
    from edgekit.generate import GenerationOptions


@dataclass(frozen=True)
class RequestOptions:
    """What the client asked for; `None` means "the variant's default"."""

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def check(self, max_new_tokens_limit: int) -> None:
        """The daemon's own bound (the form checks types and ranges; this one is configurable)."""
        if self.max_new_tokens is not None and self.max_new_tokens > max_new_tokens_limit:
            raise EdgekitError(
                f"max_new_tokens must be <= {max_new_tokens_limit}, got {self.max_new_tokens}", code="validation_error"
            )

    def as_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        return out

    @classmethod
    def from_dict(cls, stored: Mapping[str, Any]) -> RequestOptions:
        """Back from a stored job (the shape `as_dict` wrote)."""
        return cls(
            max_new_tokens=stored.get("max_new_tokens"),
            temperature=stored.get("temperature", 0.0),
            top_p=stored.get("top_p", 1.0),
            seed=stored.get("seed"),
        )


def generation_options(requested: RequestOptions, generation_config: Mapping[str, Any]) -> GenerationOptions:
    """The variant's defaults under the request's choices, through the core's one merge."""
    from edgekit.generate import request_options

    return request_options(
        generation_config,
        max_new_tokens=requested.max_new_tokens,
        temperature=requested.temperature,
        top_p=requested.top_p,
        seed=requested.seed,
    )
