"""Prints one of the README's two set-up commands (the fenced block after `<!-- NAME-command -->`),
so CI runs exactly what the README says.   usage: python .ci/readme_command.py test|main"""

import re
import sys
from pathlib import Path

name = sys.argv[1]
text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
m = re.search(rf"<!-- {name}-command -->\s*```(?:bash|sh)?\n(.+?)\n```", text, re.S)
if not m:
    sys.exit(f"README.md has no block marked <!-- {name}-command -->")
print(" ".join(line.rstrip("\\").strip() for line in m.group(1).splitlines()))
