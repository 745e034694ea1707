"""Ray is an optional extra: the single-process server and the CLI never import it."""
from __future__ import annotations

import subprocess
import sys

from server_proc import REPO


def test_single_process_server_does_not_import_ray():
    code = ("import sys, kvserve.server.app, kvserve.server.launcher, kvserve.cli; "
            "kvserve.cli.build_parser().parse_args(['serve']); "
            "assert not {'ray', 'kvserve.cluster'} & set(sys.modules), 'Ray imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
