"""The replica flags of `specd serve`: when Ray is asked for, what each flag becomes, and errors naming the flag
(no Ray needed, except for the `serve run` builder test)."""

from __future__ import annotations

import sys

import pytest

from specd.cli import build_parser, main
from specd.cluster.options import ClusterSettings, cluster_settings_from_args, require_ray, wants_cluster
from specd.cluster.replica_spec import replica_spec_from_args
from specd.errors import InvalidParameterError, SpecdError


def _args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_one_replica_without_other_flags_stays_single_process():
    assert not wants_cluster(_args())
    assert not wants_cluster(_args("--replicas", "1"))
    assert wants_cluster(_args("--replicas", "2"))
    assert wants_cluster(_args("--replicas", "1", "--ray-address", "auto"))
    assert wants_cluster(_args("--min-replicas", "1", "--max-replicas", "3"))


def test_flags_map_onto_ray_serve_settings():
    args = _args("--replicas", "2", "--max-num-seqs", "4", "--max-waiting", "0", "--shutdown-timeout", "7",
                 "--replica-cpus", "0.5")
    cluster = cluster_settings_from_args(args)
    assert cluster == ClusterSettings(num_replicas=2, replica_cpus=0.5, max_ongoing_requests=4,
                                      max_queued_requests=-1, graceful_shutdown_s=7.0)
    scaled = cluster_settings_from_args(_args("--min-replicas", "2", "--max-replicas", "4", "--max-waiting", "9",
                                              "--max-ongoing-requests", "3"))
    assert (scaled.autoscaling, scaled.num_replicas, scaled.most_replicas) == (True, 2, 4)
    assert (scaled.max_ongoing_requests, scaled.max_queued_requests) == (3, 9)


@pytest.mark.parametrize(("flags", "field", "words"), [
    (("--replicas", "0"), "--replicas", ">= 1"),
    (("--min-replicas", "1"), "--max-replicas", "required with --min-replicas"),
    (("--max-replicas", "3"), "--min-replicas", "required with --max-replicas"),
    (("--min-replicas", "0", "--max-replicas", "2"), "--min-replicas", ">= 1"),
    (("--min-replicas", "3", "--max-replicas", "2"), "--max-replicas", ">= --min-replicas"),
    (("--replicas", "5", "--min-replicas", "1", "--max-replicas", "2"), "--replicas", "must lie within"),
    (("--replicas", "2", "--replica-cpus", "0"), "--replica-cpus", "> 0"),
    (("--replicas", "2", "--max-ongoing-requests", "0"), "--max-ongoing-requests", ">= 1"),
])
def test_bad_replica_flags_name_the_flag(flags, field, words):
    with pytest.raises(InvalidParameterError) as info:
        cluster_settings_from_args(_args(*flags))
    assert info.value.field == field and words in info.value.message


def test_trace_files_are_per_replica(tmp_path):
    spec = replica_spec_from_args(_args("--replicas", "2", "--spec-trace", str(tmp_path / "trace.jsonl")))
    assert spec.config_for("abc", 1.0).spec_trace_path == str(tmp_path / "trace.abc.jsonl")
    assert replica_spec_from_args(_args("--replicas", "2")).config_for("abc", 1.0).spec_trace_path is None


def test_replica_threads_follow_its_cpus_unless_threads_is_given():
    spec = replica_spec_from_args(_args("--replicas", "2"))
    assert [spec.config_for("r", cpus).num_threads for cpus in (0.5, 1.0, 2.5, 8.0)] == [1, 1, 2, 8]
    assert replica_spec_from_args(_args("--replicas", "2", "--threads", "3")).config_for("r", 8.0).num_threads == 3


def test_missing_ray_is_a_clear_error_naming_the_flag_and_the_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(SpecdError, match=r"--replicas: .*pip install 'specd\[cluster\]'"):
        require_ray()
    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "specd: error: --replicas:" in err and "pip install 'specd[cluster]'" in err
    assert "Traceback" not in err


def test_replicas_split_the_local_cpus_by_default(monkeypatch):
    monkeypatch.setattr("specd.cluster.options.available_cpus", lambda: 8)
    assert cluster_settings_from_args(_args("--replicas", "2")).replica_cpus == 4.0
    assert cluster_settings_from_args(_args("--replicas", "3")).replica_cpus == 2.0
    assert cluster_settings_from_args(_args("--min-replicas", "1", "--max-replicas", "4")).replica_cpus == 2.0
    assert cluster_settings_from_args(_args("--replicas", "16")).replica_cpus == 1.0  # at least one each
    assert cluster_settings_from_args(_args("--replicas", "2", "--ray-address", "auto")).replica_cpus == 1.0
    assert cluster_settings_from_args(_args("--replicas", "2", "--replica-cpus", "3")).replica_cpus == 3.0


def test_more_replicas_than_local_cpus_fails_before_ray_starts(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # would fail later if Ray were reached
    monkeypatch.setattr("specd.cluster.options.available_cpus", lambda: 2)
    monkeypatch.setattr("specd.cluster.launch.available_cpus", lambda: 2)
    assert main(["serve", "--replicas", "3"]) == 2
    assert "--replica-cpus: 3 replicas x 1 CPUs need 3 CPUs and this machine has 2" in capsys.readouterr().err


def test_serve_run_builder_parses_keys_like_flags():
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'specd[cluster]')")
    from ray.serve.deployment import Application

    from specd.cluster.app import build

    app = build({"spec": "ngram", "num_spec_tokens": "3", "replicas": "2", "vllm_compat_metrics": "true"})
    assert isinstance(app, Application)
    deployment = app._bound_deployment  # what Ray Serve will run
    assert deployment._deployment_config.num_replicas == 2 and deployment._deployment_config.autoscaling_config is None
    scaled = build({"min_replicas": "1", "max_replicas": "3", "replicas": "2", "max_ongoing_requests": "5",
                    "replica_cpus": "0.5", "max_waiting": "7"})._bound_deployment
    autoscaling = scaled._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.initial_replicas, autoscaling.max_replicas) == (1, 2, 3)
    assert autoscaling.target_ongoing_requests == 5 and scaled._deployment_config.max_ongoing_requests == 5
    assert scaled._deployment_config.max_queued_requests == 7 and scaled.ray_actor_options["num_cpus"] == 0.5
    with pytest.raises(InvalidParameterError, match="port: is set by Ray Serve"):
        build({"port": "9000"})
    with pytest.raises(InvalidParameterError, match="temperature: is not a `specd serve` flag"):
        build({"temperature": "0"})
    with pytest.raises(InvalidParameterError, match="spec: invalid choice"):
        build({"spec": "magic"})
    with pytest.raises(InvalidParameterError, match="vllm_compat_metrics: must be true or false"):
        build({"vllm_compat_metrics": "yes please"})


def test_a_ray_that_does_not_start_is_an_error_naming_the_flag():
    from types import SimpleNamespace

    from specd.cluster.launch import _start_ray

    def refuse(**kwargs):
        raise ConnectionError("no GCS at 10.0.0.1:6379")

    with pytest.raises(SpecdError, match=r"--ray-address: Ray did not start: ConnectionError: no GCS"):
        _start_ray(SimpleNamespace(init=refuse), address="10.0.0.1:6379")
    with pytest.raises(SpecdError, match=r"--replicas: Ray did not start"):
        _start_ray(SimpleNamespace(init=refuse), num_cpus=2)
