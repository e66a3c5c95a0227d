"""The shared flags: as in Polygraphy's argument groups, a flag is defined once, here, and every subcommand that
takes it imports it, so `-s` or `--force` mean the same thing everywhere.

- `BundleArgument`, `ModelArgument`: the positional input (a bundle; a model directory, default the embedded one).
- `StudyOption` (`--study/-s`; `OptionalStudyOption` where a text model's bundle may take none), `PromptOption`
  (`--prompt/-p`), `ThreadsOption` (`--threads`), `EngineOption` (`--engine default|onnxruntime`, for the
  commands that run a bundle: `engine_name` turns it into `RuntimeOptions.engine`, `runs_on` names what ran),
  `MachineOption` (`--machine`), `StateDirOption` (`--state-dir`), `JsonOption` (`--json`), `ImageSizeOption`
  (`--image-size`: pins a Hugging Face Qwen2-VL's dynamic resolution; `build` and `convert` hand it to the
  library's `image_size`).
- `out_option(what)` (`--out/-o`) with `ForceOption` (`--force`): the output is claimed (`claims.claim_out`)
  before the command body runs. Every command that writes an output takes both flags.
- The sampling flags (`--max-new-tokens`, `--temperature`, `--top-p`, `--seed`), handed to `Reporter.options(...)`
  (the one merge with a bundle's generation config). Their bounds are the library's
  (`edgekit.generate.MAX_NEW_TOKENS`, `MAX_TEMPERATURE`), read when a flag is given, so `--help` does not import
  numpy.
- `examples(...)`: the Examples epilog every subcommand's `--help` ends with (tests/test_cli_help_examples.py runs
  each line).

Subcommand modules (`edgekit/cli/<name>_cmd.py`) take their flags from here, print through `output`, raise
`EdgekitError` for bad input (`errors` prints it as one line) and never import `edgekit.cli.app`. This module
imports nothing heavy, so `--help` stays fast.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from edgekit.cli.claims import claim_out

BundleArgument = Annotated[Path, typer.Argument(help="Bundle directory or .ekb file.", show_default=False)]
ModelArgument = Annotated[
    Path | None,
    typer.Argument(
        help="Model directory (model.safetensors, config.json, tokenizer.json, ...). Default: the embedded "
        "radreport-tiny.",
        show_default=False,
    ),
]
STUDY_HELP = "The study: a DICOM file, a folder holding one series, a .zip of one series, or a video file."
StudyOption = Annotated[Path, typer.Option("--study", "-s", help=STUDY_HELP, show_default=False)]
# `edgekit run`: a text model's bundle (a decoder alone) reads the prompt only, so there the study is optional
OptionalStudyOption = Annotated[
    Path | None,
    typer.Option(
        "--study", "-s", help=STUDY_HELP + " Required, unless the bundle is a text model's.", show_default=False
    ),
]
PromptOption = Annotated[str, typer.Option("--prompt", "-p", help="Clinical indication / request text.")]
ThreadsOption = Annotated[
    int | None, typer.Option("--threads", min=1, help="Intra-op threads (default: physical cores).")
]


class Engine(str, Enum):
    """`--engine`: the bundle's target's own engine, or its ONNX graphs in ONNX Runtime (the library checks that
    the target has it: `edgekit.plugins.resolve_engine`)."""

    default = "default"
    onnxruntime = "onnxruntime"


EngineOption = Annotated[
    Engine,
    typer.Option(
        "--engine",
        help="What runs the bundle: default, its target's own engine (cpu: ONNX Runtime; x1: the emulator; orin: "
        "TensorRT, on the Jetson), or onnxruntime, its ONNX graphs in ONNX Runtime on this machine's CPU: an orin "
        "bundle off the Jetson, with latency and energy estimated by the Orin cost model (labelled estimated, "
        "not measured).",
    ),
]


def engine_name(engine: Engine | str) -> str | None:
    """`RuntimeOptions.engine` for `--engine`: None for the target's own."""
    value = engine.value if isinstance(engine, Engine) else str(engine)
    return None if value == Engine.default.value else value


