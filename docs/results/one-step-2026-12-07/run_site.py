"""Run a script against a jacobi_ext installed with `pip install --target SITE` (an editable
install's import finder is removed first: it would redirect `import jacobi_ext` to the working
tree whatever sys.path says).

    python run_site.py /tmp/oldsite ab_calls.py --prompts 4 --new 64
"""

import runpy
import sys

sys.meta_path = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
site, script = sys.argv[1], sys.argv[2]
sys.path.insert(0, site)
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
