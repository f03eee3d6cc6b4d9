"""The front door (`request.RunRequest.build`): every form of a config makes the same run, the steps reach every
pipeline, a resume names its own directory and config, and what will not do is refused before anything is written."""

import json

import pytest
import yaml
from two_pipelines import FLOW, LM

from dovetail.config.common import ConfigError
from dovetail.config.load import dump_config, load_config, parse_config
from dovetail.config.multiplex import pipeline_configs
from dovetail.request import DEFAULT_OUT, RunRequest, checked_config


def test_a_path_a_tree_and_a_config_object_make_the_same_request(tmp_path):
    tree = {**LM, "train": {"lr": 1e-3, "steps": 7}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    overrides = ["algo.group_size=2"]
    requests = [
        RunRequest.build(form, overrides, out=tmp_path / "out", steps=3)
        for form in (path, tree, load_config(None, [f"{k}={json.dumps(v)}" for k, v in LM.items()]))
    ]
    dumps = [request.config.model_dump(mode="json") for request in requests]
    for dump in dumps:  # a file's config records where its rewards import from: the rest is the same run
        dump.pop("import_dirs", None)
    assert dumps[0] == dumps[1] == dumps[2]
    assert all(r.steps == 3 and r.config.algo.group_size == 2 and r.config.train.lr == 1e-3 for r in requests)
    assert requests[1].pipeline_dirs == {requests[1].config.pipeline_name: tmp_path / "out"}
    assert tree["train"]["steps"] == 7, "the caller's tree is left as it was"


def test_the_steps_reach_every_pipeline_of_a_multiplexed_run(tmp_path):
    tree = {"kind": "multiplex", "policy": "jigsaw", "cluster": {"devices": 2}, "pipelines": [LM, FLOW]}
    request = RunRequest.build(tree, out=tmp_path / "mux", steps=5)
    assert request.multiplexed and request.steps == 5
    assert {name: p.train.steps for name, p in pipeline_configs(request.config).items()} == {"sort": 5, "digits": 5}
    assert request.pipeline_dirs == {"sort": tmp_path / "mux" / "sort", "digits": tmp_path / "mux" / "digits"}
    assert request.resumes == {"sort": None, "digits": None}


def test_a_resume_runs_in_its_own_directory_with_its_own_config(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(parse_config({**LM, "train": {"lr": 5e-4, "steps": 4}})))  # a run's
    request = RunRequest.build(resume=run, steps=6)
    assert request.out == run and request.resume == run and request.config.train.lr == 5e-4
    assert request.steps == 6 and request.resumes == {request.config.pipeline_name: run}
    elsewhere = RunRequest.build(resume=run, out=tmp_path / "copy")  # another out continues a copy there
    assert elsewhere.out == tmp_path / "copy" and elsewhere.steps == 4


def test_what_will_not_do_is_one_line_naming_it_as_its_caller_spells_it(tmp_path):
    with pytest.raises(ConfigError, match=r"^--steps 0: give a number from 1 to \d+$"):
        RunRequest.build(LM, out=tmp_path / "a", steps=0, flag="--")
    with pytest.raises(ConfigError, match=r"^steps 0: give a number"):
        checked_config(LM, steps=0)
    with pytest.raises(FileNotFoundError, match=r"^resume .*nowhere: no such run directory or checkpoint; give RUN"):
        RunRequest.build(LM, resume=tmp_path / "nowhere")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^--out .*file: is a file; give a directory for the run$"):
        RunRequest.build(LM, out=tmp_path / "file", flag="--")
    with pytest.raises(ConfigError, match="train.lr"):
        RunRequest.build(LM, ["train.lr=-1"], out=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists(), "a refused request writes nothing"


def test_a_request_without_an_out_writes_to_the_default_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/latest of the working directory: this checkout's may hold a run
    assert RunRequest.build(LM).out == DEFAULT_OUT
