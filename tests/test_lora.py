"""LoRA RL (``model.lora``): adapters injected with peft on the meta device, the base frozen,
the reference the base with the adapters off, merged weights equal to the adapted model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[test]' installs it)")

from rollout import lora  # noqa: E402
from rollout.models import build_empty_model, load_model, reset_non_persistent_buffers  # noqa: E402

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture()
def models(tmp_path, monkeypatch):
    """The base model and the same model with adapters (rank 4, alpha 8), built as the trainer
    builds it: on the meta device, then given the base's weights and the seeded adapters."""
    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path / "cache"))
    base = load_model("builtin:tiny", dtype=torch.float32, seed=0).eval()
    adapted = build_empty_model("builtin:tiny", dtype=torch.float32, seed=0)
    trainable = lora.inject(adapted, 4, 8.0, 0.0, TARGETS)
    start = lora.initial_adapters(adapted, seed=5)
    adapted.to_empty(device="cpu")
    reset_non_persistent_buffers(adapted, torch.device("cpu"))
    weights = base.state_dict()
    with torch.no_grad():
        for name, tensor in adapted.state_dict().items():
            tensor.copy_(start[name] if name in start else weights[lora.base_name(name)])
    return base, adapted.eval(), trainable, start


def _logits(model):
    return model(input_ids=torch.tensor([[3, 14, 15, 92, 65]])).logits


def test_only_the_adapters_train_and_the_policy_starts_as_the_base(models):
    base, adapted, trainable, start = models
    layers = base.config.num_hidden_layers
    assert len(trainable) == 2 * len(TARGETS) * layers and all(
        lora.is_adapter(n) for n in trainable
    )
    assert [n for n, p in adapted.named_parameters() if p.requires_grad] == trainable
    assert all(not start[n].any() for n in start if ".lora_B." in n)  # B = 0: W + BA = W
    assert torch.equal(_logits(adapted), _logits(base))
    again = lora.initial_adapters(adapted, seed=5)
    assert all(torch.equal(again[n], start[n]) for n in start)  # seeded: every rank alike


def test_adapters_off_is_the_base_and_folded_weights_are_the_adapted_model(models):
    base, adapted, _, _ = models
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.1)
    out = _logits(adapted)
    assert not torch.allclose(out, _logits(base), atol=1e-4)
    with lora.adapters_off(adapted):
        assert torch.equal(_logits(adapted), _logits(base))  # the reference, no second copy
    assert [n for n, p in adapted.named_parameters() if p.requires_grad]  # trainable again
    trained = {n: t for n, t in adapted.state_dict().items() if lora.is_adapter(n)}
    base.load_state_dict(lora.fold(base.state_dict(), trained, scale=8.0 / 4))
    assert torch.allclose(_logits(base), out, atol=1e-5)


