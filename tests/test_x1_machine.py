"""The X1 machine description: the bundled file validates, bad ones are refused by field name, the hash is stable."""

from __future__ import annotations

import copy
import math

import pytest

from edgekit.errors import ConfigError
from edgekit.targets.x1.machine import (
    DEFAULT_MACHINE,
    ENERGY_ACTIONS,
    SCHEMA,
    Machine,
    load_machine,
    logic_energy_scale,
)


@pytest.fixture(scope="module")
def default():
    return load_machine()


def _with(content: dict, dotted: str, value) -> dict:
    c = copy.deepcopy(content)
    *parents, last = dotted.split(".")
    node = c
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return c


_DELETE = object()


def _raw(machine: Machine) -> dict:
    """The content as a TOML file would hold it (energies keyed pj or pj_45nm, as written)."""
    return copy.deepcopy(machine.content)


def test_default_file_validates_with_every_section_and_energy(default):
    assert default.path == str(DEFAULT_MACHINE)
    assert default.machine.name == "x1-default"
    for section, params in SCHEMA.items():
        for key in params:
            assert getattr(getattr(default, section), key) is not None
    assert set(default.energy) == set(ENERGY_ACTIONS)
    for action, e in default.energy.items():
        assert e.pj > 0 and e.source.strip(), action


def test_logic_energies_are_horowitz_45nm_scaled_to_the_stated_node(default):
    scale = logic_energy_scale(default.process.node_nm, default.process.supply_v)
    assert scale == pytest.approx((7 / 45) * (0.75 / 0.9) ** 2)
    mac = default.energy["mac_int8xint8"]
    assert mac.pj_45nm == pytest.approx(0.3)  # int8 mult 0.2 + int32 add 0.1
    assert mac.pj == pytest.approx(0.3 * scale)
    assert default.energy["near_memory_read_bit"].pj_45nm is None  # calibrated at the node, not scaled
    assert "CALIBRATED" in default.energy["near_memory_read_bit"].source


@pytest.mark.parametrize(
    "field",
    [
        "clock.ghz",
        "sram.kv_banks",
        "near_memory.bandwidth_gbs",
        "numerics.kv_bits",
        "energy.dram_read_bit",
        "energy.mac_fp16.source",
        "power",
        "energy",
    ],
)
def test_missing_field_is_refused_by_name(default, field):
    with pytest.raises(ConfigError, match=f"missing field '{field}'"):
        Machine.from_dict(_with(_raw(default), field, _DELETE), "m.toml")


@pytest.mark.parametrize(
    "field,value",
    [
        ("clock.ghz", 0.0),
        ("clock.ghz", 1000.0),
        ("clock.ghz", math.nan),
        ("near_memory.bandwidth_gbs", -5.0),
        ("near_memory.bandwidth_gbs", 7.2e8),
        ("sram.banks", 0),
        ("sram.kv_banks", 2.5),
        ("matrix.rows", "8"),
        ("energy.mac_fp16.pj_45nm", 0.0),
        ("energy.dram_read_bit.pj", 8000.0),
        ("power.static_w", True),
    ],
)
def test_absurd_value_is_refused_by_name(default, field, value):
    with pytest.raises(ConfigError, match=f"'{field}'") as err:
        Machine.from_dict(_with(_raw(default), field, value), "m.toml")
    assert err.value.path == "m.toml"


@pytest.mark.parametrize(
    "field,value,named",
    [
        ("sram.kv_banks", 96, "sram.kv_banks"),  # every bank for KV: nowhere left for activations
        ("matrix.int8_weights_per_cycle", 4096, "matrix.int8_weights_per_cycle"),
        ("numerics.weight_group_size", 48, "numerics.weight_group_size"),
        ("numerics.accumulator_bits", 16, "numerics.accumulator_bits"),
    ],
)
def test_inconsistent_fields_are_refused_by_name(default, field, value, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        Machine.from_dict(_with(_raw(default), field, value))


def test_unknown_fields_and_double_energy_are_refused(default):
    with pytest.raises(ConfigError, match="unknown field 'clock.mhz'"):
        Machine.from_dict(_with(_raw(default), "clock.mhz", 1000.0))
    with pytest.raises(ConfigError, match="unknown field 'cache'"):
        Machine.from_dict(_with(_raw(default), "cache", {"kib": 1}))
    with pytest.raises(ConfigError, match="exactly one of"):
        Machine.from_dict(_with(_raw(default), "energy.mac_fp16.pj", 0.2))


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found") as err:
        load_machine(tmp_path / "absent.toml")
    assert "absent.toml" in str(err.value)
    bad = tmp_path / "bad.toml"
    bad.write_text("[clock\nghz = 1")
    with pytest.raises(ConfigError, match="not valid TOML") as err:
        load_machine(bad)
    assert err.value.path == str(bad)


def test_hash_ignores_layout_comments_and_int_vs_float(default, tmp_path):
    text = DEFAULT_MACHINE.read_text()
    edited = "# a new comment\n\n" + text.replace("ghz = 1.0", "ghz   =   1").replace(
        "bank_kib = 256.0", "bank_kib = 256"
    )
    assert edited != text
    p = tmp_path / "same.toml"
    p.write_text(edited)
    assert load_machine(p).hash == default.hash == load_machine().hash
    assert len(default.hash) == 64 and default.short_hash == default.hash[:16]


def _numeric_leaves(content: dict, prefix: str = ""):
    for key, value in content.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _numeric_leaves(value, name + ".")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield name, value


def test_hash_changes_with_every_parameter(default):
    leaves = [(f, v) for f, v in _numeric_leaves(default.content) if f != "machine.isa_version"]  # only 1 exists
    numeric_params = sum(p.kind is not str for params in SCHEMA.values() for p in params.values())
    assert len(leaves) == numeric_params - 1 + len(ENERGY_ACTIONS)  # every parameter and energy is nudged
    seen = {default.hash}
    for field, value in leaves:
        # a nudge that stays valid: +1 on integers where the schema allows, else a small relative change
        section, key = field.split(".")[0], field.split(".")[1]
        p = SCHEMA.get(section, {}).get(key)
        if isinstance(value, int) and p is not None:
            new = value - 1 if p.hi is not None and value + 1 > p.hi else value + 1
            if field in ("numerics.weight_group_size", "numerics.kv_group_size"):
                new = value * 2
            if field == "sram.banks":
                new = value + 1
        else:
            new = value * 1.01
        try:
            m = Machine.from_dict(_with(default.content, field, new))
        except ConfigError as err:
            pytest.fail(f"nudging {field} to {new} was refused: {err}")
        assert m.hash not in seen, field
        seen.add(m.hash)
    text_changed = Machine.from_dict(_with(default.content, "energy.dram_read_bit.source", "other source"))
    assert text_changed.hash not in seen


def test_every_schema_section_is_declared_on_machine_for_the_type_checker():
    from edgekit.targets.x1.machine import SCHEMA, Machine

    assert set(SCHEMA) == {k for k, v in Machine.__annotations__.items() if v == "Section"}
