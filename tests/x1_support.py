"""Builders the x1 test modules share: a tiny INT4 model folder, a machine whose KV cache spills, and a fixed
emulator scenario (no test cases here)."""

from pathlib import Path

import numpy as np

from edgekit.targets.x1.machine import Machine


def tiny_int4_dir(root: Path) -> Path:
    """The daemon's tiny model, exported and INT4-quantised (RTN, block 16): the program the emulator's recorded
    totals were taken on, whatever the int4 pass's default method is now."""
    from edgekit.daemon.testing import write_tiny_model
    from edgekit.export import export_default
    from edgekit.passes.pipeline import run_pipeline
    from edgekit.passes.registry import make_pass

    model = write_tiny_model(root / "model")
    export_default(model, root / "onnx")
    rtn = make_pass("int4:block=16,format=qdq-blocked,method=rtn,symmetric=true")
    run_pipeline(root / "onnx", root / "int4", [rtn], overwrite=True)
    return root / "int4"


def small_kv_machine(m: Machine) -> Machine:
    c = {k: dict(v) for k, v in m.content.items()}
    c["sram"].update(banks=4, kv_banks=1, bank_kib=1.0)  # 1 KiB of KV: a window of 20 tokens per layer here
    return Machine.from_dict(c)


def fixed_scenario(emu):
    """Prefill 12 tokens, 12 decode steps (every third with heads masked), one vision and one embed call."""
    rng = np.random.default_rng(7)
    layers, heads = emu.layers, emu.heads
    feeds = {
        "inputs_embeds": rng.standard_normal((1, 12, 48)).astype(np.float32),
        "attention_mask": np.ones((1, 12), np.int64),
        "position_ids": np.arange(12)[None],
    }
    for i in range(layers):
        feeds[f"past_key_values.{i}.key"] = feeds[f"past_key_values.{i}.value"] = np.zeros(
            (1, emu.kv_heads, 0, emu.head_dim), np.float32
        )
    runs = [emu.run("decoder", feeds, kv_state=emu.new_kv(), want_present=False)]
    kv = runs[0].kv_state
    mask = np.ones((layers, heads), bool)
    mask[0, 1] = mask[1, 3] = mask[1, 0] = False
    for step in range(12):
        pos = 12 + step
        f = {
            "inputs_embeds": rng.standard_normal((1, 1, 48)).astype(np.float32),
            "attention_mask": np.ones((1, pos + 1), np.int64),
            "position_ids": np.array([[pos]]),
        }
        runs.append(emu.run("decoder", f, kv_state=kv, want_present=False, head_mask=mask if step % 3 == 2 else None))
        kv = runs[-1].kv_state
    runs.append(emu.run("vision_encoder", {"pixel_values": rng.standard_normal((1, 2, 1, 32, 32)).astype(np.float32)}))
    runs.append(emu.run("embed_tokens", {"input_ids": np.array([[1, 2, 3]], np.int64)}))
    return runs
