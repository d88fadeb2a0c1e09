"""Run a script against the jacobi_ext installed in /tmp/newsite (the editable install's finder
removed, so that it cannot redirect `import jacobi_ext` to the working tree)."""

import runpy
import sys

sys.meta_path = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
sys.path.insert(0, "/tmp/newsite")
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
