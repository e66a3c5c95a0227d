"""The three exported graphs in ONNX Runtime, behind the generation backend protocol.

ONNX Runtime is edgekit's reference executor: pass checks, export parity and calibration run graphs here, and the
`cpu` target serves this backend as it is.

The backend reads layer count and KV shapes from the decoder graph's own inputs, so it serves any export with the
Hugging Face VLM names, not just radreport-tiny. The KV cache stays a list of numpy (key, value) pairs that the
caller threads from one `decode` to the next (ORT's CPU outputs are numpy arrays already: no copies to manage).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgekit import names
from edgekit.errors import BundleError, ConfigError, TextModelError

from .threads import physical_cores

KV = list[tuple[np.ndarray, np.ndarray]]


def session_options(
    *,
    intra_op_threads: int | None = None,
    profile_prefix: str | Path | None = None,
    spin_between_runs: bool = True,
) -> ort.SessionOptions:
    """ORT_ENABLE_ALL, intra-op threads = physical cores unless given, optional chrome-trace profiling.
    `spin_between_runs=False`: the pool threads stop spinning at the end of each run (`session.force_spinning_stop`)
    instead of burning CPU for the next one, for a process that does other work between runs (edgekitd)."""
    if intra_op_threads is not None and intra_op_threads < 1:
        raise ConfigError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = physical_cores() if intra_op_threads is None else intra_op_threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if not spin_between_runs:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile_prefix)
    return so


def open_session(path: Path, options: ort.SessionOptions) -> ort.InferenceSession:
    """A CPU session of `path`, or a one-line BundleError naming the file (missing, corrupt, foreign)."""
    if not path.is_file():
        raise BundleError("ONNX graph not found", path)
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises Fail/InvalidGraph/InvalidProtobuf for corrupt or foreign files
        raise BundleError(f"ONNX Runtime cannot load this graph ({type(exc).__name__})", path) from exc


class CpuBackend:
    """`encode_images`, `embed`, `decode` over three ORT InferenceSessions (two for a text model: `vision_encoder`
    None, and `encode_images` refuses)."""

    batch_rows = True  # `decode` keeps no per-sequence state: the engine may batch rows of different lengths

    def __init__(
        self,
        vision_encoder: str | Path | None,
        embed_tokens: str | Path,
        decoder: str | Path,
        *,
        intra_op_threads: int | None = None,
        profile_dir: str | Path | None = None,
        spin_between_runs: bool = True,
    ):
        self.profile_dir = Path(profile_dir) if profile_dir is not None else None
        if self.profile_dir is not None:
            self.profile_dir.mkdir(parents=True, exist_ok=True)
        if intra_op_threads is not None and intra_op_threads < 1:
            raise ConfigError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
        self.intra_op_threads = physical_cores() if intra_op_threads is None else intra_op_threads

        def opts(name: str) -> ort.SessionOptions:
            prefix = self.profile_dir / name if self.profile_dir is not None else None
            return session_options(
                intra_op_threads=self.intra_op_threads, profile_prefix=prefix, spin_between_runs=spin_between_runs
            )

        self.vision = None if vision_encoder is None else open_session(Path(vision_encoder), opts("vision_encoder"))
        self.embed_session = open_session(Path(embed_tokens), opts("embed_tokens"))
        self.decoder = open_session(Path(decoder), opts("decoder"))
        self._decoder_path = Path(decoder)
        self._read_decoder_signature()

    @classmethod
    def from_dir(cls, model_dir: str | Path, **kwargs) -> CpuBackend:
        """A folder holding the three graphs under their standard names (what `export_default` writes)."""
        d = Path(model_dir)
        return cls(d / names.VISION_ENCODER, d / names.EMBED_TOKENS, d / names.DECODER, **kwargs)

    def _read_decoder_signature(self) -> None:
        inputs = {i.name: i for i in self.decoder.get_inputs()}
        needed = {names.INPUTS_EMBEDS, names.ATTENTION_MASK, names.POSITION_IDS}
        if not needed <= inputs.keys():
            raise BundleError(f"decoder graph lacks inputs {sorted(needed - inputs.keys())}", self._decoder_path)
        self.num_layers = sum(1 for n in inputs if n.startswith(names.PAST_PREFIX) and n.endswith(".key"))
        if self.num_layers == 0:
            raise BundleError("decoder graph has no past_key_values inputs", self._decoder_path)
        _, self.kv_heads, _, self.head_dim = inputs[names.past_key(0)].shape
        self.hidden = inputs[names.INPUTS_EMBEDS].shape[2]
        self._output_names = [o.name for o in self.decoder.get_outputs()]
        data = self._decoder_path.with_name(self._decoder_path.name + ".data")
        # what one decode step streams from memory: the decoder's weights (graph file + external data), once
        self.weight_bytes = self._decoder_path.stat().st_size + (data.stat().st_size if data.is_file() else 0)

    # the backend protocol ------------------------------------------------------------------------------------
    def encode_images(self, pixel_values: np.ndarray) -> np.ndarray:
        """(batch, frames, 1, H, W) float32 -> image features (batch, num_image_tokens, hidden)."""
        if self.vision is None:
            raise TextModelError.no_vision_graph()
        pv = np.ascontiguousarray(pixel_values, dtype=np.float32)
        return self.vision.run(None, {names.PIXEL_VALUES: pv})[0]

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        """(batch, seq) int64 -> (batch, seq, hidden)."""
        return self.embed_session.run(None, {names.INPUT_IDS: np.ascontiguousarray(input_ids, dtype=np.int64)})[0]

    def empty_past(self, batch: int) -> KV:
        z = np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32)
        return [(z, z) for _ in range(self.num_layers)]

    def decode(
        self, inputs_embeds: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: KV | None = None
    ) -> tuple[np.ndarray, KV]:
        """One decoder call: prefill (`past` None) or decode. Returns logits (batch, seq, vocab) and the new cache."""
        x = np.ascontiguousarray(inputs_embeds, dtype=np.float32)
        if past is None:
            past = self.empty_past(x.shape[0])
        feeds = {
            names.INPUTS_EMBEDS: x,
            names.ATTENTION_MASK: np.ascontiguousarray(attention_mask, dtype=np.int64),
            names.POSITION_IDS: np.ascontiguousarray(position_ids, dtype=np.int64),
        }
        for i, (k, v) in enumerate(past):
            feeds[names.past_key(i)] = k
            feeds[names.past_value(i)] = v
        outs = dict(zip(self._output_names, self.decoder.run(self._output_names, feeds)))
        present = [(outs[names.present_key(i)], outs[names.present_value(i)]) for i in range(self.num_layers)]
        return outs[names.LOGITS], present

    # profiling ------------------------------------------------------------------------------------------------
    def take_cost(self) -> dict:
        """Nothing is emulated or metered here: wall-clock timings are the reporter's."""
        return {}

    def write_profile(self, report, out: Path) -> dict:
        """The last report's ORT traces merged into one chrome trace, an op-time table and a plot."""
        from .trace import merge_traces, op_summary, plot_ops

        if self.profile_dir is None:
            raise ConfigError("this backend was not loaded for profiling (profile_dir not given)")
        traces = self.end_profiling()
        merge_traces(traces, out / "trace.json")
        ops = op_summary(traces)
        plot_ops(
            ops,
            out / "ops.png",
            f"{report.model} on {report.target}: one report ({report.timings['new_tokens']} tokens)",
        )
        return {
            "summary": {k: round(v, 2) if isinstance(v, float) else v for k, v in report.timings.items()},
            "summary_title": "stages",
            "tables": {"kernel time by op type": ops[:12]},
            "details": {"ops": ops[:15]},
            "files": {"trace": str(out / "trace.json"), "plot": str(out / "ops.png")},
            "trace": str(out / "trace.json"),
            "plot": str(out / "ops.png"),
            "source": "ONNX Runtime profiler (kernel times) and wall clock (stages), one report",
        }

    def end_profiling(self) -> list[Path]:
        """Stop profiling and return the chrome-trace JSON files (one per graph); empty when not profiling."""
        if self.profile_dir is None:
            return []
        sessions = (self.vision, self.embed_session, self.decoder)
        return [Path(s.end_profiling()) for s in sessions if s is not None]
