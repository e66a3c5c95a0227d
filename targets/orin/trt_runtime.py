"""The orin run side: the cached TensorRT engines behind the generation backend protocol, so `edgekit run`,
`eval`, `profile` and edgekitd take an orin bundle unchanged.

TensorRT 10 execution: one execution context per engine profile (the decoder has `prefill` and `decode`),
`set_input_shape` + `set_tensor_address` + `execute_async_v3` on one CUDA stream, through cuda-python. The KV
cache stays in device memory: two sets of buffers sized for the profile's maximum, the decoder reading one and
writing the other (`DeviceKV` is the handle `generate()` threads from call to call; it is valid until the next
decode). Image features, embeddings and logits come back to the host, as the decoding loop needs them there.

Before any GPU work: the engines must be this device's (`engine_cache.EngineCache.require`) and every request
must fit a profile (`profiles.select_profile`), each refused in one line. Without TensorRT the constructor fails
with `trt_import.TRT_MISSING`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit import names
from edgekit.errors import EdgekitError

from .device import current_facts, state_dir
from .engine_build import require_orin
from .engine_cache import EngineCache, bundle_id
from .plan import with_overrides
from .profiles import select_profile
from .trt_import import import_cudart, import_tensorrt


def _check(cuda_result):
    """cuda-python returns (error, *values); raise on an error, return the values."""
    err, *values = cuda_result if isinstance(cuda_result, tuple) else (cuda_result,)
    if int(err) != 0:
        raise EdgekitError(f"CUDA call failed: {err}", code="cuda_error")
    return values[0] if len(values) == 1 else values


class _DeviceBuffer:
    def __init__(self, cudart, nbytes: int):
        self.cudart, self.nbytes = cudart, max(int(nbytes), 1)
        self.ptr = _check(cudart.cudaMalloc(self.nbytes))

    def free(self) -> None:
        if self.ptr:
            self.cudart.cudaFree(self.ptr)
            self.ptr = 0


@dataclass
class DeviceKV:
    """The KV cache on the device: which buffer set holds it, its length, and the decode call that made it."""

    slot: int
    length: int
    batch: int
    epoch: int


class _Engine:
    """One engine: its execution contexts (one per profile) and its I/O description."""

    def __init__(self, trt, runtime, path, profiles: list[dict], stream):
        self.trt = trt
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise EdgekitError("TensorRT could not load this engine: rebuild with `edgekit engine build`", path)
        self.profiles = profiles
        self.contexts = []
        for i in range(len(profiles)):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(i, stream)
            self.contexts.append(ctx)
        self.tensors = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in self.tensors if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in self.tensors if n not in self.inputs]
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in self.tensors}


def _layer_profiler(trt, role: str, sink: list):
    """A TensorRT IProfiler that records each layer's time of each execution, for `edgekit profile`."""

    class LayerProfiler(trt.IProfiler):
        def __init__(self):
            trt.IProfiler.__init__(self)

        def report_layer_time(self, layer_name, ms):
            sink.append({"graph": role, "layer": layer_name, "ms": float(ms)})

    return LayerProfiler()


