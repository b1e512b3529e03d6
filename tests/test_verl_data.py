"""verl-format datasets (parquet and jsonl): chat-message prompts, data_source, reward_model,
extra_info; plain prompts keep working; a bad row fails when the file is opened, naming the
file, the row and the field."""

from __future__ import annotations

import json

import pytest

from rollout.envs.prompts import PromptSource, check_prompt_file

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def verl_rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k" if i % 2 == 0 else "math",
            "prompt": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": f"What is {i} + {i}?"},
            ],
            "ability": "math",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


def test_verl_parquet_rows_reach_the_env(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows(4))
    assert check_prompt_file(path) == 4
    items = PromptSource(str(path), seed=0).take(0, 4)
    row = next(i.env_kwargs for i in items if i.env_kwargs["extra_info"]["index"] == 3)
    assert row["prompt"][0] == {"role": "system", "content": "Answer briefly."}
    assert row["reward_model"]["ground_truth"] == "6"
    assert row["data_source"] == "math"


def test_plain_and_verl_jsonl_rows_mix(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [{"prompt": "plain", "answer": "1"}, *verl_rows(1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert check_prompt_file(path) == 2


def test_validation_set_is_every_record_in_file_order(tmp_path):
    path = write_parquet(tmp_path / "val.parquet", verl_rows(5))
    items = PromptSource(str(path), seed=3, key="data.val_source").all_records()
    assert [i.env_kwargs["extra_info"]["index"] for i in items] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda r: r.update(prompt=[]), '"prompt"'),
        (lambda r: r["prompt"][1].update(role="robot"), '"prompt[1].role"'),
        (lambda r: r["prompt"][0].update(content=None), '"prompt[0].content"'),
        (lambda r: r["reward_model"].update(ground_truth=None), '"reward_model.ground_truth"'),
        (lambda r: r.update(reward_model="72"), '"reward_model"'),
        (lambda r: r.update(data_source=""), '"data_source"'),
    ],
)
def test_a_bad_late_row_fails_at_open_naming_file_row_and_field(tmp_path, mutate, field):
    rows = verl_rows(900)
    mutate(rows[899])
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as err:
        PromptSource(str(path), seed=0)
    assert f"{path}:900" in str(err.value) and field in str(err.value)


def test_bad_parquet_row_names_the_row(tmp_path):
    rows = verl_rows(3)
    rows[2]["prompt"] = [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=r"row 2: field \"prompt\[1\]\.role\""):
        check_prompt_file(path, key="data.val_source")
