"""warm_marker.py: a module for test_warm.py's warm_spare case to preload.

Importing it records, in $AGENT_TEST_DIR/marker.<pid>, the importing
process, the time, and what it could see of the worker's environment then;
and it sets WARM_MARKER_STALE, which a worker must no longer see once its
spare has been given the round's environment.
"""
import json
import os
import time

_dir = os.environ.get("AGENT_TEST_DIR")
if _dir:
    _path = os.path.join(_dir, "marker.%d" % os.getpid())
    with open(_path + ".tmp", "w") as _f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "time": time.time(),
                   "RANK": os.environ.get("RANK"),
                   "modules": os.environ.get("DUCTILE_PRELOAD_MODULES")}, _f)
    os.rename(_path + ".tmp", _path)
os.environ["WARM_MARKER_STALE"] = "1"
