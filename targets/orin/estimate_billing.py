"""Each report billed by the Orin cost model for the tokens it actually used: what `edgekit run`, `eval` and
`pareto` show for an orin bundle on a machine that is not an Orin (`engine=onnxruntime`, `estimate=DEVICE:MODE`).

The graphs run in ONNX Runtime here and write the report; its latency and energy are the estimate's for that
report's prompt and generated token counts on the named device and power mode (`estimate.estimate_report`),
labelled `estimated:orin-<model>-<mode>` so no one reads them as measured. The bundle's shape and precision are
read once; the estimate itself is arithmetic, so billing costs a report nothing it would notice.
"""

from __future__ import annotations

import dataclasses

from .estimate import estimate_report, get_device, read_bundle


class EstimateBilling:
    def __init__(self, bundle, device: str, mode: str):
        self.device = get_device(device)
        self.mode = self.device.mode(mode)
        self.shape, self.precision, _report, _notes, _facts = read_bundle(bundle.root)
        self._seen: dict = {}

    def _estimate(self, prompt_tokens: int, new_tokens: int, with_image: bool):
        key = (prompt_tokens, new_tokens, with_image)
        if key not in self._seen:  # an eval repeats the same few (prompt, length) pairs
            shape = self.shape if with_image else dataclasses.replace(self.shape, vision=None)
            self._seen[key] = estimate_report(
                shape,
                self.device,
                self.mode.name,
                weights=self.precision,
                prompt_tokens=prompt_tokens,
                new_tokens=new_tokens,
            )
        return self._seen[key]

    def bill(self, *, prompt_tokens: int, new_tokens: int, with_image: bool) -> dict:
        """The cost of one report (`take_cost()`'s dict): `new_tokens` counts every token the decoder chose, the
        stop token included (the prefill chose the first), as each one cost a decoder pass."""
        est = self._estimate(prompt_tokens, max(new_tokens, 1), with_image)
        figure = est.figure()
        return {
            # what the reporter bills: the Orin's latency and energy, not the host's running ONNX Runtime
            "latency_ms": est.latency_ms,
            "energy_j": est.energy_j,
            "figure_source": est.source,
            "avg_power_w": est.avg_power_w,
            "ms_per_token": est.ms_per_token,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "image": with_image,
            "device": self.device.id,
            "mode": self.mode.name,
            "breakdown": est.breakdown,
            "notes": list(est.notes),
            "source": figure["source"] + "; the report itself written by the bundle's graphs in ONNX Runtime",
        }
