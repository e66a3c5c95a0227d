"""`edgekit bundle inspect|verify|pack|unpack`: look inside, check, and convert bundles."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Annotated

import typer

from edgekit.bundle import MANIFEST_NAME, Manifest, load_bundle, pack_bundle, unpack_bundle
from edgekit.bundle.io import ARCHIVE_SUFFIX
from edgekit.bundle.manifest import read_manifest
from edgekit.cli.claims import claim_out
from edgekit.cli.options import BundleArgument, ForceOption, JsonOption, examples, out_option
from edgekit.cli.output import emit
from edgekit.errors import BundleError

app = typer.Typer(
    help="Inspect, verify, pack and unpack bundles.",
    no_args_is_help=True,
    epilog=examples(
        "edgekit bundle verify out/radreport-tiny-cpu",
        "edgekit bundle pack out/radreport-tiny-cpu -o out/radreport-tiny-cpu.ekb",
    ),
)


@app.callback()
def _bundle() -> None:
    """Inspect, verify, pack and unpack bundles."""


def _read_manifest_only(path: Path) -> Manifest:
    """The manifest without checking files, so a damaged bundle can still be looked at."""
    if path.is_dir():
        return read_manifest(path)
    if not path.exists():
        raise BundleError("no such bundle (directory or .ekb file)", path)
    try:
        with zipfile.ZipFile(path) as zf:
            data = zf.read(MANIFEST_NAME)
    except zipfile.BadZipFile:
        raise BundleError("not a bundle: neither a directory nor an .ekb (zip) archive", path) from None
    except KeyError:
        raise BundleError(f"archive holds no {MANIFEST_NAME}", path) from None
    try:
        return Manifest.from_dict(json.loads(data), path)
    except json.JSONDecodeError as err:
        raise BundleError(f"manifest is not valid JSON (line {err.lineno}: {err.msg})", path) from None


@app.command(
    epilog=examples(
        "edgekit bundle inspect out/radreport-tiny-cpu",
        "edgekit bundle inspect out/radreport-tiny-x1 --json | jq .figures",
    )
)
def inspect(path: BundleArgument, as_json: JsonOption = False) -> None:
    """Show a bundle's manifest: components, provenance and measured figures (files are not checked)."""
    manifest = _read_manifest_only(path)
    if as_json:
        emit(manifest.to_dict(), True)
        return
    data = manifest.to_dict()
    emit({k: data[k] for k in ("name", "target", "schema_version", "created")}, False)
    emit(
        [
            {"role": role, "path": c["path"], "bytes": c["bytes"], "sha256": c["sha256"][:16]}
            for role, c in data["components"].items()
        ],
        False,
        title="components",
    )
    if data["provenance"]:
        emit(data["provenance"], False, title="provenance")
    if data["figures"]:
        emit(data["figures"], False, title="figures")


@app.command(
    epilog=examples(
        "edgekit bundle verify out/radreport-tiny-cpu",
        "edgekit bundle pack out/radreport-tiny-cpu -o out/b.ekb && edgekit bundle verify out/b.ekb --json",
    )
)
def verify(path: BundleArgument, as_json: JsonOption = False) -> None:
    """Check every component's size and sha256 against the manifest; exit 2 naming the first bad file."""
    bundle = load_bundle(path)
    total = sum(c.bytes for c in bundle.manifest.components.values())
    result = {
        "ok": True,
        "path": str(path),
        "name": bundle.name,
        "target": bundle.target,
        "components": len(bundle.manifest.components),
        "bytes": total,
    }
    if as_json:
        emit(result, True)
    else:
        typer.echo(
            f"ok: {path}: {bundle.name} ({bundle.target}), {result['components']} components, {total} bytes verified"
        )


@app.command(
    epilog=examples(
        "edgekit bundle pack out/radreport-tiny-cpu                # writes out/radreport-tiny-cpu.ekb",
        "edgekit bundle pack out/radreport-tiny-x1 -o out/x1.ekb --json",
    )
)
def pack(
    path: Annotated[Path, typer.Argument(help="A bundle directory.", show_default=False)],
    out: Annotated[Path | None, out_option("The .ekb file to write (default: PATH.ekb).")] = None,
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Verify a bundle directory and write it as one .ekb file."""
    if out is None:  # the default is checked here; a given --out was checked as it was parsed
        claim_out(path.with_name(path.name + ARCHIVE_SUFFIX), force)
    elif out.suffix != ARCHIVE_SUFFIX:
        claim_out(out.with_name(out.name + ARCHIVE_SUFFIX), force)  # pack_bundle adds the suffix
    written = pack_bundle(path, out)
    emit({"written": str(written)}, as_json) if as_json else typer.echo(str(written))


@app.command(
    epilog=examples(
        "edgekit bundle pack out/radreport-tiny-cpu -o out/b.ekb && edgekit bundle unpack out/b.ekb -o out/b",
        "edgekit bundle pack out/radreport-tiny-x1 && edgekit bundle unpack out/radreport-tiny-x1.ekb "
        "-o out/radreport-tiny-x1 --force --json",
    )
)
def unpack(
    path: Annotated[Path, typer.Argument(help="An .ekb file.", show_default=False)],
    out: Annotated[Path | None, out_option("The bundle directory to write (default: PATH without .ekb).")] = None,
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Verify an .ekb file and extract it to a bundle directory."""
    if out is None:  # the default is checked here; a given --out was checked as it was parsed
        claim_out(path.with_suffix(""), force)
    written = unpack_bundle(path, out)
    emit({"written": str(written)}, as_json) if as_json else typer.echo(str(written))
