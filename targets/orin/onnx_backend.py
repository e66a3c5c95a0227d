"""The orin bundle's graphs in ONNX Runtime on cpu: the reference the TensorRT engines are held to.

The same graphs TensorRT builds from, behind the same backend protocol, refusing what the engines would refuse
(shapes beyond the optimisation profiles), so a request that works here works on the device and one that fails
on the device fails here first, with the same message. `bench/orin_parity.py` and `edgekit engine check
--onnxrt` use it, and the `orin` target's `load_backend` serves it for `engine=onnxruntime`.

It keeps the engine's rows itself (`edgekit.engine.SlotBackend`), with the row algorithm the TensorRT backend runs
(`rows.RowBatcher`): per-row caches as numpy arrays (`HostKV`), a decode step over several rows left-padded into
one batch, up to the decode profile's maximum (`max_rows`). With a `billing` (`estimate_billing.EstimateBilling`),
each row is billed when it is released by the Orin cost model for the tokens it used: the image (if any), the
prompt the prefill read, and every token the decoder chose. The one-sequence `decode` stays for direct callers
(parity checks), profile-checked the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgekit import names
from edgekit.ort import CpuBackend
from edgekit.ort.backend import KV

from .plan import plan_for
from .profiles import select_profile
from .rows import RowBatcher


class HostKV:
    """The rows' caches as numpy arrays: `rows.KVStore` for ONNX Runtime, whose outputs are host arrays already."""

    def __init__(self, decode):
        self.decode = decode  # (x, mask, positions, past or None) -> (logits, present)
        self.home: dict[int, KV] = {}
        self.batch: KV | None = None

    def prefill(self, row, past_len, x, mask, positions):
        logits, self.home[row] = self.decode(x, mask, positions, self.home.get(row))
        return logits

    def gather(self, rows, lengths):
        longest = max(lengths)
        batch = []
        for layer in range(len(self.home[rows[0]])):
            pair = []
            for which in (0, 1):
                first = self.home[rows[0]][layer][which]
                out = np.zeros((len(rows), first.shape[1], longest, first.shape[3]), first.dtype)
                for i, (row, n) in enumerate(zip(rows, lengths)):
                    out[i, :, longest - n :] = self.home[row][layer][which][0]
                pair.append(out)
            batch.append((pair[0], pair[1]))
        self.batch = batch

    def step(self, past_len, x, mask, positions):
        logits, self.batch = self.decode(x, mask, positions, self.batch)
        return logits

    def scatter(self, rows, lengths, longest):
        for i, (row, n) in enumerate(zip(rows, lengths)):
            self.home[row] = [(k[i : i + 1, :, longest - n :].copy(), v[i : i + 1, :, longest - n :].copy())
                              for k, v in self.batch]  # fmt: skip
        self.batch = None

    def forget(self, row):
        self.home.pop(row, None)


class OrinOnnxBackend(CpuBackend):
    def __init__(
        self,
        bundle,
        *,
        intra_op_threads: int | None = None,
        profile_dir=None,
        billing=None,
        overrides=None,
        spin_between_runs: bool = True,
    ):
        """`overrides`: the run's plan settings (`max_batch`: the profiles are remade at it, as for the engines)."""
        super().__init__(
            None if bundle.is_text else bundle.component(names.VISION),
            bundle.component(names.EMBED),
            bundle.component(names.DECODER_ROLE),
            intra_op_threads=intra_op_threads,
            profile_dir=profile_dir,
            spin_between_runs=spin_between_runs,
        )
        self.source = bundle.source
        self.profiles = plan_for(bundle, overrides)["profiles"]
        self.billing = billing
        # the Orin estimate prices each report as if it ran alone: reports decoded together would be billed wrong
        self.bills_alone = billing is not None
        self.rows = RowBatcher(
            HostKV(super().decode),
            self.profiles[names.DECODER_ROLE],
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            billing=billing,
            where=self.source,
        )
        self.max_rows = self.rows.max_rows
        self.kv_bytes_per_token = 2 * self.num_layers * self.kv_heads * self.head_dim * 4  # float32 K and V

    def _check(self, role: str, shapes: dict) -> None:
        if role in self.profiles:
            select_profile(self.profiles[role], shapes, role, self.source)

    # images and tokens: the engine's rows, or none for a direct caller ------------------------------------------
    def encode_images(self, pixel_values: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
        self._check(names.VISION, {names.PIXEL_VALUES: np.shape(pixel_values)})
        features = super().encode_images(pixel_values)
        if rows is not None:
            self.rows.images(rows, features.shape[1])
        return features

    def embed(self, input_ids: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
        self._check(names.EMBED, {names.INPUT_IDS: np.shape(input_ids)})
        return super().embed(input_ids)

    # the engine's rows (edgekit.engine.SlotBackend) ------------------------------------------------------------
    def prefill(self, row: int, inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        return self.rows.prefill(row, inputs_embeds, position_ids)

    def step(self, rows: Sequence[int], inputs_embeds: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        return self.rows.step(rows, inputs_embeds, position_ids)

    def release(self, row: int) -> dict:
        """Forget `row`; its Orin estimate ({} without a billing, or when it never reached the decoder)."""
        return self.rows.release(row)

    # one sequence, for direct callers ----------------------------------------------------------------------------
    def decode(self, inputs_embeds, attention_mask, position_ids, past=None):
        batch = np.shape(inputs_embeds)[0]
        past_len = 0 if past is None else past[0][0].shape[2]
        shapes = {
            names.INPUTS_EMBEDS: np.shape(inputs_embeds),
            names.ATTENTION_MASK: np.shape(attention_mask),
            names.POSITION_IDS: np.shape(position_ids),
            names.past_key(0): (batch, self.kv_heads, past_len, self.head_dim),
        }
        self._check(names.DECODER_ROLE, shapes)
        return super().decode(inputs_embeds, attention_mask, position_ids, past)
