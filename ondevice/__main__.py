import sys

from ondevice.apps.cli import main

sys.exit(main())
