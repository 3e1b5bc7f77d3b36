import sys

from gpuwise.cli import main

sys.exit(main())