class TrtBackend:
    def __init__(
        self, bundle, *, overrides: dict | None = None, state: str | None = None, profile_dir: Path | None = None
    ):
        require_orin(bundle)
        trt = import_tensorrt()
        self.cudart = cudart = import_cudart()
        plan = with_overrides(bundle.manifest.runtime, overrides or {}, bundle.source)
        self.source = bundle.source
        self.profiles = plan["profiles"]
        facts = current_facts()
        cache = EngineCache(state_dir(state), bundle_id(bundle, plan), facts)
        cache.require()  # this device's engines, intact: else one line, before any GPU work
        self.stream = _check(cudart.cudaStreamCreate())
        self.stream_handle = int(self.stream)  # TensorRT takes the cudaStream_t as an integer
        logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(logger)
        if plan.get("dla_core") is not None:
            self.runtime.DLA_core = int(plan["dla_core"])
        self.engines = {
            role: _Engine(trt, self.runtime, cache.engine(role), self.profiles[role], self.stream_handle)
            for role in bundle.graph_roles
        }
        self.buffers: dict[tuple[str, str], _DeviceBuffer] = {}
        self.profile_dir = Path(profile_dir) if profile_dir is not None else None
        self.layer_times: list[dict] = []
        self.calls: list[dict] = []
        if self.profile_dir is not None:
            for role, eng in self.engines.items():
                for ctx in eng.contexts:
                    ctx.profiler = _layer_profiler(trt, role, self.layer_times)
        dec = self.engines[names.DECODER_ROLE]
        self.num_layers = sum(1 for n in dec.inputs if n.startswith(names.PAST_PREFIX) and n.endswith(".key"))
        decode_max = self.profiles[names.DECODER_ROLE][-1]["shapes"]
        _, self.kv_heads, _, self.head_dim = decode_max[names.past_key(0)]["max"]
        kv_max = {n: s["max"] for n, s in decode_max.items() if n.startswith(names.PAST_PREFIX)}
        kv_max = {n: [b, h, t + 1, d] for n, (b, h, t, d) in kv_max.items()}  # present = past + 1 token
        kv_bytes = max(int(np.prod(s)) for s in kv_max.values()) * 4
        self.kv = [[_DeviceBuffer(cudart, kv_bytes) for _ in range(2 * self.num_layers)] for _slot in range(2)]
        self.epoch = 0

    # plumbing --------------------------------------------------------------------------------------------------
    def _buffer(self, role: str, name: str, nbytes: int) -> _DeviceBuffer:
        key = (role, name)
        buf = self.buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.free()
            buf = self.buffers[key] = _DeviceBuffer(self.cudart, nbytes)
        return buf

    def _h2d(self, ptr: int, array: np.ndarray) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        _check(self.cudart.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes, kind, self.stream))

    def _d2h(self, array: np.ndarray, ptr: int) -> None:
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _check(self.cudart.cudaMemcpyAsync(array.ctypes.data, ptr, array.nbytes, kind, self.stream))

    def _kv_ptr(self, slot: int, layer: int, value: bool) -> int:
        return self.kv[slot][2 * layer + int(value)].ptr

    def run(self, role: str, feeds: dict[str, np.ndarray], *, kv_in: int | None = None, kv_out: int | None = None):
        """Execute one engine. Host feeds are copied in; KV inputs/outputs (decoder) use the device slots; the
        other outputs come back to the host. Returns {output name: array or output shape for KV outputs}."""
        eng = self.engines[role]
        started = time.perf_counter()
        shapes = {n: tuple(a.shape) for n, a in feeds.items()}
        prof = select_profile(self.profiles[role], shapes, role, self.source)  # before any GPU work
        ctx = eng.contexts[prof]
        host = {}
        for name in eng.inputs:
            if name.startswith(names.PAST_PREFIX) and kv_in is not None:
                layer, value = int(name.split(".")[1]), name.endswith(".value")
                ctx.set_input_shape(name, shapes[name])
                ctx.set_tensor_address(name, self._kv_ptr(kv_in, layer, value))
                continue
            array = np.ascontiguousarray(feeds[name], dtype=eng.dtypes[name])
            ctx.set_input_shape(name, array.shape)
            buf = self._buffer(role, name, array.nbytes)
            self._h2d(buf.ptr, array)
            ctx.set_tensor_address(name, buf.ptr)
            host[name] = array  # keep alive until the stream is synchronised
        fetched: dict[str, tuple[np.ndarray, _DeviceBuffer]] = {}
        kv_shapes: dict[str, tuple[int, ...]] = {}
        for name in eng.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            if name.startswith(names.PRESENT_PREFIX) and kv_out is not None:
                layer, value = int(name.split(".")[1]), name.endswith(".value")
                ctx.set_tensor_address(name, self._kv_ptr(kv_out, layer, value))
                kv_shapes[name] = shape
                continue
            out = np.empty(shape, eng.dtypes[name])
            buf = self._buffer(role, name, out.nbytes)
            ctx.set_tensor_address(name, buf.ptr)
            fetched[name] = (out, buf)
        if not ctx.execute_async_v3(self.stream_handle):
            raise EdgekitError(f"TensorRT failed to execute the {role} engine", self.source, code="engine_failed")
        for out, buf in fetched.values():
            self._d2h(out, buf.ptr)
        _check(self.cudart.cudaStreamSynchronize(self.stream))
        if self.profile_dir is not None:
            ms = (time.perf_counter() - started) * 1e3
            self.calls.append({"graph": role, "profile": eng.profiles[prof]["name"], "start": started, "ms": ms})
        return {**{n: out for n, (out, _buf) in fetched.items()}, **kv_shapes}

    def kv_to_host(self, past: DeviceKV) -> list[tuple[np.ndarray, np.ndarray]]:
        """The device KV cache copied out (for `edgekit engine check`, not the decoding loop)."""
        shape = (past.batch, self.kv_heads, past.length, self.head_dim)
        out = []
        for layer in range(self.num_layers):
            k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)
            self._d2h(k, self._kv_ptr(past.slot, layer, False))
            self._d2h(v, self._kv_ptr(past.slot, layer, True))
            out.append((k, v))
        _check(self.cudart.cudaStreamSynchronize(self.stream))
        return out

    # the backend protocol ------------------------------------------------------------------------------------
    def encode_images(self, pixel_values: np.ndarray) -> np.ndarray:
        out = self.run(names.VISION, {names.PIXEL_VALUES: np.asarray(pixel_values, np.float32)})
        return out[names.IMAGE_FEATURES].astype(np.float32)

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        return self.run(names.EMBED, {names.INPUT_IDS: np.asarray(input_ids, np.int64)})[names.INPUTS_EMBEDS]

    def decode(self, inputs_embeds, attention_mask, position_ids, past: DeviceKV | None = None):
        x = np.asarray(inputs_embeds, np.float32)
        batch = x.shape[0]
        if past is not None and past.epoch != self.epoch:
            raise EdgekitError("this KV cache was overwritten by a later decode call (one sequence at a time)")
        length = 0 if past is None else past.length
        slot_in = 0 if past is None else past.slot
        slot_out = 1 - slot_in
        feeds = {names.INPUTS_EMBEDS: x, names.ATTENTION_MASK: attention_mask, names.POSITION_IDS: position_ids}
        kv_shape = np.broadcast_to(np.float32(0), (batch, self.kv_heads, length, self.head_dim))  # shape only
        for layer in range(self.num_layers):
            feeds[names.past_key(layer)] = kv_shape
            feeds[names.past_value(layer)] = kv_shape
        out = self.run(names.DECODER_ROLE, feeds, kv_in=slot_in, kv_out=slot_out)
        self.epoch += 1
        return out[names.LOGITS], DeviceKV(slot_out, length + x.shape[1], batch, self.epoch)

    def take_cost(self) -> dict:
        """Nothing is metered here beyond wall time (Jetson power rails are the reporter's meter)."""
        return {}

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
        rows = sorted(
            ({"graph": g, "op": layer, "ms": round(ms, 3), "calls": n, "share": round(ms / all_ms, 4)}
             for (g, layer), (ms, n) in totals.items()),
            key=lambda r: -r["ms"],
        )  # fmt: skip
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
        for buf in [*self.buffers.values(), *(b for slot in self.kv for b in slot)]:
            buf.free()
        self.buffers.clear()
