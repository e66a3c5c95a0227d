"""The `x1` target: graphs compiled to programs for the X1 edge NPU (INT4 by default, or the precision a recipe
chose), run on its emulator.

Build side: `build.prepare`. Run side: `backend.X1Backend`. The SDK shape users were shown (`SparseConfig`,
`X1Engine`) is in `engine`; the analytic cost model, compiler, program format and emulator are described in
docs/x1/.
"""

from __future__ import annotations

from edgekit.target import ParetoKnob


class X1Target:
    name = "x1"
    takes_machine = True
    weight_formats = ("qdq-blocked",)  # blocked DequantizeLinear, which the compiler reads as XL_GEMM.W4A8 / W8A8
    # the DSS target (`sparsity_target`), and DSS off in the default grid (the bundle's own: 0.38 unless built
    # otherwise)
    pareto_knobs = {
        "sparsity_target": ParetoKnob(setting="sparsity_target", grid=(0.0,)),
        "max_batch": ParetoKnob(grid=(8,)),  # eight rows a machine step: the weights stream once for all
    }
    engines = ("emulator",)  # the X1 emulator: integer numerics, cycles and energy per instruction

    def check_recipe(self, recipe_passes: tuple[str, ...]) -> None:
        """Every recipe builds: its passes write the format x1 takes (`weight_formats`), which the generic build checks
        pass by pass up front; float weights a recipe leaves compile to XL_GEMM.F16."""

    def prepare(self, inputs):
        from .build import prepare

        return prepare(inputs)

    def load_backend(self, bundle, options):
        from .backend import X1Backend

        return X1Backend(bundle, settings=dict(options.settings), keep_runs=options.profile_dir is not None)


TARGET = X1Target()
