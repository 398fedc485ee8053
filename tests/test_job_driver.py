"""The driver a Jobs API submission starts moves to a hard-linked snapshot of its working
directory before it connects (the remote test shows why); where it cannot, it runs in place."""

from __future__ import annotations

import os

import pytest

from orchestrator.connect import job_driver
from orchestrator.connect.remote import REMOTE_RUN_ENV


def test_the_snapshot_links_every_file_so_removing_the_original_keeps_them(tmp_path):
    src = tmp_path / "_ray_pkg_0123"
    (src / "orchestrator" / "control").mkdir(parents=True)
    (src / "orchestrator" / "control" / "driver.py").write_text("x = 1\n")
    (src / "jobs").mkdir()
    (src / "jobs" / "llm.yaml").write_text("name: llm\n")
    dst = job_driver.snapshot(src, tmp_path / "_ray_pkg_0123.driver-1")
    original = src / "orchestrator" / "control" / "driver.py"
    copy = dst / "orchestrator" / "control" / "driver.py"
    assert os.stat(copy).st_ino == os.stat(original).st_ino  # a link, not a copy
    import shutil

    shutil.rmtree(src)  # what Ray's agent does before unpacking again
    assert copy.read_text() == "x = 1\n" and (dst / "jobs" / "llm.yaml").is_file()


def test_only_a_jobs_api_driver_moves_and_one_that_cannot_runs_in_place(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(job_driver.SNAPSHOT_ENV, raising=False)
    monkeypatch.delenv(REMOTE_RUN_ENV, raising=False)

    def refuse(*_):
        raise AssertionError("a local driver must not move")

    monkeypatch.setattr(job_driver.os, "execve", refuse)
    job_driver.run_from_snapshot(["submit", "jobs/llm.yaml"])  # not a Jobs API driver: nothing
    monkeypatch.setenv(REMOTE_RUN_ENV, "1")

    def fail(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(job_driver, "snapshot", fail)
    job_driver.run_from_snapshot(["submit", "jobs/llm.yaml"])
    assert "cannot snapshot the job's working directory" in capsys.readouterr().err
    assert os.getcwd() == str(tmp_path)


def test_the_moved_driver_removes_its_snapshot_at_exit(tmp_path, monkeypatch):
    registered = []
    monkeypatch.setattr(job_driver.atexit, "register", lambda fn, *a, **k: registered.append((fn, a, k)))
    monkeypatch.setenv(job_driver.SNAPSHOT_ENV, str(tmp_path / "snap"))
    (tmp_path / "snap").mkdir()
    job_driver.run_from_snapshot(["submit", "jobs/llm.yaml"])
    (fn, args, kwargs), = registered
    fn(*args, **kwargs)
    assert not (tmp_path / "snap").exists()


@pytest.fixture(autouse=True)
def _keep_cwd():
    here = os.getcwd()
    yield
    os.chdir(here)
