"""edgekit.positions without torch: text positions for left-padded rows and decode steps, the rank a graph's
signature asks for, and the record a bundle or a converted folder carries refused in one line naming its file
when it is not a scheme (`edgekit optimize` reads a converted folder's hf_config.json, which a user may edit)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgekit.errors import ConfigError
from edgekit.positions import MROPE, POSITIONS_KEY, PositionScheme, for_rank


def test_text_positions_skip_left_padding_and_step_on():
    mask = np.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int64)
    pos, nxt = PositionScheme().prefill(mask)
    assert pos.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]] and nxt.tolist() == [3, 5]
    assert PositionScheme().step(nxt).tolist() == [[3], [5]]
    assert PositionScheme(MROPE, (1, 2, 2)).step(nxt).shape == (3, 2, 1)
    assert for_rank(pos, 3).shape == (3, 2, 5) and (for_rank(pos, 3) == pos).all()
    assert for_rank(pos, 2).tolist() == pos.tolist()


@pytest.mark.parametrize(
    "record,needle",
    [
        ([1, 4, 4], "expected an object"),
        ({"kind": "mrope", "grid": "1,4,4"}, "grid: expected a list of ints"),
        ({"kind": "mrope", "grid": [1, "4", 4]}, "grid: expected a list of ints"),
        ({"kind": "mrope", "grid": [1, True, 4]}, "grid: expected a list of ints"),
        ({"kind": "mrope", "grid": [1, 0, 4]}, "must be three positive sizes"),
        ({"kind": "alibi"}, "is not one of text, mrope"),
    ],
)
def test_a_broken_record_is_refused_naming_its_file(tmp_path, record, needle):
    (tmp_path / "hf_config.json").write_text(json.dumps({"model_type": "qwen2_vl", POSITIONS_KEY: record}))
    with pytest.raises(ConfigError, match=needle) as err:
        PositionScheme.beside(tmp_path)
    assert err.value.path == str(tmp_path / "hf_config.json")


def test_a_record_is_read_back_and_its_absence_is_text(tmp_path):
    scheme = PositionScheme(MROPE, (1, 4, 4))
    assert PositionScheme.beside(tmp_path) == PositionScheme()  # no config at all
    (tmp_path / "config.json").write_text(json.dumps({POSITIONS_KEY: scheme.to_dict()}))
    assert PositionScheme.beside(tmp_path) == scheme and scheme.span_tokens == 16
