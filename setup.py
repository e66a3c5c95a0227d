"""The one part of the build pyproject.toml cannot declare on its own: the X1 emulator's optional C kernels.

`optional=True`: without a C compiler the install still succeeds and the emulator runs its numpy kernels,
which give bit-identical results, only slower (docs/x1/emulator.md). -ffp-contract=off keeps the compiler from
fusing multiply-adds, which would round differently from numpy; -fopenmp-simd only honours the `omp simd`
pragmas on loops whose sums are exact integers (no OpenMP runtime).
"""

import sys

from setuptools import Extension, setup

flags = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp-simd", "-std=c99"]
setup(
    ext_modules=[
        Extension("edgekit.targets.x1._native", ["targets/x1/_native.c"], extra_compile_args=flags, optional=True)
    ]
)
