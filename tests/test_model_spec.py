"""The planner learns a model from the module: exact parameters, the repeated block, FLOPs and
activation bytes measured on the meta device; bad models fail in one line naming the key."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.commands.plan import described_topology
from orchestrator.config import ModelConfig, load_config
from orchestrator.errors import ConfigError, PlanError
from orchestrator.planning import model_math as mm
from orchestrator.planning import plan_job
from orchestrator.planning.activations import activation_profile
from orchestrator.workloads.inspect import model_spec
from orchestrator.workloads.llama import build as llama

ROOT = Path(__file__).resolve().parent.parent
FOUR_GPUS = str(ROOT / "tests/fixtures/topology/topo_4gpu_pcie_pxb_pix_nccl667.txt")


def test_gpt_measured_equals_its_formulas() -> None:
    # The built-in GPT as any factory: what the meta-device measurement finds is what the
    # GPT-2 formulas (and the published oracles they reproduce) say.
    m = ModelConfig(factory="orchestrator.workloads.gpt:build", n_layer=3, n_embd=96, n_head=4, block_size=64)
    spec = model_spec(m)
    shape = mm.ModelShape.from_config(m)
    assert spec.params == mm.param_count(shape)
    assert (spec.blocks, spec.block_params, spec.root_params) == (3, mm.block_params(shape), mm.root_params(shape))
    assert spec.block_forward_flops_per_token * 3 == mm.forward_flops_per_token_layers(shape)
    measured = mm.ModelShape.from_spec(spec)
    for batch, rec in ((4, "none"), (2, "full")):
        assert mm.flops_per_step(measured, batch, rec) == pytest.approx(mm.flops_per_step(shape, batch, rec), rel=1e-12)
    assert spec.tp_sharded_params == mm.tp_param_split(shape)[0]
    assert spec.tied_embeddings and spec.block_class == "Block" and spec.hidden == 96 and spec.heads == 4
    # What MemTracker finds the GPT keeping on the meta device is what the planner's count of its
    # layers says, recompute mode by recompute mode, and the split tensor parallelism divides.
    for rec in ("none", "selective", "full"):
        by_count = activation_profile(shape, 4, 1, rec, 4).kept
        assert activation_profile(measured, 4, 1, rec, 4).kept == pytest.approx(by_count, rel=0.01), rec
    assert spec.tp_sharded_activation_fraction == pytest.approx(12 / 16, rel=0.03)


def test_llama_flops_the_planner_prices_are_those_of_the_whole_model() -> None:
    # The spec measures one block and extrapolates; the step the planner prices must be what
    # FlopCounterMode counts for the whole model's forward (and twice that for backward).
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    args = {"dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 300, "ffn_dim": 96}
    spec = model_spec(ModelConfig(factory="orchestrator.workloads.llama:build", args=args, block_size=32))
    counter = FlopCounterMode(display=False)
    with torch.device("meta"), counter:
        llama(**args)(torch.zeros(2, 32, dtype=torch.long))
    shape = mm.ModelShape.from_spec(spec)
    assert mm.flops_per_step(shape, 2, "none") == pytest.approx(3 * counter.get_total_flops(), rel=1e-9)
    assert mm.flops_per_step(shape, 2, "full") > mm.flops_per_step(shape, 2, "none")


@pytest.mark.parametrize("preset, params", [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)])
def test_llama3_presets_have_the_published_parameter_counts(preset: str, params: int) -> None:
    spec = model_spec(ModelConfig(factory="orchestrator.workloads.llama:build", args={"preset": preset},
                                  block_size=256))
    assert spec.params == params
    assert not spec.tied_embeddings and spec.kv_heads == 8 and spec.tp_plan and spec.block_class == "DecoderLayer"


def test_llama_spec_counts_the_real_module_exactly() -> None:
    args = {"dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 300, "ffn_dim": 96}
    spec = model_spec(ModelConfig(factory="orchestrator.workloads.llama:build", args=args, block_size=32))
    model = llama(**args)
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert spec.block_params == sum(p.numel() for p in model.layers[0].parameters())
    # Every q/k/v/o and MLP matrix is sharded by the plan; norms and embeddings are not.
    assert spec.tp_sharded_params == 3 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 96)


def test_hf_llama_by_config(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    cfg.to_json_file(tmp_path / "config.json")
    spec = model_spec(ModelConfig(hf_config=str(tmp_path / "config.json"), block_size=32))
    model = transformers.LlamaForCausalLM(cfg)
    assert spec.params == sum(p.numel() for p in model.parameters())  # the tied head counted once
    assert spec.tied_embeddings and spec.tp_plan and spec.blocks == 2 and spec.block_class == "LlamaDecoderLayer"
    assert (spec.heads, spec.kv_heads, spec.hidden, spec.vocab) == (4, 2, 64, 320)


def _module(tmp_path: Path, monkeypatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))


PLAIN = """
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self, vocab, dim):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))
            self.out = nn.Linear(dim, vocab)

        def forward(self, idx):
            x = self.emb(idx)
            for f in self.layers:
                x = x + f(x).relu()
            return self.out(x)

    def build(vocab=256, dim=16):
        return Net(vocab, dim)

    def not_a_module(**kw):
        return 42

    class Pooled(Net):
        def forward(self, idx):
            return super().forward(idx).mean(1)

    def flat(**kw):
        return Pooled(256, 8)