def runs_on(bundle, engine: str | None) -> tuple[str | None, str]:
    """The engine that runs `bundle` (`engine`, checked: one its target has; None: the target's own) and the words
    a title names it with: `orin` on the target's own engine, `orin via onnxruntime (not tensorrt)` on another."""
    from edgekit.plugins import resolve_engine

    used, own = resolve_engine(bundle, engine), resolve_engine(bundle)
    return used, bundle.target if used == own else f"{bundle.target} via {used} (not {own})"


MachineOption = Annotated[
    Path | None, typer.Option("--machine", help="X1 machine description TOML (default: the bundled x1-default.toml).")
]
StateDirOption = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        help="Where engines are cached (default: $EDGEKIT_STATE_DIR, else $XDG_STATE_HOME/edgekit or "
        "~/.local/state/edgekit; edgekitd uses its own, /var/lib/edgekit).",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout (errors too).")]
ImageSizeOption = Annotated[
    int | None,
    typer.Option(
        "--image-size",
        min=1,
        metavar="S",
        help="Hugging Face Qwen2-VL / Qwen2.5-VL: build at one S x S resolution (S a multiple of patch_size * "
        "merge_size, 28 for the released models), pinning the processor's dynamic resolution (min_pixels = "
        "max_pixels = S*S in the output's preprocessor_config.json; the model directory is not modified). "
        "Refused for other models, whose side their own config sets.",
        show_default=False,
    ),
]
# Eager, so its value is known when `--out` is checked, whatever the order on the command line.
ForceOption = Annotated[
    bool, typer.Option("--force", is_eager=True, help="Replace the output (--out) if it already exists.")
]


# The sampling flags: they only override the bundle's generation config when given. The bounds are the library's,
# imported when a flag is checked (edgekit.generate pulls in numpy; --help must stay fast).
def _max_new_tokens(value: int | None) -> int | None:
    from edgekit.generate import MAX_NEW_TOKENS

    if value is not None and not 1 <= value <= MAX_NEW_TOKENS:
        raise typer.BadParameter(f"{value} is not in [1, {MAX_NEW_TOKENS}]")
    return value


def _temperature(value: float) -> float:
    from edgekit.generate import MAX_TEMPERATURE

    if not 0 <= value <= MAX_TEMPERATURE:  # NaN fails too
        raise typer.BadParameter(f"{value:g} is not in [0, {MAX_TEMPERATURE:g}]")
    return value


MaxNewTokensOption = Annotated[
    int | None,
    typer.Option(
        "--max-new-tokens",
        callback=_max_new_tokens,
        help="Most tokens to generate, at least 1 (default: the bundle's generation config; capped at what the "
        "model's context leaves).",
    ),
]
TemperatureOption = Annotated[
    float, typer.Option("--temperature", callback=_temperature, help="Sampling temperature, from 0 (greedy).")
]


def _top_p(value: float) -> float:
    if not 0 < value <= 1:
        raise typer.BadParameter(f"{value:g} is not in (0, 1]")
    return value


TopPOption = Annotated[
    float,
    typer.Option(
        "--top-p", callback=_top_p, help="Nucleus sampling: keep the most likely tokens up to this mass, in (0, 1]."
    ),
]
SeedOption = Annotated[int | None, typer.Option("--seed", help="Seed for sampling (same seed, same report).")]


def _check_out(ctx: typer.Context, value: Path | None) -> Path | None:
    if not ctx.resilient_parsing:  # not while completing or showing help
        claim_out(value, bool(ctx.params.get("force", False)))
    return value


def out_option(what: str) -> Any:
    """`--out/-o`: `what` says what is written there. An existing output is refused unless `--force` (ForceOption,
    which the command must also take) is given; the check runs before the command body, so nothing is half done."""
    return typer.Option("--out", "-o", help=f"{what} Refused if it exists, unless --force.", callback=_check_out)


def examples(*commands: str, note: str = "") -> str:
    """The Examples epilog: one runnable command per line (a trailing `# comment` is allowed), then a note.

    Every line must run as written on the embedded model, the bundled samples and the outputs of other examples
    (`out/radreport-tiny-cpu`, `out/radreport-tiny-x1`, `data/test`); tests/test_cli_help_examples.py runs them."""
    text = "Examples:\n\n" + "\n\n".join(f"  {escape(c)}" for c in commands)
    return text + (f"\n\n{escape(note)}" if note else "")
