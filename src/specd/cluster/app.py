"""The Ray Serve application builder, for Ray's own tools:

    serve run specd.cluster.app:build spec=ngram num_spec_tokens=8 k_policy=goodput replicas=2

Each `key=value` is the `specd serve` flag --key (underscores for dashes) with that value, validated by the same
parser; boolean flags take true/false. The HTTP address is Serve's (`serve run --address`, or http_options in a
Serve config file), so host, port and ray_address are not keys here.
"""

from __future__ import annotations

import argparse

from ray.serve.deployment import Application

from specd.cluster.deployment import build_application
from specd.cluster.options import cluster_settings_from_args
from specd.cluster.replica_spec import replica_spec_from_args
from specd.config_args import add_engine_arguments
from specd.errors import InvalidParameterError
from specd.server.app import add_serve_arguments

_SET_BY_SERVE = ("host", "port", "ray_address")


class _ParseError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # raise instead of exiting the driver
        raise _ParseError(message)


def build(args: dict[str, str]) -> Application:
    """The application `specd serve` would run with these flags."""
    parser = _Parser(prog="specd.cluster.app:build", add_help=False)
    add_engine_arguments(parser)
    add_serve_arguments(parser)
    actions = {action.dest: action for action in parser._actions}
    argv: list[str] = []
    for key, value in args.items():
        if key in _SET_BY_SERVE or key not in actions:
            why = "is set by Ray Serve, not here" if key in _SET_BY_SERVE else "is not a `specd serve` flag"
            raise InvalidParameterError(key, why)
        flag = actions[key].option_strings[0]
        if isinstance(actions[key], argparse._StoreTrueAction):
            if str(value).lower() not in ("true", "false"):
                raise InvalidParameterError(key, f"must be true or false, got {value!r}")
            argv += [flag] if str(value).lower() == "true" else []
        else:
            argv += [flag, str(value)]
    try:
        namespace = parser.parse_args(argv)
    except _ParseError as exc:
        raise InvalidParameterError("args", str(exc)) from None
    return build_application(replica_spec_from_args(namespace), cluster_settings_from_args(namespace))
