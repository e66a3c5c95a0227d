"""What the package says about itself matches what it ships."""

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def test_the_license_file_is_the_license_pyproject_declares():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]
    text = (REPO / "LICENSE").read_text()
    assert declared == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a stub
