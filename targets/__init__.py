"""Deployment targets, each a plug-in package with a build side and a run side (`edgekit.target.Target`),
registered by module path in `edgekit.plugins.TARGETS`. `cpu` runs the ONNX graphs in ONNX Runtime, `x1`
compiles them for the emulated NPU; `orin` (TensorRT on Jetson, not written yet) will plug in the same way.
"""
