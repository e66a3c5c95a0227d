"""The orin bundle's graphs in ONNX Runtime on cpu: the reference the TensorRT engines are held to.

The same graphs TensorRT builds from, behind the same backend protocol, refusing what the engines would refuse
(shapes beyond the optimisation profiles), so a request that works here works on the device and one that fails
on the device fails here first, with the same message. `bench/orin_parity.py` and `edgekit engine check
--onnxrt` use it, and the `orin` target's `load_backend` serves it for `engine=onnxruntime`.

With a `billing` (`estimate_billing.EstimateBilling`), each report is billed in `take_cost()` by the Orin cost
model for the tokens it used: the image (if any), the prompt the prefill read, and every token the decoder chose.
"""

from __future__ import annotations

import numpy as np

from edgekit import names
from edgekit.errors import EdgekitError
from edgekit.ort import CpuBackend

from .profiles import select_profile


class OrinOnnxBackend(CpuBackend):
    batch_rows = False  # billing counts one report's tokens at a time (take_cost)

    def __init__(self, bundle, *, intra_op_threads: int | None = None, profile_dir=None, billing=None):
        super().__init__(
            None if bundle.is_text else bundle.component(names.VISION),
            bundle.component(names.EMBED),
            bundle.component(names.DECODER_ROLE),
            intra_op_threads=intra_op_threads,
            profile_dir=profile_dir,
        )
        self.source = bundle.source
        self.profiles = bundle.manifest.runtime.get("profiles", {})
        self.billing = billing
        self._reset_count()

    def _reset_count(self) -> None:
        self._image_tokens, self._prompt_tokens, self._decoder_calls = None, 0, 0

    def _check(self, role: str, shapes: dict) -> None:
        if role in self.profiles:
            select_profile(self.profiles[role], shapes, role, self.source)

    def encode_images(self, pixel_values: np.ndarray) -> np.ndarray:
        self._check(names.VISION, {names.PIXEL_VALUES: np.shape(pixel_values)})
        features = super().encode_images(pixel_values)
        self._image_tokens = features.shape[1]
        return features

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        self._check(names.EMBED, {names.INPUT_IDS: np.shape(input_ids)})
        return super().embed(input_ids)

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
        if self.billing is not None:
            if batch != 1:
                raise EdgekitError(f"the Orin estimate bills one report at a time, got a batch of {batch}")
            if past is None:  # the prefill: image features (if any) in front of the prompt
                self._prompt_tokens = np.shape(inputs_embeds)[1] - (self._image_tokens or 0)
            self._decoder_calls += 1
        return super().decode(inputs_embeds, attention_mask, position_ids, past)

    def take_cost(self) -> dict:
        """The Orin estimate of the report just written ({} without a billing, or when nothing was decoded)."""
        calls, image, prompt = self._decoder_calls, self._image_tokens is not None, self._prompt_tokens
        self._reset_count()
        if self.billing is None or calls == 0:
            return {}
        return self.billing.bill(prompt_tokens=prompt, new_tokens=calls, with_image=image)
