"""The `cpu` target: exported ONNX graphs run in ONNX Runtime's CPU execution provider.

Build side: the graphs ship as the export and recipe left them. Run side: `edgekit.ort.CpuBackend`.
"""

from edgekit.ort import CpuBackend, physical_cores, session_options


class CpuTarget:
    name = "cpu"
    takes_machine = False
    weight_encoding = None  # ONNX Runtime reads every encoding: recipes keep their own

    def check_recipe(self, recipe_passes: tuple[str, ...]) -> None:
        """ONNX Runtime runs every recipe's graphs."""

    def prepare(self, inputs):
        from edgekit.target import TargetBuild

        return TargetBuild(graphs=inputs.graphs)

    def load_backend(self, bundle, options):
        from edgekit import names
        from edgekit.target import runtime_settings

        runtime_settings({}, bundle.manifest.runtime, options.settings, bundle.source)
        return CpuBackend(
            None if bundle.is_text else bundle.component(names.VISION),
            bundle.component(names.EMBED),
            bundle.component(names.DECODER_ROLE),
            intra_op_threads=options.threads,
            profile_dir=options.profile_dir,
        )


TARGET = CpuTarget()

__all__ = ["TARGET", "CpuBackend", "physical_cores", "session_options"]
