"""The copyright file's part for the Python distributions bundled in the venv, from their own metadata.

Run at package build time by the venv's python (so importlib.metadata sees the venv): one DEP-5 paragraph per
distribution, naming its files, its authors, its license as it declares it, and where its license texts are
installed. Written from the metadata, never by hand, so it cannot drift from what the package ships. Stdlib only.

    /path/to/venv/bin/python bundled_copyright.py --site usr/lib/edgekit/lib/python3.11/site-packages >> copyright
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
from pathlib import Path


def license_of(meta) -> str:
    """SPDX expression if given (Core Metadata 2.4), else License:, else the OSI classifiers, else unknown."""
    expr = meta.get("License-Expression")
    if expr:
        return expr.strip()
    text = (meta.get("License") or "").strip()
    if text and "\n" not in text and len(text) <= 60:
        return text
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return " or ".join(classifiers)
    return "unknown (see the license files named below)"


def authors_of(meta) -> str:
    for key in ("Author", "Author-email", "Maintainer", "Maintainer-email"):
        value = (meta.get(key) or "").strip()
        if value:
            return " ".join(value.split())
    return "the authors of " + meta["Name"]


def top_levels(dist: md.Distribution) -> list[str]:
    """The distribution's top-level paths in site-packages (packages, modules, its .libs and .dist-info)."""
    names = set()
    for f in dist.files or []:
        first = Path(f).parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            names.add(first)
    return sorted(names)


def license_files(dist: md.Distribution) -> list[str]:
    out = []
    for f in dist.files or []:
        name = Path(f).name.upper()
        if ".dist-info" in str(f) and any(w in name for w in ("LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS")):
            out.append(str(f))
    return sorted(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--site", required=True, help="site-packages as installed, relative to / (usr/lib/...)")
    p.add_argument("--skip", action="append", default=["edgekit"], help="distributions covered elsewhere")
    args = p.parse_args()
    site = args.site.strip("/")
    dists = {d.metadata["Name"].lower(): d for d in md.distributions()}
    for name in sorted(dists):
        if name in args.skip:
            continue
        dist = dists[name]
        meta = dist.metadata
        files = " ".join(
            f"{site}/{t}" + ("/*" if "." not in t or t.endswith((".dist-info", ".libs")) else "")
            for t in top_levels(dist)
        )
        texts = license_files(dist)
        print(f"Files: {files}")
        print(f"Copyright: {authors_of(meta)}")
        print(f"License: {license_of(meta)}")
        print(f" {meta['Name']} {meta['Version']}, bundled in the virtualenv.")
        if texts:
            print(" Its license text is installed with it:")
            for t in texts:
                print(f"   /{site}/{t}")
        else:
            print(" It installs no license file; its declared license is above.")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
