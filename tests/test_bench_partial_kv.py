"""``bench.partial_kv``: a call continued after weight loads against one never stopped; its
loads land through the shipped ``VersionedEngine`` and its table reads its result. No timing is
asserted."""

from __future__ import annotations

import pytest

from bench import partial_kv


def test_loads_land_mid_call_and_the_table_reports_them(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path / "cache"))
    result = partial_kv.run(rows=2, new_tokens=12, every=3, repeats=1)
    assert result["loads"] >= 1 and result["tokens_sampled"] == 24
    assert result["tokens_prefilled_again"] > 0
    assert result["ratio"] == pytest.approx(result["continued_s"] / result["whole_s"])
    table = partial_kv.format_table(result)
    assert "| continued (KV recomputed after each load) |" in table


def test_a_count_below_one_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        partial_kv.main(["--every", "0"])
    assert "--every=0: must be >= 1" in capsys.readouterr().err
