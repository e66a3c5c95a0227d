"""What differs between the Pythons edgekit runs on: 3.11+ here, 3.10 on JetPack 6 (Ubuntu 22.04).

`tomllib` is in the standard library from 3.11; on 3.10 the same parser is the `tomli` package (a dependency
there only, see pyproject).
"""

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - JetPack 6's Python 3.10
    import tomli as tomllib

__all__ = ["tomllib"]
