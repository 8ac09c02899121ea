"""`python -m diffusion_policy_accelerated demo|serve|routes ...`: the `dpa` command."""
import sys

from .cli import main

sys.exit(main())
