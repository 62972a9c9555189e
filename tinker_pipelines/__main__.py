import sys

from tinker_pipelines.cli import main

sys.exit(main())
