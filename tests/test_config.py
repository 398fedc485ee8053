"""Config: merge order, types, and the one-line errors users see."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import JobConfig, load_config
from orchestrator.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def conf(tmp_path, monkeypatch):
    d = tmp_path / "conf"
    (d / "cluster").mkdir(parents=True)
    (d / "defaults.yaml").write_text("train:\n  lr: 0.5\n  max_steps: 11\n  eval_interval: 7\n")
    (d / "cluster" / "big.yaml").write_text("train:\n  max_steps: 22\n  eval_interval: 8\ncluster:\n  num_workers: 8\n")
    monkeypatch.setenv("ORCHESTRATOR_CONF_DIR", str(d))
    return d


def test_merge_order_schema_defaults_includes_job_overrides(conf, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("defaults: [cluster/big]\nname: j\ntrain:\n  eval_interval: 9\n")
    cfg = load_config(job, ["train.global_batch_size=64"])
    assert cfg.train.lr == 0.5  # conf/defaults.yaml over the schema
    assert cfg.train.max_steps == 22  # the job's defaults list over conf/defaults.yaml
    assert cfg.cluster.num_workers == 8
    assert cfg.train.eval_interval == 9  # the job file over its defaults list
    assert cfg.train.global_batch_size == 64  # overrides last
    assert cfg.train.beta2 == JobConfig().train.beta2  # untouched keys keep the schema default
    cfg = load_config(job, ["train.eval_interval=3"])
    assert cfg.train.eval_interval == 3


def test_overrides_are_typed():
    cfg = load_config(ROOT / "jobs" / "llm.yaml", ["parallel.tp=2", "train.lr=1e-3", "parallel.strategy=zero2"])
    assert cfg.parallel.tp == 2 and isinstance(cfg.parallel.tp, int)
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.parallel.strategy == "zero2"
    assert load_config(ROOT / "jobs" / "llm.yaml", ["parallel.tp=auto"]).parallel.tp == "auto"


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["train.max_steps=bogus"], "train.max_steps"),
        (["nosuch.key=1"], "unknown key 'nosuch'"),
        (["train.nosuch=1"], "allowed here: beta1"),
        (["parallel.strategy=zero4"], "expected one of auto, ddp, zero1"),
        (["parallel.tp=3"], "must divide model.n_head"),
        (["model.n_embd=130"], "divisible by model.n_head"),
        (["train.max_steps=0"], "train.max_steps"),
        (["elastic.leave_timeout_s=0"], "elastic.leave_timeout_s"),
        (["elastic.keep_survivors=maybe"], "elastic.keep_survivors"),
        (["data.path=/no/such/file.txt"], "data.path"),
        (["justakey"], "expected key=value"),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(ROOT / "jobs" / "llm.yaml", overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_yaml_and_missing_includes(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    inc = tmp_path / "inc.yaml"
    inc.write_text("defaults: [cluster/nope]\n")
    with pytest.raises(ConfigError, match="defaults entry 'cluster/nope' not found"):
        load_config(inc)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", "jobs/llm.yaml", "train.max_steps=bogus"],
        ["submit", "jobs/no-such.yaml"],
        ["submit", "jobs/llm.yaml", "nosuch.key=1"],
    ],
)
def test_cli_errors_are_one_line_exit_2(argv, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_cli_debug_shows_traceback_and_module_entry_point(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--debug", "submit", "jobs/no-such.yaml"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "no such file" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "submit" in proc.stdout and "probe" in proc.stdout
