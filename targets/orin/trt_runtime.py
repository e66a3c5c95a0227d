"""The orin run side: the cached TensorRT engines behind the engine's row protocol (`edgekit.engine.SlotBackend`),
so `edgekit run`, `eval`, `profile` and edgekitd take an orin bundle unchanged.

TensorRT 10 execution: one execution context per engine profile (the decoder has `prefill` and `decode`),
`set_input_shape` + `set_tensor_address` + `execute_async_v3` on one CUDA stream, through cuda-python. The KV
cache stays in device memory, one home per row and two batch buffers the decode steps read and write in turn
(`device_kv.DeviceKV`); which rows go into a step, and when their caches move, is `rows.RowBatcher`'s, the same
code the ONNX Runtime reference (`onnx_backend.OrinOnnxBackend`) runs, so the two batch alike. `max_rows` is the
decode profile's batch maximum: the engine never asks for more. Image features, embeddings and logits come back
to the host, as the decoding loop needs them there. Nothing is billed per row: on a Jetson the board's own meter
measures (`release` returns {}).

Before any GPU work: the engines must be this device's (`engine_cache.EngineCache.require`) and every request
must fit a profile (`profiles.select_profile`), each refused in one line. Without TensorRT the constructor fails
with `trt_import.TRT_MISSING`. Written against the TensorRT 10.3 API and not yet run on a device (docs/orin.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgekit import names
from edgekit.bundle import Bundle
from edgekit.errors import EdgekitError

from .device import current_facts, state_dir
from .device_kv import DeviceBuffer, DeviceKV, KVLayout, check_cuda
from .engine_build import require_orin
from .engine_cache import EngineCache, bundle_id
from .plan import plan_for
from .profiles import select_profile
from .rows import RowBatcher
from .trt_import import import_cudart, import_tensorrt

if TYPE_CHECKING:
    import tensorrt as trt


class _Engine:
    """One engine: its execution contexts (one per profile) and its I/O description."""

    def __init__(self, runtime: trt.Runtime, path: Path, profiles: list[dict], stream: int) -> None:
        import tensorrt as trt

        engine: trt.ICudaEngine | None = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:  # the stubs say ICudaEngine; TensorRT returns None when it cannot deserialize
            raise EdgekitError("TensorRT could not load this engine: rebuild with `edgekit engine build`", path)
        self.engine = engine
        self.profiles = profiles
        self.contexts: list[trt.IExecutionContext] = []
        for i in range(len(profiles)):
            ctx = self.engine.create_execution_context()
            if not ctx.set_optimization_profile_async(i, stream):
                raise EdgekitError(f"TensorRT refused optimization profile {i} of this engine", path)
            self.contexts.append(ctx)
        self.tensors = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in self.tensors if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in self.tensors if n not in self.inputs]
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in self.tensors}


def _layer_profiler(role: str, sink: list[dict]) -> trt.IProfiler:
    """A TensorRT IProfiler that records each layer's time of each execution, for `edgekit profile`."""
    import tensorrt as trt

    class LayerProfiler(trt.IProfiler):
        def __init__(self) -> None:
            trt.IProfiler.__init__(self)

        def report_layer_time(self, layer_name: str, ms: float) -> None:
            sink.append({"graph": role, "layer": layer_name, "ms": float(ms)})

    return LayerProfiler()


def _accepted(ok: bool, what: str, role: str, where: str | Path | None) -> None:
    """TensorRT's setters answer False (and log) instead of raising: a refused shape or address fails here."""
    if not ok:
        raise EdgekitError(f"TensorRT refused {what} for the {role} engine", where, code="engine_failed")


