"""``python -m vismemo_hf COMMAND``: the ``vismemo`` command line."""

import sys

from vismemo_hf.cli import main

sys.exit(main())
