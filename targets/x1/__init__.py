"""The `x1` target: INT4 graphs compiled to programs for the X1 edge NPU, run on its emulator.

Build side: `build.prepare`. Run side: `backend.X1Backend`. The SDK shape users were shown (`SparseConfig`,
`X1Engine`) is in `engine`; the analytic cost model, compiler, program format and emulator are described in
docs/x1/.
"""

from __future__ import annotations


class X1Target:
    name = "x1"
    takes_machine = True

    def check_recipe(self, recipe_passes: tuple[str, ...]) -> None:
        """Every recipe builds: the x1 build quantizes what the recipe left in float."""

    def prepare(self, inputs):
        from .build import prepare

        return prepare(inputs)

    def load_backend(self, bundle, options):
        from .backend import X1Backend

        return X1Backend(bundle, settings=dict(options.settings), keep_runs=options.profile_dir is not None)


TARGET = X1Target()