class TrtBackend:
    def __init__(
        self,
        bundle: Bundle,
        *,
        overrides: dict | None = None,
        state: str | None = None,
        profile_dir: Path | None = None,
    ) -> None:
        require_orin(bundle)
        import_tensorrt()  # one line where TensorRT is missing or older than 10.3
        import tensorrt as trt

        self.cudart = cudart = import_cudart()
        plan = plan_for(bundle, overrides)
        self.source = bundle.source
        self.profiles = plan["profiles"]
        facts = current_facts()
        cache = EngineCache(state_dir(state), bundle_id(bundle, plan), facts)
        cache.require()  # this device's engines, intact: else one line, before any GPU work
        self.stream = check_cuda(cudart.cudaStreamCreate())
        self.stream_handle = int(self.stream)  # TensorRT takes the cudaStream_t as an integer
        logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(logger)
        if plan.get("dla_core") is not None:
            self.runtime.DLA_core = int(plan["dla_core"])
        self.engines = {
            role: _Engine(self.runtime, cache.engine(role), self.profiles[role], self.stream_handle)
            for role in bundle.graph_roles
        }
        self.buffers: dict[tuple[str, str], DeviceBuffer] = {}
        self.profile_dir = Path(profile_dir) if profile_dir is not None else None
        self.layer_times: list[dict] = []
        self.calls: list[dict] = []
        if self.profile_dir is not None:
            for role, eng in self.engines.items():
                for ctx in eng.contexts:
                    ctx.profiler = _layer_profiler(role, self.layer_times)
        dec = self.engines[names.DECODER_ROLE]
        num_layers = sum(1 for n in dec.inputs if n.startswith(names.PAST_PREFIX) and n.endswith(".key"))
        layout = KVLayout.of(self.profiles[names.DECODER_ROLE], num_layers)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, layout.kv_heads, layout.head_dim
        self.kv = DeviceKV(cudart, self.stream, layout, self._decode)
        self.rows = RowBatcher(self.kv, self.profiles[names.DECODER_ROLE], kv_heads=layout.kv_heads,
                               head_dim=layout.head_dim, where=self.source)  # fmt: skip
        self.max_rows = self.rows.max_rows
        self.kv_bytes_per_token = 2 * num_layers * layout.kv_heads * layout.head_dim * 4  # FP32 K and V
        decoder = bundle.component(names.DECODER_ROLE)
        data = decoder.with_name(decoder.name + ".data")  # what a step streams: the decoder's weights, once
        self.weight_bytes = decoder.stat().st_size + (data.stat().st_size if data.is_file() else 0)

    # plumbing --------------------------------------------------------------------------------------------------
    def _buffer(self, role: str, name: str, nbytes: int) -> DeviceBuffer:
        key = (role, name)
        buf = self.buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.free()
            buf = self.buffers[key] = DeviceBuffer(self.cudart, nbytes)
        return buf

    def _h2d(self, ptr: int, array: np.ndarray) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        check_cuda(self.cudart.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes, kind, self.stream))

    def _d2h(self, array: np.ndarray, ptr: int) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        check_cuda(self.cudart.cudaMemcpyAsync(array.ctypes.data, ptr, array.nbytes, kind, self.stream))

    def run(
        self, role: str, feeds: dict[str, np.ndarray], *, kv_in: dict[str, int] | None = None,
        kv_out: dict[str, int] | None = None,
    ):  # fmt: skip
        """Execute one engine. Host feeds are copied in, except the KV inputs `kv_in` binds to device pointers
        ({name: pointer}: their feeds give the shape only); KV outputs in `kv_out` are written to its pointers, the
        other outputs come back to the host. Returns {output name: array, or its shape for a KV output}."""
        eng = self.engines[role]
        started = time.perf_counter()
        shapes = {n: tuple(a.shape) for n, a in feeds.items()}
        prof = select_profile(self.profiles[role], shapes, role, self.source)  # before any GPU work
        ctx = eng.contexts[prof]
        host = {}
        for name in eng.inputs:
            if kv_in is not None and name in kv_in:
                _accepted(ctx.set_input_shape(name, shapes[name]), f"the shape of {name}", role, self.source)
                _accepted(ctx.set_tensor_address(name, kv_in[name]), f"the address of {name}", role, self.source)
                continue
            array = np.ascontiguousarray(feeds[name], dtype=eng.dtypes[name])
            _accepted(ctx.set_input_shape(name, array.shape), f"the shape of {name}", role, self.source)
            buf = self._buffer(role, name, array.nbytes)
            self._h2d(buf.ptr, array)
            _accepted(ctx.set_tensor_address(name, buf.ptr), f"the address of {name}", role, self.source)
            host[name] = array  # keep alive until the stream is synchronised
        fetched: dict[str, tuple[np.ndarray, DeviceBuffer]] = {}
        kv_shapes: dict[str, tuple[int, ...]] = {}
        for name in eng.outputs:
            dims = ctx.get_tensor_shape(name)  # a Dims: indexable, not iterable
            shape = tuple(dims[i] for i in range(len(dims)))
            if kv_out is not None and name in kv_out:
                _accepted(ctx.set_tensor_address(name, kv_out[name]), f"the address of {name}", role, self.source)
                kv_shapes[name] = shape
                continue
            out = np.empty(shape, eng.dtypes[name])
            buf = self._buffer(role, name, out.nbytes)
            _accepted(ctx.set_tensor_address(name, buf.ptr), f"the address of {name}", role, self.source)
            fetched[name] = (out, buf)
        if not ctx.execute_async_v3(self.stream_handle):
            raise EdgekitError(f"TensorRT failed to execute the {role} engine", self.source, code="engine_failed")
        for out, buf in fetched.values():
            self._d2h(out, buf.ptr)
        check_cuda(self.cudart.cudaStreamSynchronize(self.stream))
        if self.profile_dir is not None:
            ms = (time.perf_counter() - started) * 1e3
            self.calls.append({"graph": role, "profile": eng.profiles[prof]["name"], "start": started, "ms": ms})
        return {**{n: out for n, (out, _buf) in fetched.items()}, **kv_shapes}

    def _decode(self, x, mask, positions, past_len: int, past: dict[str, int], present: dict[str, int]):
        """The decoder engine on device KV bindings (`device_kv.DeviceKV` calls it): logits (n, seq, vocab)."""
        x = np.asarray(x, np.float32)
        feeds = {names.INPUTS_EMBEDS: x, names.ATTENTION_MASK: mask, names.POSITION_IDS: positions}
        kv_shape = np.broadcast_to(np.float32(0), (x.shape[0], self.kv_heads, past_len, self.head_dim))  # shape only
        for layer in range(self.num_layers):
            feeds[names.past_key(layer)] = kv_shape
            feeds[names.past_value(layer)] = kv_shape
        return self.run(names.DECODER_ROLE, feeds, kv_in=past, kv_out=present)[names.LOGITS]

    # the engine's rows (edgekit.engine.SlotBackend) --------------------------------------------------------------
    def encode_images(self, pixel_values: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
        out = self.run(names.VISION, {names.PIXEL_VALUES: np.asarray(pixel_values, np.float32)})
        features = out[names.IMAGE_FEATURES].astype(np.float32)
        if rows is not None:
            self.rows.images(rows, features.shape[1])
        return features

    def embed(self, input_ids: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
        return self.run(names.EMBED, {names.INPUT_IDS: np.asarray(input_ids, np.int64)})[names.INPUTS_EMBEDS]

    def prefill(self, row: int, inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        return self.rows.prefill(row, inputs_embeds, position_ids)

    def step(self, rows: Sequence[int], inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        return self.rows.step(rows, inputs_embeds, position_ids)

    def release(self, row: int) -> dict:
        """Forget `row`; {}: nothing is metered here beyond wall time (Jetson power rails are the reporter's)."""
        return self.rows.release(row)

    def write_profile(self, report, out: Path) -> dict:
        """The last report's engine calls as a chrome trace, TensorRT's per-layer times as a table and a plot."""
        from edgekit.errors import ConfigError
        from edgekit.ort.trace import plot_ops

        if self.profile_dir is None:
            raise ConfigError("this backend was not loaded for profiling (profile_dir not given)")
        t0 = self.calls[0]["start"] if self.calls else 0.0
        events = [
            {"name": f"{c['graph']}:{c['profile']}", "ph": "X", "pid": 0, "tid": 0, "ts": (c["start"] - t0) * 1e6,
             "dur": c["ms"] * 1e3}
            for c in self.calls
        ]  # fmt: skip
        (out / "trace.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        totals: dict[tuple[str, str], list[float]] = {}
        for t in self.layer_times:
            acc = totals.setdefault((t["graph"], t["layer"]), [0.0, 0])
            acc[0] += t["ms"]
            acc[1] += 1
        all_ms = sum(v[0] for v in totals.values()) or 1.0
        rows: list[dict[str, Any]] = [
            {"graph": g, "op": layer, "ms": round(ms, 3), "calls": n, "share": round(ms / all_ms, 4)}
            for (g, layer), (ms, n) in totals.items()
        ]
        rows.sort(key=lambda r: -r["ms"])
        plot_ops(rows, out / "ops.png", f"{report.model} on orin (TensorRT): one report")
        self.calls, self.layer_times[:] = [], []
        return {
            "summary": {k: round(v, 2) if isinstance(v, float) else v for k, v in report.timings.items()},
            "summary_title": "stages",
            "tables": {"TensorRT time by layer": rows[:12]},
            "details": {"layers": rows[:15]},
            "files": {"trace": str(out / "trace.json"), "plot": str(out / "ops.png")},
            "trace": str(out / "trace.json"),
            "plot": str(out / "ops.png"),
            "source": "TensorRT IProfiler (per-layer times) and wall clock around each synchronised engine call",
        }

    def close(self) -> None:
        for buf in self.buffers.values():
            buf.free()
        self.buffers.clear()
        self.kv.free()