"""


def test_a_model_without_a_tp_plan_gets_no_tensor_parallelism(tmp_path, monkeypatch) -> None:
    _module(tmp_path, monkeypatch, "plainmodel_a", PLAIN)
    cfg = load_config(None, ["model.factory=plainmodel_a:build", "model.args={dim: 32}", "cluster.gpu=A100"])
    spec = model_spec(cfg.model)
    assert spec.params == 256 * 32 + 3 * (32 * 32 + 32) + 32 * 256 + 256
    assert not spec.tp_plan and spec.blocks == 3
    topo = described_topology(cfg, FOUR_GPUS, 1, None)
    plan = plan_job(cfg, topo, spec)
    assert plan.mesh.tp == 1 and plan.model.params == spec.params and not plan.model.tp_plan
    assert "tensor parallelism: none, the model declares no tensor-parallel plan" in plan.explanation
    cfg.parallel.tp = 2
    with pytest.raises(PlanError, match="declares no tensor-parallel plan, so only tp=1 can run"):
        plan_job(cfg, topo, spec)


def test_llama3_8b_plans_on_dgx_h100() -> None:
    cfg = load_config(ROOT / "jobs/llama3-8b-dgx-h100.yaml")
    spec = model_spec(cfg.model)
    plan = plan_job(cfg, described_topology(cfg, cfg.cluster.topology_file, cfg.cluster.nodes,
                                            str(ROOT / "jobs/llama3-8b-dgx-h100.yaml")), spec)
    assert plan.fits and plan.model.params == 8_030_261_248 and plan.model.block_class == "DecoderLayer"
    # 6 N per token plus attention: the FLOPs the plan prices are at least the dense 6 N D.
    tokens = cfg.train.global_batch_size * cfg.model.block_size
    assert plan.model.flops_per_step >= 6 * spec.params * tokens * 0.9


@pytest.mark.parametrize("factory, args, message", [
    ("no_such_module_xyz:build", "{}", "key 'model.factory': cannot import 'no_such_module_xyz'"),
    ("plainmodel_b:missing", "{}", "key 'model.factory': module 'plainmodel_b' has no 'missing'"),
    ("plainmodel_b:not_a_module", "{}", "returned int, not a torch.nn.Module"),
    ("plainmodel_b:flat", "{}", "must return logits [B, T, V]"),
    ("plainmodel_b:build", "{vocab: 100}", "key 'model.args': the model's vocabulary (100 logits) is smaller"),
    ("plainmodel_b:build", "{width: 3}", "key 'model.args': plainmodel_b:build(width) failed: TypeError"),
])
def test_bad_models_fail_in_one_line_naming_the_key(tmp_path, monkeypatch, factory, args, message) -> None:
    _module(tmp_path, monkeypatch, "plainmodel_b", PLAIN)
    cfg = load_config(None, [f"model.factory={factory}", f"model.args={args}"])
    with pytest.raises(ConfigError) as e:
        model_spec(cfg.model)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("factory, message", [
    ("no_such_module_xyz:build", "key 'model.factory': cannot import"),
    # imports, builds, and only its measured forward breaks the contract
    ("plainmodel_c:flat", "must return logits [B, T, V]"),
])
@pytest.mark.ray
@pytest.mark.slow
def test_bad_model_from_the_command_line_is_one_line_exit_2(tmp_path, factory, message) -> None:
    """The model is measured while Ray starts (`start_measuring`); one that breaks the contract
    still ends the submit in one line, with no run directory (nor the runs directory it made) left."""
    (tmp_path / "plainmodel_c.py").write_text(textwrap.dedent(PLAIN))
    runs = tmp_path / "runs"
    r = subprocess.run([sys.executable, "-m", "orchestrator", "submit", str(ROOT / "jobs/llm.yaml"),
                        f"model.factory={factory}", "model.args={vocab: 300, dim: 8}", f"monitor.runs_dir={runs}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not runs.exists()


def test_a_model_is_measured_alongside_whatever_the_driver_does_meanwhile(tmp_path, monkeypatch) -> None:
    from orchestrator.control.preflight import measure_model, start_measuring

    _module(tmp_path, monkeypatch, "plainmodel_d", PLAIN)
    cfg = load_config(None, ["model.factory=plainmodel_d:build", "model.args={vocab: 300, dim: 8}"])
    assert start_measuring(cfg).result() == measure_model(cfg)
    bad = load_config(None, ["model.factory=plainmodel_d:flat", "model.args={vocab: 300, dim: 8}"])
    with pytest.raises(ConfigError, match="must return logits"):
        start_measuring(bad).result()
    # The built-in GPT is priced from its config: nothing to wait for, no thread, no torch.
    builtin = start_measuring(load_config(ROOT / "jobs/llm.yaml", []))
    assert builtin.done() and builtin.result() is None


def test_tensor_parallel_all_reduces_are_counted_from_the_models_own_plan() -> None:
    from dataclasses import replace

    from orchestrator.planning.cost import tp_all_reduces_per_block

    args = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "ffn_dim": 96}
    spec = model_spec(ModelConfig(factory="orchestrator.workloads.llama:build", args=args, block_size=32))
    # q, k, v, gate and up are column-parallel; o and down row-parallel.
    assert (spec.tp_colwise_per_block, spec.tp_rowwise_per_block) == (5, 2)
    assert tp_all_reduces_per_block(mm.ModelShape.from_spec(spec)) == (2, 5)
    assert tp_all_reduces_per_block(mm.ModelShape(layers=2, hidden=64, heads=4, vocab=256, seq=32)) == (2, 2)
    cfg = load_config(None, ["model.block_size=32", "parallel.strategy=ddp", "parallel.tp=2",
                             "train.global_batch_size=8", "train.micro_batch_size=4", "cluster.gpu=A100"])
    topo = described_topology(cfg, FOUR_GPUS, 1, None)
    counted = plan_job(cfg, topo, spec)
    fused = plan_job(cfg, topo, replace(spec, tp_colwise_per_block=0, tp_rowwise_per_block=0))
    # Seven all-reduces per block instead of the fused model's four; the compute is the same.
    assert counted.step_time.compute_s == fused.step_time.compute_s
    assert counted.step_time.comm_s > fused.step_time.comm_s
