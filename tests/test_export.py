"""``crossrl export``: the default job's run becomes a Hugging Face model directory that
transformers loads with the trainer's logits and tokenizer, and that trains again as
``model.path``. Bad input exits 2 with one line naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from trainer.cli import main
from trainer.config import load_config
from trainer.loop.start.run import run_training
from trainer.records.checkpoint import find_latest, read_model_weights
from trainer.records.jsonl_files import read_jsonl

pytestmark = pytest.mark.slow

SHORT = ["train.batch_size=4", "train.mini_batch_size=2", "rollout.n=4"]
#: A multi-turn chat as the agent loop renders it: newlines, runs of spaces, tabs, digits.
CHAT = [
    {"role": "system", "content": "You recall numbers.\nAnswer with digits only."},
    {"role": "user", "content": "remember 20 3  and\t7"},
    {"role": "assistant", "content": "ok: 20, 3, 7"},
    {"role": "user", "content": "what came second?\n\n(one number)"},
]


@pytest.fixture(scope="module")
def run_dir(local_ray, tmp_path_factory):
    """The default job (configs/cpu/tiny.yaml, builtin:tiny), 2 steps, a checkpoint each."""
    run = tmp_path_factory.mktemp("export") / "run"
    overrides = [*SHORT, f"run.dir={run}", "train.total_steps=2", "run.save_every=1"]
    assert run_training(load_config(None, [*overrides, "run.resume=never"])) == 0
    return run


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "model"
    assert main(["export", str(run_dir), str(out)]) == 0
    return out


def _export(capsys, *args: str) -> tuple[int, str]:
    code = main(["export", *args])
    return code, capsys.readouterr().err.strip()


def _trainer_logits(run_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, V]`` of the trainer's own actor (FSDP2 worker, the run's config) after
    loading the run's latest checkpoint."""
    import hal
    from trainer.loop.cluster.group import free_port
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    cfg = load_config(str(run_dir / "config.yaml"), [])
    worker = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
    worker.setup("127.0.0.1", free_port())
    try:
        worker.load_pieces(str(find_latest(run_dir)))
        worker.model.eval()
        with torch.no_grad():
            positions = torch.arange(len(ids))
            cu = torch.tensor([0, len(ids)], dtype=torch.int32)
            return hal.packed_forward(worker.model, ids, positions, cu).float()
    finally:
        worker.shutdown()


def test_export_loads_in_transformers_with_the_trainers_logits(run_dir, exported):
    from transformers import AutoModelForCausalLM

    names = {p.name for p in exported.iterdir()}
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert name in names, f"{name} missing from {sorted(names)}"
    assert not [n for n in names if n.startswith(".")]  # no staging leftovers inside
    assert [p.name for p in exported.parent.iterdir()] == ["model"]  # nor beside it

    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    ids = torch.tensor([1, 80, 72, 83, 5, 20, 30, 7, 9, 2, 5, 1, 68])
    with torch.no_grad():
        hf = model(input_ids=ids[None], use_cache=False).logits[0].float()
    trainer = _trainer_logits(run_dir, ids)
    torch.testing.assert_close(hf, trainer, rtol=1e-5, atol=1e-5)
    loaded = model.state_dict()  # the checkpoint's trained weights, exactly (fp32)
    for name, tensor in read_model_weights(find_latest(run_dir), "actor").items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


def test_tokenizer_survives_the_trip(exported):
    """The shipped tokenizer beside a qwen2 config.json: AutoTokenizer would build a Qwen2
    tokenizer that drops spaces and newlines; the export must tokenize like the run did."""
    from transformers import AutoTokenizer

    from rollout.tokenizer import chat_token_ids, load_tokenizer

    before = load_tokenizer("builtin:tiny")
    want = chat_token_ids(before, CHAT)
    for tok in (AutoTokenizer.from_pretrained(str(exported)), load_tokenizer(exported)):
        got = chat_token_ids(tok, CHAT)
        assert got == want, type(tok).__name__
        assert tok.decode(got) == before.decode(want)
        assert tok.eos_token == before.eos_token and tok.pad_token == before.pad_token


def test_export_of_a_step_in_shards_and_model_dtype(run_dir, tmp_path):
    """``--step`` picks the checkpoint; ``--max-shard-mb`` below the model's size writes
    shards with an index; the weights are in the run's ``model.dtype``."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    bf16_run = tmp_path / "run"
    shutil.copytree(run_dir, bf16_run)
    config = yaml.safe_load((bf16_run / "config.yaml").read_text())
    config["model"]["dtype"] = "bfloat16"
    (bf16_run / "config.yaml").write_text(yaml.safe_dump(config))

    out = tmp_path / "model"
    assert main(["export", str(bf16_run), str(out), "--step", "1", "--max-shard-mb", "0.1"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    with safe_open(str(out / shards[0]), "pt") as fh:
        assert all(fh.get_tensor(k).dtype == torch.bfloat16 for k in fh.keys())

    step1 = read_model_weights(run_dir / "checkpoints" / "step_1", "actor")
    step2 = read_model_weights(run_dir / "checkpoints" / "step_2", "actor")
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(loaded[name], step1[name].bfloat16().float(), rtol=0, atol=0)
    assert not torch.equal(step1[name], step2[name])  # step 1 really is another checkpoint


def test_bad_input_exits_2_naming_it(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    cases = [
        ((str(tmp_path / "nope"), str(out)), "RUN_DIR"),
        ((str(tmp_path), str(out)), "config.yaml"),
        ((str(run_dir), str(out), "--step", "9"), "--step 9"),
    ]
    for args, named in cases:
        code, err = _export(capsys, *args)
        assert code == 2 and named in err and len(err.splitlines()) == 1, err
        assert not out.exists()  # nothing written
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = _export(capsys, str(run_dir), str(out))
    assert code == 2 and "OUT_DIR" in err and str(out) in err and len(err.splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # untouched


def test_exported_model_trains_as_model_path(exported, tmp_path):
    run = tmp_path / "again"
    cfg = load_config(
        None,
        [*SHORT, f"run.dir={run}", f"model.path={exported}", "train.total_steps=1"],
    )
    assert run_training(cfg) == 0
    (metrics,) = read_jsonl(run / "metrics.jsonl")
    assert metrics["batch/num_rows"] >= 4 * 4 and metrics["actor/grad_norm"] > 0