def test_adapters_off_swaps_in_the_base_embedding_and_an_untied_head():
    """With the embedding and an untied LM head trained whole, ``adapters_off`` given their
    ``base_copies`` computes the base, and after it the trained model again."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.models import builtin_config_dir

    config = AutoConfig.from_pretrained(str(builtin_config_dir("builtin:tiny")))
    config.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        base = _logits(model)
    lora.inject(model, 4, 8.0, 0.0, TARGETS, embeddings=True)
    copies = lora.base_copies(model)
    assert set(copies) == {"model.embed_tokens.weight", "lm_head.weight"}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in copies:
            params[name].add_(0.05 * torch.randn(params[name].shape))
        trained = _logits(model)
        assert not torch.allclose(trained, base, atol=1e-3)
        with lora.adapters_off(model, copies):
            assert torch.equal(_logits(model), base)
        assert torch.equal(_logits(model), trained)


def test_a_target_that_matches_no_module_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path / "cache"))
    model = build_empty_model("builtin:tiny", dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"model.lora.target_modules=\['qq_proj'\]"):
        lora.inject(model, 4, 8.0, 0.0, ["qq_proj"])


@pytest.mark.parametrize("targets", [["nonexistent_proj"], ["q_proj", "nonexistent_proj"]])
def test_a_target_that_matches_nothing_is_refused_before_start_up(tmp_path, capsys, targets):
    """Each name of model.lora.target_modules must match a linear layer of model.path's model
    (known from its config.json): exit 2 and one line naming the key, the value and the layers
    there are, before Ray or a worker starts (peft alone refuses only when no name matches)."""
    from trainer.cli import main

    listed = ",".join(targets)
    keys = ["model.lora.rank=8", f"model.lora.target_modules=[{listed}]"]
    assert main(["train", f"run.dir={tmp_path / 'run'}", *keys]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"model.lora.target_modules={targets}: 'nonexistent_proj' matches no module" in err[0]
    assert "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in err[0]
    assert not (tmp_path / "run").exists()  # refused before start-up


def test_the_head_and_the_embedding_are_no_targets():
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"model.lora.target_modules: .*train_embeddings=true"):
        load_config(None, ["model.lora.rank=4", "model.lora.target_modules=[q_proj,lm_head]"])


def test_peft_names_are_those_of_peft_adapter_files(models):
    _, adapted, _, _ = models
    names = lora.peft_names(adapted.state_dict(), embeddings=False)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert all(".default." not in n for n in names)
    with_embeddings = lora.peft_names(adapted.state_dict(), embeddings=True)
    assert "base_model.model.model.embed_tokens.weight" in with_embeddings


# ---------------------------------------------------------------- the push to vLLM


def test_a_vllm_push_carries_the_adapters_unfolded_and_keeps_a_small_update(tmp_path, monkeypatch):
    """model.lora.train_embeddings=true on vLLM: the push (``WeightPush.push_state``, packed
    in model.dtype as every push is) carries the adapters and the embedding and LM head whole,
    no target's weight; vLLM serves the adapters as LoRA, computing W x + s B (A x) as the
    trainer does. A 1e-5 update of a target's weights then survives bf16 within 1 % (folded
    into a bf16 W of N(0, 0.02), W + s B A, most of it rounds away)."""
    from types import SimpleNamespace

    from rollout.engines.weights.buckets import pack_tensor, plan_buckets, unpack_bucket
    from trainer.config import load_config
    from trainer.loop.plan.lora_layout import lora_push, pushes_whole_weights
    from trainer.loop.weights.weight_push import WeightPush

    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path / "cache"))
    keys = ["rollout.engine=vllm", "model.lora.train_embeddings=true", "model.dtype=bfloat16"]
    cfg = load_config(CONFIG, keys, check_environment=False)
    assert lora_push(cfg) == "adapters" and not pushes_whole_weights(cfg)  # engines keep base
    lora_cfg = cfg.model.lora
    model = load_model("builtin:tiny", dtype=torch.float32, seed=0)
    lora.inject(model, lora_cfg.rank, lora_cfg.alpha, 0.0, lora_cfg.target_modules, embeddings=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".base_layer." in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
            elif lora.is_adapter(name):  # s B A of about 1e-5 per entry
                param.copy_(torch.randn(param.shape, generator=generator))
                param.mul_(2e-3 if ".lora_B." in name else 1e-3)
    pushed = WeightPush.push_state(SimpleNamespace(model=model, spec=SimpleNamespace(cfg=cfg)))
    assert set(pushed) == lora.trained_names(model)  # adapters, embedding, tied LM head
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(pushed)
    assert not any(".base_layer." in n for n in pushed)
    dtype = torch.bfloat16  # what the engine receives: one bucket packed in model.dtype
    (specs,), nbytes = plan_buckets(((n, t.shape) for n, t in pushed.items()), dtype, 1 << 40)
    bucket = torch.zeros(nbytes, dtype=torch.uint8)
    for spec in specs:
        pack_tensor(bucket, spec, pushed[spec.name])
    got = dict(unpack_bucket(bucket, specs))
    prefix = "model.layers.0.self_attn.q_proj"
    a, b = (pushed[f"{prefix}.lora_{x}.default.weight"].double() for x in "AB")
    update = lora_cfg.scale * b @ a  # the trainer's: W x + s B (A x)
    assert 3e-6 < update.abs().mean() < 3e-5
    a_got, b_got = (got[f"{prefix}.lora_{x}.default.weight"].double() for x in "AB")
    served = lora_cfg.scale * b_got @ a_got

    def lost(x):
        return ((x - update).norm() / update.norm()).item()

    assert lost(served) < 0.01
    weight = dict(model.named_parameters())[f"{prefix}.base_layer.weight"].double()
    folded = (weight + update).to(dtype).double() - weight.to(dtype).double()
    assert lost(folded) > 0.5  # the merged push this replaced


# ---------------------------------------------------------------- the reference, in-process


def _lora_batch():
    """GRPO rows of random tokens (2 prompts x 4 samples) with old and reference log-probs."""
    import random

    from batching import Row, StepBatch

    rnd = random.Random(3)
    rows = []
    for uid in range(2):
        prompt = [rnd.randrange(3, 90) for _ in range(6)]
        for sample in range(4):
            response = [rnd.randrange(3, 90) for _ in range(rnd.randint(3, 8))]
            rows.append(
                Row(
                    prompt_ids=prompt,
                    response_ids=response,
                    response_mask=[1] * len(response),
                    response_logprobs=[-1.0] * len(response),
                    uid=uid,
                    trajectory_id=uid * 4 + sample,
                    score=float(sample % 2),
                )
            )
    batch = StepBatch.from_rows(rows)
    for field in ("old_logprobs", "ref_logprobs"):
        batch.set_token_field(field, batch.token_fields["rollout_logprobs"].clone())
    return batch.to_numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["plain", "fsdp2-bf16"])
def test_the_reference_stays_the_base_when_the_embeddings_train(tmp_path, monkeypatch, dtype):
    """model.lora.train_embeddings=true with a KL term: after updates that move the embedding
    and LM head, the reference log-probs (the actor with its adapters off) are still the
    base model's, bit for bit, and the policy's own forward is the trained one again after
    it. At one rank, plain and under FSDP2 (bf16 compute: FSDP2 keeps the root's gathered
    parameters after a forward, which the reference must not reuse)."""
    from trainer.config import load_config
    from trainer.loop.cluster.group import free_port
    from trainer.loop.ranks.fsdp_worker import WorkerSpec
    from trainer.loop.ranks.policy import PolicyWorker

    monkeypatch.setenv("CROSSRL_CACHE", str(tmp_path / "cache"))
    keys = ["model.lora.train_embeddings=true", "algorithm.kl_coef=0.1", "train.lr=3e-2"]
    keys += [f"train.param_dtype={dtype}", "train.grad_clip=null", "run.deterministic=false"]
    cfg = load_config(CONFIG, keys)
    worker = PolicyWorker(WorkerSpec(role="actor", rank=0, cfg=cfg))
    worker.setup("127.0.0.1", free_port())
    try:
        assert worker.spec.sharded == (dtype != "float32")
        worker.load_batch([_lora_batch()])
        worker.compute_advantages()
        rows = list(range(worker.batch.num_rows))
        base = worker.compute_logprobs([rows])[1]  # B = 0, embeddings untouched: the base
        assert np.array_equal(worker.compute_ref_logprobs([rows])[1], base)
        for _ in range(3):
            worker.train_mini_batch([rows], rows)
        policy = worker.compute_logprobs([rows])[1]  # the root stays gathered after it
        assert np.abs(policy - base).max() > 1e-2  # the embeddings and adapters moved
        assert np.array_equal(worker.compute_ref_logprobs([rows])[1], base)
        assert np.array_equal(worker.compute_logprobs([rows])[1], policy)  # trained again
        worker.train_mini_batch([rows], rows)  # and the update still trains them
        assert not np.array_equal(worker.compute_logprobs([rows])[1], policy)
    finally:
        worker.shutdown()


# ---------------------------------------------------------------------------- end to end

#: The shipped LoRA job (configs/cpu/lora.yaml), short, its adapters alone trained unless a
#: run says otherwise, with a KL term (the reference: the actor with its adapters off).
CONFIG = "configs/cpu/lora.yaml"
LORA_JOB = [
    "model.lora.train_embeddings=false",
    "algorithm.kl_coef=0.01",
    "train.batch_size=4",
    "train.mini_batch_size=2",
    "rollout.n=4",
]


def _train(run_dir, *keys: str) -> None:
    from trainer.config import load_config
    from trainer.loop.start.run import run_training

    assert run_training(load_config(CONFIG, [*LORA_JOB, f"run.dir={run_dir}", *keys])) == 0


@pytest.fixture(scope="module")
def lora_runs(local_ray, tmp_path_factory):
    """The LoRA job 4 steps straight; the same 2 steps, saved, then resumed to 4; 4 steps at
    dp 2; and at dp 2 with the embeddings trained too, recording its rollouts."""
    root = tmp_path_factory.mktemp("lora")
    _train(root / "straight", "train.total_steps=4", "run.resume=never")
    _train(root / "resumed", "train.total_steps=2", "run.save_every=2", "run.resume=never")
    _train(root / "resumed", "train.total_steps=4", "run.resume=auto")
    _train(root / "dp2", "train.total_steps=4", "train.dp_size=2", "run.resume=never")
    # the embeddings and LM head (tied in builtin:tiny) trained whole beside the adapters
    _train(
        root / "embeddings",
        "train.total_steps=4",
        "train.dp_size=2",
        "model.lora.train_embeddings=true",
        "run.record_rollouts=true",
        "run.resume=never",
    )
    return root


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_from_adapters_alone_and_agrees_across_dp(lora_runs):
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.commands.parity import compare_runs
    from trainer.records.jsonl_files import read_jsonl

    for other in ("resumed", "dp2"):
        report = compare_runs(lora_runs / "straight", lora_runs / other)
        assert report.agree, (other, report.first_divergence())
    saved = FileSystemReader(str(lora_runs / "resumed/checkpoints/step_2/actor_model"))
    names = list(saved.read_metadata().state_dict_metadata)
    assert names and all(lora.is_adapter(n) for n in names)  # no base weights in it
    steps = read_jsonl(lora_runs / "straight" / "metrics.jsonl")
    assert all(m["rollout/logprob_abs_diff"] < 1e-5 for m in steps)  # adapters pushed in place
    assert steps[-1]["algorithm/kl_penalty_token_mean"] != 0.0  # the base, not the policy


@pytest.mark.slow
def test_lora_dropout_stays_out_of_the_old_log_probs(local_ray, tmp_path):
    """model.lora.dropout > 0: the old log-probs are the policy's, taken with dropout off,
    whether or not train.old_logprobs_from_update asks for them from the update's first
    forward (which drops adapter inputs): the two runs agree under crossrl parity."""
    from trainer.commands.parity import compare_runs

    keys = ["model.lora.dropout=0.5", "algorithm.kl_coef=0.0", "train.total_steps=3"]
    for flag in ("true", "false"):
        _train(tmp_path / flag, *keys, f"train.old_logprobs_from_update={flag}")
    report = compare_runs(tmp_path / "false", tmp_path / "true")
    assert report.agree, report.first_divergence


@pytest.mark.slow
def test_the_replay_of_a_lora_run_agrees_with_it(lora_runs, tmp_path):
    from trainer.commands.parity import compare_runs
    from trainer.commands.probe import probe_config, run_probe

    run = lora_runs / "embeddings"
    cfg = probe_config(
        str(run / "config.yaml"), [], rollouts=run / "rollouts", steps=4, out=tmp_path / "p"
    )
    assert run_probe(cfg, run / "rollouts") == 0
    report = compare_runs(run, tmp_path / "p")
    assert report.agree, report.first_divergence()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("keys", "named"),
    [
        (["model.lora.rank=4"], "model.lora.rank=4: checkpoint"),
        (["model.lora.rank=0"], "model.lora.rank=0: checkpoint"),
        (["model.lora.target_modules=[q_proj]"], "model.lora.target_modules"),
        (["seed=7"], "model.path=builtin:tiny: its weights are not those"),  # another base
    ],
)
def test_a_lora_checkpoint_resumes_only_with_its_adapters_on_its_base(
    lora_runs, tmp_path, capsys, keys, named
):
    import shutil

    from trainer.cli import main

    run = tmp_path / "run"
    shutil.copytree(lora_runs / "resumed", run)
    args = ["train", "--config", CONFIG, *LORA_JOB, f"run.dir={run}", "train.total_steps=6", *keys]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert named in err[-1] and "run.resume=never" in err[-1]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["straight", "embeddings"])
def test_an_exported_adapter_loads_in_peft_and_equals_the_merged_export(lora_runs, tmp_path, name):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from trainer.cli import main
    from trainer.config import load_config

    run = lora_runs / name
    assert main(["export", str(run), str(tmp_path / "adapter")]) == 0
    assert main(["export", str(run), str(tmp_path / "merged"), "--merged"]) == 0
    with safe_open(str(tmp_path / "adapter/adapter_model.safetensors"), "pt") as handle:
        names = list(handle.keys())
    assert any(".lora_A." in n for n in names)
    assert all(".lora_" in n for n in names) == (name == "straight")  # + embeddings
    cfg = load_config(str(run / "config.yaml"), [])
    base = load_model(cfg.model.path, dtype=torch.float32, seed=cfg.seed).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    plain = base(input_ids=ids).logits
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        via_peft = adapted(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        via_merge = merged.eval()(input_ids=ids).logits
    assert not torch.allclose(via_peft, plain, atol=1e-3)  # the adapters trained
    assert torch.allclose(via_peft, via_merge, atol=1e-5)


def test_export_merged_of_a_full_fine_tune_is_refused(tmp_path, capsys):
    from trainer.commands.export import ExportError, export_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model:\n  path: builtin:tiny\n")
    with pytest.raises(ExportError, match=r"--merged: .*model.lora.rank=0"):
        export_run(run, tmp_path / "out", merged=True)


def test_the_layout_starts_no_reference_and_budgets_the_adapters_alone(capsys):
    from trainer.cli import main
    from trainer.config import load_config
    from trainer.loop.plan.layout import training_roles
    from trainer.loop.plan.lora_layout import adapter_params, lora_push, pushes_whole_weights
    from trainer.loop.plan.memory_budget import estimate_memory
    from trainer.loop.plan.model_shape import model_shape

    config = "configs/gpu/qwen2.5-7b-grpo-lora.yaml"
    cfg = load_config(config, ["algorithm.kl_coef=0.01"], check_environment=False)
    assert training_roles(cfg) == ("actor",) and lora_push(cfg) == "adapters"
    # colocated engines asleep keep their base (vLLM level 1): the pushes bring adapters only
    assert not pushes_whole_weights(cfg)
    embeddings = load_config(config, ["model.lora.train_embeddings=true"], check_environment=False)
    assert lora_push(embeddings) == "adapters"  # and the embedding and LM head, whole
    assert not pushes_whole_weights(embeddings)
    shape = model_shape(cfg.model.path)
    assert adapter_params(cfg, shape) == 40_370_176  # rank 16 on 7 projections x 28 layers
    full = load_config(
        config, ["algorithm.kl_coef=0.01", "model.lora.rank=0"], check_environment=False
    )
    assert pushes_whole_weights(full)
    phases = {}
    for name, c in (("lora", cfg), ("full", full)):
        budget = estimate_memory(c, shape, 80e9, device="cuda")
        phases[name] = budget.phase("update").parts
    assert phases["lora"]["optim"] < 0.01 * phases["full"]["optim"]
    assert phases["lora"]["params"] < 0.6 * phases["full"]["params"]  # no reference copy
    assert main(["layout", "--config", config, "algorithm.kl_coef=0.01"]) == 0
    out = capsys.readouterr().out
    assert "roles actor:" in out and "reference: the actor with its adapters off" in out
    assert "weight push: the adapters only, loaded in place (vLLM serves them" in out


def test_the_base_copy_of_trained_embeddings_is_budgeted(capsys):
    """With model.lora.train_embeddings=true and a KL term the actor keeps a frozen fp32 copy
    of the base embedding and LM head for its reference: sharded like them, in every phase's
    params, and printed by crossrl layout."""
    from trainer.cli import main
    from trainer.config import load_config
    from trainer.loop.plan.lora_layout import base_copy_params
    from trainer.loop.plan.memory_budget import estimate_memory
    from trainer.loop.plan.model_shape import model_shape

    config = "configs/gpu/qwen2.5-7b-grpo-lora.yaml"
    keys = ["model.lora.train_embeddings=true"]
    kl = load_config(config, [*keys, "algorithm.kl_coef=0.01"], check_environment=False)
    off = ["algorithm.kl_coef=0.0", "algorithm.use_kl_loss=false"]
    no_kl = load_config(config, [*keys, *off], check_environment=False)
    shape = model_shape(kl.model.path)
    copy = base_copy_params(kl, shape)
    assert copy == 2 * 152_064 * 3584  # Qwen2.5-7B: embedding and untied LM head
    assert base_copy_params(no_kl, shape) == 0
    dp = kl.train.dp_size
    for phase in ("rollout", "update"):
        with_copy, without = (
            estimate_memory(c, shape, 80e9, device="cuda").phase(phase).parts["params"]
            for c in (kl, no_kl)
        )
        assert with_copy - without == pytest.approx(copy * 4 / dp)
    assert main(["layout", "--config", config, *keys, "algorithm.kl_coef=0.01"]) == 0
    out = capsys.readouterr().out
    assert f"a frozen copy of the base embedding and LM head ({copy:,} parameters)" in out
