"""The `x1` target: graphs compiled to programs for the X1 edge NPU (INT4 by default, or the precision a recipe
chose), run on its emulator.

Build side: `build.prepare`. Run side: `backend.X1Backend`. The SDK shape users were shown (`SparseConfig`,
`X1Engine`) is in `engine`; the analytic cost model, compiler, program format and emulator are described in
docs/x1/.
"""

from __future__ import annotations


class X1Target:
    name = "x1"
    takes_machine = True
    weight_encoding = "x1"  # blocked DequantizeLinear, which the compiler reads as XL_GEMM.W4A8 / W8A8
    engines = ("emulator",)  # the X1 emulator: integer numerics, cycles and energy per instruction

    def check_recipe(self, recipe_passes: tuple[str, ...]) -> None:
        """Every recipe builds: its passes write the x1 encoding (`weight_encoding`), which the generic build checks
        pass by pass up front; float weights a recipe leaves compile to XL_GEMM.F16."""

    def prepare(self, inputs):
        from .build import prepare

        return prepare(inputs)

    def load_backend(self, bundle, options):
        from .backend import X1Backend

        return X1Backend(bundle, settings=dict(options.settings), keep_runs=options.profile_dir is not None)


TARGET = X1Target()
