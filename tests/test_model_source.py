"""The user's model module travels with the job: what is shipped (a local module), what is not
(installed packages, this project), and that `submit --address` puts it in the job's runtime_env."""

from __future__ import annotations

from pathlib import Path

import orchestrator.connect.remote as remote
from orchestrator.config import ModelConfig, load_config
from orchestrator.workloads.source import model_modules

ROOT = Path(__file__).resolve().parent.parent


def test_only_local_modules_are_shipped(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "local_lm.py").write_text("def build():\n    pass\n")
    pkg = tmp_path / "local_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text("def build():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert model_modules(ModelConfig(factory="local_lm:build")) == [str(tmp_path / "local_lm.py")]
    assert model_modules(ModelConfig(factory="local_pkg.models:build")) == [str(pkg)]
    assert model_modules(ModelConfig()) == []  # the built-in GPT is on every worker already
    assert model_modules(ModelConfig(factory="torch.nn:Linear")) == []  # installed
    assert model_modules(ModelConfig(factory="no_such_module_xyz:build")) == []  # its import error says so later

    def in_main():
        pass

    in_main.__module__ = "__main__"  # a notebook's function travels pickled, by value
    assert model_modules(ModelConfig(), in_main) == []


def test_submit_to_an_address_ships_the_model_module(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "remote_lm.py").write_text("def build():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)
    sent = {}

    class Client:
        def submit_job(self, **kwargs):
            sent.update(kwargs)
            return kwargs["submission_id"]

    monkeypatch.setattr(remote, "client", lambda address: Client())
    remote.submit_remote("http://127.0.0.1:8265", "examples/own_model/job.yaml", ["model.factory=remote_lm:build"])
    assert sent["runtime_env"]["py_modules"] == [str(tmp_path / "remote_lm.py")]
    assert sent["runtime_env"]["working_dir"] == str(ROOT)
    assert load_config(ROOT / "examples/own_model/job.yaml").model.factory == "mymodel:build"
