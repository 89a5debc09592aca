"""``python -m zerocomm_spark.agent``: the zerocomm command without the console script (how spawns run it)."""

import sys

from zerocomm_spark.agent.cli import main

sys.exit(main())
