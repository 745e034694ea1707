"""Ray is an optional extra: the single-process server and the CLI never import it; the replica
options are checked before Ray starts (kvserve/cluster/launch.py imports Ray only to run)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from server_proc import REPO

from kvserve.cli import build_parser
from kvserve.cluster.launch import _scaling
from kvserve.errors import ConfigError


def test_single_process_server_does_not_import_ray():
    code = ("import sys, kvserve.server.app, kvserve.server.launcher, kvserve.cli; "
            "kvserve.cli.build_parser().parse_args(['serve']); "
            "assert not {'ray', 'kvserve.cluster'} & set(sys.modules), 'Ray imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


@pytest.mark.parametrize("argv, field", [
    (["--min-replicas", "3", "--max-replicas", "2"], "min_replicas"),
    (["--min-replicas", "-1", "--max-replicas", "2"], "min_replicas"),
    (["--replicas", "5", "--max-replicas", "2"], "replicas"),
    (["--max-replicas", "2", "--target-ongoing-requests", "nan"], "target_ongoing_requests"),
    (["--max-replicas", "2", "--target-ongoing-requests", "0"], "target_ongoing_requests"),
    (["--max-replicas", "2", "--scale-down-delay", "-1"], "scale_down_delay"),
    (["--max-replicas", "2", "--scale-down-delay", "inf"], "scale_down_delay"),
])
def test_autoscaling_options_are_checked_before_ray_starts(argv, field):
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(ConfigError, match=field):
        _scaling(args)


def test_autoscaling_options():
    auto = _scaling(build_parser().parse_args(["serve", "--max-replicas", "4", "--replicas", "2"]))
    assert auto == {"autoscaling_config": {"min_replicas": 0, "max_replicas": 4, "target_ongoing_requests": 16.0,
                                           "downscale_delay_s": 600.0, "look_back_period_s": 30.0,
                                           "initial_replicas": 2}}
    assert _scaling(build_parser().parse_args(["serve", "--replicas", "3"])) == {"num_replicas": 3}
    # A short delay shortens Ray's load-averaging window with it (at least a second).
    for delay, window in (("2", 2.0), ("0", 1.0), ("45", 30.0)):
        short = _scaling(build_parser().parse_args(["serve", "--max-replicas", "1", "--scale-down-delay", delay]))
        assert short["autoscaling_config"]["look_back_period_s"] == window
