"""The cpu target's run side: the engine's rows (`edgekit.engine.slots.SlotBackend`) over the fused decoder.

What a decode step costs here, and why: the fused decoder (`fused.py`) takes each layer's KV cache as one buffer
that is its past and its present, so this backend binds `KvBuffers`' arrays with ORT's I/O binding and a step
copies no cache, in or out (the portable graph's Concat copies every row's whole cache every step, and
`PastKVSlots` pads rows of different lengths into one batch besides). The bindings of a step of n rows are made
once and kept: the step's inputs are written into the bound arrays in place, so steady decoding is one
`run_with_iobinding` per token, with no Python-side allocation in the decoder call. They are made again only
when the buffers move (capacity growth).

Prefill (a prompt or a chunk of one) binds the row's batch-1 view `buf[p:p+1]`; GroupQueryAttention appends at
the row's length (`seqlens_k`), so chunks simply follow one another. Logits come back for the last position only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgekit import names
from edgekit.errors import BundleError, ConfigError, ContextExceededError, TextModelError
from edgekit.ort import CpuBackend, open_session, physical_cores, session_options

from .fused import GREEDY_TOKEN, ROPE_POSITIONS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH, FusedSignature
from .kv_buffers import KvBuffers

DEFAULT_CAPACITY = 256  # positions per row before the first doubling
EMBED_CACHE_TOKENS = 4096  # embedding rows kept for decode steps (SmolLM2's 576 floats: 9 MiB at most)


def _bind(binding: ort.IOBinding, name: str, array: np.ndarray, *, output: bool = False) -> None:
    """Bind `array`'s own memory (C-contiguous) to `name`: ORT reads or writes it in place. ORT keeps only the
    pointer, so the binding keeps the array (until `name` is bound again): a temporary bound and freed before the
    run, its memory reused by another thread, once fed GroupQueryAttention a garbage length (edgekitd under load)."""
    assert array.flags.c_contiguous, name
    bind = binding.bind_output if output else binding.bind_input
    bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    binding.__dict__.setdefault("_edgekit_arrays", {})[name] = array


def _bind_call(binding: ort.IOBinding, embeds, positions, seqlens_k, total, logits) -> None:
    """A call's own inputs and its logits (every binding's; the KV views are bound once per binding)."""
    _bind(binding, names.INPUTS_EMBEDS, embeds)
    _bind(binding, names.POSITION_IDS, positions)
    _bind(binding, SEQLENS_K, seqlens_k)
    _bind(binding, TOTAL_SEQUENCE_LENGTH, total)
    _bind(binding, names.LOGITS, logits, output=True)


class _Step:
    """The bound arrays and I/O binding of a decode step of `n` rows (valid for one buffer generation)."""

    def __init__(self, backend: CpuSlotBackend, n: int):
        sig, kv = backend.signature, backend.kv
        self.generation = kv.generation
        self.embeds = np.zeros((n, 1, sig.hidden), np.float32)
        self.positions = np.zeros((3, n, 1) if sig.mrope else (n, 1), np.int64)
        self.seqlens_k = np.zeros(n, np.int32)
        self.total = np.zeros((), np.int32)
        self.logits = np.zeros((n, 1, sig.vocab), np.float32)
        self.binding = backend.bind(self.embeds, self.positions, self.seqlens_k, self.total, self.logits, 0, n)
        self.greedy: memoryview | None = None  # each physical row's argmax, where the decoder gives it
        if sig.greedy:
            tokens = np.zeros((n, 1), np.int64)
            _bind(self.binding, GREEDY_TOKEN, tokens, output=True)
            self.greedy = tokens.data.cast("B").cast("q")
        self.in_order = list(range(n))
        self.logit_rows = self.logits[:, 0]  # what a step in physical order returns: a view made once
        # flat views the step writes through with plain Python ints and buffer copies: right after a decoder
        # run each numpy call costs several microseconds (cold caches), a memoryview item a fraction of one
        self.embeds_flat = self.embeds.data.cast("B").cast("f")
        self.positions_flat = self.positions.data.cast("B").cast("q")
        self.seqlens_flat = self.seqlens_k.data
        self.total_flat = self.total.reshape(1).data


class CpuSlotBackend:
    """Rows of KV cache for the engine, decoded by the fused decoder with I/O binding (`SlotBackend`).

    `decoder` is the fused graph (`decoder_cpu.onnx`), `embed_tokens` the portable embedding graph, and
    `vision_encoder` the image encoder (None for a text-only decoder). `max_rows` bounds the rows held at once;
    `capacity` is the positions each row starts with (doubled on demand)."""

    def __init__(
        self,
        decoder: str | Path,
        embed_tokens: str | Path,
        vision_encoder: str | Path | None = None,
        *,
        max_rows: int = 8,
        capacity: int = DEFAULT_CAPACITY,
        intra_op_threads: int | None = None,
        profile_dir: str | Path | None = None,
        spin_between_runs: bool = True,
    ):
        if max_rows < 1:
            raise ConfigError(f"max_rows must be >= 1, got {max_rows}")
        if intra_op_threads is not None and intra_op_threads < 1:
            raise ConfigError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
        self.max_rows = max_rows
        self.intra_op_threads = physical_cores() if intra_op_threads is None else intra_op_threads
        self.profile_dir = Path(profile_dir) if profile_dir is not None else None
        if self.profile_dir is not None:
            self.profile_dir.mkdir(parents=True, exist_ok=True)

        def opts(name: str) -> ort.SessionOptions:
            prefix = self.profile_dir / name if self.profile_dir is not None else None
            return session_options(
                intra_op_threads=self.intra_op_threads, profile_prefix=prefix, spin_between_runs=spin_between_runs
            )

        self._decoder_path = Path(decoder)
        self.decoder = open_session(self._decoder_path, opts("decoder"))
        self.embed_session = open_session(Path(embed_tokens), opts("embed_tokens"))
        self.vision = open_session(Path(vision_encoder), opts("vision_encoder")) if vision_encoder is not None else None
        inputs = {i.name: i.shape for i in self.decoder.get_inputs()}
        if not {SEQLENS_K, TOTAL_SEQUENCE_LENGTH, names.INPUTS_EMBEDS, names.past_key(0)} <= inputs.keys():
            raise BundleError("not a fused cpu decoder (seqlens_k / past_key_values inputs missing)", decoder)
        self.signature = sig = FusedSignature.of(inputs, {o.name: o.shape for o in self.decoder.get_outputs()})
        self.num_layers, self.kv_heads, self.head_dim, self.hidden = sig.layers, sig.kv_heads, sig.head_dim, sig.hidden
        self.kv_bytes_per_token = 2 * sig.layers * sig.kv_heads * sig.head_dim * 4  # float32 key + value per layer
        data = self._decoder_path.with_name(self._decoder_path.name + ".data")
        # what one decode step streams from memory: the decoder's weights, once (the engine's bandwidth rule)
        self.weight_bytes = self._decoder_path.stat().st_size + (data.stat().st_size if data.is_file() else 0)
        meta = self.decoder.get_modelmeta().custom_metadata_map
        # position-indexed RoPE tables hold this many positions (None: per-token tables, no limit)
        self.max_positions = int(meta[ROPE_POSITIONS]) if ROPE_POSITIONS in meta else None
        self.kv = KvBuffers(sig.layers, max_rows, sig.kv_heads, sig.head_dim, capacity)
        self._steps: dict[int, _Step] = {}
        # prefill bindings with the KV views of physical rows [first, first + n) bound, by (first, n): a prefill
        # binds only its own inputs and logits (a whole binding is 0.1 ms warm, 0.3-0.5 ms right after a report,
        # of radreport-tiny's 1.2-1.5 ms 32-token prefill)
        self._prefill_bindings: dict[tuple[int, int], tuple[int, ort.IOBinding]] = {}
        self._embeddings: dict[int, np.ndarray] = {}  # token id -> its embedding row (decode steps)
        self._outputs = [o.name for o in self.decoder.get_outputs()]

    # images and tokens ----------------------------------------------------------------------------------------
    def encode_images(self, pixel_values: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
        """Image features of a batch of studies; `rows` (the engine's) does not matter here: images hold no cache."""
        if self.vision is None:
            raise TextModelError.no_vision_graph()
        pv = np.ascontiguousarray(pixel_values, dtype=np.float32)
        return self.vision.run(None, {names.PIXEL_VALUES: pv})[0]

    def embed(self, input_ids: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
        """(batch, seq) ids -> (batch, seq, hidden). A decode step's tokens (seq 1) come from a cache of the rows
        the embedding graph wrote before (a token's row depends on the token alone): at radreport-tiny's 0.3 ms
        step, the embedding graph's own ORT call was 7% of it."""
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] != 1:
            return self.embed_session.run(None, {names.INPUT_IDS: ids})[0]
        return np.stack(self._embedding_rows(ids[:, 0].tolist()))[:, None]

    def _embedding_rows(self, tokens: list[int]) -> list[np.ndarray]:
        """Each token's embedding row, from the cache (the embedding graph runs once for those it lacks)."""
        cache = self._embeddings
        missing = {t for t in tokens if t not in cache}
        if missing:
            if len(cache) + len(missing) > EMBED_CACHE_TOKENS:  # full: start again from this step's tokens
                cache.clear()
                missing = set(tokens)
            wanted = sorted(missing)
            rows_out = self.embed_session.run(None, {names.INPUT_IDS: np.asarray([wanted], np.int64)})[0][0]
            cache.update(zip(wanted, np.ascontiguousarray(rows_out, np.float32)))  # what the decoder is fed
        return [cache[t] for t in tokens]

    # the cache --------------------------------------------------------------------------------------------
    def bind(self, embeds, positions, seqlens_k, total, logits, first: int, n: int) -> ort.IOBinding:
        """An I/O binding of these arrays and physical rows [first, first + n) of every KV buffer (past and
        present alike)."""
        binding = self.decoder.io_binding()
        _bind_call(binding, embeds, positions, seqlens_k, total, logits)
        for i in range(self.num_layers):
            for past, present, buf in (
                (names.past_key(i), names.present_key(i), self.kv.keys[i]),
                (names.past_value(i), names.present_value(i), self.kv.values[i]),
            ):
                view = buf[first : first + n]
                _bind(binding, past, view)
                _bind(binding, present, view, output=True)
        return binding

    def prefill(self, row: int, inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """Append a prompt (or a chunk of one) to `row`'s cache; the logits (vocab,) of its last position."""
        if row not in self.kv:
            self.kv.acquire(row)
        seq = inputs_embeds.shape[1]
        self._within_context(self.kv.length_of(row) + seq)
        self.kv.reserve([row], seq)
        p, length = self.kv.physical(row), self.kv.length_of(row)
        logits = np.zeros((1, 1, self.signature.vocab), np.float32)
        self._prefill_run(
            np.ascontiguousarray(inputs_embeds, np.float32),
            np.ascontiguousarray(position_ids, np.int64),
            np.asarray([length + seq - 1], np.int32),
            np.asarray(length + seq, np.int32),
            logits,
            p,
            1,
        )
        self.kv.advance(p, seq)
        return logits[0, 0]

    def prefill_rows(self, rows: Sequence[int], inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """The whole first prompts of new `rows` in one decoder call; the logits (len(rows), vocab) of each last
        position. Every prompt has the same length and every row the same positions ((n, seq), or M-RoPE's
        (3, n, seq)): a first prompt of several rows is the one case where GroupQueryAttention rotates every row
        from the first row's positions (`fused.py`), so that is what makes it exact. The rows are acquired
        together, so they sit in adjacent physical rows and one view of each KV buffer binds them all."""
        n, seq = len(rows), inputs_embeds.shape[1]
        positions = np.ascontiguousarray(position_ids, np.int64)
        if inputs_embeds.shape[0] != n or positions.shape[-2] != n or positions.shape[-1] != seq:
            raise ConfigError(f"prefill_rows: {n} rows, embeddings {inputs_embeds.shape}, positions {positions.shape}")
        if not (positions == positions[..., :1, :]).all():
            raise ConfigError("prefill_rows: every row's prompt must have the same positions")
        if any(row in self.kv for row in rows):
            raise ConfigError("prefill_rows takes new rows only (a row with a cache prefills alone)")
        if self.kv.count + n > self.kv.rows:
            raise ConfigError(f"prefill_rows: {n} new rows do not fit beside {self.kv.count} of {self.kv.rows}")
        self._within_context(seq)
        first = self.kv.count  # `acquire` hands out physical rows in order: these n are first .. first + n - 1
        for row in rows:
            self.kv.acquire(row)
        self.kv.reserve(rows, seq)
        logits = np.zeros((n, 1, self.signature.vocab), np.float32)
        self._prefill_run(
            np.ascontiguousarray(inputs_embeds, np.float32),
            positions,
            np.full(n, seq - 1, np.int32),
            np.asarray(seq, np.int32),
            logits,
            first,
            n,
        )
        for p in range(first, first + n):
            self.kv.advance(p, seq)
        return logits[:, 0]

    def _prefill_run(self, embeds, positions, seqlens_k, total, logits, first: int, n: int) -> None:
        """One prefill call over physical rows [first, first + n), through their kept binding (made again when the
        buffers have moved); the binding holds this call's arrays (`_bind`) until the next call binds its own, so
        at most one prompt's embeddings per kept binding stay alive between prefills."""
        kept = self._prefill_bindings.get((first, n))
        if kept is not None and kept[0] == self.kv.generation:
            binding = kept[1]
            _bind_call(binding, embeds, positions, seqlens_k, total, logits)
        else:
            binding = self.bind(embeds, positions, seqlens_k, total, logits, first, n)
            self._prefill_bindings[(first, n)] = (self.kv.generation, binding)
        self.decoder.run_with_iobinding(binding)

    def step(self, rows: Sequence[int], inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """One token for each of `rows`, each at its own length; logits (len(rows), vocab)."""
        step, where, longest = self._step_for(rows)
        step.embeds[where] = inputs_embeds
        if self.signature.mrope:
            step.positions[:, where] = position_ids
        else:
            step.positions[where] = position_ids
        return self._run_step(step, where, longest).copy()

    def step_tokens(self, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """`step` from each row's token id and text position (the engine's call where a backend offers it): the
        token's cached embedding and its position (on every M-RoPE axis, as text positions are) are written
        straight into the step's bound inputs, with no arrays assembled between. At radreport-tiny's 0.2 ms
        step, the engine's Python around the graph was a third of a token. The logits are the step's own buffer:
        valid until the next step (the engine reads them at once)."""
        step, where, longest = self._step_for(rows)
        embeds, pos, hidden, n = step.embeds_flat, step.positions_flat, self.hidden, len(where)
        axes = range(3) if self.signature.mrope else range(1)  # positions (3, n, 1) or (n, 1), flattened
        for p, row, at in zip(where, self._embedding_rows(list(tokens)), positions):
            embeds[p * hidden : (p + 1) * hidden] = row.data
            for a in axes:
                pos[a * n + p] = at
        return self._run_step(step, where, longest)

    def decode_greedy(
        self,
        rows: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        steps: int,
        stops: AbstractSet[int],
        more: Callable[[], bool],
    ) -> list[list[int]]:
        """Up to `steps` greedy decode steps of `rows` in one call, each feeding every row the token the step
        before chose (the engine's multi-step run, as vLLM's multi-step scheduling: the scheduler's work is paid
        once for several steps). It ends early after a step where a row chose a token in `stops`, or when
        `more()` is false; fewer steps when the decoder's context would end sooner (the next single step says
        why). Returns each step's tokens, in `rows`' order. The same decoder runs with the same inputs as
        `steps` calls of `step_tokens` and an argmax each: the tokens are those."""
        step, where, longest = self._step_for(rows)
        if self.max_positions is not None:
            steps = min(steps, self.max_positions - longest)
        if longest + steps > self.kv.capacity:  # room for the whole run now, so its bindings stay valid
            self.kv.reserve(rows, steps)
            step, where, longest = self._step_for(rows)
        # `step_tokens` and `_run_step` in one loop, their lookups hoisted: between two runs of a 0.15 ms graph,
        # caches cold from it, each Python call counts
        out: list[list[int]] = []
        chosen, at, n, hidden = list(tokens), list(positions), len(where), self.hidden
        embeds, pos, seqlens, total = step.embeds_flat, step.positions_flat, step.seqlens_flat, step.total_flat
        axes = [a * n for a in range(3 if self.signature.mrope else 1)]  # positions (3, n, 1) or (n, 1), flattened
        length, cache, run, binding = self.kv.length, self._embeddings, self.decoder.run_with_iobinding, step.binding
        advance = self.kv.advance_first
        in_order, logits, greedy = where == step.in_order, step.logit_rows, step.greedy
        physical_rows = range(n)
        for _ in range(max(1, steps)):
            try:
                rows_in = [cache[t] for t in chosen]
            except KeyError:  # a token not embedded yet: the embedding graph runs for it
                rows_in = self._embedding_rows(chosen)
            for p, row, a in zip(where, rows_in, at):
                embeds[p * hidden : (p + 1) * hidden] = row.data
                for axis in axes:
                    pos[axis + p] = a
            for p in physical_rows:
                seqlens[p] = length[p]  # the new token's index = each row's total length - 1
            longest += 1
            total[0] = longest
            run(binding)
            advance(n)
            picked = greedy.tolist() if greedy is not None else logits.argmax(-1).tolist()
            chosen = picked if in_order else [picked[p] for p in where]
            out.append(chosen)
            if len(out) >= steps or not stops.isdisjoint(chosen) or not more():
                break
            at = [a + 1 for a in at]
        return out

    def _step_for(self, rows: Sequence[int]) -> tuple[_Step, list[int], int]:
        """The bound step of len(rows) rows, with `rows` gathered into physical rows [0, n) and room for one more
        position each; each row's physical index, in order; and the longest row's length."""
        n = len(rows)
        where = self.kv.gather(rows)  # a permutation of 0 .. n-1
        longest = max(self.kv.length[:n])
        if self.max_positions is not None and longest + 1 > self.max_positions:
            self._within_context(longest + 1)
        if longest + 1 > self.kv.capacity:
            self.kv.reserve(rows, 1)  # new buffers (rows keep their physical index): the bindings are made again
        step = self._steps.get(n)
        if step is None or step.generation != self.kv.generation:
            step = self._steps[n] = _Step(self, n)
        return step, where, longest

    def _within_context(self, positions: int) -> None:
        if self.max_positions is not None and positions > self.max_positions:
            raise ContextExceededError(
                f"a row would hold {positions} positions; this decoder was built for a context of {self.max_positions}",
                self._decoder_path,
            )

    def _run_step(self, step: _Step, where: list[int], longest: int) -> np.ndarray:
        n, seqlens_k, length = len(where), step.seqlens_flat, self.kv.length
        for p in range(n):
            seqlens_k[p] = length[p]  # the new token's index = each row's total length - 1
        step.total_flat[0] = longest + 1
        self.decoder.run_with_iobinding(step.binding)
        self.kv.advance_first(n)
        # rows in physical order (steady decoding): the step's own view. After a run each numpy call is several
        # times slower than warm (the graph's weights have been through the caches), so the step makes none.
        return step.logit_rows if where == step.in_order else step.logits[where, 0]

    def release(self, row: int) -> dict:
        """Free `row` (the last physical row moves into its place); nothing is metered on the cpu target."""
        self.kv.release(row)
        return {}

    # profiling --------------------------------------------------------------------------------------------
    write_profile = CpuBackend.write_profile  # the same traces, tables and plot as the portable backend

    def end_profiling(self) -> list[Path]:
        """Stop profiling and return the chrome-trace JSON files (one per graph); empty when not profiling."""
        if self.profile_dir is None:
            return []
        sessions = [s for s in (self.vision, self.embed_session, self.decoder) if s is not None]
        return [Path(s.end_profiling()) for s in sessions]
