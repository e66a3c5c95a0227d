"""`edgekit bundle inspect|verify|pack|unpack|keygen|sign`: look inside, check, convert and sign bundles."""

from __future__ import annotations

import json
import os
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

PubkeyOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--pubkey",
        help="A trusted minisign public key (.pub); repeat for several. The bundle must be signed by one of them.",
        show_default=False,
    ),
]

app = typer.Typer(
    help="Inspect, verify, pack, unpack and sign bundles.",
    no_args_is_help=True,
    epilog=examples(
        "edgekit bundle verify out/radreport-tiny-cpu",
        "edgekit bundle pack out/radreport-tiny-cpu -o out/radreport-tiny-cpu.ekb",
    ),
)


@app.callback()
def _bundle() -> None:
    """Inspect, verify, pack, unpack and sign bundles."""


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
        "edgekit bundle keygen -o out/release && edgekit bundle sign out/radreport-tiny-x1 --key out/release.key "
        "&& edgekit bundle verify out/radreport-tiny-x1 --pubkey out/release.pub",
    )
)
def verify(path: BundleArgument, pubkey: PubkeyOption = None, as_json: JsonOption = False) -> None:
    """Check every component's size and sha256 against the manifest, and with --pubkey the bundle's signature;
    exit 2 naming the first bad file or the reason the signature is refused."""
    from edgekit.bundle.signing import read_public_keys, verify_signature

    signed = verify_signature(path, read_public_keys([str(p) for p in pubkey])) if pubkey else None
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
    if signed is not None:
        result["signature"] = signed.to_dict()
    if as_json:
        emit(result, True)
        return
    by = f"; signed by key {signed.key_id}" if signed is not None else ""
    typer.echo(
        f"ok: {path}: {bundle.name} ({bundle.target}), {result['components']} components, {total} bytes verified{by}"
    )


@app.command(epilog=examples("edgekit bundle keygen -o out/release", "edgekit bundle keygen -o out/ci --json"))
def keygen(
    out: Annotated[Path, typer.Option("--out", "-o", help="Writes OUT.key (mode 0600) and OUT.pub.")],
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Make a minisign key pair (Ed25519, unencrypted like `minisign -G -W`): keep OUT.key off the devices and
    give them OUT.pub ([trust] public_keys). Keys made by `minisign -G` work as well."""
    from edgekit.bundle.minisign import SecretKey

    key_path, pub_path = out.with_name(out.name + ".key"), out.with_name(out.name + ".pub")
    for p in (key_path, pub_path):
        claim_out(p, force)
    key = SecretKey.generate()
    key_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.to_text())
    pub_path.write_text(key.public().to_text())
    result = {"key": str(key_path), "pubkey": str(pub_path), "key_id": key.public().id_hex}
    emit(result, True) if as_json else typer.echo(f"{key_path} and {pub_path}: key {result['key_id']}")


@app.command(
    epilog=examples(
        "edgekit bundle keygen -o out/release && edgekit bundle sign out/radreport-tiny-cpu --key out/release.key",
        "edgekit bundle keygen -o out/r2 && edgekit bundle pack out/radreport-tiny-cpu -o out/s.ekb "
        "&& edgekit bundle sign out/s.ekb --key out/r2.key --json",
    )
)
def sign(
    path: BundleArgument,
    key: Annotated[Path, typer.Option("--key", help="A minisign secret key (edgekit bundle keygen, minisign -G).")],
    password_file: Annotated[
        Path | None,
        typer.Option(
            "--password-file",
            help="The key's password, for an encrypted key (else $EDGEKIT_KEY_PASSWORD).",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Verify a bundle, then sign its manifest (which lists every file's sha256) into manifest.json.minisig, beside
    it or inside the .ekb. Debian's `minisign -Vm manifest.json -p KEY.pub` checks it too."""
    from edgekit.bundle.minisign import SecretKey
    from edgekit.bundle.signing import sign_bundle

    password = password_file.read_text().rstrip("\n") if password_file else os.environ.get("EDGEKIT_KEY_PASSWORD")
    signed = sign_bundle(path, SecretKey.read(key, password))
    result = {"signed": str(path), **signed.to_dict()}
    emit(result, True) if as_json else typer.echo(f"signed: {path}: key {signed.key_id}")


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
